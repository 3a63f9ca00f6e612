"""Chaos for elastic islands: random SIGKILLs of random islands at random
moments, restarts after random delays, then what survived (issue 41 item 5).

    python examples/elastic_launch.py --chaos SEED --duration SECONDS \
        [--kills N] --num-processes 4 --sync-period 4 --out DIR

runs the example under a dedicated coordinator (process 0 trains nothing;
``--dedicated-coordinator`` is added), kills for ``SECONDS`` (one island, or
one time in ten every island at once; a kill every 3-8 s), restarts each
killed island 1-6 s later, then restarts the dead ones and, once they train,
stops every island after its next round (a file the launcher writes, the
example's ``ELASTIC_EXAMPLE_STOP``). It writes
``DIR/chaos.json`` and prints:

- kills, and rounds committed (the coordinator's ``coordinator.jsonl``);
- contributions lost (:func:`audit`: the islands' logs cross-checked
  against the coordinator's; goal 0): a contribution an island was told
  was committed that the coordinator's center of that round did not
  combine, one combined in two rounds, or in a round other than the one
  it was sent to;
- rounds whose bits differ: a round logged by an island with params other
  than the coordinator's center of that round (goal 0);
- goodput (:func:`audit`): island-seconds spent in inner steps whose
  contribution reached a committed center over island-seconds from each
  island's first start to the run's end (start-ups, restarts, dead time
  and waits for rounds included), per island and overall; beside it the
  inner-step ratio: inner steps whose contribution reached a committed
  center over every inner step any incarnation took;
- per kill that left a survivor, the seconds from the kill to the next
  committed round (goal: the heartbeat timeout plus one round).

Each island's logs (``examples/elastic_diloco.py``): ``DIR/sent.{I}.jsonl``,
a line per contribution it sends (before the collective: the round, its
:func:`shardopt.elastic.rows.digest`, its weight, the inner steps and their
seconds since its last committed round); ``DIR/p{I}.jsonl``, a line per
round it was told committed (the contributions that round combined,
``{process: [digest, weight]}``, and the center's sha256);
``DIR/steps.{I}.{pid}``, per incarnation its start and its inner steps. The
coordinator's ``coordinator.jsonl`` logs the contributions it combined.

With ``--asynchronous`` (islands that never wait: each exchanges with the
coordinator alone, :func:`report_asynchronous`) the report has, instead of
rounds and stalls: the outer steps (versions); contributions lost (an
exchange returned, so the coordinator held the contribution, and no outer
step applied it) and applied twice (goal 0 each), matched by offer id
(:func:`audit_asynchronous`); versions an island received with bits other
than the coordinator's (goal 0); the same time-based goodput; the
survivors' gaps between exchanges across each kill beside all their gaps
(:func:`exchange_gaps`: a kill should cost them nothing); restarted islands
whose first exchange handed them a version older than the newest (goal 0).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

ALL_AT_ONCE = 0.1  # the share of kills that take every island down


def environment(out) -> dict:
  """The islands' environment for a chaos run writing to ``out``: the stop
  file :func:`run` writes at the end, and 4 devices per process (4^m m!
  device orders per membership of m processes; each membership and each
  failed attempt uses one up)."""
  return {
    "ELASTIC_EXAMPLE_STOP": str(Path(out) / "stop"),
    "XLA_FLAGS": "--xla_force_host_platform_device_count=4"
    " --xla_cpu_collective_timeout_seconds=10",
  }


def run(
  islands,
  *,
  seed: int,
  duration_s: float,
  timeout_s: float,
  gap_s: tuple[float, float] = (3.0, 8.0),
  down_s: tuple[float, float] = (1.0, 6.0),
  max_kills: int | None = None,
  rounds_after: int = 0,
) -> dict:
  """Kills and restarts ``islands`` (an ``elastic_launch.Islands`` whose
  process 0 is a dedicated coordinator) for ``duration_s``: a kill every
  ``gap_s`` seconds (uniform), each island back after ``down_s``; the
  report. ``max_kills`` ends the kills early. Once the kills end and every
  island is back, the run goes on until ``rounds_after`` rounds committed
  with every island in them (the recovery; the report's
  ``rounds_after_recovery``), within ``timeout_s``."""
  rng = random.Random(seed)
  load = {"start": list(os.getloadavg())}  # the machine's, for the record
  everyone = list(range(1, islands.n))
  alive = set(everyone)
  restarts: list[tuple[float, int]] = []  # (when, island)
  kills: list[dict] = []
  islands.start_all()
  end = time.time() + duration_s
  while time.time() < end and len(kills) < (max_kills or float("inf")):
    time.sleep(rng.uniform(*gap_s))
    now = time.time()
    for when, i in sorted(restarts):
      if when <= now:
        islands.start(i)
        alive.add(i)
        restarts.remove((when, i))
    if not alive:
      continue
    victims = (
      sorted(alive)
      if rng.random() < ALL_AT_ONCE
      else [rng.choice(sorted(alive))]
    )
    for i in victims:
      islands.kill(i)
      alive.discard(i)
      restarts.append((time.time() + rng.uniform(*down_s), i))
    kills.append({"time": time.time(), "islands": victims})
    print(
      f"+{time.time() - islands.t0:6.1f}s kill {victims} (kill {len(kills)})",
      flush=True,
    )
  for _, i in sorted(restarts):  # every island back, then to the end
    islands.start(i)
  _wait_until_trained(islands, everyone, timeout_s)
  recovered = time.time()
  _wait_for_rounds(islands, everyone, recovered, rounds_after, timeout_s)
  Path(environment(islands.out)["ELASTIC_EXAMPLE_STOP"]).write_text("now")
  codes = islands.wait(timeout_s)
  if is_asynchronous(islands):
    result = report_asynchronous(islands, kills, codes, time.time())
  else:
    result = report(islands, kills, codes, time.time())
  result["rounds_after_recovery"] = _rounds_after(islands, everyone, recovered)
  load["end"] = list(os.getloadavg())
  result["load_average"] = load  # 1, 5 and 15 minutes, at start and end
  return result


def _full_rounds(islands, everyone, since: float) -> set[int]:
  """The round numbers first committed after ``since`` with every island in
  them (a handshake re-logs a number it already had: not counted)."""
  logged = _logged(islands)
  before = max((r["round"] for r in logged if r["time"] <= since), default=0)
  return {
    r["round"]
    for r in logged
    if r["time"] > since
    and r["round"] > before
    and set(everyone) <= set(r["live"])
  }


def is_asynchronous(islands) -> bool:
  """Whether ``islands`` run asynchronous rounds (``--asynchronous``)."""
  return "--asynchronous" in islands.argv


def _rounds_after(islands, everyone, since: float) -> int:
  """The recovery since ``since``: synchronous, the rounds committed with
  every island in them; asynchronous, the fewest outer steps any island's
  contribution went into (every island contributed at least that often)."""
  if not is_asynchronous(islands):
    return len(_full_rounds(islands, everyone, since))
  counts = dict.fromkeys(everyone, 0)
  for r in _logged(islands):
    if r["time"] > since:
      for p in {int(p) for p, _, _ in r.get("offers", [])}:
        if p in counts:
          counts[p] += 1
  return min(counts.values())


def _wait_for_rounds(islands, everyone, since, rounds, timeout_s) -> None:
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    if _rounds_after(islands, everyone, since) >= rounds:
      return
    time.sleep(0.5)


def _wait_until_trained(islands, everyone, timeout_s: float) -> None:
  """Until every island's latest incarnation has taken an inner step (it
  joined): an island still joining when the others stop would wait for a
  round that never comes."""
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    running = {
      i: islands.procs[i].pid
      for i in everyone
      if islands.procs[i].poll() is None
    }
    if all(
      (islands.out / f"steps.{i}.{pid}").exists() for i, pid in running.items()
    ):
      return
    time.sleep(0.5)


def _logged(islands) -> list[dict]:
  """The coordinator's rows (``coordinator.jsonl``), one per commit."""
  path = Path(islands.out) / "coordinator.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line]


