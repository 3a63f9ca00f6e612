"""PowerSGD in float64 numpy, from the paper's algorithm: the reference of
tests/test_powersgd.py and tests/test_composition.py.

Written from the algorithm as design.md section 6.3 states it (Vogels,
Karimireddy and Jaggi, NeurIPS 2019; PyTorch's ``powerSGD_hook``), every
replica's matrix written out. It is seeded with the ``Q`` that ``tx.init``
drew, so the random number generator does not matter. Also the leaf shapes
both files run it on, and their gradients.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

R = 8  # replicas
# Leaf shapes: with rank 2 and min_compression_rate 1.0, "w1" (6 x 5) and
# "w3" (4 x 3 x 4, viewed 4 x 12) are compressed; "u" (3 x 3: 2 * 6 >= 9) and
# the bias "b" are mean-reduced exactly.
SHAPES = {"w1": (6, 5), "w3": (4, 3, 4), "u": (3, 3), "b": (5,)}
RANK = 2
RATE = 1.0
COMPRESSED = {"w1": True, "w3": True, "u": False, "b": False}
STEPS = 4


def np_powersgd(
  grad_steps,
  q_init,
  *,
  compressed,
  start_step=0,
  error_feedback=True,
  q_steps=None,
):
  """Runs PowerSGD on ``grad_steps`` and returns (updates per step, errors).

  Args:
    grad_steps: list over steps of ``{leaf: (R, *shape) array}``.
    q_init: ``{leaf: (m, r)}`` from ``tx.init``, for compressed leaves.
    compressed: ``{leaf: bool}``.
    start_step: steps of plain mean before compressing.
    error_feedback: keep ``M - approx`` per replica and add it next step.
    q_steps: if given (no warm start), ``q_steps[t][leaf]`` is the ``Q`` that
      step ``t`` starts from; otherwise the previous step's ``Q`` (warm start).
  """
  q = {k: np.asarray(v, np.float64) for k, v in q_init.items()}
  errors = {k: np.zeros(g.shape) for k, g in grad_steps[0].items()}
  out = []
  for t, grads in enumerate(grad_steps):
    updates = {}
    for k, g in grads.items():
      g = np.asarray(g, np.float64)
      if t < start_step or not compressed[k]:
        updates[k] = g.mean(0)
        continue
      if q_steps is not None:
        q[k] = np.asarray(q_steps[t][k], np.float64)
      m = g.reshape(g.shape[0], g.shape[1], -1)  # M_i = g_i (n x m)
      if error_feedback:
        m = m + errors[k].reshape(m.shape)  # M_i = g_i + e_i
      p = np.mean(m @ q[k], axis=0)  # P = mean_i M_i Q
      p, _ = np.linalg.qr(p)  # orthonormal columns
      q_new = np.mean(np.swapaxes(m, 1, 2) @ p, 0)  # Q = mean_i M_i^T P
      approx = p @ q_new.T
      if error_feedback:
        errors[k] = (m - approx).reshape(g.shape)  # local minus aggregated
      q[k] = q_new
      updates[k] = approx.reshape(g.shape[1:])
    out.append(updates)
  return out, errors


def random_grad_steps(seed, steps=STEPS, shapes=SHAPES, dtype=np.float32):
  """``steps`` dicts of standard normal gradients, ``(R, *shape)`` per leaf."""
  rng = np.random.default_rng(seed)
  return [
    {k: rng.normal(size=(R,) + s).astype(dtype) for k, s in shapes.items()}
    for _ in range(steps)
  ]


def zero_params(shapes=SHAPES):
  """Float32 zeros of each leaf's shape (PowerSGD's updates do not read
  params)."""
  return {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
