"""Writes the Colab-ready notebooks in this folder from the cells below.

Edit the cells here, then regenerate::

    .venv/bin/python notebooks/_make_notebooks.py

``tests/test_notebooks.py`` checks that the ``.ipynb`` files match this
script and executes every notebook on 8 CPU devices.
"""

from __future__ import annotations

import pathlib
import textwrap

import nbformat

HERE = pathlib.Path(__file__).resolve().parent

# The first code cell of every notebook. It must stay valid Python (no "!pip"
# magics) so the notebooks also run as plain scripts and under nbclient.
SETUP = '''
# Setup: install shardopt on Colab (only there), then pick the devices.
import os
import subprocess
import sys

if "google.colab" in sys.modules:
  # Point this at a wheel, a git URL or a released version of shardopt.
  SHARDOPT_PIP_SPEC = os.environ.get("SHARDOPT_PIP_SPEC", "shardopt")
  subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                  SHARDOPT_PIP_SPEC], check=True)

# With no TPU/GPU (or a single one), train on 8 virtual CPU devices. XLA reads
# this flag when JAX starts its backends, so it must be set before the first
# JAX computation; it only changes the CPU backend, never a TPU or GPU.
NUM_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + f" {_FLAG}={NUM_DEVICES}").strip()

import jax

if jax.default_backend() in ("tpu", "gpu") and jax.device_count() > 1:
  DEVICES = jax.devices()[:NUM_DEVICES]     # a TPU slice or a multi-GPU box
else:
  DEVICES = jax.devices("cpu")[:NUM_DEVICES]
print(f"JAX {jax.__version__}: {len(DEVICES)} x {DEVICES[0].device_kind}")
'''


def md(text: str):
  return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
  return nbformat.v4.new_code_cell(textwrap.dedent(text).strip())


# ---------------------------------------------------------------------------
# 01: CrossShardOptimizer in a pmap loop