def committed(logged: list[dict]) -> list[dict]:
  """The committed rounds of a log of commits: a handshake (the start, an
  island joining alone, islands resuming after all died) commits no new
  number, so the rounds are the rows whose number is new."""
  rounds, top = [], 0
  for r in logged:
    if r["round"] > top:
      rounds.append(r)
      top = r["round"]
  return rounds


def _jsonl(path: Path) -> list[dict]:
  """A JSON-lines log; a line cut by a kill is dropped."""
  if not path.exists():
    return []
  out = []
  for line in path.read_text().splitlines():
    try:
      out.append(json.loads(line))
    except ValueError:
      continue
  return out


def _incarnation(path: Path) -> dict | None:
  """An incarnation's ``steps.{I}.{pid}`` file (None if a kill cut it)."""
  try:
    return json.loads(path.read_text())
  except ValueError:
    return None


def _incarnations(out: Path, p: int) -> list[dict]:
  """Process ``p``'s incarnations (its ``steps.{p}.{pid}`` files), those a
  kill did not cut."""
  files = sorted(out.glob(f"steps.{p}.*"))
  runs = [_incarnation(f) for f in files if f.suffix != ".tmp"]
  return [r for r in runs if r is not None]


def time_figures(islands: dict, useful: dict, end: float) -> dict:
  """The figures both audits share. ``islands``: ``{process: {"incarnations":
  [...]}}``; ``useful``: ``{process: (seconds, steps)}`` of its inner steps
  whose contribution reached a center; ``end``: the run's end (unix time).
  Goodput: those seconds over each island's seconds from its first
  incarnation's start to ``end``; the inner-step ratio: those steps over
  every inner step its incarnations took."""
  seconds, inner_s, steps, by_island = 0.0, 0.0, 0, {}
  for p, log in islands.items():
    runs = log["incarnations"]
    span = end - min(r["started"] for r in runs) if runs else 0.0
    by_island[str(p)] = useful[p][0] / span if span > 0 else None
    seconds += span
    inner_s += sum(r.get("inner_seconds", 0.0) for r in runs)
    steps += sum(r.get("steps", 0) for r in runs)
  mine = sum(u[0] for u in useful.values())
  useful_steps = sum(u[1] for u in useful.values())
  return {
    "goodput": mine / seconds if seconds else None,
    "goodput_by_island": by_island,
    "useful_island_seconds": mine,
    "island_seconds": seconds,
    "inner_seconds": inner_s,
    "inner_step_ratio": useful_steps / steps if steps else None,
    "useful_inner_steps": useful_steps,
    "inner_steps": steps,
  }


