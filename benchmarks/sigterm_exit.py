"""Seconds from SIGTERM to the exit of an ``experiments.run`` process in a long one-shot round.

A scheduler (SLURM, Kubernetes) sends SIGTERM and SIGKILL about 30 s later. This starts
``python -m experiments.run`` on a one-shot method (DSC on the digits by default: the whole
method is round 1), waits until the run's loop has started and ``--after`` seconds more (the
round is compiling or computing), sends SIGTERM and measures the seconds until the process
exits, with its exit status and the 1-minute load average before and after::

  python -m benchmarks.sigterm_exit                              # this checkout
  python -m benchmarks.sigterm_exit --code-root /path/to/before .  # two checkouts in turn
  python -m benchmarks.sigterm_exit --method=psg --iterations=40

``--code-root`` runs each listed checkout's ``experiments.run`` in turn (e.g. the code before
and after a change) with the same config, so the figures are taken side by side on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = '''\
from fedlap_runs.configs import quickstart, quickstart_compare


def get_config():
  if "{method}" == "psg":
    cfg = quickstart_compare.psg_config(quickstart.dp_config())
    cfg.dp.match_epsilon_of = ""
  else:
    cfg = quickstart_compare.oneshot_config("{method}", iterations=10, batch_loop=1)
  cfg.data.normalisation = "test_split"
  cfg.plots = False
  cfg.progress_bar = False
  return cfg
'''
# A line the driver logs once its loop is about to start (a fresh run or a resume).
STARTED = ("clients run by", "resuming from round")


def load() -> float:
  return os.getloadavg()[0]


def measure(code_root: Path, method: str, iterations: int, after: float, timeout: float) -> dict:
  """Runs one process, terminates it ``after`` seconds into its loop; returns the figures."""
  with tempfile.TemporaryDirectory() as tmp:
    config = Path(tmp) / f"oneshot_{method}.py"
    config.write_text(CONFIG.format(method=method))
    env = dict(os.environ, PYTHONPATH=str(code_root), JAX_PLATFORMS="cpu")
    argv = [
      sys.executable,
      "-m",
      "experiments.run",
      f"--config={config}",
      f"--config.condense.networks={iterations}",
      f"--workdir={Path(tmp) / 'run'}",
    ]
    load_before = load()
    t_start = time.monotonic()
    proc = subprocess.Popen(
      argv, cwd=code_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, started = [], threading.Event()

    def read():
      for line in proc.stdout:
        lines.append(line)
        if any(s in line for s in STARTED):
          started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not started.wait(timeout):
      proc.kill()
      raise RuntimeError("the run's loop did not start:\n" + "".join(lines[-20:]))
    t_loop = time.monotonic()
    time.sleep(after)
    if proc.poll() is not None:
      raise RuntimeError(
        f"the run ended before SIGTERM (status {proc.returncode}); use more "
        "--iterations:\n" + "".join(lines[-20:])
      )
    t_term = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
      status = proc.wait(timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      status = "killed after timeout"
    t_exit = time.monotonic()
    reader.join(5)
    ckpts = sorted(
      p.name for p in (Path(tmp) / "run" / "checkpoints").glob("*") if p.name.isdigit()
    )
    return {
      "code_root": str(code_root),
      "method": method,
      "iterations": iterations,
      "startup_s": round(t_loop - t_start, 1),
      "sigterm_after_loop_start_s": after,
      "sigterm_to_exit_s": round(t_exit - t_term, 1),
      "exit_status": status,
      "checkpoints": ckpts,
      "load_before": load_before,
      "load_after": load(),
      "last_lines": [line.rstrip() for line in lines[-3:]],
    }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--code-root", type=Path, nargs="+", default=[ROOT])
  p.add_argument("--method", default="dsc", choices=("dsc", "dsc_centralized", "psg"))
  p.add_argument(
    "--iterations",
    type=int,
    default=10,
    help="condense.networks (fresh networks): the round's length",
  )
  p.add_argument(
    "--after", type=float, default=10.0, help="seconds after the loop starts to send SIGTERM"
  )
  p.add_argument("--timeout", type=float, default=1800.0)
  args = p.parse_args()
  for root in args.code_root:
    print(
      json.dumps(
        measure(root.resolve(), args.method, args.iterations, args.after, args.timeout), indent=2
      ),
      flush=True,
    )


if __name__ == "__main__":
  main()
