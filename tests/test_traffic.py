"""shardopt.measure.traffic: the bytes a step sends, per step, sync and run.

Every expected number is computed here by hand from the program: a ring
all-reduce of B bytes in groups of g sends 2 (g - 1) / g * B from each
member; a collective in a sync branch runs on the steps the transform's
schedule names (diloco with sync_period=H: steps H, 2H, ...; after
warmup_steps=W: the first W steps all-reduce the mean gradient, then the
syncs fall on steps W + H, W + 2H, ...).
"""

import contextlib
import doctest
import importlib
import io
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt
from shardopt.measure.traffic import Collective
from shardopt.measure.traffic import Traffic
from shardopt.measure.traffic import traffic

# The module (shardopt.measure exports the function under the same name).
traffic_module = importlib.import_module("shardopt.measure.traffic")

ROOT = pathlib.Path(__file__).resolve().parents[1]
AXIS = "batch"
N = 8
F32 = 4  # bytes
# The params of the periodic steps: a 64 x 64 matrix and a 64 bias.
PARAMS = {"w": jnp.ones((64, 64)), "b": jnp.ones((64,))}
SIZE = 64 * 64 + 64  # 4,160 float32


def _ring(group, buffer_bytes):
  return 2 * (group - 1) / group * buffer_bytes


def _pmap_step(tx, params=PARAMS):
  """A pmapped ``tx.update`` step and example arguments for it."""

  def step(p, state, g):
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

  stacked = jax.pmap(lambda _: params)(np.arange(N))
  state = jax.pmap(tx.init, axis_name=AXIS)(stacked)
  return jax.pmap(step, axis_name=AXIS), (stacked, state, stacked)


# --- Every step: a pmap psum and a jit + shard_map cross_shard_mean. -------


@pytest.mark.parametrize("devices", [8, 4])
def test_pmap_psum_of_1000_float32(devices):
  step = jax.pmap(
    lambda x: jax.lax.psum(x, "i"),
    axis_name="i",
    devices=jax.devices()[:devices],
  )
  t = traffic(step, jnp.ones((devices, 1000)))
  sent = _ring(devices, 1000 * F32)  # 7,000 bytes over 8; 6,000 over 4
  assert isinstance(t, Traffic)
  assert (t.per_step, t.peak_step, t.quiet_step) == (sent, sent, sent)
  assert (t.per_sync, t.cycle, t.warmup_step) == ((), (sent,), 0.0)
  assert t.num_devices == devices
  assert t.collectives == (
    Collective(
      kind="all-reduce",
      dtypes=("float32",),
      elements=1000,
      group_size=devices,
      buffer_bytes=4000,
      sent_bytes=sent,
      where="every step",
    ),
  )
  assert t.run(5) == 5 * sent
  assert t.wire_dtypes == ("float32",) and t.widened == ()
  assert t.warning == ""


def _shard_map_step(mesh, tx):
  """``tx.update`` of per-replica gradients under jit + shard_map (params
  replicated, gradients and the state's per-replica parts sharded)."""

  def step(params, grads):
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)

  params = jax.device_put(jnp.ones(1000), NamedSharding(mesh, P()))
  grads = jax.device_put(jnp.ones(N * 1000), NamedSharding(mesh, P(AXIS)))
  return jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
  ), (params, grads)


def test_jit_shard_map_cross_shard_mean(mesh):
  step, args = _shard_map_step(mesh, shardopt.cross_shard_mean(AXIS))
  t = traffic(step, *args)
  sent = _ring(N, 1000 * F32)  # the mean of 1,000 float32 gradients
  assert (t.per_step, t.peak_step, t.run(3)) == (sent, sent, 3 * sent)
  assert sum(op.buffer_bytes for op in t.collectives) == 1000 * F32
  assert {op.where for op in t.collectives} == {"every step"}
  assert t.num_devices == N


def test_a_bfloat16_wire_is_counted_as_compiled_and_its_dtype_reported(mesh):
  """XLA's CPU backend runs a bfloat16 all-reduce in float32: the bytes are
  the compiled program's, wire_dtypes what the program asked for."""
  tx = shardopt.cross_shard_mean(AXIS, comm_dtype=jnp.bfloat16)
  step, args = _shard_map_step(mesh, tx)
  t = traffic(step, *args)
  assert t.per_step == _ring(N, 1000 * F32)
  assert "bfloat16" in t.wire_dtypes
  assert t.widened == ("bfloat16",)
  assert "an accelerator sends fewer bytes" in t.table()


