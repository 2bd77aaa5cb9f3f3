"""What the README's privacy section says a DP run writes is in its work dir, and agrees.

One tiny FedLAP-DP run (digits, 3 of 5 clients per round, 3 rounds) through
``experiments.train``; every figure is recomputed from the work dir's public files alone
(``run_info.json``: sigma, C, B, T, delta, the client sizes; ``metrics.jsonl``: who took part)
by the accountant, as the README describes it: the Poisson-subsampled Gaussian at
``q = B / N_k``, ``T`` noisy accesses per round, composed over the rounds the client took part
in, replace-one (``epsilon``) with the add/remove figure beside it; ``epsilon`` is the maximum
over clients. ``tests/docs/test_epsilons.py`` checks the quoted figures of the named configs;
``tests/integration/test_experiments_run.py`` the records of a run without client sampling.
"""

import json
import re
from pathlib import Path

import pytest

from experiments import train
from fedlap_jax import accounting
from fedlap_jax.methods import REGISTRY
from fedlap_runs import checkpointing, configs

from conftest import TINY_FEDLAP_FLAGS

ROOT = Path(__file__).resolve().parents[2]
ROUNDS, PER_ROUND = 3, 3
TINY = {
  **TINY_FEDLAP_FLAGS,
  "server.max_epochs": 1,
  "rounds": ROUNDS,
  "snapshot_rounds": (),
  "plots": False,
  "data.clients_per_round": PER_ROUND,
  "dp.noise_multiplier": 1.3,
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  cfg = configs.load("quickstart:dp_loops")
  cfg.update_from_flattened_dict(TINY)
  path = tmp_path_factory.mktemp("dp_run")
  train.train_and_evaluate(cfg, path)
  return path


def _readme_privacy_section():
  text = (ROOT / "README.md").read_text()
  start = text.index("## Privacy guarantees and their assumptions")
  return " ".join(text[start : text.index("\n## ", start + 1)].split())


def test_the_readme_says_what_this_test_checks():
  """The statements checked below, as the README words them."""
  section = _readme_privacy_section()
  for claim in (
    "`epsilon` in `metrics.jsonl` and `privacy_ledger.json` composes privacy loss distributions"
    " of the Poisson-subsampled Gaussian (`q = B / N_k`, `T` noisy accesses per round) over the"
    " rounds the client took part in",
    "no amplification by participation is claimed",
    "`epsilon_add_remove` is the paper's notion (Rényi DP, add or remove one record)",
    "`dp.delta` must stay below `1 / min_k N_k`",
    "the radius (a constant under DP)",
  ):
    assert claim in section, claim
  experiments_md = " ".join((ROOT / "docs" / "experiments.md").read_text().split())
  assert "**`epsilon` in `metrics.jsonl` is the maximum over clients**, `epsilon_clients`" in (
    experiments_md
  )
  privacy_md = " ".join((ROOT / "docs" / "privacy.md").read_text().split())
  assert (
    "each client's epsilon (`privacy_ledger.json`; `epsilon_clients`: their min, median and max)"
    in privacy_md
  )


def test_run_info_holds_the_privacy_parameters_the_accountant_reads(workdir):
  info = json.loads((workdir / "run_info.json").read_text())
  cfg = json.loads((workdir / "config.json").read_text())
  assert info["dp"] is True and info["method_label"] == "FedLAP-DP"
  for field in ("noise_multiplier", "l2_clip_norm", "delta"):
    assert info[field] == cfg["dp"][field], field
  assert info["batch_size"] == cfg["client"]["batch_size"] == 16
  client = cfg["client"]  # T = iterations * max_outer * batch_loop (README)
  assert (
    info["steps_per_round"] == client["iterations"] * client["max_outer"] * client["batch_loop"]
  )
  sizes = info["client_sizes"]
  assert info["min_client_size"] == min(sizes) and len(sizes) == info["num_clients"] == 5
  assert info["sampling_rate"] == info["batch_size"] / min(sizes)  # q = B / min_k N_k
  assert info["delta"] < 1 / min(sizes)
  assert (info["adjacency"], info["epsilon_for"]) == ("replace_one", "replace_one")
  assert info["clients_per_round"] == PER_ROUND


def test_each_rounds_epsilon_is_the_accountants_for_the_clients_rounds(workdir):
  """From the public files alone: client k's epsilon after round r is the accountant's for
  sigma, ``q_k = B / N_k``, ``T`` per round and delta over the rounds k took part in so far (no
  amplification by participation); ``epsilon`` is their maximum, ``epsilon_clients`` their
  min / median / max, ``epsilon_add_remove`` the maximum of the add/remove figures."""
  info = json.loads((workdir / "run_info.json").read_text())
  records = checkpointing.read_metrics(workdir / "metrics.jsonl")
  assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
  sizes = info["client_sizes"]
  taken = [0] * len(sizes)

  def epsilon(k, adjacency):
    if not taken[k]:
      return 0.0
    return accounting.epsilon_after_rounds(
      rounds=taken[k],
      noise_multiplier=info["noise_multiplier"],
      batch_size=info["batch_size"],
      min_client_size=sizes[k],
      steps_per_round=info["steps_per_round"],
      delta=info["delta"],
      adjacency=adjacency,
    )

  for r in records:
    assert len(r["clients"]) == PER_ROUND and r["clients"] == sorted(set(r["clients"]))
    for k in r["clients"]:
      taken[k] += 1
    eps = sorted(epsilon(k, "replace_one") for k in range(len(sizes)))
    assert r["epsilon"] == pytest.approx(eps[-1], rel=1e-9)
    assert r["epsilon_clients"] == pytest.approx(
      {"min": eps[0], "median": eps[len(eps) // 2], "max": eps[-1]}, rel=1e-9
    )
    add_remove = max(epsilon(k, "add_remove") for k in range(len(sizes)))
    assert r["epsilon_add_remove"] == pytest.approx(add_remove, rel=1e-9)
  assert sum(taken) == ROUNDS * PER_ROUND


def test_the_ledger_file_holds_the_same_charges(workdir):
  """``privacy_ledger.json``: per client its ``N_k``, ``T`` for each round it took part in
  (those ``metrics.jsonl`` names), and the epsilons the records were computed from."""
  info = json.loads((workdir / "run_info.json").read_text())
  records = checkpointing.read_metrics(workdir / "metrics.jsonl")
  stored = json.loads((workdir / "privacy_ledger.json").read_text())
  assert stored["participants"] == [r["clients"] for r in records]
  ledgers = accounting.ClientLedgers.from_dict(stored)  # recomputes every epsilon
  for k, ledger in enumerate(stored["clients"]):
    rounds = sum(k in r["clients"] for r in records)
    assert ledger["min_client_size"] == info["client_sizes"][k]  # this client's N_k
    assert ledger["steps"] == [info["steps_per_round"]] * rounds
    for field in ("noise_multiplier", "batch_size", "delta", "adjacency"):
      assert ledger[field] == info[field], field
    assert ledger["epsilons"] == pytest.approx(ledgers.ledgers[k].epsilons, rel=1e-9)
  assert ledgers.epsilon == records[-1]["epsilon"]


def test_the_radius_is_the_configs_constant(workdir):
  """Under DP the radius is released as a constant of the config, not measured on records."""
  cfg = json.loads((workdir / "config.json").read_text())
  for r in checkpointing.read_metrics(workdir / "metrics.jsonl"):
    assert r["client_radius"] == [cfg["client"]["radius"]] * PER_ROUND
    assert r["server_radius"] == cfg["client"]["radius"]


def test_the_guarantee_names_every_dp_method_of_the_registry():
  """The README's list of the methods ``dp.enabled=True`` makes private is the registry's."""
  listed = re.search(r"`dp.enabled=True` \(([^)]*)\)", _readme_privacy_section()).group(1)
  labels = {m.label(True) for m in REGISTRY.values() if m.privacy != "never"}
  assert set(listed.split(", ")) == labels
