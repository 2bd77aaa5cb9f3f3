r"""The epsilon every named DP config spends, computed the way its run computes it.

  python -m experiments.epsilons            # the table, as README.md shows it
  python -m experiments.epsilons --write    # rewrites every figure the documents quote
  python -m experiments.epsilons --check    # exit 1 if a document quotes another figure

For each config of :data:`NAMES` (and each DP run of a suite) it builds the config as
``experiments.run`` does (:func:`fedlap_runs.flags.load_config`; a suite's
``dp.target_epsilon`` / ``dp.match_epsilon_of`` calibrated by
:func:`fedlap_runs.calibration.calibrate_noise`), takes the mechanism its method declares
(:func:`fedlap_runs.library_configs.dp_mechanism`: ``B``, ``T`` per round, ``sigma``,
``delta``) and composes its rounds into the ledger the run keeps
(:func:`experiments.train.new_ledger`, :func:`experiments.train.charge_round`). So each figure
is what the run's ``metrics.jsonl`` prints after that round: ``epsilon``, the guarantee
(replace-one neighbours given the public client sizes), and ``epsilon_add_remove``, the
paper's notion, beside it.

Client sizes: scikit-learn's digits are loaded (offline); MNIST, Fashion-MNIST and CIFAR-10
are not downloaded: their training splits' published class counts
(``train_class_counts`` of :mod:`fedlap_runs.catalog`) go through the config's own partition
(:func:`fedlap_runs.data.client_split`), which gives the sizes a run on the tfds data sees.

Documents quote a figure in one form, which ``--write`` rewrites and ``--check`` (and the
test suite) compares with what this module computes::

  `NAME`: epsilon E after R rounds (add/remove A)

``NAME`` is any ``--config`` name (``quickstart:dp``, ``cifar_dp``) or a suite's run
(``quickstart_compare/dp_fedavg``), in single or double backticks; ``E`` and ``A`` keep the
decimals they are written with; the words may wrap across lines; ``NAME`` may be followed
by ``FIELD=VALUE`` overrides (``\`digits_dp_hybrid dp.target_epsilon=10.18\```). The tables of
:data:`TABLES` (README.md's of every named DP config, docs/results.md's of its digits rows)
sit between a :data:`TABLE_BEGIN` line naming the table and a :data:`TABLE_END` line.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import types
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# The named DP configs of README.md's table, in its order (suites: every DP run of them).
NAMES = (
  "quickstart:dp",
  "quickstart:dp_tuned",
  "quickstart:dp_loops",
  "quickstart_compare",
  "mnist_dp",
  "fmnist_dp",
  "cifar_dp",
  "cifar_iid:dp",
  "mnist_dp_tuned",
  "fmnist_dp_tuned",
  "cifar_dp_tuned",
  "mnist_dp_hybrid",
  "fmnist_dp_hybrid",
  "mnist_dp_best",
  "fmnist_dp_best",
  "mnist_fedavg_dp",
  "fmnist_fedavg_dp",
  "cifar_fedavg_dp",
  "mnist_fedavg_dp_best",
  "fmnist_fedavg_dp_best",
  "mnist_fedprox_dp",
  "fmnist_fedprox_dp",
  "cifar_fedprox_dp",
  "mnist_psg",
  "fmnist_psg",
  "cifar_psg",
)
# The files whose quoted figures --write rewrites and --check compares.
DOCUMENTS = (
  "README.md",
  "docs/*.md",
  "experiments/*.py",
  "fedlap_runs/*.py",
  "fedlap_runs/configs/*.py",
)
# A generated table sits between a line "<!-- epsilons: NAME (...) -->" (NAME a key of
# TABLES) and the line TABLE_END.
TABLE_BEGIN = re.compile(
  r"^<!-- epsilons: (?P<table>[^(]+?) \(python -m experiments\.epsilons --write\) -->$", re.M
)
TABLE_END = "<!-- epsilons: end -->"
_NUMBER = r"\d+(?:\.\d+)?"
_TOKEN = r"[A-Za-z0-9_.:/+=,'-]+"
QUOTE = re.compile(
  rf"(?P<tick>`{{1,2}})(?P<name>{_TOKEN}(?:\s+{_TOKEN})*)(?P=tick):\s+epsilon\s+"
  rf"(?P<eps>{_NUMBER})\s+after\s+(?P<rounds>\d+)\s+rounds?\s+\(add/remove\s+"
  rf"(?P<ar>{_NUMBER})\)"
)


class Spend(NamedTuple):
  """What one DP run spends, round by round, as its ledger records it.

  Attributes:
    name: ``NAME`` or ``NAME/RUN`` (a suite's run).
    label: the method's display name (``FedLAP-DP``, ``DP-FedAvg``, ...).
    dataset: ``data.name``.
    batch_size: ``B``; min_client_size: ``min_k N_k`` (``q = B / min_k N_k``).
    steps_per_round: ``T``, the noisy accesses per round.
    noise_multiplier: ``sigma`` (calibrated, for a suite's matched runs).
    delta: the ``delta`` of every epsilon.
    epsilons: ``epsilon`` (replace-one, the guarantee) after rounds ``1..M``.
    epsilons_add_remove: the paper's add/remove figure after rounds ``1..M``.
  """

  name: str
  label: str
  dataset: str
  batch_size: int
  min_client_size: int
  steps_per_round: int
  noise_multiplier: float
  delta: float
  epsilons: tuple[float, ...]
  epsilons_add_remove: tuple[float, ...]

  @property
  def rounds(self) -> int:
    return len(self.epsilons)


def client_sizes(cfg) -> list[int]:
  """Records per client of ``cfg``'s data and partition, without downloading anything.

  tfds data sets with ``train_class_counts`` (:mod:`fedlap_runs.catalog`): labels with those counts through
  :func:`fedlap_runs.data.client_split` (the run's partition and ``train_fraction``, from the
  public ``data.partition_seed``); any other source: :func:`fedlap_runs.calibration.client_sizes`
  (loads the data).
  """
  from fedlap_runs import calibration, catalog  # pylint: disable=g-import-not-at-top
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top

  row = catalog.ROWS.get(cfg.data.name)
  counts = None if row is None else row.train_class_counts
  if counts is None or data_lib.parse_source(cfg.data.source)[0] != "tfds":
    return calibration.client_sizes(cfg)
  labels = np.repeat(np.arange(len(counts)), counts)
  split = data_lib.client_split(
    types.SimpleNamespace(y_train=labels, num_classes=len(counts)), cfg.data
  )
  return [len(i) for i in split]


def spend(cfg, name: str, sizes=None) -> Spend:
  """The :class:`Spend` of the DP config ``cfg`` (``sizes``: records per client, else
  :func:`client_sizes`): its method's mechanism composed round by round into the run's ledger."""
  from experiments import train  # pylint: disable=g-import-not-at-top
  from fedlap_runs import library_configs, method_entries  # pylint: disable=g-import-not-at-top
  from fedlap_jax import participation  # pylint: disable=g-import-not-at-top

  sizes = client_sizes(cfg) if sizes is None else list(sizes)
  mechanism = library_configs.dp_mechanism(cfg, sizes)
  if mechanism is None:
    raise ValueError(f"{name} is not a DP config (dp.enabled is False)")
  per_round = cfg.data.get("clients_per_round")
  ledger = train.new_ledger(mechanism, sizes, per_round)
  epsilons, add_remove = [], []
  for m in range(1, cfg.rounds + 1):
    idx = participation.sample_clients(
      cfg.data.get("participation_seed", 0), m, len(sizes), per_round
    )
    epsilons.append(float(train.charge_round(ledger, mechanism, idx)))
    add_remove.append(float(ledger.epsilon_add_remove))
  return Spend(
    name=name,
    label=cfg.get("label") or method_entries.label(cfg.method, True),
    dataset=cfg.data.name,
    batch_size=mechanism.batch_size,
    min_client_size=int(min(sizes)),
    steps_per_round=mechanism.steps_per_round,
    noise_multiplier=float(mechanism.noise_multiplier),
    delta=float(mechanism.delta),
    epsilons=tuple(epsilons),
    epsilons_add_remove=tuple(add_remove),
  )


def spends_of(name: str) -> tuple[Spend, ...]:
  """Every DP run of ``name``: ``NAME[/RUN] [FIELD=VALUE ...]``, the config
  ``--config=NAME --config.FIELD=VALUE ...`` (a suite: each of its DP runs, calibrated as
  ``experiments.run`` calibrates them; ``/RUN``: that run of the suite alone)."""
  return _spends_of(" ".join(name.split()))


@functools.lru_cache(maxsize=None)
def _spends_of(name: str) -> tuple[Spend, ...]:
  from fedlap_runs import calibration, flags  # pylint: disable=g-import-not-at-top

  head, *overrides = name.split(" ")
  base, _, only = head.partition("/")
  config, _ = flags.load_config(base, overrides)
  calibration.calibrate_noise(config, sizes_of=client_sizes)
  if "suite" not in config:
    if only:
      raise KeyError(f"{name}: {base} is not a suite")
    return (spend(config, name),) if config.dp.enabled else ()
  runs = [k for k in config.suite.keys() if config.suite[k].dp.enabled]
  if only:
    if only not in runs:
      raise KeyError(f"{name}: {base} has no DP run {only!r}; it has {runs}")
    runs = [only]
  return tuple(spend(config.suite[k], f"{base}/{k}") for k in runs)


def table(names=NAMES) -> str:
  """README.md's Markdown table: each DP run of ``names`` after its last round."""
  lines = [
    "| config | q = B / min N_k | T per round | rounds | sigma | delta | **epsilon** "
    "(the guarantee) | add/remove (the paper's notion) |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for name in names:
    for s in spends_of(name):
      lines.append(
        f"| `{s.name}` ({s.label}, {s.dataset}) | {s.batch_size} / {s.min_client_size} "
        f"| {s.steps_per_round:,} | {s.rounds} | {s.noise_multiplier:.6g} | {s.delta:g} "
        f"| **{s.epsilons[-1]:.3f}** | {s.epsilons_add_remove[-1]:.3f} |"
      )
  return "\n".join(lines)


# docs/results.md's DP rows on the digits, each run as its command line gives it (the
# overrides of ``--config=NAME``), at the paper's add/remove levels of those tables.
_DIGITS = (
  "data.name=digits data.source=sklearn data.normalisation=test_split model.width=32 "
  "model.depth=2 lr_schedule=cosine_open"
)
RESULT_RUNS = (
  ("FedLAP-DP, paper loops (1 round)", f"mnist_dp {_DIGITS} rounds=1 client.batch_size=7"),
  ("FedLAP-DP, tuned recipe (M 3)", "digits_dp_tuned"),
  ("FedLAP-DP hybrid, `digits_dp_hybrid` (M 5)", "digits_dp_hybrid"),
  (
    "DP-FedAvg, paper's q (M 5)",
    f"mnist_fedavg_dp {_DIGITS} rounds=5 client.batch_size=7 dp.l2_clip_norm=0.1",
  ),
  (
    "DP-FedAvg, q 0.17 (M 5)",
    f"mnist_fedavg_dp {_DIGITS} rounds=5 client.batch_size=46 baseline.local_epochs=3 "
    "dp.l2_clip_norm=1.0",
  ),
  (
    "DP-FedProx (M 5)",
    f"mnist_fedprox_dp {_DIGITS} rounds=5 client.batch_size=7 dp.l2_clip_norm=1.0",
  ),
)
RESULT_LEVELS = (2.79, 10.18)


def results_table(runs=RESULT_RUNS, levels=RESULT_LEVELS) -> str:
  """docs/results.md's table: the guarantee each digits row holds at the paper's add/remove
  levels (``dp.target_epsilon=E dp.epsilon_for=add_remove``, as those runs were calibrated)."""
  head = " | ".join(f"add/remove {e:g}: sigma, **epsilon**" for e in levels)
  lines = [f"| run (digits) | T per round | {head} |", "|---|---:|" + "---:|" * len(levels)]
  for label, name in runs:
    cells, steps = [], None
    for e in levels:
      (s,) = spends_of(f"{name} dp.target_epsilon={e:g} dp.epsilon_for=add_remove")
      steps = s.steps_per_round
      cells.append(f"{s.noise_multiplier:.4g}, **{s.epsilons[-1]:.2f}**")
    lines.append(f"| {label} | {steps} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


# The generated tables: the name in a document's begin line -> the function that makes it.
TABLES = {"named DP configs": table, "digits rows at the add/remove levels": results_table}


def _documents(root: Path) -> list[Path]:
  return sorted({p for pattern in DOCUMENTS for p in root.glob(pattern) if p.is_file()})


def _figure(written: str, value: float) -> str:
  decimals = len(written.partition(".")[2])
  return f"{value:.{decimals}f}"


class Mismatch(NamedTuple):
  """A quoted figure that is not what :func:`spends_of` computes (``want``), or a quote of an
  unknown config or round (``want`` says why)."""

  path: str
  line: int
  quote: str
  want: str


def rewrite(text: str, where: str = "") -> tuple[str, list[Mismatch]]:
  """``text`` with every quote's figures recomputed, and the quotes that differed."""
  mismatches = []

  def fix(match: re.Match) -> str:
    quote = match.group(0)
    line = text.count("\n", 0, match.start()) + 1
    name, rounds = match.group("name"), int(match.group("rounds"))
    try:
      spends = spends_of(name)
    except (KeyError, ValueError) as e:  # an unknown name or a config that does not load
      mismatches.append(Mismatch(where, line, quote, f"no such DP config ({e})"))
      return quote
    if len(spends) != 1:
      runs = [s.name for s in spends]
      mismatches.append(Mismatch(where, line, quote, f"one DP run, e.g. one of {runs}"))
      return quote
    s = spends[0]
    if not 1 <= rounds <= s.rounds:
      mismatches.append(Mismatch(where, line, quote, f"a round in 1..{s.rounds}"))
      return quote
    out = quote
    for group, value in (
      ("ar", s.epsilons_add_remove[rounds - 1]),
      ("eps", s.epsilons[rounds - 1]),
    ):  # right to left: the offsets of the earlier groups stay valid
      a, b = match.span(group)
      a, b = a - match.start(), b - match.start()
      out = out[:a] + _figure(match.group(group), value) + out[b:]
    if out != quote:
      mismatches.append(Mismatch(where, line, quote, " ".join(out.split())))
    return out

  text = QUOTE.sub(fix, text)
  pos = 0
  while (begin := TABLE_BEGIN.search(text, pos)) is not None:
    end = text.find(f"\n{TABLE_END}", begin.end())
    line = text.count("\n", 0, begin.start()) + 1
    make = TABLES.get(begin.group("table"))
    if end < 0 or make is None:
      why = f"a table of {list(TABLES)}" if make is None else f"a closing {TABLE_END} line"
      mismatches.append(Mismatch(where, line, begin.group(0), why))
      break
    new = f"{text[: begin.end()]}\n{make()}{text[end:]}"
    if new != text:
      mismatches.append(
        Mismatch(where, line, f"the table of {begin.group('table')}", "regenerated")
      )
    text = new
    pos = text.find(f"\n{TABLE_END}", begin.end()) + 1
  return text, mismatches


def check(root: Path = ROOT, *, write: bool = False) -> list[Mismatch]:
  """Every quote (and table) of :data:`DOCUMENTS` that differs from what this module computes;
  with ``write``, the documents are rewritten with the computed figures."""
  out = []
  for path in _documents(root):
    text = path.read_text()
    if not QUOTE.search(text) and not TABLE_BEGIN.search(text):
      continue
    new, mismatches = rewrite(text, str(path.relative_to(root)))
    out += mismatches
    if write and new != text:
      path.write_text(new)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m experiments.epsilons", description=__doc__.split("\n\n")[0]
  )
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument("--write", action="store_true", help="rewrite the documents' figures")
  mode.add_argument("--check", action="store_true", help="exit 1 if a document differs")
  args = parser.parse_args(argv)
  if not (args.write or args.check):
    print(table())
    return 0
  mismatches = check(write=args.write)
  for m in mismatches:
    print(f"{m.path}:{m.line}: {' '.join(m.quote.split())} -> {m.want}")
  if args.write:
    unfixable = [m for m in mismatches if m.want.startswith(("no such", "one DP", "a ", "one of"))]
    print(f"rewrote {len(mismatches) - len(unfixable)} figure(s); {len(unfixable)} left")
    return 1 if unfixable else 0
  return 1 if mismatches else 0


if __name__ == "__main__":
  sys.exit(main())
