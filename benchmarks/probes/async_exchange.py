"""Probe for issue 50 (asynchronous rounds): how can ONE island exchange with
the coordinator while the other islands keep training and take no part?

It starts real processes on localhost (``jax.distributed.initialize``, CPU,
``jax_cpu_collectives_implementation='gloo'``, ``jax_enable_recoverability``,
a free port, heartbeat 5 s, ``--xla_cpu_collective_timeout_seconds=5``):
process 0 is a coordinator that trains nothing and holds a "center"; the
others are islands that run inner steps (a small jitted step plus a sleep)
and, when their round is due, post a request in the coordination service's
key-value store (control only: who, which sequence number, how many floats)
and exchange with the coordinator alone: their contribution (float32) goes
in, the coordinator's center comes back. Three mechanisms, one run each:

- ``clique``: a jitted ``shard_map`` ``all_gather`` over a mesh of just two
  devices, the coordinator's and island i's, run by those two processes only
  (coordinator + 2 islands, 4 CPU devices each). Island 1 does 1,000
  back-to-back 1 MB exchanges on one pair, then 16 MB ones, then kills itself
  (SIGKILL from a timer thread) mid-way through a 16 MB exchange; the driver
  restarts it; the new incarnation first tries the dead incarnation's device
  pair again (to show it is used up), then walks through every remaining
  (coordinator device, island device, order) pair, one exchange each. Island
  2 trains and exchanges every few steps the whole time: its step timeline
  shows whether island 1's exchanges, its kill and its restart cost it.
- ``transfer``: ``jax.experimental.transfer`` (a point-to-point transfer
  server per process; the receiver pulls by uuid): the same plan, with no
  device pairs to use up (coordinator + 2 islands).
- ``kv``: for comparison only, the key-value store carrying the bytes
  (``key_value_set_bytes``/``blocking_key_value_get_bytes``), and JAX's
  cross-host ``jax.device_put`` (``jax_cross_host_transfer_socket_address``)
  between two processes' devices (coordinator + 1 island).

Run (about 2-3 minutes on a 2-core machine; no GPU, no network):

    python benchmarks/probes/async_exchange.py [--only clique,transfer,kv]
        [--reuse 1000] [--out benchmarks/results/async_exchange_probe.json]

It prints one table per run: for each mechanism and payload, how many
exchanges ran and their median / p90 / max seconds as the island saw them
(request posted to center received: control and data) and inside the data
call alone; what the kill did (the coordinator's error, seconds from the kill
to the coordinator's error); the restarted island's first exchange; how many
distinct device pairs ran; and island 2's longest gap between inner steps
(besides its own exchanges) against its step time. The JSON has every number
and the provenance (UTC date, commit, jax/jaxlib, machine, load).
Each process's log is in a temporary folder named at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

MB = 1 << 20
HB_S = 5
COLL_TIMEOUT_S = 5
# Per-run wall clock limit: the driver SIGKILLs whatever is still running.
RUN_LIMIT_S = {"clique": 150, "transfer": 100, "kv": 45}


# ---------------------------------------------------------------- workers --


def worker(cfg: dict) -> None:
  pid, mode = cfg["pid"], cfg["mode"]
  t_zero = cfg["t0"]
  tag = "'" * cfg.get("incarnation", 0)

  def log(msg):
    print(f"[{pid}{tag}] t={time.time() - t_zero:7.2f} {msg}", flush=True)

  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={cfg['k']}"
    f" --xla_cpu_collective_timeout_seconds={COLL_TIMEOUT_S}"
  )
  import jax
  import numpy as np

  jax.config.update("jax_enable_recoverability", True)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{cfg['port']}",
    num_processes=cfg["n"],
    process_id=pid,
    heartbeat_timeout_seconds=HB_S,
    initialization_timeout=90,
  )
  from jax._src import distributed

  client = distributed.global_state.client
  token = f"{os.getpid()}"

  def try_get(key):
    try:
      return client.key_value_try_get(key)
    except Exception:  # noqa: BLE001  (NOT_FOUND)
      return None

  log(f"initialized, devices {[d.id for d in jax.local_devices()]}")
  result = {"pid": pid, "incarnation": cfg.get("incarnation", 0), "records": []}
  rec = result["records"]

  def dump():
    path = os.path.join(
      cfg["dir"], f"result_{pid}_{cfg.get('incarnation', 0)}.json"
    )
    with open(path, "w") as f:
      json.dump(result, f)

  by_proc: dict[int, list] = {}
  for d in sorted(jax.devices(), key=lambda d: d.id):
    by_proc.setdefault(d.process_index, []).append(d)
  by_id = {d.id: d for d in jax.devices()}
  me_dev = by_proc[pid][0]

  # ---- mechanism: the exchange itself ----------------------------------
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  programs = {}

  def clique_exchange(pair: tuple[int, int], mine: np.ndarray) -> np.ndarray:
    """all_gather over the two devices of ``pair``; returns the other row."""
    n = mine.size
    key = (pair, n)
    devs = [by_id[i] for i in pair]
    mesh = Mesh(np.array(devs), ("x",))
    if key not in programs:
      programs[key] = jax.jit(
        jax.shard_map(
          lambda v: jax.lax.all_gather(v, "x", tiled=True),
          mesh=mesh,
          in_specs=P("x"),
          out_specs=P(),
          check_vma=False,
        )
      )
    pos = next(p for p, d in enumerate(devs) if d.process_index == pid)
    x = jax.make_array_from_single_device_arrays(
      (2, n),
      NamedSharding(mesh, P("x")),
      [jax.device_put(mine[None], devs[pos])],
    )
    out = jax.block_until_ready(programs[key](x))
    rows = np.asarray(out.addressable_shards[0].data)
    return rows[1 - pos]

  server = None
  if mode == "transfer":
    from jax.experimental import transfer

    server = transfer.start_transfer_server(
      me_dev.client, "127.0.0.1:0", ["127.0.0.1:0"]
    )
    client.key_value_set(
      f"tx/addr/{pid}", server.address(), allow_overwrite=True
    )
    log(f"transfer server at {server.address()}")
  connections = {}

  def spec(n, dev):
    return jax.ShapeDtypeStruct(
      (n,), np.float32, sharding=jax.sharding.SingleDeviceSharding(dev)
    )

  # ---- coordinator ----------------------------------------------------------
  if pid == 0:
    cfg["k"]
    centers = {}
    pairs_used = {}  # island -> list of pairs handed out
    broken = set()
    current = {}  # island -> (token, pair)

    def center(n):
      if n not in centers:
        centers[n] = np.full(n, 0.5, np.float32)
      return centers[n]

    def candidates(i):
      for cd in by_proc[0]:
        for idv in by_proc[i]:
          yield (cd.id, idv.id)
          yield (idv.id, cd.id)

    def fresh_pair(i):
      for p in candidates(i):
        if p not in pairs_used.setdefault(i, []) and p not in broken:
          return p
      return None

    done = set()
    islands = set(range(1, cfg["n"]))
    deadline = t_zero + cfg["limit"] - 5
    served, last_done_check = 0, 0.0
    while time.time() < deadline and done != islands:
      try:
        reqs = client.key_value_dir_get("ax/req/")
      except Exception as e:  # noqa: BLE001
        log(f"dir_get failed {e}")
        time.sleep(0.05)
        continue
      if time.time() - last_done_check > 0.2:
        last_done_check = time.time()
        done = {
          int(k.rsplit("/", 1)[1])
          for k, _ in client.key_value_dir_get("ax/done/")
        }
      if not reqs:
        time.sleep(0.002)
        continue
      for key, value in sorted(reqs, key=lambda kv: json.loads(kv[1])["t"]):
        client.key_value_delete(key)
        r = json.loads(value)
        i, seq, n = r["island"], r["seq"], r["n"]
        ack_key = f"ax/ack/{i}/{r['token']}/{seq}"
        t_in = time.time()
        entry = {
          "island": i,
          "seq": seq,
          "n": n,
          "token": r["token"],
          "phase": r.get("phase"),
        }
        if mode == "clique":
          if r.get("failed"):
            broken.add(tuple(r["failed"]))
          cur = current.get(i)
          if r.get("old") and cur is not None:
            pair = cur[1]
          elif (
            cur is None
            or cur[0] != r["token"]
            or r.get("fresh")
            or cur[1] in broken
          ):
            pair = fresh_pair(i)
          else:
            pair = cur[1]
          if pair is None:
            client.key_value_set(ack_key, json.dumps({"exhausted": True}))
            entry.update(ok=False, error="no unused device pair left")
            rec.append(entry)
            continue
          if pair not in pairs_used.setdefault(i, []):
            pairs_used[i].append(pair)
          current[i] = (r["token"], pair)
          client.key_value_set(ack_key, json.dumps({"pair": pair}))
          entry["pair"] = pair
          try:
            got = clique_exchange(tuple(pair), center(n))
            entry.update(
              ok=True, seconds=time.time() - t_in, got0=float(got[0])
            )
          except Exception as e:  # noqa: BLE001
            broken.add(tuple(pair))
            entry.update(
              ok=False,
              seconds=time.time() - t_in,
              error=f"{type(e).__name__}: {str(e)[:300]}",
            )
        elif mode == "transfer":
          try:
            addr = r["addr"]
            if addr not in connections:
              connections[addr] = server.connect(addr)
            server.await_pull(r["down"], [jax.device_put(center(n), me_dev)])
            client.key_value_set(ack_key, "{}")
            timeout = datetime.datetime.now() + datetime.timedelta(
              seconds=COLL_TIMEOUT_S
            )
            (got,) = connections[addr].pull(
              r["up"], [spec(n, me_dev)], timeout=timeout
            )
            got = np.asarray(got)
            entry.update(
              ok=True, seconds=time.time() - t_in, got0=float(got[0])
            )
          except Exception as e:  # noqa: BLE001
            entry.update(
              ok=False,
              seconds=time.time() - t_in,
              error=f"{type(e).__name__}: {str(e)[:300]}",
            )
        if not entry["ok"]:
          killed = try_get(f"ax/killed/{i}")
          entry["killed_at"] = float(killed) if killed else None
          if killed:
            entry["error_after_kill_s"] = time.time() - float(killed)
          log(
            f"exchange with {i} seq {seq} FAILED after"
            f" {entry['seconds']:.2f}s: {entry['error'][:200]}"
          )
        served += 1
        entry["t_end"] = time.time()
        rec.append(entry)
    result["pairs_used"] = {str(k): v for k, v in pairs_used.items()}
    result["broken"] = sorted(broken)
    result["served"] = served
    log(f"coordinator done, served {served}")
    dump()
    os._exit(0)

  # ---- island ---------------------------------------------------------------
  w = jax.device_put(np.zeros(4096, np.float32), me_dev)
  inner = jax.jit(lambda w: w - 0.01 * (w - 1.0))
  step_s = cfg["step_s"]
  steps = []  # (start, end) of each inner step
  exchanges = []  # (start, end)
  seq = [0]
  last_failed = [None]

  def inner_step():
    nonlocal w
    t = time.time()
    w = jax.block_until_ready(inner(w))
    time.sleep(step_s)
    steps.append((t, time.time()))

  def exchange(
    n, phase, old=False, fresh=False, kill_after_s=None, stall_s=None
  ):
    seq[0] += 1
    s = seq[0]
    mine = np.full(n, float(pid), np.float32)
    r = {
      "island": pid,
      "seq": s,
      "n": n,
      "token": token,
      "t": time.time(),
      "phase": phase,
    }
    if old:
      r["old"] = True
    if fresh:
      r["fresh"] = True
    if last_failed[0] is not None:
      r["failed"] = last_failed[0]
      last_failed[0] = None
    t_start = time.time()
    entry = {"seq": s, "n": n, "phase": phase}
    if mode == "transfer":
      up = (int(token) << 24) + 2 * s  # unique per incarnation and exchange
      down = up + 1
      up_arr = jax.device_put(mine, me_dev)
      server.await_pull(up, [up_arr])
      r.update(up=up, down=down, addr=server.address())
    if kill_after_s is not None:
      client.key_value_set(
        f"ax/killed/{pid}",
        repr(time.time() + kill_after_s),
        allow_overwrite=True,
      )
    client.key_value_set(f"ax/req/{pid}", json.dumps(r), allow_overwrite=False)
    ack = json.loads(
      client.blocking_key_value_get(f"ax/ack/{pid}/{token}/{s}", 60_000)
    )
    client.key_value_delete(f"ax/ack/{pid}/{token}/{s}")
    t_data = time.time()
    if kill_after_s is not None:

      def die():
        time.sleep(kill_after_s)
        os.kill(os.getpid(), signal.SIGKILL)

      threading.Thread(target=die, daemon=True).start()
    if stall_s:  # alive, but late into the data call (a stuck or slow island)
      time.sleep(stall_s)
    if ack.get("exhausted"):
      entry.update(ok=False, exhausted=True)
      rec.append(entry)
      return entry
    try:
      if mode == "clique":
        entry["pair"] = ack["pair"]
        got = clique_exchange(tuple(ack["pair"]), mine)
      else:
        if "coord" not in connections:
          connections["coord"] = server.connect(
            client.blocking_key_value_get("tx/addr/0", 10_000)
          )
        timeout = datetime.datetime.now() + datetime.timedelta(
          seconds=COLL_TIMEOUT_S
        )
        (got,) = connections["coord"].pull(
          down, [spec(n, me_dev)], timeout=timeout
        )
        got = np.asarray(got)
      t_end = time.time()
      entry.update(
        ok=True,
        seconds=t_end - t_start,
        data_seconds=t_end - t_data,
        got0=float(got[0]),
      )
    except Exception as e:  # noqa: BLE001
      t_end = time.time()
      if mode == "clique":
        last_failed[0] = ack["pair"]
      entry.update(
        ok=False,
        seconds=t_end - t_start,
        error=f"{type(e).__name__}: {str(e)[:300]}",
      )
      log(
        f"exchange seq {s} FAILED after {t_end - t_start:.2f}s: {entry['error'][:200]}"
      )
    exchanges.append((t_start, t_end))
    rec.append(entry)
    return entry

  plan = cfg["plan"]
  stop_at = t_zero + cfg["limit"] - 15
  for item in plan:
    kind = item[0]
    if kind == "burst":  # back-to-back exchanges, no training
      _, count, n = item
      t = time.time()
      for _ in range(count):
        exchange(n, f"burst{n * 4 // MB}MB")
      log(f"burst of {count} x {n * 4 / MB:.0f} MB in {time.time() - t:.2f}s")
    elif (
      kind == "train"
    ):  # `count` rounds of `every` inner steps + one exchange
      _, count, n, every = item
      for _ in range(count):
        for _ in range(every):
          inner_step()
        exchange(n, f"train{n * 4 // MB}MB")
    elif (
      kind == "train_until"
    ):  # until the coordinator says island 1's plan ended
      _, n, every = item
      while time.time() < stop_at and try_get("ax/done/1") is None:
        for _ in range(every):
          inner_step()
        exchange(n, f"train{n * 4 // MB}MB")
    elif kind == "kill":  # SIGKILL itself kill_after_s into an exchange
      _, n, after = item
      log(f"killing myself {after}s into a {n * 4 / MB:.0f} MB exchange")
      dump()
      exchange(n, "kill", kill_after_s=after)
      time.sleep(30)  # the timer kills us
    elif kind == "stall":  # one exchange entered stall_s late
      _, n, stall = item
      e = exchange(n, "stall", stall_s=stall)
      log(f"stalled exchange: ok={e['ok']} {e.get('error', '')[:160]}")
    elif kind == "old":  # the dead incarnation's pair, then a fresh one
      _, n = item
      e = exchange(n, "old_pair", old=True)
      log(f"old pair {e.get('pair')}: ok={e['ok']} {e.get('error', '')[:160]}")
      e = exchange(n, "first_fresh")
      log(f"fresh pair {e.get('pair')}: ok={e['ok']}")
    elif kind == "first":
      _, n = item
      e = exchange(n, "first_after_restart")
      log(
        f"first exchange after restart: ok={e['ok']} {e.get('seconds', 0):.3f}s"
      )
    elif kind == "all_pairs":  # every remaining pair, one exchange each
      _, n = item
      while True:
        e = exchange(n, "all_pairs", fresh=True)
        if e.get("exhausted"):
          break
        if not e["ok"]:
          log(f"pair {e.get('pair')} failed: {e.get('error', '')[:160]}")
    elif kind == "done":
      client.key_value_set(f"ax/done/{pid}", "1", allow_overwrite=True)
  result["steps"] = steps
  result["exchanges"] = exchanges
  result["step_s"] = step_s
  dump()
  client.key_value_set(f"ax/done/{pid}", "1", allow_overwrite=True)
  log("island done")
  os._exit(0)


def kv_worker(cfg: dict) -> None:
  """Run ``kv``: the key-value store carrying bytes, and cross-host device_put."""
  pid, t_zero = cfg["pid"], cfg["t0"]

  def log(msg):
    print(f"[{pid}] t={time.time() - t_zero:7.2f} {msg}", flush=True)

  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  import jax
  import numpy as np

  jax.config.update("jax_enable_recoverability", True)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_cross_host_transfer_socket_address", "127.0.0.1:0")
  jax.config.update("jax_cross_host_transfer_timeout_seconds", 10)
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{cfg['port']}",
    num_processes=2,
    process_id=pid,
    heartbeat_timeout_seconds=HB_S,
    initialization_timeout=90,
  )
  from jax._src import distributed
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  client = distributed.global_state.client
  result = {"pid": pid, "kv": [], "device_put": []}
  for mb in (1, 16):
    n = mb * MB // 4
    payload = np.full(n, float(pid), np.float32).tobytes()
    for rep in range(cfg["reps"]):
      t = time.time()
      try:
        if pid == 1:  # island: up, then wait for the center
          client.key_value_set_bytes(f"kv/up/{mb}/{rep}", payload)
          got = client.blocking_key_value_get_bytes(
            f"kv/down/{mb}/{rep}", 30_000
          )
        else:
          got = client.blocking_key_value_get_bytes(f"kv/up/{mb}/{rep}", 30_000)
          client.key_value_delete(f"kv/up/{mb}/{rep}")
          client.key_value_set_bytes(f"kv/down/{mb}/{rep}", payload)
        ok = len(got) == len(payload)
        result["kv"].append({"mb": mb, "ok": ok, "seconds": time.time() - t})
      except Exception as e:  # noqa: BLE001
        result["kv"].append(
          {
            "mb": mb,
            "ok": False,
            "seconds": time.time() - t,
            "error": f"{type(e).__name__}: {str(e)[:300]}",
          }
        )
        log(f"kv {mb} MB failed: {str(e)[:200]}")
        break
    if pid == 1:
      for rep in range(cfg["reps"]):
        try:
          client.key_value_delete(f"kv/down/{mb}/{rep}")
        except Exception:  # noqa: BLE001
          pass
  log("kv done")
  # Cross-host device_put: island 1's array onto the coordinator's device,
  # then the center back; both processes call device_put with the global view.
  d0, d1 = (d for d in sorted(jax.devices(), key=lambda d: d.process_index))
  s0 = NamedSharding(Mesh(np.array([d0]), ("x",)), P())
  s1 = NamedSharding(Mesh(np.array([d1]), ("x",)), P())

  def save():
    with open(os.path.join(cfg["dir"], f"result_{pid}_0.json"), "w") as f:
      json.dump(result, f)

  hung_after = 15.0  # the cross-host transfer timeout is set to 10 s above

  def watchdog():
    while True:
      time.sleep(0.5)
      t = result.get("device_put_entered")
      if t is not None and time.time() - t > hung_after:
        result["device_put"].append(
          {
            "mb": result["device_put_mb"],
            "ok": False,
            "seconds": time.time() - t,
            "error": f"hung: no result and no error after {hung_after:.0f} s",
          }
        )
        log("device_put hung; giving up")
        save()
        os._exit(0)

  threading.Thread(target=watchdog, daemon=True).start()
  for mb in (1, 16):
    n = mb * MB // 4
    for rep in range(cfg["reps"]):
      t = time.time()
      result["device_put_entered"], result["device_put_mb"] = t, mb
      try:

        def on(sharding, dev):
          local = (
            [jax.device_put(np.full(n, float(pid), np.float32), dev)]
            if dev.process_index == pid
            else []
          )
          return jax.make_array_from_single_device_arrays(
            (n,), sharding, local, dtype=np.float32
          )

        log(f"device_put {mb} MB rep {rep}: island -> coordinator")
        up = jax.block_until_ready(
          jax.device_put(on(s1, d1), s0)
        )  # island -> coordinator
        log("  coordinator -> island")
        down = jax.block_until_ready(
          jax.device_put(on(s0, d0), s1)
        )  # coordinator -> island
        mine = up if pid == 0 else down
        v = float(np.asarray(mine.addressable_shards[0].data)[0])
        result["device_put"].append(
          {"mb": mb, "ok": v == float(1 - pid), "seconds": time.time() - t}
        )
      except Exception as e:  # noqa: BLE001
        result["device_put"].append(
          {
            "mb": mb,
            "ok": False,
            "seconds": time.time() - t,
            "error": f"{type(e).__name__}: {str(e)[:400]}",
          }
        )
        log(f"device_put {mb} MB failed: {str(e)[:300]}")
        break
    if result["device_put"] and not result["device_put"][-1]["ok"]:
      break
  result["device_put_entered"] = None
  log("device_put done")
  save()
  os._exit(0)


# ----------------------------------------------------------------- driver --


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run(mode: str, workdir: str, reuse: int) -> dict:
  """Starts the run's processes, restarts island 1 once it dies (clique and
  transfer), kills whatever is left at the run's limit; returns the workers'
  results and the driver's own timeline."""
  d = os.path.join(workdir, mode)
  os.makedirs(d, exist_ok=True)
  port, t0 = free_port(), time.time()
  limit = RUN_LIMIT_S[mode]
  one_mb, sixteen_mb = MB // 4, 16 * MB // 4
  if mode == "kv":
    base = {"mode": "kv", "n": 2, "k": 1, "reps": 5}
    plans = {0: None, 1: None}
  else:
    base = {
      "mode": mode,
      "n": 3,
      "k": 4 if mode == "clique" else 1,
      "step_s": 0.02,
    }
    plans = {
      0: [],
      1: [
        ("burst", reuse, one_mb),
        ("train", 10, sixteen_mb, 2),
        ("train", 40, one_mb, 5),
        ("kill", sixteen_mb, 0.003),
      ],
      2: [
        ("train", 5, one_mb, 10),
        ("stall", one_mb, 8.0),
        ("train_until", one_mb, 10),
      ],
    }
  restart_plan = (
    [("old", one_mb), ("all_pairs", one_mb), ("train", 5, one_mb, 2), ("done",)]
    if mode == "clique"
    else [
      ("first", one_mb),
      ("train", 20, one_mb, 2),
      ("train", 5, sixteen_mb, 2),
      ("done",),
    ]
  )
  procs, events = {}, []

  def say(msg):
    events.append((round(time.time() - t0, 2), msg))
    print(f"[drv] t={time.time() - t0:7.2f} {msg}", flush=True)

  def start(i, incarnation=0, plan=None):
    cfg = dict(
      base,
      pid=i,
      port=port,
      t0=t0,
      dir=d,
      limit=limit,
      incarnation=incarnation,
      plan=plan,
    )
    log = open(os.path.join(d, f"p{i}_{incarnation}.log"), "w")
    procs[i] = subprocess.Popen(
      [
        sys.executable,
        "-u",
        os.path.abspath(__file__),
        "--worker",
        json.dumps(cfg),
      ],
      stdout=log,
      stderr=subprocess.STDOUT,
      start_new_session=True,
    )

  for i, plan in plans.items():
    start(i, plan=plan)
  restarted = False
  rcs = {}
  try:
    while time.time() - t0 < limit:
      time.sleep(0.05)
      for i, p in list(procs.items()):
        rc = p.poll()
        if rc is None or (i, p.pid) in rcs:
          continue
        rcs[(i, p.pid)] = rc
        say(f"process {i} (pid {p.pid}) exited rc={rc}")
        if mode != "kv" and i == 1 and rc == -signal.SIGKILL and not restarted:
          restarted = True
          time.sleep(1.0)
          say("restarting island 1 (new incarnation)")
          start(1, incarnation=1, plan=restart_plan)
      if all(p.poll() is not None for p in procs.values()):
        break
    else:
      say(f"run limit {limit}s reached")
  finally:
    for i, p in procs.items():
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        say(f"driver SIGKILLed process {i}")
  results = {}
  for fn in sorted(os.listdir(d)):
    if fn.startswith("result_"):
      with open(os.path.join(d, fn)) as f:
        results[fn[len("result_") : -len(".json")]] = json.load(f)
  return {
    "events": events,
    "results": results,
    "wall_s": round(time.time() - t0, 1),
    "logs": d,
  }


