r"""PROTOTYPE: what each lever does to a round program's compile time, size and round time.

  python -m benchmarks.compile_levers --configs quickstart:dp,quickstart:nondp --rounds 6
  python -m benchmarks.compile_levers --configs cifar_dp --rounds 0 --levers none,xla_llvm_o1

A measuring tool for the design of smaller round programs, not a feature: each *lever* is
applied to the library from the outside (a patch, XLA options or a config override) in a
fresh process, which builds the config's round program ahead of time (trace, lower, compile:
wall and process-CPU seconds; no persistent cache), counts its HLO (as JAX hands it to XLA,
and after XLA's optimisation: instructions, fusions, while loops) and runs ``--rounds``
rounds of it (median wall and CPU seconds after the first). Every lever's first round is
compared with the baseline's bit for bit (``same numbers``). Levers:

* ``none``: the library as it is (the baseline).
* ``xla_emitters_off``, ``xla_llvm_o1``, ``xla_cheap_llvm``, ``xla_fast_preset``: XLA:CPU
  options (``--xla_cpu_use_fusion_emitters=false``, ``--xla_backend_optimization_level=1``,
  ``--xla_llvm_disable_expensive_passes=true``,
  ``--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE``); ``xla_emitters_off_fast_preset``:
  the first and the last together (the tests add LLVM's level 0 to them).
* ``one_noise_draw``: the Gaussian mechanism draws one normal vector for the whole clipped
  gradient instead of one per parameter leaf (same distribution, other numbers).
* ``paired_keys``: a client's key and its DSA family key are folded and split in one
  ``vmap``-ed PRNG call instead of two (the same numbers; valid when clients are not run
  side by side with ``vmap``, which would batch the family key).
* ``prng_rbg``, ``prng_unsafe_rbg``: JAX's ``rbg`` / ``unsafe_rbg`` key implementations
  (``jax_default_prng_impl``) instead of threefry: XLA's ``RngBitGenerator`` draws the bits,
  one instruction instead of a threefry loop per draw (other numbers: another generator).
* ``bound_no_prng``: threefry lowered to one xor per word: an upper bound of what fewer PRNG
  call sites could save, not a lever (the numbers are wrong).
* ``bound_no_dsa``: the config without DSA augmentation: an upper bound of the DSA's share.
* ``split``: compiles the client step (one client) and the server step alone instead of the
  round: where the round's compile time goes.

cifar10 / mnist configs read the synthetic stand-ins of :mod:`benchmarks.compile_times`.
Figures from a machine shared with other work are provisional: compare levers within one run
and repeat it (``--repeats``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import compile_times

LEVERS = (
  "none",
  "xla_emitters_off",
  "xla_llvm_o1",
  "xla_cheap_llvm",
  "xla_fast_preset",
  "xla_emitters_off_fast_preset",
  "one_noise_draw",
  "paired_keys",
  "prng_rbg",
  "prng_unsafe_rbg",
  "bound_no_prng",
  "bound_no_dsa",
  "split",
)
XLA_OPTIONS = {
  "xla_emitters_off": "--xla_cpu_use_fusion_emitters=false",
  "xla_llvm_o1": "--xla_backend_optimization_level=1",
  "xla_cheap_llvm": "--xla_llvm_disable_expensive_passes=true",
  "xla_fast_preset": "--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE",
  "xla_emitters_off_fast_preset": (
    "--xla_cpu_use_fusion_emitters=false --xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE"
  ),
}
NO_DSA = ("client.dsa_strategy=", "server.dsa_strategy=")
RESULT = "COMPILE_LEVERS_RESULT "


def _apply_patch(lever: str) -> None:
  """Patches the library for ``lever`` (before anything is traced)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  if lever in ("prng_rbg", "prng_unsafe_rbg"):
    jax.config.update("jax_default_prng_impl", lever.removeprefix("prng_"))
  elif lever == "bound_no_prng":
    from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
    from jax._src.random import threefry2x32  # pylint: disable=g-import-not-at-top

    def cheap(k1, k2, x1, x2):
      return [jnp.bitwise_xor(x1, k1), jnp.bitwise_xor(x2, k2)]

    mlir.register_lowering(
      threefry2x32.threefry2x32_p, mlir.lower_fun(cheap, multiple_results=True), platform="cpu"
    )
  elif lever == "one_noise_draw":
    from fedlap_jax import privacy  # pylint: disable=g-import-not-at-top

    def add_gaussian_noise(key, tree, stddev):
      leaves, treedef = jax.tree.flatten(tree)
      z = jax.random.normal(key, (sum(leaf.size for leaf in leaves),), leaves[0].dtype)
      out, start = [], 0
      for leaf in leaves:
        out.append(leaf + stddev * z[start : start + leaf.size].reshape(leaf.shape))
        start += leaf.size
      return jax.tree.unflatten(treedef, out)

    privacy.add_gaussian_noise = add_gaussian_noise
  elif lever == "paired_keys":
    from fedlap_jax.methods.fedlap import client  # pylint: disable=g-import-not-at-top

    def _fold(keys, data):
      k, f = keys
      if f is None:
        return jax.random.fold_in(k, data), None
      both = jax.vmap(jax.random.fold_in, in_axes=(0, None))(jnp.stack([k, f]), data)
      return both[0], both[1]

    def _split(keys, num):
      k, f = keys
      if f is None:
        return jax.random.split(k, num), None
      both = jax.vmap(lambda key: jax.random.split(key, num))(jnp.stack([k, f]))
      return both[0], both[1]

    client._fold, client._split = _fold, _split  # pylint: disable=protected-access


