"""`kvmem gate pr`, round two: on the scratch repository of tests/test_gate_pr.py, each way a
pull request could choose how it is judged (the backend its summaries name, what its scenario
measures, a baseline ratcheted inside its tolerance, a spread of its own, a scenario moved out
of the checked path, a variant renamed) fails the check with its cause in the comment; the
comment escapes what the pull request wrote, and is written even when the head cannot start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path, PurePosixPath

from harness.common.units import MiB
from tests import test_gate_pr as scratch
from tests.test_gate_pr import AFTER, FILE, commit, edit, failing, gate, git, init_repository

# The scratch repository and a pull request's branch of it.
recorded, branch = scratch.recorded, scratch.branch


def head_reports(change, to: str = "reports-head") -> Path:
    """The main branch's reports as the head's, each summary.json passed through `change`."""
    shutil.copytree("reports-main", to)
    for path in Path(to).rglob("summary.json"):
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data, indent=1))
    return Path(to)


def regress(by: int = 2 * MiB) -> None:
    """The main branch's `after` baseline recorded `by` lower, and the pull request's branch
    started again from there: its runs (the main branch's reports, as they are: a summary
    rewritten is tampering, harness.gate.rejudge) hold `by` more than their baseline, a real
    regression (`by` < 0: an improvement)."""
    git("checkout", "-q", "main")
    data = json.loads(AFTER.read_text())
    for name in ("peak", "steady", "final"):
        data["metrics"][name] -= by
    AFTER.write_text(json.dumps(data, indent=2) + "\n")
    commit("the baseline moved")
    git("checkout", "-q", "-B", "pr")


def test_a_head_naming_another_backend_fails_instead_of_being_new(branch):
    def rename(data: dict) -> None:
        data["environment"]["backend"] = "cpu-x86_64"

    regress()

    code, comment, result = gate("--from", str(head_reports(rename)))
    assert code == 1
    assert comment.splitlines()[1] == "### 🔴 kvmem: memory regression in 2 of 2 variants; 2 failed"
    assert ("the head's run reports backend cpu-x86_64; this check judges backend cpu (gate pr "
            "--backend), so it is compared with nothing and fails") in comment
    # The base's variants, still defined in the head, answer for themselves: failed, not removed.
    assert [e["state"] for e in result["entries"]] == ["failed"] * 2
    assert "new" not in comment.lower().split("###")[1].splitlines()[0]


def test_a_changed_workload_is_a_change_to_the_yardstick(branch):
    edit("    - {prompt: 300, decode: 8}\n", "")            # one request fewer: less memory
    commit("a lighter workload")
    code, comment, _ = gate()
    assert code == 1
    rows = failing(comment)
    assert ("| `gate_pr/after` | scenario workload.requests\\[2\\].prompt | 300 | (none) | "
            "loosens the check: needs the `memory-accepted` label |  |  |") in rows
    assert ("| `gate_pr/before` | scenario workload.requests\\[2\\].decode | 8 | (none) | "
            "loosens the check: needs the `memory-accepted` label |  |  |") in rows


def test_a_baseline_ratcheted_inside_its_tolerance_needs_the_acceptance(branch):
    data = json.loads(AFTER.read_text())
    spike = data["metrics"]["largest_spike"]
    data["metrics"]["largest_spike"] = spike + 64 * 1024   # under the 672 KiB tolerance
    data["recorded"]["reason"] = "noise"
    AFTER.write_text(json.dumps(data, indent=2) + "\n")
    commit("re-record")
    code, _, result = gate("--from", "reports-main")
    assert code == 1
    change = next(c for c in result["changes"] if c["what"] == "baseline largest_spike")
    assert (change["loosens"], change["status"]) == (True, "needs acceptance")
    assert change["new"] != change["old"]
    assert gate("--from", "reports-main", "--accept")[0] == 0


def test_a_spread_the_head_reports_does_not_widen_its_tolerance(branch):
    def noisy(data: dict) -> None:
        if data["variant"] == "after":
            peak = data["metrics"]["peak"]
            data["noise"] = {"runs": 5, "nondeterministic": {}, "passed": 5,
                             "peak": {"min": peak - 8 * MiB, "max": peak, "spread": 8 * MiB,
                                      "values": [peak] * 4 + [peak - 8 * MiB]}}

    regress()
    code, comment, result = gate("--from", str(head_reports(noisy)))
    assert code == 1
    after = next(e for e in result["entries"] if e["variant"] == "after")
    assert after["metrics"]["peak"]["verdict"] == "regression"
    assert "measured spread" not in comment


def test_a_scenario_moved_into_a_subfolder_stays_judged(branch):
    regress()
    Path("scenarios/more").mkdir()
    git("mv", str(FILE), "scenarios/more/gate_pr.yaml")
    commit("move the scenario")

    def moved(data: dict) -> None:
        data["scenario_file"] = "scenarios/more/gate_pr.yaml"

    reports = head_reports(moved)
    for paths in ([], ["scenarios/more"]):
        code, comment, _ = gate("--from", str(reports), *paths)
        assert code == 1, paths
        assert comment.splitlines()[1] == "### 🔴 kvmem: memory regression in 1 of 2 variants"


def test_a_renamed_variant_is_compared_with_the_old_one_and_named_with_its_code_points(branch):
    regress()
    edit("  after: {}", "  \u0430fter: {}")                  # a Cyrillic а
    commit("rename")

    def renamed(data: dict) -> None:
        if data["variant"] == "after":
            data["variant"] = "\u0430fter"

    code, comment, result = gate("--from", str(head_reports(renamed)))
    assert code == 1
    assert comment.splitlines()[1] == "### 🔴 kvmem: memory regression in 1 of 2 variants"
    assert "renamed from gate_pr/after" in comment
    assert "`gate_pr/\u0430fter` (U+0430 CYRILLIC SMALL LETTER A)" in comment
    change = next(c for c in result["changes"] if c["what"] == "variant name")
    assert (change["old"], change["loosens"]) == ("gate_pr/after", False)


def test_an_expectation_the_head_no_longer_records_fails_as_a_rewritten_summary(branch):
    def dropped(data: dict) -> None:
        if data["variant"] == "before":
            data["expectations"] = [e for e in data["expectations"] if e["name"] != "retained"]

    code, comment, _ = gate("--from", str(head_reports(dropped)))
    assert code == 1
    # The judge checks the expectations the head's scenario file states against the rows.
    assert ("`gate_pr/before` (summary.json says 10 expectations held; its rows give 11 "
            "expectations held: judged from the rows") in comment


def test_what_the_pull_request_wrote_is_escaped_in_the_comment(branch):
    data = json.loads(AFTER.read_text())
    data["metrics"]["largest_spike"] += 1024
    data["recorded"]["reason"] = "<!-- the rest is hidden | [link](x)\nsecond line"
    AFTER.write_text(json.dumps(data, indent=2) + "\n")
    commit("re-record")
    _, comment, _ = gate("--from", "reports-main")
    assert comment.count("<!--") - comment.count("\\<!--") == 1    # the marker alone
    assert "\\<!-- the rest is hidden \\| \\[link\\](x) second line" in comment


def test_a_head_that_cannot_start_still_gets_a_comment(branch):
    Path("crashing.py").write_text("raise RuntimeError('broken at import')\n")
    edit("  after: {}", "  after: {}\n  crash:\n    cache: {layer: {component: \"crashing:Cache\"}}")
    commit("a component that crashes at import")
    code, comment, result = gate()
    assert code == 2
    assert comment.splitlines()[1].startswith("### 🔴 kvmem: the head failed to run")
    assert "broken at import" in comment
    assert result["verdict"] == "regression"


def test_a_genuinely_improved_branch_still_passes(branch):
    regress(-256 * 1024)
    code, comment, result = gate("--from", "reports-main")
    assert code == 0
    assert comment.splitlines()[1] == "### 🟢 kvmem: memory improved in 1 variant, no regression"
    assert result["changes"] == []


HOST_SCENARIO = """\
name: gate_host
description: A store whose copies outside MLX are what the pull request changes.
model: {dtype: float16, vocab: 1024, layers: [{count: 4, kind: full, kv_heads: 4, head_dim: 64}]}
cache:
  store: {component: "hoststore:Store"}
