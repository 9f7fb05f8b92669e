"""`run --jobs N`, `run --shard i/n` and `merge`: the same verdicts as one plain run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from harness.cli import main, parser
from harness.common.units import GiB, MiB
from harness.judge.metrics import exact
from harness.pipeline import isolation
from harness.pipeline.defaults import usable_cores
from harness.pipeline.isolation import estimate_bytes
from harness.pipeline.schedule import Scheduler, shard, shards
from harness.pipeline.suite import run_variants
from harness.scenario import Variant, load_variants
from tests.conftest import make_spec
from tests.test_isolation import CRASHES

# Tiny variants (about two seconds each, most of it the child's imports); `beta` loads a store
# by import path and keeps (and reports) one 128 KiB keys buffer per request, past a 256 KiB budget.
ALPHA = """\
name: alpha
model: {dtype: float16, vocab: 256, layers: [{count: 1, kind: full, kv_heads: 1, head_dim: 32}]}
cache: {layer: {component: mlx_lm.KVCache}}
workload: {prefill_chunk: 32, requests: [{prompt: 64, decode: 4}]}
variants:
  short: {}
  long: {workload: {requests: [{prompt: 96, decode: 24}]}}
  repeated: {workload: {requests: [{prompt: 32, decode: 2, repeat: 3}]}}
"""
BETA = """\
name: beta
model: {dtype: float16, vocab: 256, layers: [{count: 2, kind: full, kv_heads: 4, head_dim: 64}]}
cache: {store: {component: "examples.leaky_store:LeakyStore"}}
workload: {prefill_chunk: 64, requests: [{prompt: 64, decode: 8, repeat: 4}]}
detect: {unbounded: {budget: 256 KiB}}
variants:
  leaky: {cache: {store: {options: {leak: true}}}, expect: {unbounded: detected}}
  clean: {cache: {store: {options: {leak: false}}}}
