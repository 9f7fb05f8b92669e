"""Bad input never passes and never shows a traceback: exit 2, one line naming file and field.

`tests/data/bad_scenarios/` holds one malformed scenario per file. A text file's first line,
`# expect: <text>`, is what its error message must contain; files that are not UTF-8 text (or
hold characters YAML refuses) are listed in `EXPECTED.json` instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harness.cli
from harness.cli import main
from harness.common.units import MiB
from harness.components import registry as components
from harness.gate import compare
from harness.judge import metrics
from harness.scenario import ScenarioError
from harness.scenario import load_variants as load
from tests import summaries as gate_summaries
from tests.signals import interruptible

CORPUS = Path(__file__).parent / "data" / "bad_scenarios"
EXPECTED = json.loads((CORPUS / "EXPECTED.json").read_text(encoding="utf-8"))
FILES = sorted(p for p in CORPUS.iterdir() if p.suffix == ".yaml")
VALID = Path(__file__).parent.parent / "scenarios" / "qwen3_8b_growth.yaml"


def expectation(path: Path) -> str:
    if path.name in EXPECTED:
        return EXPECTED[path.name]
    first = path.read_text(encoding="utf-8").split("\n", 1)[0]
    assert first.startswith("# expect: "), f"{path.name}: no '# expect:' line"
    return first.removeprefix("# expect: ")


def test_the_corpus_holds_sixty_files_or_more_each_with_an_expectation():
    assert len(FILES) >= 60
    assert set(EXPECTED) <= {p.name for p in FILES}
    assert all(expectation(p) for p in FILES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_run_exits_2_with_one_line_naming_the_file_and_field(path, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    message = captured.err.strip()
    assert len(message.splitlines()) == 1, message
    assert message.startswith("error: ") and str(path) in message, message
    assert expectation(path) in message, message
    assert not out.exists()  # refused before anything ran


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_load_raises_a_scenario_error_naming_the_file(path):
    with pytest.raises(ScenarioError) as error:
        load(path)
    assert str(error.value).startswith(f"{path}: ")
    assert str(error.value).isprintable()  # one line, control characters escaped


class WideConsole(harness.cli.Console):
    """The CLI's console, wide enough that a table row is one line."""

    def __init__(self, *args, **kwargs):
        if not kwargs.get("stderr"):
            kwargs["width"] = 5000
        super().__init__(*args, **kwargs)


