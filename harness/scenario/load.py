"""Reading scenario files: strict YAML, variants merged into the base, then the schema.

Variants are named overrides deep-merged into the base, so one file carries a "before" and an
"after". Every error names the file, the field path and what was expected, on one line.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..common.echo import MAX_ECHO, clip, echo
from ..common.errors import BadInput
from ..common.units import MiB
from ..components.registry import Binding
from ..components.registry import check as check_components
from ..models import loading as models
from . import checks, trace
from .schema import AS_DATA, ScenarioSpec, check_name


@dataclass(frozen=True)
class Variant:
    """One runnable variant of a scenario file: its name and its fully merged spec."""

    path: Path
    name: str
    spec: ScenarioSpec
    # Installed packages (distribution -> version) that the file's user components loaded in
    # the pre-run check: their bounds on mlx and mlx-lm are checked, and summaries record them.
    packages: dict[str, str] = field(default_factory=dict)
    override: bool = False  # the variant overrides the base (errors then name the variant)

    @property
    def scenario(self) -> str:
        return self.spec.name

    @property
    def label(self) -> str:
        return f"{self.scenario}/{self.name}"


class ScenarioError(BadInput):
    """Bad scenario input; the message names the file and the field."""


def _merge(base: dict, override: dict) -> dict:
    """Deep-merge a variant into the base; naming another component replaces its options too."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        switches = (isinstance(value, dict) and isinstance(merged.get(key), dict)
                    and value.get("component", merged[key].get("component"))
                    != merged[key].get("component"))
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and not switches:
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


_UNION_TAGS = ("scalar", "mapping", "list")


def _field_path(loc: tuple) -> str:
    # pydantic adds the union member's tag to the location, and `[key]` when a mapping's key
    # (not its value) is wrong; the user never wrote either.
    parts = [clip(str(p), MAX_ECHO) for p in loc if p not in _UNION_TAGS and p != "[key]"]
    return ".".join(parts) or "(top level)"


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"{_field_path(item['loc'])}: {message}")
    return "; ".join(dict.fromkeys(lines))


def _validate(raw: dict, as_data: bool = False) -> ScenarioSpec:
    try:
        return ScenarioSpec.model_validate(raw, context={AS_DATA: as_data})
    except ValidationError as exc:
        raise ScenarioError(_describe(exc)) from None


MAX_FILE_BYTES = 8 * MiB
MAX_DEPTH = 64  # mappings and lists within one another; a scenario needs about 6


