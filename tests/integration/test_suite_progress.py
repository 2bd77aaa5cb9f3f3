"""A suite says which of its runs is under way, as each run's bar says which round."""

from experiments import report, suite, train
from fedlap_runs.configs import quickstart


def test_a_suite_numbers_its_runs(tmp_path, monkeypatch, capsys):
  done = []

  def fake_run(cfg, workdir, *, config_name, built):
    del cfg, workdir, built
    done.append(config_name)
    return {"records": [], "seconds": 0.0}

  monkeypatch.setattr(train, "train_and_evaluate", fake_run)
  monkeypatch.setattr(report, "make_report", lambda *a, **k: None)
  assert suite.run_config(quickstart.get_config(), str(tmp_path), "quickstart") == 0
  out = capsys.readouterr().out
  assert sorted(done) == ["quickstart/fedlap", "quickstart/fedlap_dp"]
  lines = [l for l in out.splitlines() if " of the suite: " in l]
  assert lines == [f"run {i}/2 of the suite: {name}" for i, name in enumerate(done, 1)]