def test_list_shows_every_bad_file_as_invalid(capsys, monkeypatch):
    monkeypatch.setattr(harness.cli, "Console", WideConsole)
    assert main(["list", "--dir", str(CORPUS)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    rows = {line.split("│")[1].strip(): line for line in captured.out.splitlines()
            if line.count("│") >= 3}
    for path in FILES:
        assert path.name in rows, path.name
        assert "invalid" in rows[path.name], rows[path.name]


def test_run_over_the_whole_corpus_stops_at_the_first_bad_file(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(CORPUS), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert str(FILES[0]) in captured.err and "Traceback" not in captured.err
    assert not out.exists()


@pytest.mark.parametrize("text, check", [
    ("name: qwen3_8b_growth\nworkload: {requests: [{prompt: 16}]}\n",
     lambda s: s[0].scenario == "qwen3_8b_growth"),
    ("name: trim-slice\nworkload: {requests: [{prompt: 16}]}\n", lambda s: s[0].scenario == "trim-slice"),
    ("name: q8.threshold\nworkload: {requests: [{prompt: 16}]}\n", lambda s: s[0].scenario == "q8.threshold"),
    ("name: größe_ü\nworkload: {requests: [{prompt: 16}]}\n", lambda s: s[0].scenario == "größe_ü"),
    (f"name: {'n' * 100}\nworkload: {{requests: [{{prompt: 16}}]}}\n", lambda s: len(s[0].scenario) == 100),
    ("workload: {requests: [{prompt: 2147483647, decode: 0, repeat: 1}]}\nsampling: {seed: 4294967295}\n",
     lambda s: s[0].spec.sampling.seed == 2**32 - 1),
    ("workload: {requests: [{prompt: 16}]}\nvariants: {}\n", lambda s: [v.name for v in s] == ["default"]),
    ("workload: {requests: [{prompt: 16}]}\nvariants:\n", lambda s: [v.name for v in s] == ["default"]),
    ("workload: {requests: [{prompt: 16}]}\nvariants: {q8.threshold: {}, trim-slice: ~}\n",
     lambda s: [v.name for v in s] == ["q8.threshold", "trim-slice"]),
    ("workload: {requests: [{prompt: 16}]}\ndetect: {spike: {min_ratio: 2, min_bytes: 1.5 KiB}}\n",
     lambda s: s[0].spec.detect.spike.min_ratio == 2.0 and s[0].spec.detect.spike.min_bytes == 1536),
    ("workload: {requests: [{prompt: 16}]}\nexpect: {peak: 8 PiB}\n".replace("8 PiB", str(2**53)),
     lambda s: s[0].spec.expect.peak == 2**53),
    ("workload: {requests: [{prompt: 16}]}\nexpect: {compare: {rss_peak: {rel: 0.1, abs: 64 MiB}}}\n",
     lambda s: s[0].spec.expect.compare["rss_peak"].abs == 64 * MiB),
    ("defaults: &d {prompt: 16, decode: 2}\n", None),  # an unknown field, even as an anchor holder
    ("workload:\n  requests:\n    - &r {prompt: 16, decode: 2}\n    - {<<: *r, decode: 4}\n",
     lambda s: s[0].spec.workload.requests[1].decode == 4),  # a merge key may be overridden
    ("\ufeffworkload: {requests: [{prompt: 16}]}\n", lambda s: len(s) == 1),  # UTF-8 with a BOM
], ids=["snake", "dash", "inner_dot", "unicode", "100_chars", "bounds_inclusive", "empty_variants",
        "null_variants", "dotted_variant", "int_ratio", "size_bound", "compare_metric",
        "anchor_field", "merge_override", "utf8_bom"])
def test_strict_loading_keeps_what_is_fine(tmp_path, text, check):
    path = tmp_path / "good.yaml"
    bom, text = ("\ufeff", text[1:]) if text.startswith("\ufeff") else ("", text)
    path.write_text(bom + "model: qwen3-8b\n" + text, encoding="utf-8")
    if check is None:
        with pytest.raises(ScenarioError, match="defaults: unknown field"):
            load(path)
    else:
        assert check(load(path))


def summary(**changes) -> dict:
    data = {"schema": 1, "scenario": "s", "variant": "v", "status": "ok", "error": None,
            "metrics": {"peak": MiB, "steady": 2**19}, "findings": [], "expectations": [],
            "passed": True, "environment": {"backend": "cpu"}}
    data.update(changes)
    return {k: v for k, v in data.items() if v is not ...}


BAD_SUMMARIES = {
    "binary": (b"\x89PNG\r\n\x1a\n\x00\xff", "not UTF-8 text"),
    "utf16": (json.dumps(summary()).encode("utf-16"), "not UTF-8 text"),
    "empty": (b"", "corrupt JSON"),
    "truncated": (json.dumps(summary()).encode()[:-5], "corrupt JSON"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "not a valid summary (JSON nested too deeply)"),
    "deep_object": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "JSON nested too deeply"),
    "nan_peak": (b'{"schema": 1, "scenario": "s", "variant": "v", "status": "ok", "metrics": {"peak": NaN}, '
                 b'"environment": {"backend": "cpu"}}',
                 "metrics.peak: expected a finite number, got NaN"),
    "object_a1": (b'{"a": 1}', "unsupported summary schema null, expected 1"),
    "list": (b"[1]", "not a valid summary (expected a JSON object)"),
    "string": (b'"summary"', "not a valid summary (expected a JSON object)"),
    "no_scenario": (summary(scenario=...), "scenario: expected the scenario's name, got nothing"),
    "no_variant": (summary(variant=...), "variant: expected the variant's name, got nothing"),
    "no_status": (summary(status=...), "status: expected the run's status (ok, failed, "
                                       "refused or interrupted), got nothing"),
    "no_metrics": (summary(metrics=...), "metrics: expected an object of metrics, got nothing"),
    "scenario_number": (summary(scenario=5), "scenario: expected the scenario's name, got 5"),
    "metrics_list": (summary(metrics=[1]), "metrics: expected an object of metrics, got [1]"),
    "peak_text": (summary(metrics={"peak": "big"}), 'metrics.peak: expected a finite number, got "big"'),
    "findings_dict": (summary(findings={}), "findings: expected a list"),
    "finding_no_kind": (summary(findings=[{"message": "m"}]), "findings.0.kind: expected text, "
                                                              "got nothing"),
    "expectation_no_ok": (summary(expectations=[{"name": "peak"}]), "expectations.0.ok"),
    "passed_text": (summary(passed="yes"), "passed: expected true or false"),
    "error_number": (summary(status="failed", error=7), "error: expected text"),
    "no_environment": (summary(environment=...), "environment: expected an object of the run's "
                                                 "backend and versions, got nothing"),
    "no_backend": (summary(environment={"mlx": "0.32.4"}), "environment.backend: expected the "
                   "backend's name (cpu, metal or cuda), got nothing"),
    "mlx_number": (summary(environment={"backend": "cpu", "mlx": 0.32}),
                   "environment.mlx: expected text, got 0.32"),
    "expectation_name_mapping": (summary(expectations=[{"name": {"a": 1}, "ok": True}]),
                                 'expectations.0.name: expected text, got {"a": 1}'),
}


@pytest.mark.parametrize("case", sorted(BAD_SUMMARIES))
def test_show_exits_2_on_a_bad_summary_naming_the_file(case, tmp_path, capsys):
    content, expected = BAD_SUMMARIES[case]
    path = tmp_path / "run" / "s" / "v" / "summary.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    for target in (path, tmp_path / "run"):  # the file, and a report folder holding it
        assert main(["show", str(target)]) == 2
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err + captured.out
        message = captured.err.strip()
        assert len(message.splitlines()) == 1, message
        assert str(path) in message and expected in message, message


def test_show_prints_a_summary_whose_text_looks_like_markup(tmp_path, capsys):
    path = tmp_path / "summary.json"
    data = summary(scenario="[/bold]", status="failed", error="[/red] died",
                   findings=[{"kind": "leak", "count": 1, "message": "[/] 1 B per request"}])
    path.write_text(json.dumps(data))
    assert main(["show", str(path)]) == 2  # a failed run
    captured = capsys.readouterr()
    assert "[/] 1 B per request" in captured.out and "Traceback" not in captured.err
    assert captured.err == ""


def test_show_on_an_empty_folder_exits_2(tmp_path, capsys):
    assert main(["show", str(tmp_path)]) == 2
    assert f"{tmp_path}: no summaries found" in capsys.readouterr().err


def test_the_schema_and_the_gate_know_the_same_metrics():
    assert compare.METRICS == metrics.METRICS


# Byte-level fuzzing of the loader: whatever the bytes, load() returns or raises ScenarioError.

def _names_a_user_component(data: bytes) -> bool:
    """Whether the bytes, read as YAML, name a component outside kvmem's registry: loading it
    would import user code in a child process, which is slow and not what this test is about."""
    try:
        document = yaml.safe_load(data.decode("utf-8"))
    except Exception:
        return False  # the loader refuses it before any component is resolved
    stack, seen = [document], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            component = node.get("component")
            if component is not None and (not isinstance(component, str)
                                          or component not in components.REGISTRY):
                return True
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _mutate(text: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    data = bytearray(text)
    for kind, position, byte in edits:
        at = position % (len(data) + 1)
        if kind == 0:
            data.insert(at, byte)
        elif kind == 1 and data:
            del data[min(at, len(data) - 1)]
        elif data:
            data[min(at, len(data) - 1)] = byte
    return bytes(data)


# Bytes that matter to YAML and to the schema, more often than chance would pick them.
SPECIAL = st.sampled_from(b":-{}[],&*!|>'\"#%@`\n\t 0123456789.~\x00\xff\xfe\xc3")
edits = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10_000),
                           st.one_of(st.integers(0, 255), SPECIAL)), min_size=1, max_size=8)