class _Loader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader, made strict where it is silent or crashes.

    A key given twice in one mapping is an error (safe_load keeps the last); nesting deeper
    than MAX_DEPTH is an error (not a RecursionError); a value its explicit tag cannot
    construct (`!!int abc`, `!!bool maybe`, `!!timestamp x`) is a YAML error with its line
    (not a ValueError, KeyError or TypeError from inside PyYAML).
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except Exception:
            tag = str(node.tag).replace("tag:yaml.org,2002:", "!!")
            value = node.value if isinstance(node, yaml.ScalarNode) else node.id
            raise yaml.constructor.ConstructorError(
                None, None, f"{echo(value)} is not a valid {tag} value",
                node.start_mark) from None

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` keys may be overridden: that is what merging is
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:
                    continue  # an unhashable key: the base class says so
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {echo(key)} (given twice in one mapping)",
                        key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _printable(text: str) -> str:
    """One line: control characters (a newline in a key, a NUL) shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _read_yaml(path: Path, data: bytes | None = None) -> Any:
    """The file's YAML (or that of `data`, its text read elsewhere, e.g. from git), or a
    ScenarioError naming the file and what is wrong with it."""
    if data is None:
        try:
            with open(path, "rb") as stream:
                data = stream.read(MAX_FILE_BYTES + 1)
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
            raise ScenarioError(
                f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ScenarioError(f"{path}: expected a scenario file of at most "
                            f"{MAX_FILE_BYTES // MiB} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        hint = " (it looks like UTF-16)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        line = data[:exc.start].count(b"\n") + 1
        raise ScenarioError(f"{path}: not UTF-8 text{hint}: invalid byte "
                            f"0x{data[exc.start]:02x} at line {line}; save it as UTF-8") from None
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem, context = exc.problem or "", exc.context or ""
        if problem.startswith("but ") and context:
            problem = f"{context}, {problem}"  # "expected a single document ..., but found ..."
        elif context:
            problem = f"{problem} ({context})" if problem else context
        problem = problem or str(exc)
        raise ScenarioError(f"{path}: invalid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:  # a reader error: a character YAML does not allow
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ScenarioError(f"{path}: invalid YAML: {problem}") from None
    except RecursionError:
        raise ScenarioError(f"{path}: invalid YAML: nested too deeply") from None


def load_variants(path: str | Path, variants: list[str] | None = None) -> list[Variant]:
    """Every variant of a scenario file (or those named), validated.

    Any bad input, from bytes that are not UTF-8 to a field out of range, raises ScenarioError
    naming the file and the field, on one line.
    """
    path = Path(path)
    try:
        return _load(path, variants)
    except ScenarioError as exc:
        raise ScenarioError(_printable(str(exc))) from None
    except RecursionError:  # aliases can nest deeper than the text does
        raise ScenarioError(_printable(f"{path}: nested too deeply")) from None


def definitions(path: Path, data: bytes | None = None) -> dict[str, ScenarioSpec]:
    """Each variant's merged and validated spec, by name, without importing or building any
    component: what a file asks to measure, read as data (the gate reads the base's and the
    head's files so, and must not run a pull request's code). Bad input raises ScenarioError."""
    try:
        return {v.name: v.spec for v in _variants(path, _read_yaml(path, data), None, True)}
    except ScenarioError as exc:
        raise ScenarioError(_printable(str(exc))) from None
    except RecursionError:
        raise ScenarioError(_printable(f"{path}: nested too deeply")) from None


def _load(path: Path, variants: list[str] | None) -> list[Variant]:
    scenarios = _variants(path, _read_yaml(path), variants)
    _check_traces(path, scenarios)
    bindings = [binding for v in scenarios
                for binding in _bindings(v.spec, path, f"variant {v.name!r}: " if v.override else "")]
    # Every component of every variant resolved and built, so a typo fails before any run;
    # user code is imported once per file, in a child (see components.check).
    checked = check_components(bindings)
    if checked.problems:
        raise ScenarioError(f"{path}: {checked.problems[0]}")
    return [dataclasses.replace(v, packages=checked.packages) for v in scenarios]


def _variants(path: Path, raw: Any, variants: list[str] | None,
              as_data: bool = False) -> list[Variant]:
    """The file's variants (or those named), merged into the base and validated (`as_data`:
    a model folder is not looked for)."""
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: (top level): expected a mapping of scenario fields")
    if "name" not in raw:
        try:
            raw["name"] = check_name(path.stem)
        except ValueError as exc:
            raise ScenarioError(f"{path}: name: {exc} (the name defaults to the file's; "
                                "give one with name:)") from None
    overrides = raw.pop("variants", None)
    if overrides is None or overrides == {}:
        overrides = {"default": {}}
    if not isinstance(overrides, dict):
        raise ScenarioError(f"{path}: variants: expected a mapping of variant name to overrides, "
                            f"got {type(overrides).__name__}")
    for name, override in overrides.items():
        try:
            check_name(name)
        except ValueError as exc:
            raise ScenarioError(f"{path}: variants.{echo(name)}: {exc}") from None
        if not isinstance(override, (dict, type(None))):
            raise ScenarioError(f"{path}: variants.{name}: expected a mapping of overrides, "
                                f"got {type(override).__name__}")
    unknown = [clip(name, MAX_ECHO) for name in sorted(set(variants or []) - set(overrides))]
    if unknown:
        raise ScenarioError(f"{path}: variants: no variant {', '.join(unknown)} "
                            f"(expected one of {', '.join(overrides)})")
    scenarios = []
    for name, override in overrides.items():
        if variants and name not in variants:
            continue
        try:
            spec = _validate(_merge(raw, override or {}), as_data)
        except ScenarioError as exc:
            raise ScenarioError(f"{path}: {f'variant {name!r}: ' if override else ''}{exc}") from None
        scenarios.append(Variant(path=path, name=name, spec=_traced(spec, path),
                                 override=bool(override)))
    return scenarios


def _traced(spec: ScenarioSpec, path: Path) -> ScenarioSpec:
    """The spec with its trace (if any) named from the scenario file's folder, where it is
    read from wherever kvmem runs."""
    http = spec.workload.http
    if http is None or http.trace is None or Path(http.trace).is_absolute():
        return spec
    http = http.model_copy(update={"trace": str(path.parent / http.trace)})
    return spec.model_copy(update={"workload": spec.workload.model_copy(update={"http": http})})


def _check_traces(path: Path, scenarios: list[Variant]) -> None:
    """Every trace the variants replay, read whole: a bad line is bad input before any run."""
    read: set[str] = set()
    for variant in scenarios:
        http = variant.spec.workload.http
        if http is None or http.trace is None or http.trace in read:
            continue
        read.add(http.trace)
        try:
            trace.read(Path(http.trace))
        except trace.TraceError as exc:
            where = f"variant {variant.name!r}: " if variant.override else ""
            raise ScenarioError(f"{path}: {where}workload.http.trace: {exc}") from None


def _bindings(spec: ScenarioSpec, path: Path, where: str) -> list[Binding]:
    """The variant's components, to be checked; bad input where what it needs is not installed
    or its model cannot be built."""
    needed = checks.missing(spec)
    if needed is not None:
        raise ScenarioError(f"{path}: {where}{needed}")
    try:
        return checks.bindings(spec, where)
    except models.ModelError as exc:
        raise ScenarioError(f"{path}: {where}model: {exc}") from None


def check_unique(variants: Sequence[Variant]) -> None:
    """Refuse two variants of one scenario and variant name: both would write one report folder
    (<out>/<scenario>/<variant>/), the second replacing the first, so this is bad input before
    anything runs. A file given twice, or two files with one `name:`, are the usual causes."""
    seen: dict[tuple[str, str], Variant] = {}
    for variant in variants:
        first = seen.setdefault((variant.scenario, variant.name), variant)
        if first is variant:
            continue
        if first.path.resolve() == variant.path.resolve():
            raise ScenarioError(f"{variant.path}: given twice (among the paths, or in a folder "
                                "given too); each scenario file runs once")
        raise ScenarioError(f"{variant.path}: name: {variant.scenario!r} is also the name of "
                            f"{first.path}; each scenario needs its own name (its reports go "
                            f"under <out>/{variant.scenario}/)")


def discover(paths: Sequence[str | Path]) -> list[Path]:
    """Scenario files from files and folders (folders: every *.yaml / *.yml in them and in
    their subfolders, hidden ones left out, sorted by path). Subfolders count, so moving a
    scenario into one does not take it out of the suite (or out of the gate)."""
    found: list[Path] = []
    for entry in map(Path, paths):
        if entry.is_dir():
            try:
                found.extend(sorted(
                    p for p in entry.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file()
                    and not any(part.startswith(".") for part in p.relative_to(entry).parts)))
            except OSError as exc:
                raise ScenarioError(f"{entry}: cannot read: {exc.strerror or exc}") from None
        elif entry.exists():
            found.append(entry)
        else:
            raise ScenarioError(f"{entry}: no such file or folder")
    return found