NB01 = [
    md('''
    # shardopt 01 — `CrossShardOptimizer` in a `jax.pmap` loop

    TensorFlow 1's `tf.compat.v1.tpu.CrossShardOptimizer(opt)` combined the
    gradients of all TPU shards before applying `opt`. In shardopt it is an optax
    transform you put in a chain:

    ```python
    tx = optax.chain(shardopt.cross_shard_mean("batch"), optax.adam(1e-3))
    # or, as one wrapper around the optimizer:
    tx = shardopt.cross_shard(optax.adam(1e-3), "batch")
    ```

    This notebook trains with it in a `pmap` loop, shows TensorFlow's literal
    recipe (scale the loss, sum the gradients), subgroups of replicas
    (`axis_index_groups`, TF's `group_assignment`), per-replica gradient clipping,
    and the same step under `jax.shard_map`.

    Runs on a Colab TPU, a multi-GPU machine, or a CPU (8 virtual devices).
    '''),
    code(SETUP),
    code('''
    import functools

    import jax.numpy as jnp
    import numpy as np
    import optax

    import shardopt

    n = len(DEVICES)
    pmap = functools.partial(jax.pmap, axis_name="batch", devices=DEVICES)
    '''),
    md('''
    ## 1. A data-parallel training loop

    Every replica holds the same weights and sees its own shard of the batch.
    `cross_shard_mean("batch")` averages the gradients over the replicas (a
    `pmean`); Adam then applies the same update everywhere, so the replicas stay
    bit-identical, which `shardopt.replica_divergence` checks (0.0 = in sync).
    '''),
    code('''
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=(8, 1)).astype(np.float32)
    x = rng.normal(size=(n, 64, 8)).astype(np.float32)   # [replica, example, feature]
    y = x @ true_w + 0.01 * rng.normal(size=(n, 64, 1)).astype(np.float32)


    def loss_fn(w, x, y):
      return jnp.mean((x @ w - y) ** 2)


    tx = optax.chain(shardopt.cross_shard_mean("batch"), optax.adam(0.05))


    def train_step(w, opt_state, x, y):
      loss, grads = jax.value_and_grad(loss_fn)(w, x, y)   # this replica's gradient
      updates, opt_state = tx.update(grads, opt_state, w)  # averaged, then Adam
      return optax.apply_updates(w, updates), opt_state, loss


    train_step = pmap(train_step)
    w = pmap(lambda _: jnp.zeros((8, 1)))(np.arange(n))   # the same on every replica
    opt_state = pmap(tx.init)(w)
    for step in range(150):
      w, opt_state, loss = train_step(w, opt_state, x, y)
      loss = float(loss.mean())   # (waiting for each step also keeps CPU runs snappy)

    divergence = float(pmap(lambda w: shardopt.replica_divergence(w, "batch"))(w)[0])
    print(f"loss {loss:.5f}   max |w - true_w| = {np.abs(w[0] - true_w).max():.4f}")
    print(f"replica divergence: {divergence}")
    assert divergence == 0.0 and loss < 1e-3
    '''),
    md('''
    ## 2. TensorFlow's recipe, literally

    `CrossShardOptimizer(reduction=MEAN)` divided the loss by the number of shards
    in `compute_gradients` and *summed* the gradients in `apply_gradients`. The
    literal port is `shardopt.scale_loss` + `shardopt.cross_shard_sum`; it gives
    the same update as `cross_shard_mean` on the unscaled loss. (Scaling the loss
    *and* averaging would divide twice.)
    '''),
    code('''
    w0 = pmap(lambda _: jnp.zeros((8, 1)))(np.arange(n))


    def first_update(loss_transform, reduce_tx):
      tx = optax.chain(reduce_tx, optax.sgd(0.1))

      def step(w, x, y):
        grads = jax.grad(lambda w: loss_transform(loss_fn(w, x, y)))(w)
        updates, _ = tx.update(grads, tx.init(w), w)
        return updates

      return np.asarray(pmap(step)(w0, x, y)[0])


    tf_literal = first_update(lambda l: shardopt.scale_loss(l, "batch"),
                              shardopt.cross_shard_sum("batch"))
    jax_style = first_update(lambda l: l, shardopt.cross_shard_mean("batch"))
    print("max |difference|:", np.abs(tf_literal - jax_style).max())
    np.testing.assert_allclose(tf_literal, jax_style, rtol=1e-6)
    '''),
    md('''
    ## 3. Subgroups of replicas

    `axis_index_groups` (TF's `group_assignment`) reduces within each group only:
    here the first and the second half of the replicas each average on their own.
    TensorFlow's test oracle: SGD with learning rate 1 from `w = 0`, replica `i`'s
    gradient is `i + 1`; each replica lands on minus its group's mean gradient.
    Every member of a group ends with bit-identical values.
    '''),
    code('''
    half = n // 2
    groups = [list(range(half)), list(range(half, n))]


    def sgd_step(reduce_tx):
      tx = optax.chain(reduce_tx, optax.sgd(1.0))

      def step(w, g):
        updates, _ = tx.update(g, tx.init(w), w)
        return optax.apply_updates(w, updates)

      return np.asarray(pmap(step)(np.zeros(n, np.float32),
                                   np.arange(1.0, n + 1, dtype=np.float32)))


    print("groups:", groups)
    print("mean, all replicas :", sgd_step(shardopt.cross_shard_mean("batch")))
    print("mean, within groups:", sgd_step(shardopt.cross_shard_mean(
        "batch", axis_index_groups=groups)))
    print("sum,  within groups:", sgd_step(shardopt.cross_shard_sum(
        "batch", axis_index_groups=groups)))
    g = np.arange(1.0, n + 1)
    np.testing.assert_allclose(
        sgd_step(shardopt.cross_shard_mean("batch", axis_index_groups=groups)),
        np.repeat([-g[:half].mean(), -g[half:].mean()], half))
    '''),
    md('''
    ## 4. Clip each replica's gradient before combining

    TF's `CrossShardOptimizer` defers the sum to `apply_gradients` "so that user
    can modify the gradients like clipping with per replica global norm": one
    replica's huge gradient should not swamp everyone else's. In optax that is
    the order of the chain: clip first (per replica), then combine.

    Replica 0 sees an outlier gradient `[100, 0]`; the others see `[0, 1]`.
    '''),
    code('''
    grads = np.zeros((n, 2), np.float32)
    grads[0] = [100.0, 0.0]
    grads[1:] = [0.0, 1.0]

    clip_then_mean = optax.chain(optax.clip_by_global_norm(1.0),
                                 shardopt.cross_shard_mean("batch"))
    mean_then_clip = optax.chain(shardopt.cross_shard_mean("batch"),
                                 optax.clip_by_global_norm(1.0))


    def combined(tx):
      return np.asarray(pmap(lambda g: tx.update(g, tx.init(g))[0])(grads)[0])


    print("clip per replica, then mean:", combined(clip_then_mean))
    print("mean, then clip            :", combined(mean_then_clip))
    # Per-replica clipping: the outlier counts as one replica out of n.
    np.testing.assert_allclose(combined(clip_then_mean), [1 / n, (n - 1) / n],
                               rtol=1e-6)
    '''),
    md('''
    ## 5. The same step under `jax.shard_map`

    `pmap` is in maintenance mode; `jax.shard_map` over a mesh is the modern
    path. Params can stay replicated (`P()`): their gradient is then typed
    *invariant* because autodiff has already summed it over the axis, and
    `cross_shard_mean` divides that sum by the number of replicas instead of
    summing again. No change to the optimizer.
    '''),
    code('''
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(DEVICES), ("batch",))
    tx = shardopt.cross_shard(optax.adam(0.05), "batch")


    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh,
                       in_specs=(P(), P(), P("batch"), P("batch")),
                       out_specs=(P(), P(), P()))
    def sharded_step(w, opt_state, x, y):
      loss, grads = jax.value_and_grad(loss_fn)(w, x, y)
      updates, opt_state = tx.update(grads, opt_state, w)
      return optax.apply_updates(w, updates), opt_state, jax.lax.pmean(loss, "batch")


    rows = NamedSharding(mesh, P("batch"))
    x_rows = jax.device_put(x.reshape(-1, 8), rows)
    y_rows = jax.device_put(y.reshape(-1, 1), rows)
    w = jax.device_put(jnp.zeros((8, 1)), NamedSharding(mesh, P()))
    opt_state = jax.device_put(tx.init(w), NamedSharding(mesh, P()))
    for step in range(150):
      w, opt_state, loss = sharded_step(w, opt_state, x_rows, y_rows)
      loss = float(loss)
    print(f"loss {loss:.5f}   max |w - true_w| = {np.abs(np.asarray(w) - true_w).max():.4f}")
    assert loss < 1e-3
    '''),
    md('''
    Next: `02_agn_local_steps.ipynb` (communicate every T steps: AGN, local SGD,
    DiLoCo) and `03_tower_sharded_state.ipynb` (TowerOptimizer with the optimizer
    state split across replicas). Porting TF1 code? See `docs/migration.md`.
    '''),
]

