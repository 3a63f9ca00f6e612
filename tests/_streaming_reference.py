"""Streaming DiLoCo in float64 numpy, from its spec: the reference of
tests/test_streaming.py and tests/test_streaming_flax.py.

On one flat vector per replica. Step t = 1, 2, ...: every replica takes an
inner SGD step; fragment f (elements with ``ids == f``) syncs when ``t %
H == (f * H) // F``: its outer gradient ``center_f - mean_i(params_i,f)``
moves ``center_f`` by Nesterov SGD (one momentum per fragment); the
fragment that synced ``tau`` steps ago merges, ``params_f <- alpha *
params_f + (1 - alpha) * center_f``.
"""

from __future__ import annotations

import numpy as np


def np_streaming_diloco(
  center, grads, steps, ids, *, num_fragments, period, tau, alpha, lr,
  outer_lr, outer_momentum, replicas, wire=None,
):  # fmt: skip
  """``center`` (N,) the start, ``grads(params, t)`` the (R, N) gradients
  at step t. Returns the params after every step (steps, R, N) and the
  center after every step, step 0 included (steps + 1, N).

  ``wire(t, f, mask, delta)``, if given, returns what the all-reduce delivers
  for the outer gradient ``delta`` (``(mask.sum(),)``) of fragment ``f``
  synced at step ``t`` (a lossy wire); None: ``delta`` itself."""
  center = np.asarray(center, np.float64).copy()
  params = np.tile(center, (replicas, 1))
  momentum = np.zeros_like(center)  # disjoint per fragment: F states in one
  phases = [(f * period) // num_fragments for f in range(num_fragments)]
  params_out, centers = [], [center.copy()]
  for t in range(1, steps + 1):
    params = params - lr * grads(params, t)
    for f, phase in enumerate(phases):
      if t % period == phase:
        m = ids == f
        delta = center[m] - params[:, m].mean(axis=0)
        if wire is not None:
          delta = wire(t, f, m, delta)
        momentum[m] = outer_momentum * momentum[m] + delta
        center[m] = center[m] - outer_lr * (
          delta + outer_momentum * momentum[m]
        )
    for f, phase in enumerate(phases):
      if t - tau >= 1 and (t - tau) % period == phase:
        m = ids == f
        params[:, m] = alpha * params[:, m] + (1 - alpha) * center[m]
    params_out.append(params.copy())
    centers.append(center.copy())
  return np.stack(params_out), np.stack(centers)
