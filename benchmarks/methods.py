"""The data-parallel methods the benchmarks compare (both sides: the bytes of
:mod:`benchmarks.perf.communication` and :mod:`benchmarks.perf.cost`, the
quality of :mod:`benchmarks.studies.quality_per_byte` and
:mod:`benchmarks.studies.schedule_convergence`).

Each :class:`Method` names the shardopt functions it needs and builds its
transform around an optimizer factory (``lambda: optax.adamw(lr)``).
:func:`build` returns ``(None, reason)`` only when one of those names is not
in the installed ``shardopt`` (checked by name, before building); any error
of the build itself (a ``TypeError`` from a renamed keyword) propagates, so
a section fails loudly instead of recording a "not available" row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax.numpy as jnp
import optax

import shardopt
from benchmarks.studies import workload
from shardopt.measure import hlo
from shardopt.periodic import schedules
from shardopt.sparse import TopKSpec

Factory = Callable[[], optax.GradientTransformation]
AXIS = workload.AXIS


@dataclasses.dataclass(frozen=True)
class Method:
  """A labelled transform recipe.

  Attributes:
    label: the row name in tables and plots.
    requires: public shardopt names it uses.
    build: ``optimizer factory -> transform``.
    schedule: which steps communicate what (:class:`shardopt.measure.hlo.Schedule`,
      built from the periodic engine's own schedule).
    rounds_per_step: communication rounds per step (1 = every step), for the
      "per round" view.
    quick: part of the ``--quick`` smoke run (one per code path).
    updates_per_step: optimizer updates per step (``accumulate(..., k)``:
      ``1 / k``), so that a learning-rate schedule spans the run's updates.
    family: the group it is plotted with (``"sync"``, ``"powersgd"``,
      ``"diloco"``, ...).
    optimizer: the inner optimizer's name in
      :data:`benchmarks.studies.workload.OPTIMIZERS` (``"adamw"``, ``"muon"``).
  """

  label: str
  requires: tuple
  build: Callable[[Factory], optax.GradientTransformation]
  schedule: hlo.Schedule
  rounds_per_step: float = 1.0
  quick: bool = False
  updates_per_step: float = 1.0
  family: str = ""
  optimizer: str = "adamw"


def wire_name(comm_dtype, error_feedback: bool = False) -> str:
  """``"int8"``, ``"int4+EF"``, ``"float8_e4m3fn"``, ``quantized(...)``'s
  repr, ``"topk 64/4096 2-bit"`` for :func:`shardopt.topk` (with its
  ``error_decay`` when it is not 0.95), or ``""`` for None (float32)."""
  if comm_dtype is None:
    return ""
  if isinstance(comm_dtype, TopKSpec):
    decay = comm_dtype.error_decay
    return (
      f"topk {comm_dtype.k}/{comm_dtype.chunk_size}"
      f" {comm_dtype.value_bits}-bit"
      + ("+EF" if error_feedback else "")
      + ("" if decay == 0.95 else f" decay {decay:g}")
    )
  try:
    name = jnp.dtype(comm_dtype).name
  except TypeError:  # a shardopt.quantized spec
    name = repr(comm_dtype)
  return name + ("+EF" if error_feedback else "")


def _suffix(*parts: str) -> str:
  return "".join(f", {p}" for p in parts if p)


def build(
  method: Method, optimizer: Factory
) -> tuple[optax.GradientTransformation | None, str]:
  """``(transform, "")``, or ``(None, why)`` if this shardopt lacks one of
  ``method.requires`` by name. Errors of the build itself propagate."""
  missing = [name for name in method.requires if not hasattr(shardopt, name)]
  if missing:
    return None, (
      "not available: shardopt."
      + ", shardopt.".join(missing)
      + " is not in this version"
    )
  return method.build(optimizer), ""


def sync(name: str = "adamw") -> Method:
  return Method(
    f"cross_shard({name}) [sync]",
    ("cross_shard",),
    lambda opt: shardopt.cross_shard(opt(), AXIS),
    hlo.Schedule(),
    quick=True,
    family="sync" if name == "adamw" else name,
    optimizer=name,
  )


def cross_shard_mean(
  comm_dtype=None,
  error_feedback: bool = False,
  quick: bool = False,
  name: str = "adamw",
) -> Method:
  """``chain(cross_shard_mean(comm_dtype, error_feedback), optimizer)``:
  synchronous training with the gradient's mean on a (quantized) wire."""
  wire = wire_name(comm_dtype, error_feedback)
  return Method(
    f"chain(cross_shard_mean({wire or 'float32'}), {name})",
    ("cross_shard_mean",),
    lambda opt: optax.chain(
      shardopt.cross_shard_mean(
        AXIS, comm_dtype=comm_dtype, error_feedback=error_feedback
      ),
      opt(),
    ),
    hlo.Schedule(),
    quick=quick,
    family="topk" if isinstance(comm_dtype, TopKSpec) else "sync",
  )


def accumulate(k: int, quick: bool = False, name: str = "adamw") -> Method:
  return Method(
    f"accumulate(cross_shard({name}), {k})",
    ("accumulate", "cross_shard"),
    lambda opt: shardopt.accumulate(shardopt.cross_shard(opt(), AXIS), k),
    hlo.Schedule(schedules.every(k)),
    1.0 / k,
    quick,
    updates_per_step=1.0 / k,
    family="accumulate",
  )


def powersgd(
  rank: int, quick: bool = False, name: str = "adamw", comm_dtype=None
) -> Method:
  wire = wire_name(comm_dtype)
  return Method(
    f"chain(powersgd(rank={rank}{_suffix(wire)}), {name})",
    ("powersgd",),
    lambda opt: optax.chain(
      shardopt.powersgd(AXIS, rank=rank, comm_dtype=comm_dtype), opt()
    ),
    hlo.Schedule(taken="min"),
    1.0,
    quick,
    family="powersgd",
  )


def agn(period: int, quick: bool = False, name: str = "adamw") -> Method:
  return Method(
    f"agn({name}, T={period})",
    ("agn",),
    lambda opt: shardopt.agn(opt(), AXIS, sync_period=period),
    hlo.Schedule(schedules.every(period)),
    1.0 / period,
    quick,
  )


def local_sgd(
  period: int,
  quick: bool = False,
  name: str = "adamw",
  comm_dtype=None,
  error_feedback: bool = False,
) -> Method:
  """``local_sgd(optimizer, sync_period=period)``: plain parameter averaging
  every ``period`` steps, the average on ``comm_dtype`` (optionally with
  error feedback)."""
  wire = wire_name(comm_dtype, error_feedback)
  return Method(
    f"local_sgd({name}, H={period}{_suffix(wire)})",
    ("local_sgd",),
    lambda opt: shardopt.local_sgd(
      opt(),
      AXIS,
      sync_period=period,
      comm_dtype=comm_dtype,
      error_feedback=error_feedback,
    ),
    hlo.Schedule(schedules.every(period)),
    1.0 / period,
    quick,
    family="local_sgd",
  )


OUTER_STEPS = {
  "": ("", {}),
  "paper": (
    "paper outer 0.7/0.9",
    {"outer_learning_rate": 0.7, "outer_momentum": 0.9},
  ),
  "sgd": ("outer sgd(1)", {"outer_optimizer": optax.sgd(1.0)}),
}
"""``diloco``'s outer steps by name: its default (Nesterov lr 0.8, momentum
0.2), the DiLoCo paper's (Nesterov lr 0.7, momentum 0.9), and SparseLoCo's
plain step (SGD lr 1, no momentum: the decaying error stands in for it)."""


def diloco(
  period: int,
  quick: bool = False,
  name: str = "adamw",
  comm_dtype=None,
  error_feedback: bool = False,
  warmup_steps: int = 0,
  outer: str = "",
  eager: bool = False,
) -> Method:
  """``diloco(optimizer, sync_period=period)`` with the outer step
  :data:`OUTER_STEPS` names (default: shardopt's default, Nesterov SGD lr
  0.8, momentum 0.2), its outer gradient on ``comm_dtype`` (optionally with
  error feedback), after ``warmup_steps`` synchronous steps; ``eager``:
  Eager updates (``docs/eager.md``)."""
  wire = wire_name(comm_dtype, error_feedback)
  warm = f"warm-up {warmup_steps}" if warmup_steps else ""
  outer_label, outer_kwargs = OUTER_STEPS[outer]
  topk = isinstance(comm_dtype, TopKSpec)
  return Method(
    f"diloco({name}, H={period}"
    f"{_suffix(wire, warm, outer_label, 'eager' if eager else '')})",
    ("diloco",),
    lambda opt: shardopt.diloco(
      opt(),
      AXIS,
      sync_period=period,
      comm_dtype=comm_dtype,
      error_feedback=error_feedback,
      **({"warmup_steps": warmup_steps} if warmup_steps else {}),
      **({"eager": True} if eager else {}),
      **outer_kwargs,
    ),
    hlo.Schedule(schedules.every(period), warmup_steps=warmup_steps),
    1.0 / period,
    quick,
    family="topk" if topk else name if name != "adamw" else "diloco",
    optimizer=name,
  )


def noloco(
  period: int = 16, pull: float | None = None, name: str = "adamw"
) -> Method:
  """NoLoCo (``docs/noloco.md``) at the paper's outer step (momentum 0.5,
  learning rate 0.7, pull = learning rate unless ``pull`` says), its
  gossip with one random peer every ``period`` steps."""
  from shardopt.periodic import gossip

  knob = f"pull {pull:g}" if pull is not None else ""
  return Method(
    f"noloco({name}, H={period}{_suffix(knob)})",
    ("noloco",),
    lambda opt: shardopt.noloco(
      opt(),
      AXIS,
      sync_period=period,
      **({"pull": pull} if pull is not None else {}),
    ),
    hlo.Schedule(gossip.schedule(period, 16)),
    1.0 / period,
    family="noloco",
    optimizer=name,
  )


def streaming_diloco(
  period: int,
  num_fragments: int,
  quick: bool = False,
  name: str = "adamw",
  overlap_steps: int = 0,
  overlap_alpha: float = 0.0,
  comm_dtype=None,
  error_feedback: bool = False,
) -> Method:
  """Streaming DiLoCo: ``num_fragments`` fragments, optionally overlapped
  (``overlap_steps``, ``overlap_alpha``) and on a quantized wire."""
  overlap = (
    f"overlap {overlap_steps}, alpha={overlap_alpha:g}"
    if overlap_steps or overlap_alpha
    else ""
  )
  wire = wire_name(comm_dtype, error_feedback)
  return Method(
    f"streaming diloco({name}, H={period}, F={num_fragments}"
    f"{_suffix(overlap, wire)})",
    ("diloco",),
    lambda opt: shardopt.diloco(
      opt(),
      AXIS,
      sync_period=period,
      num_fragments=num_fragments,
      **(
        {"overlap_steps": overlap_steps, "overlap_alpha": overlap_alpha}
        if overlap
        else {}
      ),
      **(
        {"comm_dtype": comm_dtype, "error_feedback": error_feedback}
        if wire
        else {}
      ),
    ),
    hlo.Schedule(
      schedules.streaming(period, num_fragments, lag=min(overlap_steps, 1))
    ),
    num_fragments / period,
    quick,
    family="streaming",
  )


def hierarchical(
  period_group_sizes: dict, quick: bool = False, name: str = "adamw"
) -> Method:
  cycle = math.lcm(*period_group_sizes)
  rounds = (
    sum(
      1
      for t in range(1, cycle + 1)
      if any(t % p == 0 for p in period_group_sizes)
    )
    / cycle
  )
  return Method(
    f"hierarchical_local_sgd({name}, {period_group_sizes})",
    ("hierarchical_local_sgd",),
    lambda opt: shardopt.hierarchical_local_sgd(
      opt(), AXIS, period_group_sizes=period_group_sizes
    ),
    hlo.Schedule(schedules.hierarchy(period_group_sizes)),
    rounds,
    quick,
    family="hierarchical",
  )


def demo(
  lr_scale: float = 1.0,
  k: int = 32,
  chunk_size: int = 64,
  decay: float = 0.999,
  quick: bool = False,
  mean: str = "replicas",
) -> Method:
  """DeMo: ``chain(decoupled_momentum(k, chunk_size, decay), sign step)``
  with the paper's defaults (32 DCT coefficients of every 64 x 64 tile,
  float32 values, decay 0.999) and the sign step at ``lr_scale`` times the
  study's schedule (``workload.OPTIMIZERS["sign"]``: the paper's DeMo runs
  took AdamW's learning rate and schedule, without weight decay);
  ``mean="senders"`` (issue 51): each coefficient averaged over the
  replicas that sent it, as the authors' code does."""
  scale = f", lr x{lr_scale:g}" if lr_scale != 1 else ""
  senders = ", mean over senders" if mean == "senders" else ""
  return Method(
    f"chain(decoupled_momentum(k={k}, chunk={chunk_size},"
    f" decay={decay:g}{senders}), sign step{scale})",
    ("decoupled_momentum",),
    lambda opt: optax.chain(
      shardopt.decoupled_momentum(
        AXIS,
        k=k,
        chunk_size=chunk_size,
        decay=decay,
        **({"mean": mean} if mean != "replicas" else {}),
      ),
      opt(),
      *([optax.scale(lr_scale)] if lr_scale != 1 else []),
    ),
    hlo.Schedule(),
    quick=quick,
    family="demo",
    optimizer="sign",
  )


def desloc(period: int = 16, mu: int | None = None, nu: int | None = None):
  """DES-LOC (issue 51, arXiv 2505.22549): ``desloc(adamw, sync_period=
  period)`` with the moments on their own periods (default the paper's
  rule, ``mu`` every ``3 * period``, ``nu`` every ``6 * period``;
  ``mu = nu = period`` is Local Adam)."""
  mu = 3 * period if mu is None else mu
  nu = 6 * period if nu is None else nu
  periods = {"params": period, "mu": mu, "nu": nu}
  cycle = math.lcm(*periods.values())
  rounds = (
    sum(
      1
      for t in range(1, cycle + 1)
      if any(t % k == 0 for k in periods.values())
    )
    / cycle
  )
  return Method(
    f"desloc(adamw, Kx={period}, Ku={mu}, Kv={nu})",
    ("desloc",),
    lambda opt: shardopt.desloc(
      opt(), AXIS, sync_period=period, state_sync_periods={"mu": mu, "nu": nu}
    ),
    hlo.Schedule(schedules.desloc(periods)),
    rounds,
    family="desloc",
  )


def pier(
  period: int = 16,
  steps: int = workload.FULL.steps,
  warmup_fraction: float = 0.1,
) -> Method:
  """Pier (issue 51, arXiv 2511.17849) as its authors' code runs it
  (``shardopt.pier``, ``docs/pier.md``): the first ``warmup_fraction`` of
  the run's ``steps // period`` syncs synchronous (the mean gradient every
  step) while the outer momentum accumulates (0.9), then DiLoCo with the
  outer momentum decaying 0.99 -> 0.9 and the outer rate 0 -> 1.1 -> 0.9."""
  warm = f", warm-up {warmup_fraction:g}" if warmup_fraction != 0.1 else ""
  return Method(
    f"pier(adamw, H={period}{warm})",
    ("pier",),
    lambda opt: shardopt.pier(
      opt(),
      AXIS,
      total_steps=steps,
      sync_period=period,
      warmup_fraction=warmup_fraction,
    ),
    hlo.Schedule(
      schedules.every(period),
      warmup_steps=round(warmup_fraction * (steps // period)) * period,
    ),
    1.0 / period,
    family="pier",
  )


def mt_dao(
  period: int = 16,
  beta: float = 0.995,
  omega: float = 0.7,
  quick: bool = False,
) -> Method:
  """MT-DAO (issue 51, arXiv 2510.05361): ``local_sgd`` every ``period``
  steps around ``shardopt.mt_dao``'s step (one slow momentum of decay
  ``beta`` weighted ``omega``, the gradient ``1 - omega``, Adam's
  denominator) with AdamW's weight decay and the study's schedule
  (``workload.OPTIMIZERS["decayed step"]``): AdamW with its
  ``scale_by_adam`` replaced by ``scale_by_mt_dao``. The paper's sync also
  averages the optimizer's states; the periodic engine averages the params
  only (docs/mt_dao.md)."""
  return Method(
    f"local_sgd(mt_dao(beta={beta:g}, omega={omega:g}), H={period})",
    ("local_sgd", "scale_by_mt_dao"),
    lambda opt: shardopt.local_sgd(
      optax.chain(shardopt.scale_by_mt_dao((beta,), (omega,)), opt()),
      AXIS,
      sync_period=period,
    ),
    hlo.Schedule(schedules.every(period)),
    1.0 / period,
    quick,
    family="mt_dao",
    optimizer="decayed step",
  )


def mt_dao_synced(
  period: int = 16, beta: float = 0.995, omega: float = 0.7
) -> Method:
  """MT-DAO with the paper's sync (issue 51, arXiv 2510.05361): every
  ``period`` steps the params, the momentum and the second moment are all
  averaged (``K_x = K_1 = K_v``, its experiments' setting), as
  ``shardopt.desloc`` around :func:`mt_dao`'s inner step
  (``state_sync_periods={"momenta": period, "nu": period}``)."""
  periods = {"params": period, "momenta": period, "nu": period}
  return Method(
    f"desloc(mt_dao(beta={beta:g}, omega={omega:g}), K={period}, states"
    f" every {period})",
    ("desloc", "scale_by_mt_dao"),
    lambda opt: shardopt.desloc(
      optax.chain(shardopt.scale_by_mt_dao((beta,), (omega,)), opt()),
      AXIS,
      sync_period=period,
      state_sync_periods={"momenta": period, "nu": period},
    ),
    hlo.Schedule(schedules.desloc(periods)),
    1.0 / period,
    family="mt_dao",
    optimizer="decayed step",
  )


def quality_per_byte(steps: int = 1536, quick: bool = False) -> list[Method]:
  """Issue 24's frontier (section 8) with issue 33's rows, for a run of
  ``steps`` steps.

  Full (50 methods, about 125 min for 2 seeds on the shared 2-core
  machine): sync and ``cross_shard_mean`` on an int8 wire with error
  feedback and on a top-k wire (32 of every 4096 entries, 2-bit values,
  error feedback without decay: DeMo's density on per-step gradients);
  ``accumulate`` k = 4; ``powersgd`` rank 2 and 4 on a float32 and an int8
  wire; ``local_sgd`` H = 2, 4, 8, 16 and 64, and H = 16 with an int4
  average and error feedback; ``diloco`` (shardopt's default outer step,
  Nesterov lr 0.8, momentum 0.2) H = 16, 32, 64, 128 with a float32 outer
  gradient, H = 16 and 64 on int4 with and without error feedback, H = 128
  int4 with error feedback, H = 16 with the paper's outer step (0.7, 0.9)
  for comparison; SparseLoCo: ``diloco`` H = 2, 4, 16 with its outer
  gradient on a top-k wire (64 of 4096, 2-bit, error decay 0.95) and a
  plain outer SGD step (lr 1); MuLoCo: Muon as the inner optimizer, sync
  and ``diloco`` H = 16 and 64; ``diloco`` H = 64 after a synchronous warm
  start of ``steps / 6`` (rounded down to a multiple of 64); streaming
  ``diloco`` H = 64, F = 4 with overlap (1 step, alpha 0.5);
  ``hierarchical_local_sgd`` pairs every 16 steps, all 8 every 64; DeMo
  (:func:`demo`, issue 43) at the paper's defaults, its sign step at 3, 1,
  0.3 and 0.1 times the study's learning rate; issue 51's DES-LOC
  (:func:`desloc`: K_x = 16 at the paper's rule, and as Local Adam) and
  Pier (:func:`pier`: H = 16 at its defaults, and a 30% warm-up); DeMo with
  the authors' mean over senders (1x), and MT-DAO (:func:`mt_dao`,
  ``local_sgd`` H = 16) with its slow momentum's decay 0.99, 0.995 (the
  default) and 0.999; NoLoCo H = 16 at the paper's outer step and its pull at 0
  and 0.35; Eager updates (``diloco(..., eager=True)``) H = 16 and 64.
  ``quick`` (the CI smoke run): four methods that cover the code paths (a
  quantized wire with error feedback and a warm-up in one DiLoCo), with
  periods that fit a short run (H = 16).
  """
  if quick:
    return [
      sync(),
      powersgd(2, quick=True, comm_dtype=jnp.int8),
      diloco(
        16,
        quick=True,
        comm_dtype=jnp.int4,
        error_feedback=True,
        warmup_steps=16,
      ),
      streaming_diloco(16, 4, quick=True, overlap_steps=1, overlap_alpha=0.5),
    ]
  warm = max(64, steps // 6 // 64 * 64)
  sparse_step = shardopt.topk(32, error_decay=1.0)
  sparse_outer = shardopt.topk(64)
  return [
    sync(),
    cross_shard_mean(jnp.int8, error_feedback=True),
    cross_shard_mean(sparse_step, error_feedback=True),
    accumulate(4),
    *(powersgd(r, comm_dtype=w) for r in (2, 4) for w in (None, jnp.int8)),
    *(local_sgd(h) for h in (2, 4, 8, 16)),
    local_sgd(16, comm_dtype=jnp.int4, error_feedback=True),
    local_sgd(64),
    *(diloco(h) for h in (16, 32, 64, 128)),
    *(
      diloco(h, comm_dtype=jnp.int4, error_feedback=ef)
      for h in (16, 64)
      for ef in (False, True)
    ),
    diloco(128, comm_dtype=jnp.int4, error_feedback=True),
    diloco(16, outer="paper"),
    *(
      diloco(h, comm_dtype=sparse_outer, error_feedback=True, outer="sgd")
      for h in (2, 4, 16)
    ),
    sync("muon"),
    *(diloco(h, name="muon") for h in (16, 64)),
    diloco(64, warmup_steps=warm),
    streaming_diloco(64, 4, overlap_steps=1, overlap_alpha=0.5),
    hierarchical({16: 2, 64: 8}),
    *(demo(scale) for scale in (3.0, 1.0, 0.3, 0.1)),
    # Issue 51: DES-LOC at the paper's rule (K_x 4, 16, 64) and as Local
    # Adam (every state with the params); Pier at its defaults and a longer
    # warm-up.
    desloc(16),
    desloc(16, mu=16, nu=16),
    *(desloc(k) for k in (4, 64)),  # K_x, the knob the paper tunes
    pier(16, steps),
    pier(16, steps, warmup_fraction=0.3),
    demo(mean="senders"),
    *(mt_dao(16, beta) for beta in (0.99, 0.995, 0.999)),
    *(mt_dao_synced(16, beta) for beta in (0.99, 0.995, 0.999)),
    *(noloco(16, pull) for pull in (None, 0.0, 0.35)),
    *(diloco(h, eager=True) for h in (16, 64)),
  ]


def frontier() -> list[Method]:
  """Issue 43's handful, the frontier that ``quality_per_byte --tiny`` and
  ``python -m benchmarks.accelerator`` train: sync, ``cross_shard_mean`` on
  int8 with error feedback, ``local_sgd`` H = 16, ``diloco`` H = 16 (AdamW
  and Muon inside), SparseLoCo H = 4 (``diloco`` on ``topk(64)`` with error
  feedback, outer ``sgd(1)``), DeMo at the paper's defaults with each of its
  two means (issue 51), and issue 51's DES-LOC (K_x = 16), Pier (H = 16),
  MT-DAO (``desloc`` K = 16 around ``mt_dao``: params and states averaged,
  the paper's sync), NoLoCo H = 16 and Eager
  updates H = 16 at the papers' defaults."""
  return [
    sync(),
    cross_shard_mean(jnp.int8, error_feedback=True),
    local_sgd(16),
    diloco(16),
    diloco(16, name="muon"),
    diloco(4, comm_dtype=shardopt.topk(64), error_feedback=True, outer="sgd"),
    demo(),
    desloc(16),
    pier(16),
    demo(mean="senders"),
    mt_dao_synced(16),
    noloco(16),
    diloco(16, eager=True),
  ]
