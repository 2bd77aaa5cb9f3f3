"""Where the time went in a ``jax.profiler`` trace, as text (no TensorBoard needed).

``python -m benchmarks.bench ... --profile DIR`` writes one trace per operation
(``DIR/<op>/plugins/profile/<run>/<host>.trace.json.gz``, Chrome trace
events). This prints, per trace and per process (``/host:CPU``,
``/device:GPU:0``, ...), how long the process was busy within the traced span
(the union of its events' intervals) and the events that took the most time
in total. On a GPU the device rows are kernels, so "busy" is the share of the
run the GPU was computing::

  python -m benchmarks.trace_summary DIR [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import sys
from typing import NamedTuple


class ProcessSummary(NamedTuple):
  """One process of a trace; times in microseconds."""

  name: str
  span_us: float
  busy_us: float
  events: list[tuple[str, float, int]]  # (event name, total us, count), largest first


def _union_length(intervals: list[tuple[float, float]]) -> float:
  total, end = 0.0, float("-inf")
  for start, stop in sorted(intervals):
    if stop <= end:
      continue
    total += stop - max(start, end)
    end = stop
  return total


def summarise(events: list[dict]) -> list[ProcessSummary]:
  """Per-process busy time and event totals of Chrome trace ``events`` (``ph == "X"``)."""
  names = {
    e["pid"]: e.get("args", {}).get("name", str(e["pid"]))
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
  if not complete:
    return []
  t0 = min(e["ts"] for e in complete)
  t1 = max(e["ts"] + e["dur"] for e in complete)
  by_pid = collections.defaultdict(list)
  for e in complete:
    by_pid[e["pid"]].append(e)
  out = []
  for pid, evs in by_pid.items():
    totals, counts = collections.Counter(), collections.Counter()
    for e in evs:
      totals[e["name"]] += e["dur"]
      counts[e["name"]] += 1
    busy = _union_length([(e["ts"], e["ts"] + e["dur"]) for e in evs])
    ranked = [(n, t, counts[n]) for n, t in totals.most_common()]
    out.append(ProcessSummary(names.get(pid, str(pid)), t1 - t0, busy, ranked))
  return sorted(out, key=lambda p: p.name)


def load(path: pathlib.Path) -> list[dict]:
  with gzip.open(path, "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("dir", help="a --profile directory (searched recursively)")
  parser.add_argument("--top", type=int, default=15, help="events listed per process")
  args = parser.parse_args(argv)
  paths = sorted(pathlib.Path(args.dir).rglob("*.trace.json.gz"))
  if not paths:
    print(
      f"no *.trace.json.gz under {args.dir}; allowed: a directory written by "
      "`python -m benchmarks.bench ... --profile DIR`",
      file=sys.stderr,
    )
    return 2
  for path in paths:
    print(f"## {path.relative_to(args.dir)}")
    for p in summarise(load(path)):
      print(
        f"{p.name}: busy {p.busy_us / 1e3:.1f} ms of {p.span_us / 1e3:.1f} ms "
        f"({100 * p.busy_us / max(p.span_us, 1e-9):.0f}%)"
      )
      for name, total, count in p.events[: args.top]:
        print(f"  {total / 1e3:10.2f} ms  {count:6d}x  {name[:100]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
