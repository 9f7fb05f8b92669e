"""The scenario format's JSON Schema: what `kvmem schema` writes, the copy kvmem ships beside its
bundled scenarios (which name it on their first line), and what it tells an editor: every
bundled scenario validates, and a mistake is found at its field."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml
from jsonschema.exceptions import best_match

from harness.cli import main
from harness.scenario.file_schema import NAME, SHIPPED, file_schema, render
from harness.scenario.load import ScenarioError, definitions

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))
FIRST_LINE = f"# yaml-language-server: $schema={NAME}\n"
VALIDATOR = jsonschema.Draft202012Validator(file_schema())
BASE = "model: qwen3-8b\nworkload: {requests: [{prompt: 16}]}\n"


def test_the_shipped_schema_is_what_kvmem_schema_prints(capsys):
    """Regenerate it after a change to the scenario models with
    `kvmem schema -o scenarios/kvmem-scenario.schema.json`."""
    assert main(["schema"]) == 0
    assert capsys.readouterr().out == render() == SHIPPED.read_text()


def test_kvmem_schema_writes_a_file_whole_and_a_file_it_cannot_write_is_bad_input(tmp_path,
                                                                                   capsys):
    out = tmp_path / "kvmem.schema.json"
    assert main(["schema", "-o", str(out)]) == 0
    assert out.read_text() == render() and capsys.readouterr().out == f"wrote {out}\n"
    assert main(["schema", "-o", str(tmp_path)]) == 2
    assert f"{tmp_path}: cannot write" in capsys.readouterr().err


def test_the_schema_is_a_valid_json_schema_naming_every_field():
    jsonschema.Draft202012Validator.check_schema(file_schema())
    defs = file_schema()["$defs"]
    assert defs["DetectSpec"]["additionalProperties"] is False
    assert file_schema()["properties"]["engine"]["enum"] == ["synthetic", "mlx_lm", "server"]


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_each_bundled_scenario_names_the_schema_and_validates(path):
    text = path.read_text()
    assert text.startswith(FIRST_LINE)
    assert [e.message for e in VALIDATOR.iter_errors(yaml.safe_load(text))] == []


@pytest.mark.parametrize("text, where, message", [
    ("detect: {leek: {min_bytes: 1 KiB}}\n", ["detect"], "'leek' was unexpected"),
    ("engine: mlx\n", ["engine"], "'mlx' is not one of ['synthetic', 'mlx_lm', 'server']"),
    ("workload: {requests: [{prompt: many}]}\n", ["workload", "requests", 0, "prompt"],
     "'many' is not of type 'integer'"),
    ("detect: {leak: {min_bytes: 64 KB/s}}\n", ["detect", "leak", "min_bytes"],
     "'64 KB/s' does not match"),
    ("variants: {after: {expect: {leak: maybe}}}\n", ["variants", "after", "expect", "leak"],
     "'maybe' is not one of ['none', 'detected']"),
])
def test_a_mistake_fails_the_schema_at_its_field_as_kvmem_refuses_it(tmp_path, text, where,
                                                                     message):
    error = best_match(VALIDATOR.iter_errors(yaml.safe_load(BASE + text)))
    assert list(error.absolute_path) == where and message in error.message
    path = tmp_path / "s.yaml"
    path.write_text(BASE + text)
    with pytest.raises(ScenarioError):
        definitions(path)


def test_sizes_durations_and_a_model_preset_are_written_as_kvmem_reads_them():
    text = ("model: qwen3-8b\ndetect: {leak: {min_bytes: 64 KiB}, drift: {rate: 5 MiB/s}}\n"
            "workload: {requests: [{prompt: 16}]}\nexpect: {peak: 1.5 GiB, overhead: 1.2}\n")
    assert list(VALIDATOR.iter_errors(yaml.safe_load(text))) == []