fuzz = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.filter_too_much])


def _load_or_scenario_error(path: Path, data: bytes) -> None:
    if _names_a_user_component(data):
        return
    path.write_bytes(data)
    try:
        load(path)
    except ScenarioError as exc:
        assert str(exc).startswith(f"{path}: ") and str(exc).isprintable()


@fuzz
@given(data=st.binary(max_size=400))
def test_random_bytes_load_or_fail_with_a_scenario_error(tmp_path, data):
    _load_or_scenario_error(tmp_path / "r.yaml", data)


@fuzz
@given(edits=edits)
def test_mutated_scenarios_load_or_fail_with_a_scenario_error(tmp_path, edits):
    _load_or_scenario_error(tmp_path / "m.yaml", _mutate(VALID.read_bytes(), edits))


@fuzz
@given(edits=edits, index=st.integers(0, len(FILES) - 1))
def test_mutated_bad_scenarios_load_or_fail_with_a_scenario_error(tmp_path, edits, index):
    _load_or_scenario_error(tmp_path / "b.yaml", _mutate(FILES[index].read_bytes(), edits))


def test_a_valid_scenario_survives_the_mutation_helper_unchanged():
    text = VALID.read_bytes()
    assert _mutate(text, []) == text
    assert len(load(VALID)) == 2 and not _names_a_user_component(text)