def read_logs(out, processes) -> dict:
  """The logs of the islands ``processes`` in ``out``, as :func:`audit`
  takes them: per process its incarnations, the contributions it sent and
  the commits it was told of."""
  out = Path(out)
  return {
    p: {
      "incarnations": _incarnations(out, p),
      "sent": _jsonl(out / f"sent.{p}.jsonl"),
      "told": _jsonl(out / f"p{p}.jsonl"),
    }
    for p in processes
  }


def audit(reference: list[dict], islands: dict, end: float) -> dict:
  """The islands' logs cross-checked against the reference's: goodput and
  the contributions lost. Pure: no files, no processes.

  Args:
    reference: the committed rounds (:func:`committed`) as the reference
      logged them (the dedicated coordinator's), each ``{"round": n,
      "contributions": {process: [digest, weight]}}``.
    islands: ``{process: {"incarnations": [...], "sent": [...], "told":
      [...]}}`` (:func:`read_logs`): per incarnation ``{"started": unix
      time, "steps": inner steps taken}``; per contribution sent ``{"round",
      "digest", "weight", "steps", "inner_seconds"}`` (the inner steps since
      the incarnation's last committed round); per commit it was told of
      ``{"round", "contributions"}``.
    end: the run's end (unix time).

  Returns ``{"goodput", "goodput_by_island", "useful_island_seconds",
  "island_seconds", "inner_seconds", "inner_step_ratio",
  "useful_inner_steps", "inner_steps", "contributions_combined",
  "contributions_lost"}``: a contribution is lost if an island was told a
  round combined it and the reference's round did not (with its weight),
  if the reference combined it in two rounds, or in a round other than the
  one it was sent to (each ``{"process", "round", "digest", "why"}``).
  Goodput counts the inner seconds of a contribution the reference
  combined in its round, once, over each island's seconds from its first
  incarnation's start to ``end``.
  """
  applied: dict = {}  # (process, digest) -> [(round, weight)], weight > 0
  for r in reference:
    for p, (d, w) in r.get("contributions", {}).items():
      if w > 0:
        applied.setdefault((int(p), int(d)), []).append((r["round"], w))
  lost = []

  def lose(p, number, d, why):
    entry = {"process": p, "round": number, "digest": d, "why": why}
    if entry not in lost:
      lost.append(entry)

  for (p, d), where in applied.items():
    if len(where) > 1:
      numbers = [n for n, _ in where]
      lose(p, numbers[0], d, f"combined in {len(where)} rounds {numbers}")
  useful = {}  # process -> (inner seconds, inner steps) that reached a center
  for p, log in islands.items():
    for t in log["told"]:
      if str(p) not in t.get("contributions", {}):
        continue
      d, w = t["contributions"][str(p)]
      where = dict(applied.get((p, int(d)), []))
      if w <= 0:
        continue
      if not where:
        lose(p, t["round"], d, "told it committed, not in the center")
      elif t["round"] not in where:
        lose(p, t["round"], d, f"told round {t['round']}, in {sorted(where)}")
      elif where[t["round"]] != w:
        lose(p, t["round"], d, f"told weight {w}, combined {where[t['round']]}")
    sent = {}  # the last line per (incarnation, round): retries resend it
    for s in log["sent"]:
      sent[(s.get("incarnation"), s["round"], s["digest"])] = s
    mine, mine_steps = 0.0, 0
    for s in sent.values():
      where = applied.get((p, int(s["digest"])), [])
      if s["weight"] <= 0 or not where:
        continue
      if [n for n, _ in where] == [s["round"]]:
        mine += s["inner_seconds"]
        mine_steps += s["steps"]
      elif s["round"] not in [n for n, _ in where]:
        lose(
          p,
          s["round"],
          s["digest"],
          f"sent to round {s['round']}, in {[n for n, _ in where]}",
        )
    useful[p] = (mine, mine_steps)
  return {
    **time_figures(islands, useful, end),
    "contributions_combined": sum(len(w) for w in applied.values()),
    "contributions_lost": lost,
  }


