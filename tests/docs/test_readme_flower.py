"""The README's Flower commands use flags that the CLIs receiving them have."""

import os
import pathlib
import re
import subprocess
import sys


README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_flower_commands_use_flags_the_installed_flower_has():
  """Every --flag of the README's Flower commands exists in the CLI that receives it.

  ``python -m fedlap_flower.node`` takes its own flags and hands the rest to Flower 1.42's
  ``flower-supernode``; ``python -m fedlap_flower.runtime.run_signature`` has its own CLI.
  """
  readme = README.read_text()
  section = readme.split("## Running across machines with Flower", 1)[1].split("\n## ", 1)[0]
  prefixes = (
    "flower-superlink",
    "python -m fedlap_flower.node",
    "flwr run",
    "python -m fedlap_flower.runtime.run_signature",
  )
  commands = [
    part.strip()
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    for line in block.splitlines()
    for part in re.split(r"&&|(?<!&)&(?!&)", line)
    if part.strip().startswith(prefixes)
  ]
  assert {p for p in prefixes if any(c.startswith(p) for c in commands)} == set(prefixes)
  bin_dir = pathlib.Path(sys.executable).parent

  def help_of(*argv):
    return subprocess.run(
      [*argv, "--help"],
      capture_output=True,
      text=True,
      timeout=60,
      env={**os.environ, "COLUMNS": "200"},
    ).stdout

  for command in commands:
    if command.startswith("python -m fedlap_flower.node"):
      help_text = help_of(sys.executable, "-m", "fedlap_flower.node") + help_of(
        str(bin_dir / "flower-supernode")
      )
    elif command.startswith("python -m"):
      help_text = help_of(sys.executable, "-m", command.split()[2])
    elif command.startswith("flwr run"):
      help_text = help_of(str(bin_dir / "flwr"), "run")
    else:
      help_text = help_of(str(bin_dir / command.split()[0]))
    flags = re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", command)
    assert flags, command
    for flag in flags:
      assert flag in help_text, (command.split(" --")[0], flag)