# --------------------------------------------------------------- summary --


def stats(xs):
  xs = sorted(xs)
  if not xs:
    return None
  q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
  return {"n": len(xs), "median": q(0.5), "p90": q(0.9), "max": xs[-1]}


def fmt(s):
  if s is None:
    return "-"
  return f"{s['n']:5d}  {s['median'] * 1e3:8.1f} {s['p90'] * 1e3:8.1f} {s['max'] * 1e3:8.1f}"


def longest_gap(res):
  """Island's longest wait between inner steps that is not its own exchange."""
  steps, exch = res.get("steps", []), res.get("exchanges", [])
  worst = 0.0
  for (_, e0), (s1, _) in zip(steps, steps[1:], strict=False):
    own = sum(max(0.0, min(s1, b) - max(e0, a)) for a, b in exch)
    worst = max(worst, s1 - e0 - own)
  return worst


def summarize(mode, out) -> dict:
  res = out["results"]
  summary: dict = {"mode": mode, "wall_s": out["wall_s"]}
  if mode == "kv":
    for key in ("kv", "device_put"):
      rows = res.get("1_0", {}).get(key, []) + [
        r for r in res.get("0_0", {}).get(key, []) if not r["ok"]
      ]
      for mb in (1, 16):
        ok = [r["seconds"] for r in rows if r["mb"] == mb and r["ok"]]
        err = [r.get("error") for r in rows if r["mb"] == mb and not r["ok"]]
        summary[f"{key}_{mb}MB"] = {"island": stats(ok), "errors": err[:1]}
    return summary
  isl1 = [r for k, v in res.items() if k.startswith("1_") for r in v["records"]]
  coord = res.get("0_0", {}).get("records", [])
  by_phase: dict = {}
  for r in isl1 + res.get("2_0", {}).get("records", []):
    ph = (
      r["phase"]
      if r["phase"] != "stall"
      else f"stall (island {2 if r in res.get('2_0', {}).get('records', []) else 1})"
    )
    by_phase.setdefault(ph, {"ok": [], "data": [], "fail": []})
    if r.get("ok"):
      by_phase[ph]["ok"].append(r["seconds"])
      by_phase[ph]["data"].append(r["data_seconds"])
    elif not r.get("exhausted"):
      by_phase[ph]["fail"].append(r.get("error"))
  summary["phases"] = {
    ph: {
      "exchange": stats(v["ok"]),
      "data_call": stats(v["data"]),
      "failures": len(v["fail"]),
      "first_error": (v["fail"] or [None])[0],
    }
    for ph, v in by_phase.items()
  }
  fails = [r for r in coord if not r.get("ok") and r.get("seconds") is not None]
  summary["coordinator_failures"] = [
    {
      k: r.get(k)
      for k in (
        "island",
        "seq",
        "n",
        "pair",
        "phase",
        "seconds",
        "error",
        "error_after_kill_s",
      )
    }
    for r in fails
  ]
  summary["coordinator_ok"] = sum(1 for r in coord if r.get("ok"))
  summary["distinct_pairs_ok"] = sorted(
    {tuple(r["pair"]) for r in coord if r.get("ok") and r.get("pair")}
  )
  summary["pairs_used"] = res.get("0_0", {}).get("pairs_used")
  summary["broken_pairs"] = res.get("0_0", {}).get("broken")
  i2 = res.get("2_0", {})
  summary["island2"] = {
    "inner_steps": len(i2.get("steps", [])),
    "exchanges": len(i2.get("exchanges", [])),
    "step_s": i2.get("step_s"),
    "longest_gap_not_own_exchange_s": round(longest_gap(i2), 4) if i2 else None,
  }
  return summary


