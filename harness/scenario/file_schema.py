"""The scenario file's JSON Schema, for editors: what `kvmem schema` writes, and what kvmem
ships beside its bundled scenarios (SHIPPED), which name it on their first line for the YAML
language server (`# yaml-language-server: $schema=kvmem-scenario.schema.json`).

It is ScenarioSpec's own schema with what a file adds around it: `variants`, each a partial
scenario deep-merged into the base, and no field required (a variant may give what the base
leaves out; kvmem names what a merged variant lacks). Types, ranges, names and unknown keys
are checked as kvmem checks them; what depends on other fields (a sliding layer's window, the
engine's model) is kvmem's alone.
"""

from __future__ import annotations

import json
from typing import Any

from .packaged import BUNDLED
from .schema import ScenarioSpec

NAME = "kvmem-scenario.schema.json"
SHIPPED = BUNDLED / NAME  # regenerate: kvmem schema -o scenarios/kvmem-scenario.schema.json
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _optional(node: Any) -> None:
    """Every object schema below `node` with no required field."""
    if isinstance(node, dict):
        if "properties" in node:
            node.pop("required", None)
        for value in node.values():
            _optional(value)
    elif isinstance(node, list):
        for value in node:
            _optional(value)


def file_schema() -> dict[str, Any]:
    """The JSON Schema of a scenario file."""
    schema = ScenarioSpec.model_json_schema()
    _optional(schema)
    schema["$defs"]["Variant"] = {
        "type": "object", "additionalProperties": False, "properties": dict(schema["properties"]),
        "description": "Overrides deep-merged into the scenario: a mapping merges into the "
                       "base's, anything else replaces it; naming another component replaces "
                       "its options too."}
    schema["properties"]["variants"] = {
        "type": "object", "description": "Named variants (a \"before\" and an \"after\"), each "
                                         "run as its own process; none: one named default.",
        "additionalProperties": {"anyOf": [{"$ref": "#/$defs/Variant"}, {"type": "null"}]}}
    return {"$schema": DIALECT, **schema, "title": "kvmem scenario"}


def render() -> str:
    """The schema as `kvmem schema` prints it and SHIPPED holds it."""
    return json.dumps(file_schema(), indent=2) + "\n"