# The JAX random functions whose instructions count as the PRNG's (``op_name`` metadata).
PRNG_PIECES = (
  "_threefry_split",
  "_threefry_fold_in",
  "_randint",
  "_uniform",
  "_normal",
  "_shuffle",
  "_bernoulli",
  "_random_bits",
)


def prng_instructions(text: str) -> dict[str, int]:
  """Instructions of an optimised HLO module by the JAX random function they come from.

  An instruction counts for the outermost ``jit(<random function>)`` named in its
  ``op_name``; ``total`` is every instruction, ``prng`` those of any random function.
  """
  out = dict.fromkeys(("total", "prng", *PRNG_PIECES), 0)
  for line in text.splitlines():
    if " = " not in line or line.lstrip().startswith(("HloModule", "//")):
      continue
    out["total"] += 1
    name = line.partition('op_name="')[2].partition('"')[0]
    piece = next((p for p in name.split("/") if p[:4] == "jit(" and p[4:-1] in PRNG_PIECES), None)
    if piece is not None:
      out["prng"] += 1
      out[piece[4:-1]] += 1
  return out


def _timed(jitted_call) -> tuple[dict, object]:
  """Trace, lower and compile one ``jax.stages.Traced`` producer; seconds and HLO counts."""
  t0, c0 = time.perf_counter(), time.process_time()
  traced = jitted_call()
  t1, c1 = time.perf_counter(), time.process_time()
  lowered = traced.lower()
  t2, c2 = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  t3, c3 = time.perf_counter(), time.process_time()
  out = {
    "trace_s": t1 - t0,
    "lower_s": t2 - t1,
    "compile_s": t3 - t2,
    "trace_cpu": c1 - c0,
    "lower_cpu": c2 - c1,
    "compile_cpu": c3 - c2,
    "hlo_input": compile_times.hlo_counts(lowered.as_text(dialect="hlo")),
    "hlo_optimised": compile_times.hlo_counts(compiled.as_text()),
    "prng_instructions": prng_instructions(compiled.as_text()),
  }
  return out, compiled


def _child(spec: dict) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_enable_compilation_cache", False)
  lever = spec["lever"]
  _apply_patch(lever)
  from fedlap_runs import library_configs  # pylint: disable=g-import-not-at-top
  from fedlap_runs import build, calibration, flags  # pylint: disable=g-import-not-at-top

  cfg, _ = flags.load_config(spec["config"], spec["overrides"])
  calibration.calibrate_noise(cfg)
  setup = build.build_run(cfg)
  alg, state, clients = setup.algorithm, setup.state, setup.clients
  if lever == "split":
    return _split_child(setup, library_configs.library_config(cfg))
  out, compiled = _timed(lambda: compile_times._jitted_call(alg.round, state, clients))  # pylint: disable=protected-access
  walls, cpus = [], []
  for r in range(spec["rounds"]):
    t, c = time.perf_counter(), time.process_time()
    state, _ = compiled(state, clients)
    jax.block_until_ready(state)
    walls.append(time.perf_counter() - t)
    cpus.append(time.process_time() - c)
    if r == 0:
      leaves = [
        jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        for x in jax.tree.leaves(state)
      ]
      np.savez(spec["first_round"], *[np.asarray(x) for x in leaves])
  out["rounds_s"], out["rounds_cpu"] = walls, cpus
  if len(walls) >= 2:
    out["later_s"], out["later_cpu"] = statistics.median(walls[1:]), statistics.median(cpus[1:])
  return out


