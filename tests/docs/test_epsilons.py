"""Every epsilon the README, docs/ and the config docstrings quote is what the runs print.

The figures are computed by :mod:`experiments.epsilons` through the runs' own code path
(config -> library config -> mechanism -> ledger); ``python -m experiments.epsilons --write``
regenerates them. A run's ``metrics.jsonl`` against the same computation:
``tests/integration/test_experiments_run.py::test_the_epsilon_table_computes_what_a_run_prints``.
"""

import re
from pathlib import Path

import pytest

from experiments import epsilons

from fedlap_runs import calibration, configs, flags
from fedlap_runs.configs import fedlap

ROOT = Path(__file__).resolve().parents[2]


def test_the_documents_quote_the_epsilons_the_runs_print():
  mismatches = epsilons.check(ROOT)
  assert mismatches == [], "run `python -m experiments.epsilons --write`:\n" + "\n".join(
    f"{m.path}:{m.line}: {' '.join(m.quote.split())} -> {m.want}" for m in mismatches
  )


def test_the_readme_shows_the_generated_table_of_every_named_dp_config():
  readme = (ROOT / "README.md").read_text()
  assert epsilons.table() in readme
  assert (
    "| `quickstart:dp` (FedLAP-DP, digits) | 46 / 274 | 20 | 5 | 2.92 | 1e-05 | **5.116** "
    in (readme)
  )
  assert epsilons.results_table() in (ROOT / "docs" / "results.md").read_text()


def test_a_wrong_quote_is_rewritten_and_a_bad_one_reported():
  text = (
    "The hybrid: ``quickstart:dp``: epsilon 2.78 after\n  5 rounds (add/remove 2.78).\n"
    "`cifar_dp`: epsilon 1.0 after 1 round (add/remove 9.9)\n"
    "`no_such_config`: epsilon 1.0 after 1 round (add/remove 1.0)\n"
    "`quickstart:dp`: epsilon 1.0 after 6 rounds (add/remove 1.0)\n"
    "`quickstart_compare`: epsilon 1.0 after 1 round (add/remove 1.0)\n"
  )
  new, mismatches = epsilons.rewrite(text, "x.md")
  assert "``quickstart:dp``: epsilon 5.12 after\n  5 rounds (add/remove 2.78)." in new
  assert "`cifar_dp`: epsilon 3.4 after 1 round (add/remove 2.8)" in new
  assert [(m.line, m.want.split(" (")[0].split(",")[0]) for m in mismatches] == [
    (1, "``quickstart:dp``: epsilon 5.12 after 5 rounds"),
    (3, "`cifar_dp`: epsilon 3.4 after 1 round"),
    (4, "no such DP config"),
    (5, "a round in 1..5"),
    (6, "one DP run"),
  ]
  assert epsilons.rewrite(new, "x.md")[1][:2] == mismatches[2:4]  # fixed ones stay fixed


def test_a_quote_with_overrides_is_the_command_lines_config():
  (s,) = epsilons.spends_of("digits_dp_hybrid  dp.target_epsilon=10.18\n dp.epsilon_for=add_remove")
  assert s.epsilons_add_remove[-1] == pytest.approx(10.18, rel=2e-4)
  assert s.noise_multiplier == pytest.approx(1.17, abs=0.005)
  assert s.epsilons[-1] > s.epsilons_add_remove[-1]


def _named_dp_configs():
  """Every ``--config`` name whose config (or one of whose suite runs) has DP on."""
  names = list(configs.ALIASES) + ["quickstart", "quickstart_compare", "quickstart:dp_loops"]
  out = {}
  for name in names:
    cfg = configs.load(name)
    runs = cfg.suite.values() if "suite" in cfg else [cfg]
    if any(r.dp.enabled for r in runs):
      out[name] = cfg
  return out


def test_the_table_holds_every_named_dp_config():
  tabled = [configs.load(n) for n in epsilons.NAMES]
  tabled_runs = [r for c in tabled for r in (c.suite.values() if "suite" in c else [c])]
  missing = []
  for name, cfg in _named_dp_configs().items():
    for r in cfg.suite.values() if "suite" in cfg else [cfg]:
      if r.dp.enabled and not any(r.to_dict() == t.to_dict() for t in tabled_runs):
        missing.append(name)
  assert missing == []


@pytest.mark.parametrize("dataset", ["mnist", "fmnist", "cifar"])
def test_the_published_class_counts_give_the_paper_partitions_sizes(dataset):
  sizes = epsilons.client_sizes(configs.load(f"{dataset}_dp"))
  assert min(sizes) == fedlap.MIN_CLIENT_SIZE[dataset] and len(sizes) == 5
  assert sum(sizes) == {"mnist": 60_000, "fmnist": 60_000, "cifar": 50_000}[dataset]


def test_digits_sizes_come_from_the_data():
  cfg = configs.load("quickstart:dp")
  assert epsilons.client_sizes(cfg) == calibration.client_sizes(cfg) == [283, 280, 274, 283, 280]


def test_config_docstrings_state_no_unlabelled_epsilon():
  """A figure in a config file is a generated quote or labelled as the paper's add/remove."""
  loose = []
  for path in sorted((ROOT / "fedlap_runs" / "configs").glob("*.py")):
    text = epsilons.QUOTE.sub("", path.read_text())
    for m in re.finditer(r"(?i)\bepsilon\s+(\d+(?:\.\d+)?)", text):
      before = " ".join(text[max(0, m.start() - 40) : m.start()].split())
      if not before.endswith(("add/remove", "add/remove the")):
        loose.append(f"{path.name}: ...{before} {m.group(0)}")
  assert loose == []


def test_the_readme_calibration_line_is_what_the_command_prints():
  readme = (ROOT / "README.md").read_text()
  cmd = re.search(r"`python -m experiments.run --config=(\S+)\s+--config\.(\S+)` prints", readme)
  printed = re.search(r"\n(calibrated: [^\n]+)\n", readme).group(1)
  config, _ = flags.load_config(cmd.group(1), [cmd.group(2)])
  assert calibration.calibrate_noise(config) == [printed]