def _kill_counts(islands, kills: list[dict]) -> dict:
  """The kills, and how many took every island at once."""
  return {
    "kills": len(kills),
    "kills_of_every_island": sum(
      len(k["islands"]) == islands.n - 1 for k in kills
    ),
  }


def report(islands, kills: list[dict], codes: dict, end: float) -> dict:
  """The chaos run's report (the module's docstring); ``end``: the run's
  end, unix time."""
  rounds = committed(_logged(islands))
  center = {r["round"]: r["params_sha256"] for r in rounds}
  differ = set()
  for i in range(1, islands.n):
    for row in islands.rows(i):
      if center.get(row["round"], row["params_sha256"]) != row["params_sha256"]:
        differ.add(row["round"])
  ledger = audit(rounds, read_logs(islands.out, range(1, islands.n)), end)
  stalls = []
  for kill in kills:
    if len(kill["islands"]) == islands.n - 1:
      continue  # no survivor: nothing to stall
    after = [r["time"] for r in rounds if r["time"] > kill["time"]]
    if after:
      stalls.append(after[0] - kill["time"])
  return {
    **_kill_counts(islands, kills),
    "rounds_committed": len(rounds),
    "rounds_with_other_bits": sorted(differ),
    **ledger,
    "stall_after_kill_s": {
      "median": statistics.median(stalls) if stalls else None,
      "max": max(stalls) if stalls else None,
      "count": len(stalls),
    },
    "exit_codes": {str(i): c for i, c in sorted(codes.items())},
    "failed_attempts": sum(r["attempts"] for r in rounds),
  }


def _share(x) -> str:
  return "-" if x is None else f"{x:.1%}"


def _time_lines(result: dict) -> list[str]:
  """:func:`time_figures`' lines of either report."""
  return [
    f"goodput (time)             {_share(result['goodput'])}"
    f" ({result['useful_island_seconds']:.1f} of"
    f" {result['island_seconds']:.1f} island-seconds; per island"
    f" {', '.join(map(_share, result['goodput_by_island'].values()))})",
    f"inner-step ratio           {_share(result['inner_step_ratio'])}"
    f" ({result['useful_inner_steps']} of {result['inner_steps']} inner"
    " steps)",
  ]


def _load_lines(result: dict) -> list[str]:
  """The machine's load at the run's start and end, if recorded."""
  if "load_average" not in result:
    return []
  load = result["load_average"]
  return [
    f"load average (1 min)       {load['start'][0]:.1f} at the start,"
    f" {load['end'][0]:.1f} at the end"
  ]


def show(result: dict) -> str:
  """The report, one line per figure."""
  if result.get("asynchronous"):
    return show_asynchronous(result)
  stall = result["stall_after_kill_s"]
  lines = [
    f"kills                      {result['kills']}"
    f" ({result['kills_of_every_island']} of every island at once)",
    f"rounds committed           {result['rounds_committed']}"
    f" ({result['failed_attempts']} failed attempts)",
    f"contributions lost         {len(result['contributions_lost'])}"
    f" (of {result['contributions_combined']} combined)",
    f"rounds with other bits     {len(result['rounds_with_other_bits'])}",
    *_time_lines(result),
    f"stall after a kill         median {stall['median']:.1f} s,"
    f" max {stall['max']:.1f} s ({stall['count']} kills with survivors)"
    if stall["median"] is not None
    else "stall after a kill         -",
    f"exit codes                 {result['exit_codes']}",
  ]
  return "\n".join(lines + _load_lines(result))


