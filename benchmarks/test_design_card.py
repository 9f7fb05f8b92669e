"""What the design-card command costs: `kvmem run scenarios/gemma26b_hot.yaml`, variant by
variant and as a user types it.

Run with `python -m pytest benchmarks/test_design_card.py --benchmark-only` (about three
minutes on two cores; figures in docs/benchmarks.md). Each variant is served once in its own
process, as `kvmem run` serves it, one at a time so the machine's two cores do not share it;
`extra_info` holds the child's own `wall_s` (what the report records) beside the benchmark's
time, which adds the child's start. The last case is the whole command with its defaults
(`--jobs auto`), the figure the under-a-minute target is about. A slower variant shows in
review as a moved row here; nothing in a pass/fail test depends on time.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from harness.pipeline.suite import run_variants
from harness.scenario import load_variants

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "gemma26b_hot.yaml"
VARIANTS = [v.name for v in load_variants(SCENARIO)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant(benchmark, tmp_path, variant):
    (chosen,) = load_variants(SCENARIO, [variant])
    quiet = Console(file=io.StringIO())
    (summary,) = benchmark.pedantic(run_variants, args=([chosen], tmp_path / "out", quiet),
                                    rounds=1, iterations=1)
    benchmark.extra_info.update(status=summary.status, wall_s=summary.metrics.get("wall_s"))
    assert summary.ok


def test_the_whole_command_with_its_defaults(benchmark, tmp_path):
    def command() -> int:
        return subprocess.run([sys.executable, "-m", "harness", "run", str(SCENARIO), "--out",
                               str(tmp_path / "out")], cwd=ROOT, capture_output=True).returncode

    assert benchmark.pedantic(command, rounds=1, iterations=1) == 0
