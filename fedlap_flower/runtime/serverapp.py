"""The server's ServerApp executor: runs only the ``fedlap_flower`` ServerApp installed here.

Flower 1.42's SuperLink runs a run's ServerApp as a ``flwr-serverapp`` process, which loads
the ``serverapp`` that the run's bundle names, from the bundle's own files: whoever can submit
a run (anyone who reaches the Control API) runs code of their choosing as the SuperLink's user.
This module takes the place of ``flower-superexec`` and ``flwr-serverapp`` on the server
(the SuperLink started with ``--isolation process --superexec-auth-secret-file S``):

* ``python -m fedlap_flower.runtime.serverapp --runtime-api-address 127.0.0.1:8000
  --superexec-auth-secret-file S [--insecure | --root-certificates CA]`` acquires the
  SuperLink's ServerApp tasks (Flower's SuperExec, authenticated with the secret, so no other
  local process takes them) and starts each as ``python -m fedlap_flower.runtime.serverapp
  --task ...`` (never ``flwr-serverapp`` from the PATH), with runtime dependency installation
  off (``uv sync`` of a bundle runs its build code);
* a task process is ``flwr-serverapp``, except that it refuses a bundle whose ``serverapp``
  is not ``fedlap_flower.server_app:app`` (the run fails, saying why) and otherwise runs the
  ServerApp imported from this installed package, never from the bundle's directory.

It replaces names inside Flower, checked on import (:mod:`fedlap_flower.runtime.support`): on
another Flower it refuses to start (:class:`~fedlap_flower.runtime.support.UncheckedFlower`),
saying what to do instead (:data:`INSTEAD`, or install a checked Flower).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from typing import Any

from fedlap_flower.runtime import support

# What a server on a Flower whose internals this module was not checked on does instead.
INSTEAD = (
  "start the SuperLink without --isolation process and without this command: Flower's own "
  "SuperExec then runs the ServerApp of every bundle submitted, so do that only where everyone "
  "who can reach the Control API (on loopback: every local account) is trusted"
)
# Before any of Flower's internals is imported: a Flower that moved them is refused, saying why.
support.require("serverapp", INSTEAD)

# pylint: disable=wrong-import-position
from flwr.serverapp.server_app import LoadServerAppError  # noqa: E402
from flwr.supercore.constant import TaskType  # noqa: E402
from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor  # noqa: E402
from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResult  # noqa: E402

# Modules, not the functions of the same names their packages export.
flwr_run_serverapp = importlib.import_module("flwr.server.run_serverapp")
flwr_run_superexec = importlib.import_module("flwr.supercore.superexec.run_superexec")
flwr_serverapp_runtime = importlib.import_module("flwr.superlink.runtime.run_serverapp")

SERVERAPP_REF = "fedlap_flower.server_app:app"
DEPENDENCY_FLAG = "--allow-runtime-dependency-installation"


class OtherServerApp(LoadServerAppError):
  """A run's bundle names another ``serverapp`` than the installed one.

  Attributes:
    field: ``"serverapp"``; value: what the bundle names.
  """

  def __init__(self, value: Any):
    self.field, self.value = "serverapp", value
    super().__init__(
      f"the bundle's serverapp is {value!r}; this server runs only {SERVERAPP_REF!r} "
      "(installed with fedlap_flower)"
    )


def run_installed(grid, context, server_app_dir: str, server_app_attr=None, loaded_server_app=None):
  """Flower's ``run`` of a ServerApp (``flwr.server.run_serverapp.run``), loading only the
  installed ``fedlap_flower`` ServerApp: ``server_app_dir`` (the bundle's files) never
  enters ``sys.path``.

  Raises:
    OtherServerApp: ``server_app_attr`` is not :data:`SERVERAPP_REF` (or an app is given).
  """
  del server_app_dir
  if loaded_server_app is not None or server_app_attr != SERVERAPP_REF:
    raise OtherServerApp(server_app_attr if loaded_server_app is None else loaded_server_app)
  module, attr = SERVERAPP_REF.split(":")
  app = getattr(importlib.import_module(module), attr)
  return flwr_run_serverapp.run(
    grid=grid, context=context, server_app_dir="", loaded_server_app=app
  )


class ServerAppExecutor(SubprocessExecutor):
  """Flower's subprocess executor, starting ServerApp tasks as this module's task process
  and refusing every other kind of task."""

  def launch(self, spec: ExecutionSpec) -> LaunchResult:
    if spec.task_type != TaskType.SERVER_APP:
      return LaunchResult.failed(f"this executor runs ServerApp tasks only, not {spec.task_type}")
    args = [
      sys.executable,
      "-m",
      "fedlap_flower.runtime.serverapp",
      "--task",
      "--runtime-api-address",
    ]
    args += [spec.runtime_api_address, "--token", spec.token]
    if spec.insecure:
      args.append("--insecure")
    elif spec.root_certificates_path is not None:
      args += ["--root-certificates", spec.root_certificates_path]
    if spec.parent_pid is not None:
      args += ["--parent-pid", str(spec.parent_pid)]
    subprocess.Popen(args)  # pylint: disable=consider-using-with
    return LaunchResult.accepted()


def main(argv: list[str]) -> None:
  """``--task ARGS``: a ServerApp task process (``flwr-serverapp ARGS``); otherwise the
  executor (``flower-superexec ARGS``). Refuses to start on a Flower where the installed
  ServerApp cannot be put in place of the bundle's (:func:`support.problems`), and refuses
  runtime dependency installation.

  Raises:
    support.UncheckedFlower: naming ``flwr``, the installed version and what to do instead.
  """
  support.require("serverapp", INSTEAD)
  if DEPENDENCY_FLAG in argv:
    raise SystemExit(f"{DEPENDENCY_FLAG}: refused (a bundle's dependencies are not installed)")
  if argv[:1] == ["--task"]:
    from flwr.superlink.cli.flwr_serverapp import flwr_serverapp  # pylint: disable=g-import-not-at-top

    flwr_serverapp_runtime.run_ = run_installed
    sys.argv = ["flwr-serverapp", *argv[1:]]
    flwr_serverapp()
    return
  from flwr.supercore.cli.flower_superexec import flower_superexec  # pylint: disable=g-import-not-at-top

  flwr_run_superexec.get_executor = lambda *a, **k: ServerAppExecutor()
  sys.argv = ["flower-superexec", *argv]
  flower_superexec()


if __name__ == "__main__":
  main(sys.argv[1:])
