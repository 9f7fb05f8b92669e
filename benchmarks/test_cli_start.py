"""How long the command line takes to refuse bad input: `python -m harness run bad.yaml`.

Run with `python -m pytest benchmarks/test_cli_start.py --benchmark-only` (figures in
docs/benchmarks.md). Each round is a fresh interpreter, as a user or a CI step runs it: what it
measures is the imports before the file is read, the reason MLX, mlx-lm, pandas and matplotlib
are imported only where they are used.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def kvmem(*argv: str) -> int:
    return subprocess.run([sys.executable, "-m", "harness", *argv], cwd=ROOT,
                          capture_output=True).returncode


@pytest.mark.parametrize("text", ["model: [\n", "model: qwen3-8b\nbogus: 1\n"],
                         ids=["invalid_yaml", "unknown_field"])
def test_refusing_a_bad_scenario(benchmark, tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert benchmark.pedantic(kvmem, args=("run", str(path)), rounds=10, warmup_rounds=1) == 2


def test_help(benchmark):
    assert benchmark.pedantic(kvmem, args=("--help",), rounds=10, warmup_rounds=1) == 0