# ---------------------------------------------------------------------------
# 02: AGN, local SGD, DiLoCo

NB02 = [
    md('''
    # shardopt 02 — communicate every T steps: AGN, local SGD, DiLoCo

    TensorFlow's `tf.contrib.opt.AGNOptimizer` (Accumulated Gradient
    Normalization, Hermans et al. 2017) lets every worker take `T` local steps,
    then commits the *normalized* accumulated gradient (sum of the `T` gradients
    divided by `T`) to shared center variables. shardopt runs it synchronously
    across replicas, with two relatives that share its engine:

    | transform | what is combined every T steps | center update |
    |---|---|---|
    | `shardopt.agn(opt, "batch", communication_period=T)` | accumulated gradients / T | `global_optimizer` (default: a second `opt`) |
    | `shardopt.local_sgd(opt, "batch", period=T)` | params | their mean |
    | `shardopt.diloco(opt, "batch", sync_period=T)` | `center - params` | Nesterov SGD (lr 0.7, momentum 0.9) |

    Between syncs the replicas do not communicate at all. This notebook trains a
    small MLP on scikit-learn's digits with each method and plots test accuracy
    against the number of all-reduces.
    '''),
    code(SETUP),
    code('''
    import functools

    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np
    import optax

    import shardopt
    from shardopt.demo import cross_entropy, init_mlp, load_digits_split, mlp_logits

    n = len(DEVICES)
    pmap = functools.partial(jax.pmap, axis_name="batch", devices=DEVICES)
    x_train, x_test, y_train, y_test = load_digits_split()
    print(f"{len(x_train)} training and {len(x_test)} test images, {n} replicas")
    '''),
    md('''
    ## The training loop

    A plain `pmap` loop; every replica gets its own batch. For the periodic
    methods the model we evaluate is the shared `center` (the state's
    `center` field, equal to every replica's params right after a sync), and
    the number of all-reduces is the state's `sync_count`.
    '''),
    code('''
    STEPS, BATCH, LR = 120, 32, 3e-3
    batches = np.random.default_rng(0).integers(0, len(x_train), size=(STEPS, n, BATCH))
    params0 = init_mlp(jax.random.key(0), (64, 64, 10))


    def train(tx):
      def step(params, state, x, y):
        grads = jax.grad(cross_entropy)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

      step = pmap(step)
      params = pmap(lambda _: params0)(np.arange(n))
      state = pmap(tx.init)(params)
      for i in range(STEPS):
        params, state = step(params, state, x_train[batches[i]], y_train[batches[i]])
        jax.block_until_ready(params)
      center = optax.tree_utils.tree_get(state, "center")
      model = jax.tree.map(lambda a: a[0], center if center is not None else params)
      accuracy = float((mlp_logits(model, x_test).argmax(-1) == y_test).mean())
      sync_count = optax.tree_utils.tree_get(state, "sync_count")
      all_reduces = STEPS if sync_count is None else int(sync_count[0])
      return accuracy, all_reduces
    '''),
    code('''
    runs = {
        "every step (cross_shard)": shardopt.cross_shard(optax.adam(LR), "batch"),
    }
    for period in (5, 20):
      # The center takes one step per period: give it a T-times larger step.
      runs[f"agn T={period}"] = shardopt.agn(
          optax.adam(LR), "batch", communication_period=period,
          global_optimizer=optax.adam(LR * period))
      runs[f"local_sgd T={period}"] = shardopt.local_sgd(
          optax.adam(LR), "batch", period=period)
    runs["diloco T=20"] = shardopt.diloco(optax.adam(LR), "batch", sync_period=20)

    results = {}
    for name, tx in runs.items():
      results[name] = train(tx)
      print(f"{name:<26} test accuracy {results[name][0]:.1%}"
            f"   all-reduces {results[name][1]:>4}")
    '''),
    code('''
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (accuracy, all_reduces) in results.items():
      ax.scatter(all_reduces, accuracy, s=40)
      ax.annotate(name, (all_reduces, accuracy), textcoords="offset points",
                  xytext=(5, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(f"all-reduces in {STEPS} steps (communication)")
    ax.set_ylabel("test accuracy")
    ax.set_title("Communication vs accuracy, MLP on sklearn digits")
    ax.grid(alpha=0.3)
    plt.show()

    assert results["agn T=5"][1] == STEPS // 5 and results["diloco T=20"][1] == STEPS // 20
    assert all(accuracy > 0.5 for accuracy, _ in results.values())
    '''),
    md('''
    ## Communication happens only on sync steps

    The all-reduce sits inside the sync branch of a `jax.lax.cond` whose
    predicate is the step counter, so the other `T - 1` steps run no collective
    at all. We can see it in the traced program of one AGN step:
    '''),
    code('''
    COLLECTIVES = {"psum", "pmax", "pmin", "all_gather", "psum_scatter",
                   "reduce_scatter", "all_to_all", "ppermute"}


    def collectives_in(jaxpr):
      """Names of the collectives in a jaxpr and in every sub-jaxpr it holds."""
      found = []
      for eqn in jaxpr.eqns:
        if eqn.primitive.name in COLLECTIVES:
          found.append(eqn.primitive.name)
        for value in eqn.params.values():
          for sub in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(sub, "jaxpr") or hasattr(sub, "eqns"):
              found += collectives_in(getattr(sub, "jaxpr", sub))
      return found


    tx = shardopt.agn(optax.adam(LR), "batch", communication_period=10)


    def agn_step(params, state, x, y):
      grads = jax.grad(cross_entropy)(params, x, y)
      return tx.update(grads, state, params)


    closed = jax.make_jaxpr(agn_step, axis_env=[("batch", n)])(
        params0, tx.init(params0), x_train[:BATCH], y_train[:BATCH])
    outside = [e.primitive.name for e in closed.jaxpr.eqns if e.primitive.name in COLLECTIVES]
    cond = next(e for e in closed.jaxpr.eqns if e.primitive.name == "cond")
    quiet, sync = (collectives_in(b.jaxpr) for b in cond.params["branches"])
    print("collectives outside the cond:", outside)
    print("quiet branch (T - 1 of every T steps):", quiet)
    print("sync branch:", sync)
    assert not outside and not quiet and sync
    '''),
    md('''
    Notes

    * TensorFlow's AGNOptimizer is asynchronous (each worker commits to a
      parameter server on its own); shardopt is synchronous SPMD.
      `reduction="mean"` (default) averages the replicas' normalized
      accumulators; `"sum"` is what a parameter server does when it applies every
      worker's commit in one round.
    * All counters live in the optimizer state as arrays, so a checkpoint taken
      mid-period restores and continues bit-identically (see
      `tests/test_integration_flax.py`, which does it with orbax).
    '''),
]