def test_a_float8_collective_reports_its_wire_dtype():
  """The lowered StableHLO spells float8 in mixed case (f8E4M3FN); the
  reader still names it, whatever the backend compiles it to."""
  step = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
  t = traffic(step, jnp.ones((N, 256), jnp.float8_e4m3fn))
  assert t.wire_dtypes == ("float8_e4m3fn",)
  (op,) = t.collectives
  itemsize = np.dtype(op.dtypes[0]).itemsize  # float16 on a CPU
  assert op.buffer_bytes == 256 * itemsize
  assert t.per_step == _ring(N, 256 * itemsize)
  widened = op.dtypes != ("float8_e4m3fn",)
  assert t.widened == (("float8_e4m3fn",) if widened else ())


# --- On a schedule: diloco's sync, fragments, warm-up. ----------------------


def test_diloco_every_4_steps_sends_its_sync_once_per_4():
  tx = shardopt.diloco(optax.adam(1e-3), AXIS, sync_period=4)
  step, args = _pmap_step(tx)
  t = traffic(step, *args, tx=tx)
  # The sync all-reduces the float32 outer gradient of every param and the
  # finite flag (one float32): 4,161 float32.
  sync = _ring(N, (SIZE + 1) * F32)  # 29,127 bytes
  assert sum(op.buffer_bytes for op in t.collectives) == (SIZE + 1) * F32
  assert {op.where for op in t.collectives} == {"sync 1"}
  assert t.per_sync == (sync,)
  assert t.quiet_step == 0.0
  assert t.cycle == (0.0, 0.0, 0.0, sync)
  assert t.per_step == sync / 4
  assert t.peak_step == sync
  assert t.schedule == "once per 4 steps"
  # Syncs on steps 4 and 8 of 10; 4 and 8 and 12 of 12.
  assert (t.run(0), t.run(3), t.run(10), t.run(12)) == (
    0,
    0,
    2 * sync,
    3 * sync,
  )
  assert t.warning == ""
  assert "sync 1" in str(t) and "per step (mean)" in str(t)


def test_diloco_with_a_warm_up_counts_its_steps_in_a_run():
  tx = shardopt.diloco(optax.adam(1e-3), AXIS, sync_period=4, warmup_steps=2)
  step, args = _pmap_step(tx)
  t = traffic(step, *args, tx=tx)
  warm = _ring(N, SIZE * F32)  # the mean gradient, no flag: 29,120 bytes
  sync = _ring(N, (SIZE + 1) * F32)
  assert (t.warmup_steps, t.warmup_step) == (2, warm)
  assert t.per_sync == (sync,) and t.per_step == sync / 4
  assert t.peak_step == sync
  # Steps 1, 2: warm-up; syncs after steps 2 + 4 = 6 and 2 + 8 = 10.
  assert t.run(1) == warm
  assert t.run(5) == 2 * warm
  assert t.run(10) == 2 * warm + 2 * sync
  assert sorted({op.where for op in t.collectives}) == ["sync 1", "warm-up"]


def test_streaming_diloco_has_one_sync_per_fragment():
  tx = shardopt.diloco(optax.adam(1e-3), AXIS, sync_period=4, num_fragments=2)
  step, args = _pmap_step(tx)
  t = traffic(step, *args, tx=tx)
  # Two fragments: the bias and the matrix, each with its finite flag, each
  # once per 4 steps at its own offset.
  bias, matrix = _ring(N, (64 + 1) * F32), _ring(N, (64 * 64 + 1) * F32)
  assert sorted(t.per_sync) == [bias, matrix]
  assert sorted(t.cycle) == [0.0, 0.0, bias, matrix]
  assert t.per_step == pytest.approx((bias + matrix) / 4)
  assert t.peak_step == matrix
  assert t.run(8) == pytest.approx(2 * (bias + matrix))
  assert t.warning == ""


# --- What the reader is given. ----------------------------------------------


def test_lowered_compiled_and_text_give_the_same_bytes():
  step = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
  lowered = step.lower(jnp.ones((N, 1000)))
  compiled = lowered.compile()
  sent = _ring(N, 1000 * F32)
  for given in (lowered, compiled, compiled.as_text()):
    assert traffic(given).per_step == sent
  assert traffic(lowered).wire_dtypes == ("float32",)
  assert traffic(compiled).wire_dtypes is None  # no StableHLO to read
  assert traffic(compiled.as_text(), num_devices=N).num_devices == N


def test_what_it_cannot_read_is_refused_with_the_fix():
  step = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
  x = jnp.ones((N, 4))
  with pytest.raises(TypeError, match="jax.jit- or jax.pmap-wrapped"):
    traffic(lambda x: x, x)
  with pytest.raises(TypeError, match="already built for its arguments"):
    traffic(step.lower(x), x)
  with pytest.raises(ValueError, match="no ENTRY computation"):
    traffic(step.lower(x).as_text())
  with pytest.raises(TypeError, match="not an optax GradientTransformation"):
    traffic(step, x, tx="diloco")
  with pytest.raises(ValueError, match="sync_period=0 must be a positive"):
    traffic(step, x, sync_period=0)
  with pytest.raises(ValueError, match="num_devices=0 must be a positive"):
    traffic(step, x, num_devices=0)
  with pytest.raises(ValueError, match="steps=-1"):
    traffic(step, x).run(-1)


