"""experiments.audit (membership inference) on a checkpointed run dir, as its CLI is used."""

from __future__ import annotations

import json

import chex
import jax
import pytest

DELTA = 1e-5


def test_cli_audits_a_run_dir(tmp_path, capsys):
  """A run dir (config.json + checkpoint + ledger) -> audit/ files; the checkpointed model is audited."""
  audit = pytest.importorskip("experiments.audit")
  from fedlap_runs import checkpointing
  from fedlap_runs.configs import quickstart
  from fedlap_jax.accounting import PrivacyLedger

  cfg = quickstart.dp_config()
  cfg.model.width, cfg.model.depth, cfg.client.ipc, cfg.rounds = 8, 1, 2, 3
  cfg.seed = 0  # a run dir's config.json holds its resolved seed
  checkpointing.write_json_atomic(tmp_path / "config.json", cfg.to_dict())
  built = audit.rebuild_run(cfg)
  alg = built.algorithm
  state = built.template._replace(
    params=jax.tree.map(lambda p: p + 0.01, alg.params_of(built.template))
  )
  ledger = PrivacyLedger(
    noise_multiplier=1.0,
    batch_size=64,
    min_client_size=260,
    steps_per_round=alg.dp_steps_per_round,
    delta=DELTA,
  )
  ledger.record_round()
  ledger.record_round()
  ckpt = checkpointing.Checkpointer(tmp_path / "checkpoints")
  ckpt.save(2, state, {"round": 2, "ledger": ledger.to_dict()})
  ckpt.close()

  run = audit.load_run(tmp_path)
  chex.assert_trees_all_close(run.params, alg.params_of(state))
  assert (run.round_index, run.rounds, run.label) == (2, 3, "FedLAP-DP")
  assert run.accountant_epsilon == pytest.approx(ledger.epsilon) and run.delta == DELTA
  sizes = [len(i) for i in built.client_indices]
  assert len(run.members[1]) == sum(sizes) and len(run.nonmembers[1]) == 397

  assert audit.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
  printed = capsys.readouterr()
  assert "blackbox_loss: AUC=" in printed.out and "auditing round 2" in printed.err
  with open(tmp_path / "out" / "audit.json") as f:
    result = json.load(f)
  assert result["accountant"] == {
    "dp": True,
    "epsilon": pytest.approx(ledger.epsilon),
    "delta": DELTA,
  }
  assert result["run"]["round"] == 2 and result["run"]["label"] == "FedLAP-DP"
  assert result["counts"]["audit_members"] == result["counts"]["audit_nonmembers"] == 198
  for a in result["attacks"].values():  # 198 non-members resolve 1 % but not 0.1 %
    assert a["tpr_at_fpr"]["0.001"] is None and a["tpr_at_fpr"]["0.01"] is not None
    assert a["tpr_unresolved"]["0.001"].startswith("needs >= 1,000 audit non-members, has 198")
    assert a["lowest_resolvable_fpr"] == pytest.approx(1 / 198)
  assert "TPR@0.001=N/A (needs >= 1,000 audit non-members" in printed.out
  assert (tmp_path / "out" / "roc_whitebox.png").exists()
  assert audit.main([str(tmp_path / "missing")]) == 2
  assert "config.json does not exist" in capsys.readouterr().err


def test_the_audit_reports_only_the_rates_it_resolves():
  """TPR at FPR f needs >= 1/f audit non-members (0.1 %: 1,000); below, N/A with the reason,
  and the TPR at the lowest FPR the audit half does resolve."""
  audit = pytest.importorskip("experiments.audit")
  tprs = {0.001: 0.0, 0.01: 0.05, 1 / 198: 0.02}
  out = audit.tpr_report(tprs, 198, (0.001, 0.01))
  assert out["tpr_at_fpr"] == {"0.001": None, "0.01": 0.05}
  assert out["tpr_unresolved"] == {
    "0.001": "needs >= 1,000 audit non-members, has 198 (lowest resolvable FPR 0.00505)"
  }
  assert (out["lowest_resolvable_fpr"], out["tpr_at_lowest_resolvable_fpr"]) == (1 / 198, 0.02)
  assert audit.resolves(0.001, 1000) and not audit.resolves(0.001, 999)
  full = audit.tpr_report({0.001: 0.1, 0.01: 0.2, 1 / 1000: 0.1}, 1000, (0.001, 0.01))
  assert full["tpr_at_fpr"] == {"0.001": 0.1, "0.01": 0.2} and full["tpr_unresolved"] == {}