workload:
  prefill_chunk: 128
  requests: [{prompt: 248, decode: 8, repeat: 20}]
"""
HOST_STORE = """\
from tests.fixtures.host_store import NumpyCopyStore

KEEP = False  # a copy of each request's keys and values is made; kept only where True


class Store(NumpyCopyStore):
    def __init__(self, geometry):
        super().__init__(geometry, keep=KEEP)
"""


def test_a_store_that_keeps_a_host_copy_of_every_request_fails_the_gate(tmp_path, monkeypatch):
    """Under the 32 MiB floor and the 64 MiB RSS floor: 1 MiB a request over 20 requests, with
    no change to the scenario, only to the store's code."""
    monkeypatch.chdir(tmp_path)
    init_repository()
    Path("scenarios").mkdir()
    Path("scenarios/gate_host.yaml").write_text(HOST_SCENARIO)
    Path("hoststore.py").write_text(HOST_STORE)
    Path(".gitignore").write_text("reports*/\nkvmem-gate/\n__pycache__/\n")
    assert scratch.cli("run", "scenarios", "--out", "reports-main") == 0
    assert scratch.cli("baseline", "update", "--reason", "first record", "--from",
                       "reports-main") == 0
    commit("scenario, store and baselines")
    git("checkout", "-q", "-b", "pr")
    Path("hoststore.py").write_text(HOST_STORE.replace("KEEP = False", "KEEP = True"))
    commit("keep the copies")
    code, comment, result = gate()
    assert code == 1
    assert comment.splitlines()[1] == "### 🔴 kvmem: memory regression in 1 of 1 variant"
    assert "expectation `host_memory` fails: expected none, got detected" in comment
    assert "process memory outside MLX grows" in comment
    assert result["changes"] == []                          # the scenario did not change


