"""The server's ServerApp executor (:mod:`fedlap_flower.runtime.serverapp`), without processes:
it runs only the installed ``fedlap_flower`` ServerApp, never a bundle's own code."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResultStatus

import fedlap_flower.server_app
from fedlap_flower.runtime import serverapp


def _bundle_dir(tmp_path):
  """A bundle's files whose modules leave a mark when imported: ``evilsrv`` and a
  ``fedlap_flower.server_app`` shadowing the installed one."""
  mark = tmp_path / "imported"
  code = f"open({str(mark)!r}, 'a').write('x')\napp = None\n"
  (tmp_path / "evilsrv.py").write_text(code)
  (tmp_path / "fedlap_flower").mkdir()
  (tmp_path / "fedlap_flower" / "__init__.py").write_text(code)
  (tmp_path / "fedlap_flower" / "server_app.py").write_text(code)
  return tmp_path, mark


def test_server_refuses_a_bundle_naming_another_serverapp(tmp_path, monkeypatch):
  bundle, mark = _bundle_dir(tmp_path)
  ran = []
  monkeypatch.setattr(serverapp.flwr_run_serverapp, "run", lambda **kw: ran.append(kw))
  with pytest.raises(serverapp.OtherServerApp) as refused:
    serverapp.run_installed(None, None, str(bundle), server_app_attr="evilsrv:app")
  assert (refused.value.field, refused.value.value) == ("serverapp", "evilsrv:app")
  assert not mark.exists() and not ran and str(bundle) not in sys.path
  with pytest.raises(serverapp.OtherServerApp):  # an app object is not the installed one
    serverapp.run_installed(None, None, str(bundle), loaded_server_app=types.SimpleNamespace())


def test_server_runs_the_installed_serverapp_not_the_bundles(tmp_path, monkeypatch):
  bundle, mark = _bundle_dir(tmp_path)
  ran = []
  monkeypatch.setattr(serverapp.flwr_run_serverapp, "run", lambda **kw: ran.append(kw) or "ctx")
  assert serverapp.run_installed("grid", "context", str(bundle), serverapp.SERVERAPP_REF) == "ctx"
  (call,) = ran
  assert call["loaded_server_app"] is fedlap_flower.server_app.app
  assert (call["grid"], call["context"], call["server_app_dir"]) == ("grid", "context", "")
  assert not mark.exists() and str(bundle) not in sys.path
  # the task process puts this loader in place of flwr-serverapp's
  monkeypatch.setattr(sys, "argv", sys.argv)
  monkeypatch.setattr(
    serverapp.flwr_serverapp_runtime, "run_", serverapp.flwr_serverapp_runtime.run_
  )
  called = []
  monkeypatch.setattr(serverapp.support, "problems", lambda part: ())
  cli = importlib.import_module("flwr.superlink.cli.flwr_serverapp")
  monkeypatch.setattr(cli, "flwr_serverapp", lambda: called.append(list(sys.argv)))
  serverapp.main(["--task", "--runtime-api-address", "127.0.0.1:1", "--token", "t", "--insecure"])
  assert called == [
    ["flwr-serverapp", "--runtime-api-address", "127.0.0.1:1", "--token", "t", "--insecure"]
  ]
  assert serverapp.flwr_serverapp_runtime.run_ is serverapp.run_installed
  with pytest.raises(SystemExit, match=serverapp.DEPENDENCY_FLAG):
    serverapp.main(["--task", serverapp.DEPENDENCY_FLAG])


def _spec(task_type):
  return ExecutionSpec(
    task_type=task_type,
    runtime_api_address="127.0.0.1:8000",
    token="tok",
    insecure=False,
    root_certificates_path="ca.crt",
    runtime_dependency_install=True,
    parent_pid=None,
    suppress_output=False,
    task_id=1,
  )


def test_server_executor_starts_only_this_modules_task_process(monkeypatch):
  started = []
  monkeypatch.setattr(serverapp.subprocess, "Popen", started.append)
  executor = serverapp.ServerAppExecutor()
  assert executor.launch(_spec(TaskType.CLIENT_APP)).status == LaunchResultStatus.FAILED
  assert not started
  assert executor.launch(_spec(TaskType.SERVER_APP)).status == LaunchResultStatus.ACCEPTED
  assert started == [
    [
      sys.executable,
      "-m",
      "fedlap_flower.runtime.serverapp",
      "--task",
      "--runtime-api-address",
      "127.0.0.1:8000",
    ]
    + ["--token", "tok", "--root-certificates", "ca.crt"]
  ]


def test_server_executor_refuses_to_start_on_an_untested_flower(monkeypatch):
  assert serverapp.support.problems("serverapp", cached=False) == ()
  assert serverapp.support.problems("serverapp", version="0.0.0")
  monkeypatch.setattr(
    serverapp.support, "problems", lambda part: ("run_serverapp.run_ is missing",)
  )
  for argv in (["--task"], ["--runtime-api-address", "127.0.0.1:1"]):
    with pytest.raises(SystemExit, match="run_serverapp.run_"):
      serverapp.main(argv)


def test_an_unchecked_flower_version_takes_flowers_own_paths_or_is_refused(monkeypatch):
  """A Flower release the internals were not checked on (the version the gate reads): the node
  becomes Flower's own flower-supernode, the ServerApp Grid keeps Flower's own retries, and
  the server runner refuses, naming ``flwr`` and the version."""
  from fedlap_flower import node  # pylint: disable=g-import-not-at-top
  from fedlap_flower.runtime import object_pulls, supernode  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(serverapp.support, "flower_version", lambda: "9.9.9")

  class Execd(Exception):
    pass

  def execv(path, argv):
    raise Execd(argv)

  monkeypatch.setattr(supernode.os, "execv", execv)
  monkeypatch.setattr(supernode, "run_warm", lambda *a, **k: pytest.fail("the worker started"))
  with pytest.raises(Execd) as stock:
    node.main(["--allow-unsigned-runs", "--insecure", "--superlink", "x:1"])
  assert stock.value.args[0][1:] == ["--insecure", "--superlink", "x:1", "--host", "127.0.0.1"]
  grid = types.ModuleType(object_pulls.GRID_MODULE)
  grid.pull_objects = flowers = lambda *a, **k: {}
  assert object_pulls.quick_grid_pulls(grid) is False and grid.pull_objects is flowers
  for argv in (["--task", "--insecure"], ["--runtime-api-address", "127.0.0.1:1"]):
    with pytest.raises(serverapp.support.UncheckedFlower) as refused:
      serverapp.main(argv)
    assert (refused.value.field, refused.value.value) == ("flwr", "9.9.9")
    assert serverapp.support.TESTED_INSTALL in str(refused.value)