def print_table(s):
  print(f"\n== {s['mode']} (run wall {s['wall_s']} s)")
  if s["mode"] == "kv":
    print(
      f"{'what':28s} {'n':>5s}  {'med ms':>8s} {'p90 ms':>8s} {'max ms':>8s}  error"
    )
    for k, v in s.items():
      if isinstance(v, dict) and "island" in v:
        print(
          f"{k:28s} {fmt(v['island'])}  {(v['errors'] or [''])[0] or ''}"[:200]
        )
    return
  print(
    f"{'phase':22s} {'n':>5s}  {'med ms':>8s} {'p90 ms':>8s} {'max ms':>8s}"
    f" | data call: {'med ms':>8s} {'max ms':>8s}  fails"
  )
  for ph, v in s["phases"].items():
    e, dcall = v["exchange"], v["data_call"]
    dd = (
      f"{dcall['median'] * 1e3:8.1f} {dcall['max'] * 1e3:8.1f}"
      if dcall
      else f"{'-':>8s} {'-':>8s}"
    )
    print(
      f"{ph:22s} {fmt(e) if e else '    0':>32s} |            {dd}  {v['failures']}"
    )
    if v["first_error"]:
      print(f"{'':22s}   error: {v['first_error'][:150]}")
  print(
    f"coordinator: {s['coordinator_ok']} exchanges ok; distinct device pairs"
    f" that ran: {len(s['distinct_pairs_ok'])}"
  )
  for f in s["coordinator_failures"]:
    aft = f.get("error_after_kill_s")
    print(
      f"coordinator failure: island {f['island']} phase {f['phase']}"
      f" pair {f.get('pair')}: after {f['seconds']:.2f} s"
      + (f" ({aft:.2f} s after the kill)" if aft is not None else "")
      + f": {(f['error'] or '')[:150]}"
    )
  i2 = s["island2"]
  print(
    f"island 2: {i2['inner_steps']} inner steps ({i2['step_s']} s each),"
    f" {i2['exchanges']} exchanges; longest gap between its inner steps"
    f" besides its own exchanges: {i2['longest_gap_not_own_exchange_s']} s"
  )


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--only", default="clique,transfer,kv")
  ap.add_argument("--reuse", type=int, default=1000)
  here = os.path.dirname(os.path.abspath(__file__))
  ap.add_argument(
    "--out",
    default=os.path.join(here, "..", "results", "async_exchange_probe.json"),
  )
  args = ap.parse_args()
  import jax
  import jaxlib

  workdir = tempfile.mkdtemp(prefix="async_exchange_")
  try:
    commit = subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"],
      cwd=here,
      capture_output=True,
      text=True,
    ).stdout.strip()
  except OSError:
    commit = None
  doc = {
    "probe": "benchmarks/probes/async_exchange.py",
    "command": "python benchmarks/probes/async_exchange.py "
    + " ".join(sys.argv[1:]),
    "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y-%m-%dT%H:%M:%SZ"
    ),
    "commit": commit,
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "machine": {
      "node": platform.node(),
      "platform": platform.platform(),
      "cpus": os.cpu_count(),
      "loadavg_start": os.getloadavg(),
    },
    "settings": {
      "heartbeat_s": HB_S,
      "collective_timeout_s": COLL_TIMEOUT_S,
      "reuse": args.reuse,
    },
    "runs": {},
  }
  for mode in args.only.split(","):
    out = run(mode, workdir, args.reuse)
    s = summarize(mode, out)
    s["driver_events"] = out["events"]
    doc["runs"][mode] = {"summary": s, "raw": out["results"]}
    print_table(s)
  doc["machine"]["loadavg_end"] = os.getloadavg()
  for run_ in doc[
    "runs"
  ].values():  # keep the JSON small: drop per-step timelines
    for r in run_["raw"].values():
      if "steps" in r:
        r["steps"] = len(r["steps"])
        r["exchanges"] = len(r.get("exchanges", []))
      if "records" in r and len(r["records"]) > 200:
        r["records"] = r["records"][:50] + r["records"][-150:]
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(doc, f, indent=1, default=str)
  print(f"\nwrote {os.path.relpath(args.out)}; process logs in {workdir}")


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "--worker":
    c = json.loads(sys.argv[2])
    (kv_worker if c["mode"] == "kv" else worker)(c)
  else:
    main()
