"""One error type per kind of mistake, across every transform (issue 34).

A flag that is not True/False is a ``TypeError``; a count, period or rate
outside its range (or a float or bool where an integer is needed) is a
``ValueError``. Each message names the transform and the argument.
"""

import jax.numpy as jnp
import optax
import pytest

import shardopt

AXIS = "batch"
SGD = optax.sgd(0.1)

FLAGS = {
  "accumulate(use_grad_mean)": lambda v: shardopt.accumulate(
    SGD, 2, use_grad_mean=v
  ),
  "cross_shard(error_feedback)": lambda v: shardopt.cross_shard(
    SGD,
    AXIS,
    comm_dtype=shardopt.quantized(jnp.int8),
    error_feedback=v,
  ),
  "powersgd(error_feedback)": lambda v: shardopt.powersgd(
    AXIS, error_feedback=v
  ),
  "powersgd(warm_start)": lambda v: shardopt.powersgd(AXIS, warm_start=v),
  "diloco(nesterov)": lambda v: shardopt.diloco(SGD, AXIS, nesterov=v),
}

INTEGERS = {
  "accumulate(every_k_steps)": lambda v: shardopt.accumulate(SGD, v),
  "apply_if_finite(max_consecutive_errors)": lambda v: shardopt.apply_if_finite(
    SGD, v, axis_name=AXIS
  ),
  "powersgd(rank)": lambda v: shardopt.powersgd(AXIS, rank=v),
  "local_sgd(sync_period)": lambda v: shardopt.local_sgd(
    SGD, AXIS, sync_period=v
  ),
  "agn(sync_period)": lambda v: shardopt.agn(SGD, AXIS, sync_period=v),
  "diloco(warmup_steps)": lambda v: shardopt.diloco(SGD, AXIS, warmup_steps=v),
  "diloco(num_fragments)": lambda v: shardopt.diloco(
    SGD, AXIS, sync_period=4, num_fragments=v
  ),
}


def _names(label):
  transform, arg = label.rstrip(")").split("(")
  return f"shardopt.{transform}", arg


@pytest.mark.parametrize("bad", ["yes", 1, None, 0.0])
@pytest.mark.parametrize("label", FLAGS)
def test_a_flag_that_is_not_a_bool_is_a_type_error(label, bad):
  transform, arg = _names(label)
  with pytest.raises(TypeError, match=rf"{transform}.*{arg}={bad!r}"):
    FLAGS[label](bad)


@pytest.mark.parametrize("bad", [-1, 2.5, True, None, "4"])
@pytest.mark.parametrize("label", INTEGERS)
def test_an_integer_out_of_range_or_of_the_wrong_kind_is_a_value_error(
  label, bad
):
  transform, arg = _names(label)
  with pytest.raises(ValueError, match=rf"{transform}.*{arg}="):
    INTEGERS[label](bad)