# --------------------------------------------------------------------------
# Asynchronous rounds (``--asynchronous``): each island exchanges with the
# coordinator alone; the coordinator logs one row per outer step (a
# version) with the offers it combined, each island one row per exchange.


def read_exchanges(out, processes) -> dict:
  """The logs of asynchronous islands ``processes`` in ``out``, as
  :func:`audit_asynchronous` takes them: per process its incarnations and
  its exchanges (``p{I}.jsonl``, in the order it wrote them)."""
  out = Path(out)
  return {
    p: {
      "incarnations": _incarnations(out, p),
      "exchanges": _jsonl(out / f"p{p}.jsonl"),
    }
    for p in processes
  }


def audit_asynchronous(versions: list[dict], islands: dict, end: float) -> dict:
  """Asynchronous islands' logs cross-checked against the coordinator's.
  Pure: no files, no processes.

  Args:
    versions: the coordinator's rows, one per outer step, each
      ``{"version": v, "params_sha256": ..., "offers": [[process, offer,
      weight], ...]}``.
    islands: ``{process: {"incarnations": [...], "exchanges": [...]}}``
      (:func:`read_exchanges`): per incarnation ``{"started", "steps",
      "inner_seconds"}``; per exchange ``{"incarnation", "version",
      "params_sha256", "offer", "weight", "inner_seconds"}``
      (``inner_seconds``: the incarnation's seconds in inner steps up to
      this exchange; ``offer``: None when it offered nothing).
    end: the run's end (unix time).

  Returns :func:`time_figures` (``goodput``: island-seconds in
  inner steps whose contribution an outer step applied, over island-seconds
  from each island's first start to ``end``; ``inner_step_ratio``: the
  applied contributions' inner steps over every inner step taken),
  ``contributions_combined`` and:
  ``contributions_applied_twice`` (offers combined by two outer steps, or
  twice by one), ``contributions_lost`` (an exchange returned, so the
  coordinator held the contribution, and no outer step applied it, or
  applied it with another weight), ``contributions_dropped`` (exchanges
  whose contribution the coordinator could not pull and said so: not
  applied, not lost; their seconds count against goodput) and
  ``versions_with_other_bits`` (an
  island received version v with bits other than the coordinator's v, or a
  version the coordinator never logged), each a list of
  ``{"process", "offer" or "version", "why"}``.
  """
  applied: dict = {}  # offer -> [(version, process, weight)]
  for r in versions:
    for p, offer, w in r.get("offers", []):
      applied.setdefault(offer, []).append((r["version"], int(p), w))
  twice = [
    {"process": where[0][1], "offer": offer, "why": f"in versions {where}"}
    for offer, where in applied.items()
    if len(where) > 1
  ]
  bits = {r["version"]: r["params_sha256"] for r in versions}
  other, lost, dropped = [], [], []
  useful = {}  # process -> (inner seconds, inner steps) that reached a center
  for p, log in islands.items():
    mine, mine_steps = 0.0, 0
    before = {}  # incarnation -> its last inner_seconds
    for x in log["exchanges"]:
      v = x["version"]
      if v and bits.get(v) != x["params_sha256"]:
        why = "not logged" if v not in bits else "other bits"
        other.append({"process": p, "version": v, "why": why})
      spent = x["inner_seconds"] - before.get(x["incarnation"], 0.0)
      before[x["incarnation"]] = x["inner_seconds"]
      if any(
        f.startswith("ContributionDropped") for f in x.get("failures", [])
      ):
        dropped.append({"process": p, "version": v, "seconds": spent})
      if x.get("offer") is None:
        continue
      where = applied.get(x["offer"], [])
      if not where:
        lost.append({"process": p, "offer": x["offer"], "why": "not applied"})
      elif where[0][2] != x["weight"] or where[0][1] != p:
        lost.append(
          {
            "process": p,
            "offer": x["offer"],
            "why": f"sent weight {x['weight']}, applied {where}",
          }
        )
      else:
        mine += spent
        mine_steps += int(x["weight"])
    useful[p] = (mine, mine_steps)
  return {
    **time_figures(islands, useful, end),
    "contributions_combined": sum(len(w) for w in applied.values()),
    "contributions_applied_twice": twice,
    "contributions_lost": lost,
    "contributions_dropped": dropped,
    "versions_with_other_bits": other,
  }


