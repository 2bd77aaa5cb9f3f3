"""The README's Python examples run and print what the README says they print."""

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks():
  return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _expected_output(block):
  """The documented output: a ``# value`` comment on the line after a print, or after it."""
  out = []
  lines = block.splitlines()
  for prev, line in zip([""] + lines, lines):
    m = re.match(r"^print\(.*\)\s+# (.+)$", line)
    if m:
      out.append(m.group(1).split(",")[0].strip())
    elif prev.startswith("print(") and line.startswith("# "):
      out.append(line[2:].strip())
  return out


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_block_runs_and_prints_documented_output(index):
  block = _python_blocks()[index]
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    exec(compile(block, f"README.md block {index}", "exec"), {})
  printed = buf.getvalue()
  expected = _expected_output(block)
  assert expected, "each README example documents its output"
  for value in expected:
    assert value in printed, (value, printed)


def test_readme_runs_local_approx_with_an_nnx_and_an_equinox_model():
  """Besides linen, the README shows the two other Flax/JAX model styles calling local_approx
  (the parametrized test above runs the block)."""
  blocks = [b for b in _python_blocks() if "local_approx" in b]
  assert any("nnx.split(" in b and "nnx.merge(" in b for b in blocks)
  assert any("eqx.partition(" in b and "eqx.combine(" in b for b in blocks)
