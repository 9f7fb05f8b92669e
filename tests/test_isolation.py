"""Each variant in its own process: a dying child is a failed run, not the end of the suite."""

from __future__ import annotations

import json
import textwrap

from harness.cli import main

CRASHES = """
model:
  dtype: float16
  vocab: 256
  layers: [{count: 2, kind: full, kv_heads: 2, head_dim: 32}]
workload:
  prefill_chunk: 16
  requests: [{prompt: 32, decode: 20}]
cache: {layer: {component: "tests.fixtures.components:CrashingCache", options: {at: 8}}}
variants:
  killed: {cache: {layer: {options: {how: kill}}}}
  segfault: {cache: {layer: {options: {how: segv}}}}
  raises: {cache: {layer: {options: {how: raise}}}}
  healthy: {cache: {layer: {component: mlx_lm.KVCache}}}
"""


def summary(out, variant, scenario="crashes"):
    return json.loads((out / scenario / variant / "summary.json").read_text())


def test_dead_children_are_failed_runs_and_the_others_still_report(tmp_path, capsys):
    path = tmp_path / "crashes.yaml"
    path.write_text(textwrap.dedent(CRASHES))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 2

    # Row 0 is the baseline and each layer's cache counts its own updates, so the 8th update
    # comes at step 8: steps 0-7 were recorded, step 8 never finished.
    killed = summary(out, "killed")
    assert killed["status"] == "failed" and killed["exit_status"] == -9
    assert killed["last_step"] == 8
    assert "killed by signal 9 at step 8" in killed["error"]

    segfault = summary(out, "segfault")
    assert segfault["status"] == "failed" and segfault["exit_status"] == -11
    assert "killed by signal 11" in segfault["error"]

    raises = summary(out, "raises")
    assert raises["status"] == "failed" and raises["exit_status"] == 1
    assert "RuntimeError: cache gave up at update 8" in raises["error"]
    # A run that raised still hands back the steps it recorded before the error.
    assert len((out / "crashes" / "raises" / "samples.csv").read_text().splitlines()) == 1 + 8

    healthy = summary(out, "healthy")
    assert healthy["status"] == "ok" and healthy["passed"]
    assert healthy["metrics"]["steady"] == 256 * 2 * 2 * 2 * 32 * 2  # 52 tokens in 256 slots
    assert (out / "crashes" / "healthy" / "memory.png").stat().st_size > 0
    assert "killed by signal 9" in " ".join(capsys.readouterr().out.split())


def test_a_variant_that_cannot_fit_is_refused_with_its_estimate(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("model: qwen3-8b\nworkload: {requests: [{prompt: 4000000}]}\n")
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 2
    refused = summary(out, "default", "huge")
    assert refused["status"] == "refused"
    # 4,000,256 tokens x 144 KiB, twice, plus two 512-token chunks and the runtime slack.
    estimate = 2 * 4_000_256 * 147456 + 2 * 512 * 147456 + 256 * 2**20
    assert refused["metrics"]["estimate"] == estimate
    assert f"{estimate / 2**30:.2f} GiB" in refused["error"]