# Every echoed value is clipped: a mistaken 100,000-character value never makes a 100 KB line.

HUGE = "x" * 100_000
CLIPPED = {
    "preset": (f"model: {HUGE}\n", f"model.preset: unknown preset '{'x' * 40}...'"),
    "component": (f"model: qwen3-8b\ncache: {{layer: {{component: {HUGE}}}}}\n",
                  f"cache.layer.component: unknown component '{'x' * 40}...'"),
    "import_path": (f"model: qwen3-8b\ncache: {{layer: {{component: '{HUGE}:f'}}}}\n",
                    f"cache.layer.component: cannot import module '{'x' * 40}...'"),
    "model_path": (f"engine: mlx_lm\nmodel: {{path: {HUGE}}}\n",
                   f"model: path: cannot read '{'x' * 40}...': File name too long"),
    "unknown_key": (f"model: qwen3-8b\nsampling:\n  {HUGE[:1000]}: 1\n",
                    f"sampling.{'x' * 40}...: unknown field"),
    "option": (f"model: qwen3-8b\ncache:\n  layer:\n    component: mlx_lm.KVCache\n"
               f"    options:\n      {HUGE[:1000]}: 1\n",
               "cache.layer.options: "),
    "variant_name": (f"model: qwen3-8b\nvariants:\n  {HUGE[:1000]}: {{}}\n",
                     f"variants.'{'x' * 40}...': expected a name of at most 100 characters"),
}


@pytest.mark.parametrize("case", sorted(CLIPPED))
def test_a_huge_value_is_echoed_clipped_on_one_short_line(case, tmp_path, capsys):
    text, expected = CLIPPED[case]
    path = tmp_path / "huge.yaml"
    path.write_text(text + "workload: {requests: [{prompt: 16}]}\n")
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1 and len(message) < 1000, message[:2000]
    assert message.startswith(f"error: {path}: ") and expected in message, message


def test_a_huge_variant_flag_is_echoed_clipped(capsys):
    assert main(["run", str(VALID), "--variant", HUGE]) == 2
    message = capsys.readouterr().err.strip()
    assert f"no variant {'x' * 40}... (expected one of" in message and len(message) < 1000


# Rejecting bad input starts fast: the runner's heavy imports are made where they are used.

HEAVY = ("mlx_lm", "transformers", "matplotlib", "pandas", "numpy")


@pytest.mark.parametrize("argv", [["run", "{bad}"], ["run", "{unknown}"], ["--help"]],
                         ids=["bad_yaml", "unknown_field", "help"])
