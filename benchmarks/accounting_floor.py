"""What one replace-one PLD evaluation costs near the accounting floor, and its lower bound.

  python -m benchmarks.accounting_floor [--sigmas 0.1,0.3,0.5] [--rates 1,0.5,0.05]
                                       [--steps 1000,5000,20000]

For each ``(sigma, q, T)`` a fresh process evaluates, as a ledger does, the replace-one
epsilon of ``T`` Poisson-sampled Gaussian steps at rate ``q`` (delta 1e-5; the headline
pessimistic PLD on a grid of ``accounting.PLD_DISCRETIZATION``) and then the cheap lower
bound (the optimistic PLD on ``accounting.LOWER_BOUND_DISCRETIZATION``), and prints the
seconds and the process's peak resident memory after each. Below
``accounting.MIN_NOISE_MULTIPLIER`` (0.3) the library refuses to account; the figures at
0.1 show why the floor sits where it does (one step at sigma 0.001 exhausts a machine's
memory, so it is not measured). Each figure comes from its own process (peak memory is per
process); on a shared machine the times are noisy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, time
import dp_accounting.pld.privacy_loss_distribution  # imported before the clocks start
from fedlap_jax import accounting
q, sigma, steps = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
t = time.perf_counter()
lower = accounting._replace_one_lower(q, steps, sigma, 1e-5)
t_lower, m_lower = time.perf_counter() - t, rss()
t = time.perf_counter()
eps = accounting._replace_one(q, steps, sigma, 1e-5)
t_eps, m_eps = time.perf_counter() - t, rss()
print(json.dumps(dict(eps=eps, lower=lower, t_eps=t_eps, t_lower=t_lower, m_lower=m_lower, m_eps=m_eps)))
"""


def _floats(text: str, name: str, cast=float) -> list:
  try:
    values = [cast(v) for v in text.split(",")]
  except ValueError:
    values = []
  if not values or min(values) <= 0:
    print(f"{name} {text!r} is invalid; allowed: comma-separated numbers > 0", file=sys.stderr)
    raise SystemExit(2)
  return values


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sigmas", default="0.1,0.3,0.5")
  parser.add_argument("--rates", default="1,0.5,0.05")
  parser.add_argument("--steps", default="1000,5000,20000")
  parser.add_argument("--timeout", type=float, default=600.0)
  args = parser.parse_args(argv)
  sigmas = _floats(args.sigmas, "--sigmas")
  rates = _floats(args.rates, "--rates")
  steps = _floats(args.steps, "--steps", int)
  print("sigma      q  steps      epsilon  lower bound  PLD s  peak GB  bound s  peak GB (bound)")
  for sigma in sigmas:
    for q in rates:
      for t in steps:
        try:
          out = subprocess.run(
            [sys.executable, "-c", CHILD, str(q), str(sigma), str(t)],
            capture_output=True,
            text=True,
            timeout=args.timeout,
            check=True,
          )
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
          print(f"{sigma:5g} {q:6g} {t:6d}  failed: {type(e).__name__}")
          continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
          f"{sigma:5g} {q:6g} {t:6d} {r['eps']:12.4g} {r['lower']:12.4g} {r['t_eps']:6.2f} "
          f"{r['m_eps']:8.2f} {r['t_lower']:8.2f} {r['m_lower']:8.2f}"
        )
  return 0


if __name__ == "__main__":
  sys.exit(main())