def _split_child(setup, config) -> dict:
  """The client step of one client and the server step of all, compiled alone."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from fedlap_jax.methods.fedlap import client as client_lib  # pylint: disable=g-import-not-at-top
  from fedlap_jax.methods.fedlap import server as server_lib  # pylint: disable=g-import-not-at-top
  from fedlap_jax.dispatch import record_counts  # pylint: disable=g-import-not-at-top

  state, clients, apply_fn = setup.state, setup.clients, setup.apply_fn
  key = jax.random.key(0)

  def client_step(k, params, syn, data, lr, fk, ik):
    return client_lib.client_step(
      k, apply_fn, params, syn, data, config, learning_rate=lr, family_key=fk, init_key=ik
    )

  def first(tree):
    return jax.tree.map(lambda a: a[0], tree)

  init_key = key if config.synthetic_init == "real" else None
  args = (
    key,
    state.params,
    first(state.synthetic),
    first(clients),
    jnp.float32(0.1),
    key,
    init_key,
  )
  out = {"client_step": _timed(lambda: jax.jit(client_step).trace(*args))[0]}
  update = jax.eval_shape(client_step, *args)[0]
  num = clients.mask.shape[0]
  stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((num, *s.shape), s.dtype), update)

  def server_step(k, params, updates, lr, n):
    return server_lib.server_step_with_state(
      k, apply_fn, params, updates, config, None, learning_rate=lr, num_records=n
    )[::2]

  server_args = (key, state.params, stacked, jnp.float32(0.1), record_counts(clients))
  out["server_step"] = _timed(lambda: jax.jit(server_step).trace(*server_args))[0]
  return out


def _same(a: Path, b: Path) -> bool | None:
  import numpy as np  # pylint: disable=g-import-not-at-top

  if not (a.exists() and b.exists()):
    return None
  with np.load(a) as x, np.load(b) as y:
    return len(x.files) == len(y.files) and all(np.array_equal(x[k], y[k]) for k in x.files)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_levers")
  parser.add_argument("--configs", default="quickstart:dp,quickstart:nondp")
  parser.add_argument("--levers", default=",".join(LEVERS))
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--json", default=None)
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child is not None:
    print(RESULT + json.dumps(_child(json.loads(args.child))), flush=True)
    return 0
  levers = [x for x in args.levers.split(",") if x]
  bad = [x for x in levers if x not in LEVERS]
  if bad:
    parser.error(f"--levers {','.join(bad)} is invalid; allowed: {list(LEVERS)}")
  work = Path(tempfile.mkdtemp(prefix="compile-levers-"))
  try:
    results = _measure(args, levers, work)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  if args.json:
    Path(args.json).write_text(json.dumps(results, indent=1))
  return 0


def _measure(args, levers: list[str], work: Path) -> list[dict]:
  """Every (config, repeat, lever) in a fresh process; prints each row as it comes."""
  results = []
  for name in [c for c in args.configs.split(",") if c]:
    overrides, _ = compile_times._overrides(name, work, [])  # pylint: disable=protected-access
    for rep in range(args.repeats):
      for lever in levers:
        spec = {
          "config": name,
          "lever": lever,
          "overrides": overrides + (list(NO_DSA) if lever == "bound_no_dsa" else []),
          "rounds": args.rounds,
          "first_round": str(work / f"{name.replace(':', '_')}-{lever}-{rep}.npz"),
        }
        env = {**os.environ, "PYTHONPATH": str(compile_times.ROOT)}
        if lever in XLA_OPTIONS:
          env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_OPTIONS[lever]}".strip()
        proc = subprocess.run(
          [sys.executable, "-P", str(Path(__file__).resolve()), "--child", json.dumps(spec)],
          cwd=compile_times.ROOT,
          env=env,
          capture_output=True,
          text=True,
          check=False,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
        r = json.loads(line[len(RESULT) :]) if line else {"error": proc.stderr[-2000:]}
        r.update(config=name, lever=lever, repeat=rep)
        base = work / f"{name.replace(':', '_')}-none-{rep}.npz"
        r["same_numbers"] = _same(base, Path(spec["first_round"])) if lever != "none" else True
        results.append(r)
        print(_row(r), flush=True)
  return results


def _prng_share(r: dict) -> str:
  p = r["prng_instructions"]
  return f"PRNG {p['prng']:,} of {p['total']:,} instructions ({100 * p['prng'] / max(p['total'], 1):.0f} %)"


def _row(r: dict) -> str:
  if "error" in r:
    return f"{r['config']} {r['lever']}: error {r['error'][-300:]}"
  if r["lever"] == "split":
    c, s = r["client_step"], r["server_step"]
    return (
      f"{r['config']} split: client step compile {c['compile_s']:.1f} s ({c['compile_cpu']:.1f} "
      f"CPU), {c['hlo_optimised']['instructions']:,} instr, {c['hlo_optimised']['fusions']} "
      f"fusions ({_prng_share(c)}); server step {s['compile_s']:.1f} s "
      f"({s['compile_cpu']:.1f} CPU), {s['hlo_optimised']['instructions']:,} instr, "
      f"{s['hlo_optimised']['fusions']} fusions ({_prng_share(s)})"
    )
  hin, hopt = r["hlo_input"], r["hlo_optimised"]
  later = f"later {r['later_s']:.2f} s ({r['later_cpu']:.2f} CPU)" if "later_s" in r else "not run"
  return (
    f"{r['config']} {r['lever']}: trace {r['trace_s']:.2f} lower {r['lower_s']:.2f} compile "
    f"{r['compile_s']:.1f} s ({r['compile_cpu']:.1f} CPU); HLO {hin['instructions']:,} -> "
    f"{hopt['instructions']:,}, {hopt['fusions']} fusions, {hopt['while']} while "
    f"({_prng_share(r)}); {later}; "
    f"same numbers: {r['same_numbers']}"
  )


if __name__ == "__main__":
  sys.exit(main())