def test_an_unknown_backend_is_bad_input(branch, capsys):
    assert scratch.cli("gate", "pr", "--base", "main", "--backend", "metla") == 2
    assert "invalid choice: 'metla' (choose from 'cpu', 'metal', 'cuda')" in capsys.readouterr().err


def test_what_a_scenario_asks_is_read_whole_and_quietly():
    """The judge's reading of a scenario file keeps a spike bound as the mapping it is (a
    tagged union once serialized it as a presence, with a warning on every gate run)."""
    import warnings

    from harness.gate.definition import read

    root = Path(__file__).resolve().parent.parent
    notes: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = read([Path("scenarios/qwen3_8b_growth.yaml")],
                     lambda f: (root / f).read_bytes(), notes, "head")
    assert notes == []
    assert found[("qwen3_8b_growth", "kvcache")]["expect"]["spike"] == {"max_ratio": 2.2}


def test_a_trace_edited_by_the_pull_request_is_a_change_to_what_is_measured(tmp_path):
    """The requests a scenario replays live in its trace file: the judge reads the file on each
    side and names it with a digest of its bytes, so editing the trace is listed as editing the
    phases would be."""
    from harness.gate.definition import differences, read

    scenario = (b"name: replay\nengine: server\nmodel: qwen3-tiny\n"
                b"workload: {http: {trace: traces/t.jsonl, rate: 2/s}}\n")
    base = {"scenarios/replay.yaml": scenario, "scenarios/traces/t.jsonl": b'{"prompt": "a"}\n'}
    head = {**base, "scenarios/traces/t.jsonl": b'{"prompt": "a much longer prompt"}\n'}
    sides = [read([PurePosixPath("scenarios/replay.yaml")],
                  lambda f, files=files: files.get(str(f)), [], side)
             for files, side in ((base, "base"), (head, "head"))]
    old, new = (side[("replay", "default")] for side in sides)
    ((field, before, after),) = differences(old, new)
    assert field == "workload.http.trace"
    assert before.startswith('"scenarios/traces/t.jsonl (sha256 ') and before != after
    gone = read([PurePosixPath("scenarios/replay.yaml")],
                lambda f: scenario if str(f).endswith(".yaml") else None, [], "head")
    assert gone[("replay", "default")]["workload"]["http"]["trace"] == \
        "scenarios/traces/t.jsonl (missing)"