"""


def verdicts(out: Path) -> dict[str, dict]:
    """What must not depend on how the suite was split or scheduled, per scenario/variant."""
    found = {}
    for path in sorted(out.glob("*/*/summary.json")):
        s = json.loads(path.read_text())
        found[f"{s['scenario']}/{s['variant']}"] = {
            "status": s["status"], "passed": s["passed"],
            "findings": sorted((f["kind"], f.get("count")) for f in s["findings"]),
            "expectations": [(e["name"], e["ok"]) for e in s["expectations"]],
            "metrics": {name: s["metrics"][name] for name in exact()}}
    return found


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    """A folder holding the two scenario files, run once in turn as the reference."""
    root = tmp_path_factory.mktemp("suite")
    (root / "scenarios").mkdir()
    (root / "scenarios" / "alpha.yaml").write_text(ALPHA)
    (root / "scenarios" / "beta.yaml").write_text(BETA)
    assert main(["run", str(root / "scenarios"), "--out", str(root / "jobs1")]) == 0
    return root


def test_two_jobs_give_the_same_summaries_in_the_same_order(suite, capsys):
    capsys.readouterr()
    assert main(["run", str(suite / "scenarios"), "--jobs", "2", "--out", str(suite / "jobs2")]) == 0
    reference = verdicts(suite / "jobs1")
    assert verdicts(suite / "jobs2") == reference
    assert list(reference) == ["alpha/long", "alpha/repeated", "alpha/short", "beta/clean",
                               "beta/leaky"]
    assert reference["beta/leaky"]["findings"] == [("unbounded", 2)]
    # The table, like the summaries, keeps the files' variant order, whatever finished first.
    rows = [line.split("│")[2].strip() for line in capsys.readouterr().out.splitlines()
            if line.count("│") > 3]
    assert rows == ["short", "long", "repeated", "leaky", "clean"]
    for scenario in ("alpha", "beta"):
        assert (suite / "jobs2" / scenario / "memory.png").stat().st_size > 0


def test_variants_that_do_not_fit_together_never_serve_at_once(suite):
    first, second = load_variants(suite / "scenarios" / "alpha.yaml", ["short", "long"])
    estimates = {v.label: estimate_bytes(v.spec) for v in (first, second)}
    available = max(estimates.values()) + MiB  # room for either, never for both
    scheduler = Scheduler(2, lambda: available)
    summaries = run_variants([first, second], suite / "scarce", jobs=2, scheduler=scheduler)
    assert [s.status for s in summaries] == ["ok", "ok"]
    assert [s.variant for s in summaries] == ["short", "long"]

    starts = {e.label: e.at for e in scheduler.log if e.event == "start"}
    ends = {e.label: e.at for e in scheduler.log if e.event == "end"}
    (a, b) = sorted(starts, key=starts.get)
    assert ends[a] <= starts[b]  # the second started only once the first had ended
    # The second usually waited for the first (it may have estimated after the first ended).
    waited = [(e.label, e.estimate, e.available) for e in scheduler.log if e.event == "wait"]
    assert waited in ([], [(b, estimates[b], available)])


def test_a_variant_that_cannot_fit_even_alone_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "big.yaml"
    path.write_text(ALPHA.replace("name: alpha", "name: big").replace(
        "  long: {workload: {requests: [{prompt: 96, decode: 24}]}}",
        "  huge: {model: qwen3-8b, workload: {requests: [{prompt: 1024}]}}"))
    huge = load_variants(path, ["huge"])[0]
    available = estimate_bytes(huge.spec) - 1
    monkeypatch.setattr(isolation, "available_memory", lambda: available)
    assert main(["run", str(path), "--jobs", "2", "--out", str(tmp_path / "out")]) == 2
    summaries = {p.parent.name: json.loads(p.read_text())
                 for p in (tmp_path / "out" / "big").glob("*/summary.json")}
    assert {name: s["status"] for name, s in summaries.items()} == {
        "short": "ok", "huge": "refused", "repeated": "ok"}
    refused = summaries["huge"]
    assert refused["metrics"]["estimate"] == estimate_bytes(huge.spec)
    assert refused["error"] == (f"estimated footprint {estimate_bytes(huge.spec) / GiB:.2f} "
                                f"GiB exceeds the {available / GiB:.2f} GiB available")


def _admit_in_thread(scheduler: Scheduler, index: int, label: str, estimate: int,
                     heard: list[str]) -> tuple[threading.Thread, list[str | None]]:
    verdict: list[str | None] = []
    thread = threading.Thread(target=lambda: verdict.append(
        scheduler.admit(index, label, estimate, heard.append)))
    thread.start()
    time.sleep(0.3)
    return thread, verdict


def test_the_scheduler_waits_for_a_job_and_for_memory_and_refuses_what_never_fits():
    scheduler = Scheduler(2, lambda: 10)
    heard: list[str] = []
    assert scheduler.admit(0, "a", 6) is None
    thread, verdict = _admit_in_thread(scheduler, 1, "b", 6, heard)
    assert verdict == [] and heard == ["waiting for memory"]  # 6 + 6 > 10
    scheduler.release(0, "a")
    thread.join(5)
    assert verdict == [None]

    assert scheduler.admit(2, "c", 1) is None
    thread, verdict = _admit_in_thread(scheduler, 3, "d", 1, heard)
    assert verdict == [] and heard[-1] == "queued"  # it fits, but both jobs are taken
    scheduler.release(2, "c")
    thread.join(5)
    assert verdict == [None]

    scheduler.release(1, "b")
    scheduler.release(3, "d")
    assert scheduler.admit(4, "e", 11) == ("estimated footprint 0.00 GiB exceeds the 0.00 GiB "
                                           "available")  # nothing serves: it can never fit
    assert scheduler.admit(5, "f", 10) is None
    thread, verdict = _admit_in_thread(scheduler, 6, "g", 1, heard)
    scheduler.cancel()  # an interrupted suite lets no waiting variant start
    thread.join(5)
    assert verdict == ["interrupted before it started"]
    assert [(e.event, e.label) for e in scheduler.log] == [
        ("start", "a"), ("wait", "b"), ("end", "a"), ("start", "b"), ("start", "c"),
        ("end", "c"), ("start", "d"), ("end", "b"), ("end", "d"), ("refuse", "e"),
        ("start", "f"), ("wait", "g")]


def _variant(scenario: str, name: str, decode: int) -> Variant:
    """A variant of `decode` + 3 planned steps: one prefill chunk, the tokens, one idle."""
    spec = make_spec(name=scenario, workload={"prefill_chunk": 32,
                                              "requests": [{"prompt": 32, "decode": decode}]})
    return Variant(Path(f"{scenario}.yaml"), name, spec)


STEPS = [("s1", "a", 20), ("s1", "b", 14), ("s1", "c", 11), ("s2", "a", 11), ("s2", "b", 8),
         ("s2", "c", 5), ("s2", "d", 3)]


def test_shards_are_deterministic_balanced_and_cover_every_variant_once():
    variants = [_variant(scenario, name, steps - 3) for scenario, name, steps in STEPS]
    labels = lambda part: [v.label for v in part]
    # Longest first into the lighter bin: 20 | 14, 11 (s1/c before s2/a: same steps, by name)
    # goes to 14, 11 to 20, 8 to 25, 5 to 31, 3 to 33: 36 steps each.
    assert labels(shard(variants, 1, 2)) == ["s1/a", "s2/a", "s2/c"]
    assert labels(shard(variants, 2, 2)) == ["s1/b", "s1/c", "s2/b", "s2/d"]
    assert shards(variants, 2) == shards(list(variants), 2)
    for count in range(1, 9):
        parts = [labels(shard(variants, index, count)) for index in range(1, count + 1)]
        assert sorted(label for part in parts for label in part) == sorted(labels(variants))
    assert labels(shard(variants, 8, 8)) == []


@pytest.mark.parametrize("text", ["0/2", "3/2", "a/b", "1/0", "2", "1/2/3", "+1/2", "1.5/2",
                                  "1/1001", "2/10000000", "1/99999999999999999999"])
def test_a_bad_shard_is_bad_input(capsys, text):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "scenarios", "--shard", text])  # refused before anything is read
    assert exit_info.value.code == 2
    assert (f"--shard: expected I/N with whole numbers 1 <= I <= N <= 1000, got '{text}'"
            in capsys.readouterr().err)


def test_a_shard_of_many_digits_is_refused_on_one_clipped_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "scenarios", "--shard", "1/" + "9" * 100_000])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"got '1/{'9' * 38}...'" in error and len(error) < 1000


def test_run_defaults_to_one_job_per_usable_core(monkeypatch, capsys):
    monkeypatch.setattr("harness.cli.options.usable_cores", lambda: 3)
    assert parser().parse_args(["run", "scenarios"]).jobs == 3
    assert parser().parse_args(["run", "scenarios", "--jobs", "auto"]).jobs == 3
    for command in (["noise", "scenarios"], ["baseline", "check"],
                    ["gate", "pr", "--base", "main"]):
        assert parser().parse_args([*command, "--jobs", "auto"]).jobs == 3
        assert parser().parse_args(command).jobs == 1        # figures that are recorded or judged
    with pytest.raises(SystemExit):
        parser().parse_args(["run", "--help"])
    assert "(default: auto, 3 here)" in " ".join(capsys.readouterr().out.split())
    assert usable_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("text", ["0", "x", "1.5", "1025", "9" * 5000])
def test_a_bad_jobs_count_is_bad_input(capsys, text):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "scenarios", "--jobs", text])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--jobs: expected a whole number of jobs from 1 to 1024, got '" in error
    assert len(error) < 1000


def test_shards_merged_give_the_unsharded_verdicts(suite, capsys):
    for index in (1, 2):
        assert main(["run", str(suite / "scenarios"), "--shard", f"{index}/2", "--jobs", "2",
                     "--out", str(suite / f"shard{index}")]) == 0
    held = [{p.parent.relative_to(suite / f"shard{i}").as_posix()
             for p in (suite / f"shard{i}").glob("*/*/summary.json")} for i in (1, 2)]
    assert held[0] and held[1] and not held[0] & held[1]
    merged = suite / "merged"
    capsys.readouterr()
    assert main(["merge", str(suite / "shard1"), str(suite / "shard2"),
                 "--out", str(merged)]) == 0
    out = capsys.readouterr().out
    assert "merged 5 variant(s) from 2 folder(s)" in out
    rows = [line.split("│")[2].strip() for line in out.splitlines() if line.count("│") > 3]
    assert rows == ["short", "long", "repeated", "leaky", "clean"]  # each file's order
    assert verdicts(merged) == verdicts(suite / "jobs1")
    for folder in merged.glob("*/*/"):
        shard_copy = next(suite / f"shard{i}" / folder.relative_to(merged) for i in (1, 2)
                          if (suite / f"shard{i}" / folder.relative_to(merged)).exists())
        assert sorted(p.name for p in folder.iterdir()) == ["holders.csv", "memory.png",
                                                            "samples.csv", "summary.json"]
        assert (folder / "samples.csv").read_bytes() == (shard_copy / "samples.csv").read_bytes()
    for scenario in ("alpha", "beta"):  # redrawn from the merged samples
        assert (merged / scenario / "memory.png").stat().st_size > 0
    assert not [p for p in merged.rglob(".*") if p.name != ".kvmem.lock"]


def test_a_variant_in_two_inputs_is_bad_input_naming_both(suite, tmp_path, capsys):
    shutil.copytree(suite / "jobs1", tmp_path / "again")
    out = tmp_path / "merged"
    assert main(["merge", str(suite / "jobs1"), str(tmp_path / "again"), "--out", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f"alpha/long is in both {suite / 'jobs1' / 'alpha' / 'long'} and "
            f"{tmp_path / 'again' / 'alpha' / 'long'}: each variant must come from one shard"
            in err)
    assert not out.exists()
    assert main(["merge", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "nothing: not a report folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()  # an empty part's folder adds nothing, but something must
    assert main(["merge", str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "empty: no summaries found" in capsys.readouterr().err


def test_dead_and_hanging_children_fail_alone_under_jobs(tmp_path):
    # The timeout counts the child's start, slower while other children start beside it.
    path = tmp_path / "crashes.yaml"
    path.write_text(CRASHES.replace("  raises:", "  hangs: {cache: {layer: {options: {how: hang}}}, "
                                    "timeout: 8}\n  raises:"))
    out = tmp_path / "out"
    assert main(["run", str(path), "--jobs", "2", "--out", str(out)]) == 2
    found = {p.parent.name: json.loads(p.read_text()) for p in out.glob("crashes/*/summary.json")}
    assert {name: (s["status"], s["exit_status"]) for name, s in found.items()} == {
        "killed": ("failed", -9), "segfault": ("failed", -11), "hangs": ("failed", -9),
        "raises": ("failed", 1), "healthy": ("ok", 0)}
    assert found["hangs"]["error"].startswith("timed out after 8 s at step 8")
    assert 8 <= found["hangs"]["metrics"]["wall_s"] < 30


def _command_line(process: psutil.Process) -> str:
    """A process's command line, or "" for one that ended since it was listed (the pre-run
    check's child lives a moment)."""
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def test_an_interrupt_stops_every_running_and_waiting_child(tmp_path):
    path = tmp_path / "hangs.yaml"
    path.write_text(CRASHES.split("variants:")[0] + "variants:\n" + "".join(
        f"  hangs{i}: {{cache: {{layer: {{options: {{how: hang}}}}}}}}\n" for i in range(3)))
    parent = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", str(path), "--jobs", "2", "--timeout", "600",
         "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    children: list[psutil.Process] = []
    while len(children) < 3 and time.monotonic() < deadline:  # two serving, one queued
        time.sleep(0.2)
        children = [c for c in psutil.Process(parent.pid).children(recursive=True)
                    if "spawn_main" in _command_line(c)]
    assert len(children) == 3
    time.sleep(1)
    parent.send_signal(signal.SIGTERM)
    stdout, stderr = parent.communicate(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == [] and parent.returncode == 130
    assert "interrupted" in stderr and "Traceback" not in stderr + stdout
    assert not [p for p in (tmp_path / "out").rglob(".*") if p.name != ".kvmem.lock"]