def exchange_gaps(exchanges: dict, kills: list[dict]) -> dict:
  """What a kill costs the islands it spared: per kill and survivor, the
  seconds between the survivor's last exchange before the kill and its
  first after (``wall``), beside every gap between two exchanges of one
  incarnation. ``exchanges``: ``{process: rows}``; ``kills``: ``{"time",
  "islands"}`` each."""
  spanning, every = [], []
  for p, rows in exchanges.items():
    walls = {}
    for x in rows:
      walls.setdefault(x["incarnation"], []).append(x["wall"])
    for ws in walls.values():
      gaps = list(zip(ws, ws[1:], strict=False))
      every += [b - a for a, b in gaps]
      for kill in kills:
        if int(p) in kill["islands"]:
          continue
        spanning += [b - a for a, b in gaps if a <= kill["time"] < b]

  def summary(xs):
    return {
      "median": statistics.median(xs) if xs else None,
      "max": max(xs) if xs else None,
      "count": len(xs),
    }

  return {"spanning_a_kill_s": summary(spanning), "every_s": summary(every)}


def restarts_behind(versions: list[dict], exchanges: dict) -> list[dict]:
  """Restarted incarnations whose first exchange handed them a version
  older than one the coordinator had logged before that exchange began
  (``wall - exchange_seconds``): goal none (the coordinator answers every
  offer with its newest center)."""
  behind = []
  for p, rows in exchanges.items():
    first = {}
    for x in rows:
      first.setdefault(x["incarnation"], x)
    for x in list(first.values())[1:]:
      began = x["wall"] - x["exchange_seconds"]
      made = max(
        (r["version"] for r in versions if r["time"] < began), default=0
      )
      if x["version"] < made:
        behind.append({"process": p, "version": x["version"], "newest": made})
  return behind


def report_asynchronous(islands, kills: list[dict], codes: dict, end: float):
  """The chaos run's report under ``--asynchronous``: :func:`audit_asynchronous`,
  :func:`exchange_gaps` and :func:`restarts_behind` of its logs."""
  versions = _logged(islands)
  everyone = range(1, islands.n)
  logs = read_exchanges(islands.out, everyone)
  exchanges = {p: log["exchanges"] for p, log in logs.items()}
  return {
    "asynchronous": True,
    **_kill_counts(islands, kills),
    "versions": len(versions),
    "version_numbers_in_order": [r["version"] for r in versions]
    == list(range(1, len(versions) + 1)),
    **audit_asynchronous(versions, logs, end),
    "exchange_gaps": exchange_gaps(exchanges, kills),
    "restarts_behind": restarts_behind(versions, exchanges),
    "restarts": sum(
      max(0, len({x["incarnation"] for x in rows}) - 1)
      for rows in exchanges.values()
    ),
    "exit_codes": {str(i): c for i, c in sorted(codes.items())},
  }


def show_asynchronous(result: dict) -> str:
  gaps = result["exchange_gaps"]

  def gap(g):
    if g["median"] is None:
      return "-"
    return f"median {g['median']:.2f} s, max {g['max']:.2f} s ({g['count']})"

  lines = [
    f"kills                      {result['kills']}"
    f" ({result['kills_of_every_island']} of every island at once)",
    f"outer steps (versions)     {result['versions']}"
    f" (numbered 1, 2, ...: {result['version_numbers_in_order']})",
    f"contributions lost         {len(result['contributions_lost'])}"
    f" (of {result['contributions_combined']} applied)",
    f"applied twice              {len(result['contributions_applied_twice'])}",
    f"dropped (told, not pulled) {len(result['contributions_dropped'])}",
    f"versions with other bits   {len(result['versions_with_other_bits'])}",
    *_time_lines(result),
    f"survivors' exchange gap    across a kill: {gap(gaps['spanning_a_kill_s'])};"
    f" every gap: {gap(gaps['every_s'])}",
    f"restarts behind the newest {len(result['restarts_behind'])}"
    f" (of {result['restarts']} restarts)",
    f"exit codes                 {result['exit_codes']}",
  ]
  return "\n".join(lines + _load_lines(result))