def test_help_and_a_refused_file_import_neither_mlx_lm_nor_pandas_nor_matplotlib(argv, tmp_path):
    bad, unknown = tmp_path / "bad.yaml", tmp_path / "unknown.yaml"
    bad.write_text("model: [\n")
    unknown.write_text("model: qwen3-8b\nbogus: 1\nworkload: {requests: [{prompt: 16}]}\n")
    argv = [a.format(bad=bad, unknown=unknown) for a in argv]
    code = ("import sys\nfrom harness.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


# Summaries the gate reads: wrong types and missing blocks are bad input in every command.

def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    message = captured.err.strip()
    assert len(message.splitlines()) == 1 and message.startswith("error: "), message
    return message


def _folder(root: Path, *items: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for item in items:
        gate_summaries.write(root, item)
    return root


@pytest.mark.parametrize("side", ["base", "head"])
@pytest.mark.parametrize("case, change, expected", [
    ("mlx_not_a_string", {"environment": {**gate_summaries.ENVIRONMENT, "mlx": {"v": 1}}},
     'not a valid summary (environment.mlx: expected text, got {"v": 1})'),
    ("mlx_lm_not_a_string", {"environment": {**gate_summaries.ENVIRONMENT, "mlx_lm": 33}},
     "not a valid summary (environment.mlx_lm: expected text, got 33)"),
    ("expectation_name_mapping",
     {"expectations": [{"name": {"peak": 1}, "expected": 1, "actual": 1, "ok": True}]},
     'not a valid summary (expectations.0.name: expected text, got {"peak": 1})'),
    ("expectation_name_list",
     {"expectations": [{"name": ["peak"], "expected": 1, "actual": 1, "ok": True}]},
     'not a valid summary (expectations.0.name: expected text, got ["peak"])'),
    ("no_environment", {"environment": None},
     "not a valid summary (environment: expected an object of the run's backend and versions, "
     "got nothing)"),
])
def test_compare_refuses_a_mistyped_summary_on_either_side(tmp_path, capsys, side, case, change,
                                                           expected):
    good = gate_summaries.summary("s", "v", environment={"mlx": "0.33.0"})  # versions differ
    bad = {k: v for k, v in {**gate_summaries.summary("s", "v"), **change}.items()
           if v is not None}
    base = _folder(tmp_path / "base", bad if side == "base" else good)
    head = _folder(tmp_path / "head", bad if side == "head" else good)
    assert main(["compare", str(base), str(head)]) == 2
    message = _one_line_error(capsys)
    assert f"{tmp_path / side / 's' / 'v' / 'summary.json'}: {expected}" in message, message


def test_a_head_whose_summaries_lost_their_environment_fails_the_gate(tmp_path, capsys):
    """It once compared nothing and exited 0: a broken head passed."""
    items = [gate_summaries.summary("s", v) for v in ("a", "b")]
    base = _folder(tmp_path / "base", *items)
    head = _folder(tmp_path / "head", *({k: v for k, v in i.items() if k != "environment"}
                                         for i in items))
    assert main(["compare", str(base), str(head), "--format", "markdown"]) == 2
    assert "environment: expected an object of the run's backend and versions, got nothing" \
        in _one_line_error(capsys)


def test_baseline_update_refuses_summaries_without_an_environment(tmp_path, capsys):
    data = {k: v for k, v in gate_summaries.summary("s", "v").items() if k != "environment"}
    reports = _folder(tmp_path / "reports", data)
    assert main(["baseline", "update", "--reason", "test", "--from", str(reports),
                 "--dir", str(tmp_path / "baselines")]) == 2
    assert "environment: expected an object of the run's backend and versions, got nothing" \
        in _one_line_error(capsys)
    assert not (tmp_path / "baselines").exists()  # nothing filed under a backend named '?'


def test_baseline_update_refuses_two_summaries_of_one_variant(tmp_path, capsys):
    """As compare, export, history and `baseline check` do: which to record cannot be guessed."""
    reports = tmp_path / "reports"
    for shard, peak in (("one", 10), ("two", 20)):
        _folder(reports / shard, gate_summaries.summary("s", "v", peak=peak * gate_summaries.MiB))
    assert main(["baseline", "update", "--reason", "test", "--from", str(reports),
                 "--dir", str(tmp_path / "baselines")]) == 2
    message = _one_line_error(capsys)
    assert (f"two summaries for s/v on backend cpu: {reports / 'one/s/v/summary.json'} and "
            f"{reports / 'two/s/v/summary.json'}") in message
    assert not (tmp_path / "baselines").exists()
    for command in (["compare", str(reports), str(reports)], ["export", str(reports)]):
        assert main(command) == 2
        assert "two summaries for s/v" in _one_line_error(capsys)


# merge reads and checks every input before it writes anything; --out is left as it was.

SAMPLES = "step,phase,active,peak\n0,idle,0,0\n1,prefill,1024,2048\n"


def _shard(root: Path, variants: int, samples: dict[int, bytes]) -> Path:
    """A report folder of `variants` variants of scenario s, each with samples.csv (the bytes
    given for some, sound ones for the others)."""
    for index in range(variants):
        path = gate_summaries.write(root, gate_summaries.summary("s", f"v{index}"))
        (path.parent / "samples.csv").write_bytes(samples.get(index, SAMPLES.encode()))
    return root


@pytest.mark.parametrize("samples, expected", [
    (b"step,phase,active\n0,idle,0\n",
     "not valid samples (lacks peak; expected the columns step, active, peak)"),
    ("step,active,peak\n0,0,0\n1,5,\u00e9\n".encode("latin-1"), "not valid samples (not UTF-8 text)"),
    (b"step,active,peak\n0,0,lots\n", "not valid samples (peak: expected numbers)"),
    (b'step,active,peak\n0,0,"1\n', "not valid samples (Error tokenizing data"),
], ids=["no_peak", "latin1", "text_peak", "unclosed_quote"])
@pytest.mark.parametrize("existing", [False, True], ids=["new_out", "existing_out"])
def test_merge_refuses_bad_samples_before_writing_anything(tmp_path, capsys, samples, expected,
                                                           existing):
    one = _shard(tmp_path / "one", 8, {})
    two = _shard(tmp_path / "two", 0, {})
    gate_summaries.write(two, gate_summaries.summary("t", "w"))
    (two / "t" / "w" / "samples.csv").write_bytes(samples)
    out = tmp_path / "out"
    if existing:
        (out / "old").mkdir(parents=True)
        (out / "old" / "kept.txt").write_text("kept")
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert main(["merge", str(one), str(two), "--out", str(out)]) == 2
    message = _one_line_error(capsys)
    assert f"error: {two / 't' / 'w' / 'samples.csv'}: {expected}" in message, message
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before


# A full disk: the lock file's write is handled like every other write (exit 2, one line).

def _full_disk(monkeypatch) -> None:
    import errno
    import os

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)


def test_merge_into_a_new_out_on_a_full_disk_exits_2(tmp_path, capsys, monkeypatch):
    one = _shard(tmp_path / "one", 2, {})
    _full_disk(monkeypatch)
    assert main(["merge", str(one), "--out", str(tmp_path / "out")]) == 2
    assert _one_line_error(capsys) == (f"error: {tmp_path / 'out'}: cannot write: "
                                       "No space left on device")


def test_run_into_a_new_out_on_a_full_disk_exits_2(tmp_path, capsys, monkeypatch):
    path = tmp_path / "tiny.yaml"
    path.write_text("model: {dtype: float16, vocab: 256, layers: [{count: 1, kind: full, "
                    "kv_heads: 1, head_dim: 32}]}\nworkload: {requests: [{prompt: 8}]}\n")
    _full_disk(monkeypatch)
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    assert _one_line_error(capsys) == (f"error: {tmp_path / 'out'}: cannot write: "
                                       "No space left on device")
    assert [p.name for p in (tmp_path / "out").iterdir()] == [".kvmem.lock"]  # nothing ran


# A corrupt model folder is bad input naming the file, refused before any variant runs.

@pytest.mark.parametrize("keep", [0.5, 20], ids=["truncated_data", "truncated_header"])
def test_a_truncated_safetensors_file_is_bad_input_naming_it(tmp_path, capsys, keep):
    from tests.test_model_engine import tiny_llama_folder

    folder = tmp_path / "model"
    folder.mkdir()
    tiny_llama_folder(folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
    path = tmp_path / "real.yaml"
    path.write_text(f"engine: mlx_lm\nmodel: {{path: '{folder}'}}\n"
                    "workload: {requests: [{prompt: 8, decode: 2}]}\n")
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    message = _one_line_error(capsys)
    assert message.startswith(f"error: {path}: model: {weights}: not a valid safetensors file "
                              "([load_safetensors] "), message
    assert not (tmp_path / "out").exists()


# Two variants that would write one report folder: bad input before anything runs.

TINY = ("model: {dtype: float16, vocab: 256, layers: [{count: 1, kind: full, kv_heads: 1, "
        "head_dim: 32}]}\nworkload: {requests: [{prompt: 8}]}\n")


def test_two_scenario_files_with_one_name_are_refused_before_anything_runs(tmp_path, capsys):
    one, two = tmp_path / "one.yaml", tmp_path / "two.yaml"
    for path in (one, two):
        path.write_text("name: same\n" + TINY)
    assert main(["run", str(one), str(two), "--out", str(tmp_path / "out")]) == 2
    assert _one_line_error(capsys) == (
        f"error: {two}: name: 'same' is also the name of {one}; each scenario needs its own "
        "name (its reports go under <out>/same/)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("twice", [["{f}", "{f}"], ["{d}", "{f}"]], ids=["file", "folder_and_file"])
def test_a_scenario_file_given_twice_is_refused_before_anything_runs(tmp_path, capsys, twice):
    folder = tmp_path / "scenarios"
    folder.mkdir()
    path = folder / "tiny.yaml"
    path.write_text(TINY)
    paths = [t.format(f=path, d=folder) for t in twice]
    for command in (["run", *paths, "--out", str(tmp_path / "out")],
                    ["baseline", "update", "--reason", "test", *paths, "--dir", str(tmp_path / "baselines")]):
        assert main(command) == 2
        assert _one_line_error(capsys) == (
            f"error: {path}: given twice (among the paths, or in a folder given too); each "
            "scenario file runs once")
    assert not (tmp_path / "out").exists() and not (tmp_path / "baselines").exists()


# Ctrl-C at any moment: exit 130 and one line, never a traceback, in the parent or a child.

INTERRUPT_AT_IMPORT = """\
import os, signal, sys
from harness.__main__ import run  # what the kvmem script calls (python -m harness too)

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:  # Ctrl-C while this module is being imported
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

MODULE, sys.argv = sys.argv[1], ["kvmem", *sys.argv[2:]]
sys.meta_path.insert(0, Interrupt())
run()
"""


@pytest.mark.parametrize("module", ["harness.cli", "rich.console", "harness.scenario.schema",
                                    "harness.gate.render", "harness.pipeline.suite"])
def test_ctrl_c_while_the_command_line_imports_is_one_line_and_130(tmp_path, module):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    done = subprocess.run([sys.executable, "-c", INTERRUPT_AT_IMPORT, module, "run", str(path),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent, preexec_fn=interruptible)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert len(done.stderr.strip().splitlines()) == 1 and "interrupted" in done.stderr


# In the variant's child only: Ctrl-C (a terminal sends it to the whole process group) while the
# child is still importing the runner, before any of kvmem's code runs there.
CHILD_SITECUSTOMIZE = """\
import os, signal, sys

if "--multiprocessing-fork" in sys.argv:
    class Interrupt:
        def find_spec(self, name, path=None, target=None):
            if name == "harness.pipeline.isolation":
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGINT)
            return None

    sys.meta_path.insert(0, Interrupt())
"""


def test_a_variant_process_is_deaf_to_ctrl_c_while_it_imports(tmp_path):
    """Deaf from its first instruction, not once its imports end: it once printed a
    KeyboardInterrupt traceback. (The parent decides: with the whole group interrupted, the
    parent stops the run, exit 130, as the signal tests of test_isolation show.)"""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(CHILD_SITECUSTOMIZE)
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "site"), str(root), os.environ.get("PYTHONPATH", "")])}
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    done = subprocess.run([sys.executable, "-m", "harness", "run", str(path), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, env=env,
                          cwd=root, timeout=120)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("argv, expected", [
    (["run", "scenarios", "--shard", "1/99999999999999999999"],
     "error: kvmem run: argument --shard: expected I/N with whole numbers 1 <= I <= N <= 1000, "
     "got '1/99999999999999999999'"),
    (["compare", "a", "b", "--format", HUGE], "error: kvmem compare: argument --format: invalid "
                                              f"choice: '{'x' * 50}"),
    (["run", "scenarios", "--jobs", "9" * 5000], "error: kvmem run: argument --jobs: expected a "
                                                 "whole number of jobs from 1 to 1024, got '999"),
    ([], "error: kvmem: the following arguments are required: command"),
], ids=["shard_huge_n", "format_huge", "jobs_many_digits", "no_command"])
def test_a_mistake_in_the_arguments_is_one_short_line_and_exit_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    message = _one_line_error(capsys)
    assert message.startswith(expected) and len(message) < 500, message[:1000]