# ---------------------------------------------------------------------------
# 03: tower with sharded optimizer state

NB03 = [
    md('''
    # shardopt 03 — `TowerOptimizer`: reduce once, update once, state sharded

    TensorFlow's `tf.contrib.estimator.TowerOptimizer` summed the gradients of all
    towers and applied the optimizer *once*. `shardopt.tower(inner, "batch")`
    makes "once" literal and cheap: it reduce-scatters the gradients so each
    replica owns `1/n` of every parameter, runs `inner` only on its slice (with
    optimizer state for that slice only), and all-gathers the update. For
    elementwise optimizers (sgd, momentum, adam, adamw, rmsprop, adagrad, lion)
    the result equals `shardopt.cross_shard(inner)`, with `1/n` of the optimizer
    state per device: ZeRO stage 1.

    This notebook uses `jax.shard_map` with replicated params and sharded
    optimizer state.
    '''),
    code(SETUP),
    code('''
    import functools

    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import shardopt
    from shardopt.demo import cross_entropy, init_mlp, load_digits_split

    n = len(DEVICES)
    mesh = jax.sharding.Mesh(np.array(DEVICES), ("batch",))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    x_train, _, y_train, _ = load_digits_split()
    '''),
    md('''
    ## Specs: params replicated, optimizer state sharded

    `tower`'s state is `inner`'s state over the owned slices: every leaf
    flattened, zero-padded to a multiple of `n`, and chunk `axis_index` kept.
    In `shard_map` those 1-D slices get `P("batch")` (the global array is the
    concatenation of the slices) and scalar counters stay `P()`. `inner.init` on
    1-element stand-ins gives the state's structure without needing the axis.
    '''),
    code('''
    inner = optax.adam(1e-2)
    params = jax.device_put(init_mlp(jax.random.key(0), (64, 128, 10)), replicated)


    def tower_state_specs(inner, params):
      stand_ins = jax.tree.map(lambda p: jax.ShapeDtypeStruct((1,), p.dtype), params)
      return jax.tree.map(lambda s: P("batch") if s.ndim else P(),
                          jax.eval_shape(inner.init, stand_ins))


    def make_step(tx, state_specs):
      @jax.jit
      @functools.partial(jax.shard_map, mesh=mesh,
                         in_specs=(P(), state_specs, P("batch"), P("batch")),
                         out_specs=(P(), state_specs, P()))
      def step(params, state, x, y):
        loss, grads = jax.value_and_grad(cross_entropy)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "batch")
      init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(),
                                   out_specs=state_specs))
      return init, step


    tower_tx = shardopt.tower(inner, "batch")
    cross_tx = shardopt.cross_shard(inner, "batch")
    tower_init, tower_step = make_step(tower_tx, tower_state_specs(inner, params))
    cross_init, cross_step = make_step(cross_tx, P())
    '''),
    code('''
    def per_device_bytes(tree):
      """Bytes of ``tree`` that live on the first device."""
      first = DEVICES[0]
      return sum(s.data.nbytes for leaf in jax.tree.leaves(tree)
                 for s in leaf.addressable_shards if s.device == first)


    batches = np.random.default_rng(0).integers(0, len(x_train), size=(40, n * 32))
    runs = {}
    for name, init, step in (("tower", tower_init, tower_step),
                             ("cross_shard", cross_init, cross_step)):
      p, state = params, init(params)
      for idx in batches:
        p, state, loss = step(p, state, jax.device_put(x_train[idx], rows),
                              jax.device_put(y_train[idx], rows))
        loss = float(loss)
      runs[name] = (p, state, loss)
      print(f"{name:<12} loss {loss:.4f}   optimizer state on one device:"
            f" {per_device_bytes(state):>7,} bytes")

    diff = max(float(jnp.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(runs["tower"][0]), jax.tree.leaves(runs["cross_shard"][0])))
    print(f"max |params(tower) - params(cross_shard)| after {len(batches)} steps: {diff:.2e}")
    assert diff < 1e-4   # equal up to the order of float additions
    assert per_device_bytes(runs["tower"][1]) * n <= per_device_bytes(runs["cross_shard"][1]) + 64 * n
    '''),
    md('''
    ## TensorFlow's loss scaling, and its test oracle

    `TowerOptimizer` divided the loss by the number of towers (unless the
    reduction is SUM) and summed the gradients. Both ways of writing it in
    shardopt give TF's numbers (two towers, `c = 10`, loss
    `sum(|features * c - labels|)` with features = labels = `[[1]]` and
    `[[2]]`, gradient descent with learning rate 1): SUM → `c = 7`,
    MEAN → `c = 8.5`.
    '''),
    code('''
    two = jax.sharding.Mesh(np.array(DEVICES[:2]), ("batch",))


    def tower_oracle(reduction, scale_loss_first):
      tx = shardopt.tower(optax.sgd(1.0), "batch",
                          reduction="sum" if scale_loss_first else reduction)

      @jax.jit
      @functools.partial(jax.shard_map, mesh=two, in_specs=(P(), P("batch")),
                         out_specs=P())
      def step(c, features):
        def loss(c):
          per_tower = jnp.sum(jnp.abs(features * c - features))
          return (shardopt.scale_loss(per_tower, "batch", reduction=reduction)
                  if scale_loss_first else per_tower)
        grads = jax.grad(loss)(jax.lax.pcast(c, "batch", to="varying"))
        updates, _ = tx.update(grads, tx.init(c), c)
        return optax.apply_updates(c, updates)

      features = jax.device_put(jnp.array([[1.0], [2.0]]), NamedSharding(two, P("batch")))
      return float(step(jnp.float32(10.0), features))


    for reduction, want in (("sum", 7.0), ("mean", 8.5)):
      literal, jax_style = tower_oracle(reduction, True), tower_oracle(reduction, False)
      print(f"{reduction}: TF literal (scale_loss + tower sum) c = {literal},"
            f"  JAX style (tower {reduction}) c = {jax_style}")
      assert literal == jax_style == want
    '''),
    md('''
    ## Whole-tree statistics need the sharding-aware version

    Inside `tower`, `inner` sees only this replica's slice. Elementwise
    transforms don't care, but `optax.clip_by_global_norm` would clip every slice
    by *its own* norm. `shardopt.clip_by_global_norm(max_norm, "batch")` adds the
    slices' squared norms across replicas first, so it clips by the norm of the
    full gradient.
    '''),
    code('''
    grads = {"w": jnp.arange(1.0, 17.0)}   # the same on every replica; norm ~ 38.7


    def tower_update(inner):
      tx = shardopt.tower(inner, "batch")

      @jax.jit
      @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P())
      def update(g):
        g = jax.lax.pcast(g, "batch", to="varying")   # each replica's own gradient
        return tx.update(g, tx.init(g), g)[0]

      return np.asarray(update(grads)["w"])


    full = np.asarray(optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())[0]["w"])
    aware = tower_update(shardopt.clip_by_global_norm(1.0, "batch"))
    naive = tower_update(optax.clip_by_global_norm(1.0))
    print("norm of the update, sharding-aware clip:", np.linalg.norm(aware))
    print("norm of the update, optax clip per slice:", np.linalg.norm(naive))
    np.testing.assert_allclose(aware, full, rtol=1e-6)
    assert np.linalg.norm(naive) > 1.5
    '''),
    md('''
    Safe inside `tower`: `sgd` (with momentum), `adam`, `adamw`, `rmsprop`,
    `adagrad`, `lion`, `clip`, `scale`, schedules, and
    `shardopt.clip_by_global_norm(max_norm, axis)`. Not safe: anything reading a
    whole-tree or whole-leaf statistic (`optax.clip_by_global_norm`, `lamb`/`lars`
    trust ratios, `adafactor`'s factored moments).
    '''),
]

NOTEBOOKS = {
    "01_cross_shard_pmap.ipynb": NB01,
    "02_agn_local_steps.ipynb": NB02,
    "03_tower_sharded_state.ipynb": NB03,
}


def build(cells) -> nbformat.NotebookNode:
  nb = nbformat.v4.new_notebook()
  nb.cells = cells
  nb.metadata = {
      "kernelspec": {"display_name": "Python 3", "language": "python",
                     "name": "python3"},
      "language_info": {"name": "python"},
      "colab": {"provenance": []},
  }
  return nb


def main(out_dir: pathlib.Path = HERE) -> list:
  written = []
  for name, cells in NOTEBOOKS.items():
    nb = build(cells)
    # Stable cell ids so regenerating does not churn the files.
    for i, cell in enumerate(nb.cells):
      cell["id"] = f"cell-{i:02d}"
    nbformat.validate(nb)
    path = out_dir / name
    nbformat.write(nb, str(path))
    written.append(path)
  return written


if __name__ == "__main__":
  for path in main():
    print(f"wrote {path}")
