"""A local Flower federation as real processes: SuperLink, SuperNodes, ``flwr run``.

Used by the tests and by ``benchmarks/flower_runs.py``; each process runs in
its own session (process group), so stopping it also stops the ServerApp /
ClientApp processes it spawned. :class:`Federation` is a context manager whose
exit always stops everything it started (SIGTERM, then SIGKILL after a few
seconds).

* ``Federation(workdir, simulation=False)``: ``flower-superlink --insecure``
  on a free localhost port; :meth:`Federation.start_supernode` starts
  ``flower-supernode --insecure`` with a node config (partition, state dir,
  max epsilon); :meth:`Federation.kill_supernode` kills one (SIGKILL: a crash).
* ``Federation(workdir, simulation=True)``: ``flower-superlink --simulation``;
  ``flwr run`` then runs the app on ``num-supernodes`` virtual clients with the
  simulation engine (Ray).
* :meth:`Federation.run` submits ``fedlap_flower/app`` with a run config
  (``flwr run APP NAME --run-config FILE.toml``) through a Flower configuration
  in ``workdir/flwr_home`` (``FLWR_HOME``), never the user's ``~/.flwr``;
  :meth:`Federation.wait` polls ``flwr list`` until the run finishes.

Insecure (plain HTTP on localhost) is for tests; README.md, "Running across
machines with Flower", shows TLS and SuperNode authentication.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Mapping

APP_DIR = Path(__file__).resolve().parent / "app"


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _toml_value(v) -> str:
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, float) and v == float("inf"):
    return "inf"
  if isinstance(v, (int, float)):
    return repr(v)
  return json.dumps(str(v))  # a TOML basic string


def write_toml(path: Path, values: Mapping[str, Any]) -> Path:
  """Flat ``key = value`` TOML (keys may hold '-')."""
  path.write_text("".join(f'"{k}" = {_toml_value(v)}\n' for k, v in values.items()))
  return path


def node_config_arg(values: Mapping[str, Any]) -> str:
  """``--node-config`` text: ``key=value`` pairs, strings quoted."""
  return " ".join(f"{k}={_toml_value(v)}" for k, v in values.items())


class Federation:
  """Processes of a local federation (see the module docstring)."""

  def __init__(self, workdir: str | os.PathLike, *, simulation: bool = False,
               env: Mapping[str, str] | None = None, bin_dir: str | None = None):
    self.workdir = Path(workdir).resolve()  # FLWR_HOME must not depend on the cwd
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.simulation = simulation
    self.bin = Path(bin_dir or os.path.dirname(sys.executable))
    self.port = free_port()
    self.env = {**os.environ, **(env or {}), "FLWR_HOME": str(self.workdir / "flwr_home"),
                "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0",
                "PYTHONUNBUFFERED": "1"}
    # The SuperLink starts flower-superexec by name: find it next to flower-superlink
    # even when the virtual environment was not activated.
    self.env["PATH"] = os.pathsep.join([str(self.bin), self.env.get("PATH", "")])
    self.superlink: subprocess.Popen | None = None
    self.supernodes: dict[int, subprocess.Popen] = {}
    self.node_configs: dict[int, dict] = {}
    self._logs: list = []

  # -- processes -----------------------------------------------------------------

  def _spawn(self, args: list[str], log_name: str, cwd: Path | None = None) -> subprocess.Popen:
    log = open(self.workdir / log_name, "ab")
    self._logs.append(log)
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                            cwd=str(cwd or self.workdir), start_new_session=True)

  def start(self, timeout: float = 60.0) -> "Federation":
    """Starts the SuperLink and waits until its HTTP endpoint answers."""
    args = [str(self.bin / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
            "--port", str(self.port), "--disable-runtime-dependency-installation"]
    if self.simulation:
      args.append("--simulation")
    self.superlink = self._spawn(args, "superlink.log")
    deadline = time.time() + timeout
    while time.time() < deadline:
      if self.superlink.poll() is not None:
        raise RuntimeError(f"flower-superlink exited with {self.superlink.returncode}: "
                           f"{self.log_tail('superlink.log')}")
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
          if r.status == 200:
            break
      except OSError:
        time.sleep(0.3)
    else:
      raise TimeoutError(f"flower-superlink did not answer within {timeout} s: "
                         f"{self.log_tail('superlink.log')}")
    home = self.workdir / "flwr_home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "test"\n\n'
        f'[superlink.test]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n')
    return self

  def start_supernode(self, index: int, node_config: Mapping[str, Any] | None = None
                      ) -> subprocess.Popen:
    """Starts SuperNode ``index`` (its own Runtime API port) with ``node_config``."""
    if node_config is not None:
      self.node_configs[index] = dict(node_config)
    args = [sys.executable, "-m", "fedlap_flower.node", "--allow-unsigned-runs", "--insecure",
            "--superlink", f"127.0.0.1:{self.port}", "--host", "127.0.0.1",
            "--port", str(free_port()),
            "--node-config", node_config_arg(self.node_configs[index])]
    self.supernodes[index] = self._spawn(args, f"supernode-{index}.log")
    return self.supernodes[index]

  def kill_supernode(self, index: int) -> None:
    """SIGKILL to SuperNode ``index`` and every process it started (a crash)."""
    proc = self.supernodes.pop(index)
    _signal_group(proc, signal.SIGKILL)
    proc.wait(timeout=10)

  def close(self) -> None:
    """Stops every process this federation started (SIGTERM, then SIGKILL after 5 s)."""
    procs = list(self.supernodes.values()) + ([self.superlink] if self.superlink else [])
    for p in procs:
      _signal_group(p, signal.SIGTERM)
    deadline = time.time() + 5
    for p in procs:
      try:
        p.wait(timeout=max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        pass
      _signal_group(p, signal.SIGKILL)  # also the group's children that ignored SIGTERM
      try:
        p.wait(timeout=5)
      except subprocess.TimeoutExpired:
        pass
    self.supernodes.clear()
    self.superlink = None
    for f in self._logs:
      f.close()
    self._logs.clear()

  def __enter__(self) -> "Federation":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()

  def log_tail(self, name: str, chars: int = 3000) -> str:
    path = self.workdir / name
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

  # -- runs --------------------------------------------------------------------------

  def _flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(self.bin / "flwr"), *args], capture_output=True, text=True,
                          env=self.env, cwd=str(self.workdir), timeout=timeout)

  def run(self, run_config: Mapping[str, Any], *, num_supernodes: int | None = None,
          app_dir: Path = APP_DIR) -> int:
    """Submits the app with ``run_config``; returns the run id."""
    path = write_toml(self.workdir / f"run_config_{time.time_ns()}.toml", run_config)
    args = ["run", str(app_dir), "test", "--run-config", str(path), "--format", "json"]
    if self.simulation:
      args += ["--federation-config", f"num-supernodes={num_supernodes or 2}"]
    res = self._flwr(*args)
    try:
      payload = json.loads(res.stdout[res.stdout.index("{"):])
      return int(payload["run-id"])
    except (ValueError, KeyError, TypeError):
      raise RuntimeError(f"flwr run failed ({res.returncode}): {res.stdout[-2000:]} "
                         f"{res.stderr[-2000:]}") from None

  def status(self, run_id: int) -> str:
    """The run's status as ``flwr list`` reports it (e.g. ``finished:completed``)."""
    res = self._flwr("list", "--run-id", str(run_id), "--format", "json", timeout=60)
    try:
      payload = json.loads(res.stdout[res.stdout.index("{"):])
      runs = payload.get("runs", [])
      return str(runs[0].get("status", "unknown")) if runs else "unknown"
    except (ValueError, KeyError, TypeError, IndexError):
      return "unknown"

  def wait(self, run_id: int, timeout: float, poll: float = 3.0) -> str:
    """Waits until the run finished; returns its final status (``finished:...``)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
      status = self.status(run_id)
      if status.startswith("finished"):
        return status
      if self.superlink is not None and self.superlink.poll() is not None:
        raise RuntimeError(f"flower-superlink died: {self.log_tail('superlink.log')}")
      time.sleep(poll)
    raise TimeoutError(f"run {run_id} did not finish within {timeout} s (status "
                       f"{self.status(run_id)}); superlink log: "
                       f"{self.log_tail('superlink.log')}")

  def logs(self, run_id: int) -> str:
    """The run's ServerApp log as ``flwr log`` shows it."""
    res = self._flwr("log", str(run_id), "test", "--show", timeout=60)
    return res.stdout + res.stderr


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass
