"""The round's progress line (experiments.outputs.format_line) says what bound the round."""

from experiments import outputs

BASE = {"round": 3, "test_accuracy": 0.8, "test_loss": 0.5, "epsilon": 4.2}


def test_a_radius_that_bound_nothing_is_not_printed_as_a_limit():
  # The hybrid recipe: one constant radius of 1e4, the server stopped at max_epochs far
  # inside it.
  rec = {**BASE, "client_radius": [1e4] * 5, "server_radius": 1e4, "server_distance": 2.3}
  line = outputs.format_line(rec, 5)
  assert "10000" not in line and "server radius not reached" in line
  assert "eps 4.200" in line


def test_a_radius_that_bound_the_server_or_differs_per_client_is_printed():
  reached = {**BASE, "client_radius": [1.5] * 5, "server_radius": 1.5, "server_distance": 1.52}
  assert "radius 1.500 (r_k 1.50..1.50)" in outputs.format_line(reached, 5)
  calibrated = {**BASE, "client_radius": [1.2, 2.0], "server_radius": 1.2, "server_distance": 0.4}
  assert "radius 1.200 (r_k 1.20..2.00)" in outputs.format_line(calibrated, 5)
  fixed = {**BASE, "client_radius": [5.0], "server_radius": None, "server_distance": 0.4}
  assert "radius fixed (r_k 5.00..5.00)" in outputs.format_line(fixed, 5)


def test_a_first_round_says_it_compiles_before_it_does():
  assert outputs.compiling_line(1).startswith("compiling round 1 ")
  assert outputs.compiling_line(4).startswith("compiling round 4 ")


def test_a_notice_goes_to_stdout_only(tmp_path, capsys):
  log = outputs.TrainLog(tmp_path / "train.log", "run")
  log("compiling round 1", kept=False)
  log("round   1/2  acc 0.5")
  log.close()
  assert capsys.readouterr().out == "[run] compiling round 1\n[run] round   1/2  acc 0.5\n"
  assert (tmp_path / "train.log").read_text() == "[run] round   1/2  acc 0.5\n"