def test_an_unreadable_tx_with_collectives_in_a_branch_is_an_error():
  """accumulate's emit branch runs inner's all-reduce once per k steps, but
  the transform does not carry its schedule: the error names sync_period."""
  tx = shardopt.accumulate(shardopt.cross_shard(optax.sgd(0.1), AXIS), 4)
  step, args = _pmap_step(tx)
  with pytest.raises(ValueError, match=r"built by accumulate.*sync_period=k"):
    traffic(step, *args, tx=tx)
  with pytest.raises(ValueError, match="no tx says"):
    traffic(step, *args)
  with pytest.raises(ValueError, match="not both"):
    traffic(step, *args, tx=tx, sync_period=4)
  t = traffic(step, *args, sync_period=4)
  sync = _ring(N, SIZE * F32)  # the mean of the accumulated gradients
  assert (t.per_sync, t.per_step, t.run(8)) == ((sync,), sync / 4, 2 * sync)


def test_a_transform_without_branches_needs_no_schedule():
  """Any tx is fine where every collective runs on every step."""
  tx = shardopt.cross_shard(optax.adam(1e-3), AXIS)
  step, args = _pmap_step(tx)
  t = traffic(step, *args, tx=tx)
  sent = _ring(N, SIZE * F32)
  assert (t.per_step, t.peak_step, t.per_sync) == (sent, sent, ())


def test_docstring_examples_run():
  # tests/test_docstrings.py walks only shardopt's top-level modules.
  result = doctest.testmod(
    traffic_module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  )
  assert result.attempted > 0 and result.failed == 0


# --- docs/bytes.md, and the README's demo table. ----------------------------


def _readme_demo_megabytes() -> list:
  """The "bytes sent per replica" column of the README's `make demo` table,
  in MB, in the demo's order (sync, powersgd, diloco, streaming)."""
  text = (ROOT / "README.md").read_text()
  section = text[text.index("## What it buys: `make demo`") :]
  section = section[: section.index("\n## ")]
  return [
    float(mb)
    for mb in re.findall(
      r"^\|[^|\n]+\| [\d.]+% \| ([\d.]+) MB \|", section, re.M
    )
  ]


def test_docs_bytes_page_prints_what_it_shows_and_the_readme_numbers():
  """Each ```python block of docs/bytes.md prints the ```text block after
  it; its numbers are the hand arithmetic it states, and the demo's run
  bytes are the README's table."""
  page = (ROOT / "docs" / "bytes.md").read_text()
  pairs = re.findall(r"```python\n(.*?)```\n\n```text\n(.*?)```", page, re.S)
  assert len(pairs) == 3
  namespace = {}
  for index, (code, shown) in enumerate(pairs):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      exec(compile(code, f"docs/bytes.md[block {index}]", "exec"), namespace)
    assert printed.getvalue() == shown
  synchronous, periodic = namespace["synchronous"], namespace["periodic"]
  assert synchronous.per_step == 1.75 * 4096 * F32 == 28_672
  assert synchronous.run(1000) == 28_672_000
  assert periodic.per_sync == (1.75 * 4097 * F32,)
  assert periodic.run(1000) == 62 * 28_679 == 1_778_098  # steps 16, ..., 992
  sent = namespace["sent"]
  params = 64 * 64 + 64 + 64 * 10 + 10  # the demo's MLP: 4,810 float32
  assert sent["sync"] == 256 * 1.75 * params * F32 == 8_619_520
  assert sent["diloco"] == 16 * 1.75 * (params + 1) * F32 == 538_832
  readme = _readme_demo_megabytes()
  assert readme == [
    round(sent[m] / 1e6, 2) for m in ("sync", "powersgd", "diloco", "streaming")
  ]


@pytest.mark.parametrize("name", ["traffic", "Traffic", "Collective"])
def test_the_names_before_the_move_give_the_same_object_with_a_warning(name):
  """shardopt.wire's names of the reader lead to shardopt.measure's, with a
  DeprecationWarning naming the new one (docs/layers.md: the one exception)."""
  with pytest.warns(DeprecationWarning, match=f"shardopt.measure.{name}"):
    old = getattr(shardopt.wire, name)
  assert old is getattr(shardopt.measure, name)
  with pytest.raises(AttributeError, match="no attribute 'nothing'"):
    shardopt.wire.nothing  # noqa: B018
