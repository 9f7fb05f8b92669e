"""Compare two sets of run summaries (base vs head) metric by metric: the regression gate.

Active-byte metrics are exact on one backend, so their tolerance is a tiny floor; the step peak
varies run to run on CPU (an MLX worker thread frees inputs asynchronously), so peak and spike get
a floor that absorbs that noise and no more; RSS includes the interpreter and the allocator cache,
so it gets a generous one. A change counts only when it exceeds both the absolute floor and the
relative threshold. Results from different backends are never compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.report import SCHEMA, atomic_text
from harness.scenario import parse_size

MiB = 1 << 20

# All metrics are "lower is better".
METRICS = (
    "peak", "steady", "final", "largest_spike", "leak_rate", "retained", "rss_peak",
    "overhead_ratio",
)


@dataclass(frozen=True)
class Tolerance:
    """A change counts when |delta| > abs and |delta| > rel * |base|."""

    rel: float
    abs: float

    def exceeded(self, base: float, delta: float) -> bool:
        return abs(delta) > self.abs and abs(delta) > self.rel * abs(base)


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    # Under load the CPU step peak moves by up to ~2 MiB between identical runs.
    "peak": Tolerance(rel=0.0, abs=4 * MiB),
    "largest_spike": Tolerance(rel=0.0, abs=4 * MiB),
    # Exact on one backend: the floor only absorbs float rounding in the fitted leak rate.
    "steady": Tolerance(rel=0.0, abs=256),
    "final": Tolerance(rel=0.0, abs=256),
    "retained": Tolerance(rel=0.0, abs=256),
    "leak_rate": Tolerance(rel=0.0, abs=256),
    "overhead_ratio": Tolerance(rel=0.0, abs=0.001),
    # RSS counts the interpreter, imported libraries and the MLX buffer cache.
    "rss_peak": Tolerance(rel=0.10, abs=64 * MiB),
}


class CompareError(Exception):
    """Bad input: an unreadable or malformed summary, or a bad option. Exit status 2."""


def size(value: int | str) -> int:
    """Bytes from an int or a string such as `4 MiB`, as in scenario files."""
    try:
        return parse_size(value)
    except ValueError as exc:
        raise CompareError(f"{value!r}: {exc}") from None


@dataclass(frozen=True)
class Summary:
    """One variant's summary.json as loaded, with the file it came from."""

    path: Path
    data: dict

    @property
    def key(self) -> tuple[str, str]:
        return self.data["scenario"], self.data["variant"]

    @property
    def label(self) -> str:
        return "/".join(self.key)

    @property
    def backend(self) -> str:
        return self.environment.get("backend", "?")

    @property
    def environment(self) -> dict:
        return self.data.get("environment") or {}

    @property
    def ok(self) -> bool:
        return self.data.get("status") == "ok"

    def metric(self, name: str) -> float | None:
        value = (self.data.get("metrics") or {}).get(name)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_summary(path: Path) -> Summary:
    """Load one summary, naming the file in every error."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CompareError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CompareError(f"{path}: not a valid summary (corrupt JSON: {exc})") from None
    if not isinstance(data, dict):
        raise CompareError(f"{path}: not a valid summary (expected a JSON object)")
    if data.get("schema") != SCHEMA:
        raise CompareError(f"{path}: unsupported summary schema {data.get('schema')!r}, "
                           f"expected {SCHEMA}")
    for name in ("scenario", "variant", "status"):
        if not isinstance(data.get(name), str):
            raise CompareError(f"{path}: not a valid summary (missing or non-string '{name}')")
    if data["status"] == "ok" and not isinstance(data.get("metrics"), dict):
        raise CompareError(f"{path}: not a valid summary (status ok but no 'metrics' object)")
    return Summary(Path(path), data)


def load(path: str | Path) -> list[Summary]:
    """Summaries under `path`: a summary file, a report folder, or a baselines folder.

    Folders are walked for `summary.json` files (report layout); a folder holding none is read
    as a baselines folder, where every `*.json` is a summary.
    """
    path = Path(path)
    if path.is_file():
        return [read_summary(path)]
    if not path.is_dir():
        raise CompareError(f"{path}: no such file or folder")
    files = sorted(path.rglob("summary.json")) or sorted(path.rglob("*.json"))
    return [read_summary(f) for f in files]


@dataclass(frozen=True)
class MetricDelta:
    metric: str
    base: float
    head: float
    tolerance: Tolerance

    @property
    def delta(self) -> float:
        return self.head - self.base

    @property
    def relative(self) -> float | None:
        """delta / base, or None when base is 0."""
        return self.delta / self.base if self.base else None

    @property
    def verdict(self) -> str:
        if not self.tolerance.exceeded(self.base, self.delta):
            return "unchanged"
        return "regression" if self.delta > 0 else "improvement"


# Entry states: both sides ran and were compared, or why they were not.
COMPARED, NEW, REMOVED, FAILED, INCOMPARABLE = "compared", "new", "removed", "failed", "incomparable"


@dataclass
class Entry:
    """One scenario variant: its deltas, or the reason it could not be compared."""

    scenario: str
    variant: str
    state: str
    base: Summary | None = None
    head: Summary | None = None
    deltas: list[MetricDelta] = field(default_factory=list)
    note: str = ""

    @property
    def label(self) -> str:
        return f"{self.scenario}/{self.variant}"

    @property
    def changed(self) -> list[MetricDelta]:
        return [d for d in self.deltas if d.verdict != "unchanged"]

    @property
    def verdict(self) -> str:
        # A head run that fails where the base ran is a regression: the change broke the run.
        if self.state == FAILED and self.base is not None and self.base.ok:
            return "regression"
        verdicts = {d.verdict for d in self.deltas}
        for verdict in ("regression", "improvement"):
            if verdict in verdicts:
                return verdict
        return "unchanged"


@dataclass
class Comparison:
    entries: list[Entry]
    notes: list[str]

    def having(self, state: str) -> list[Entry]:
        return [e for e in self.entries if e.state == state]

    @property
    def regressions(self) -> list[Entry]:
        return [e for e in self.entries if e.verdict == "regression"]

    @property
    def improvements(self) -> list[Entry]:
        return [e for e in self.entries if e.verdict == "improvement"]

    @property
    def verdict(self) -> str:
        if self.regressions:
            return "regression"
        if self.improvements:
            return "improvement"
        if any(e.state != COMPARED for e in self.entries) or self.notes:
            return "changed"
        return "no change"

    @property
    def exit_code(self) -> int:
        return 1 if self.regressions else 0


def tolerances(head: Summary, rel: dict[str, float] | None = None,
               abs_: dict[str, float] | None = None) -> dict[str, Tolerance]:
    """Defaults, then the head scenario's `expect.compare`, then command-line flags."""
    result = dict(DEFAULT_TOLERANCES)
    for name, spec in (head.data.get("compare") or {}).items():
        if name not in result or not isinstance(spec, dict):
            raise CompareError(f"{head.path}: compare.{name}: expected a metric among "
                               f"{', '.join(METRICS)} with {{rel, abs}}")
        current = result[name]
        spec_rel, spec_abs = spec.get("rel"), spec.get("abs")
        result[name] = Tolerance(rel=current.rel if spec_rel is None else float(spec_rel),
                                 abs=current.abs if spec_abs is None else size(spec_abs))
    for name, value in (rel or {}).items():
        result[name] = replace(result[name], rel=value)
    for name, value in (abs_ or {}).items():
        result[name] = replace(result[name], abs=value)
    return result


def _failure(summary: Summary) -> str:
    """`failed: <first line of the error>`; the error may carry a traceback."""
    error = summary.data.get("error") or f"exit status {summary.data.get('exit_status')}"
    return f"{summary.data['status']}: {error.splitlines()[0]}"


def _versions(summary: Summary) -> tuple[str, str]:
    env = summary.environment
    return env.get("mlx", "?"), env.get("mlx_lm", "?")


def _pair(base: Summary, head: Summary, rel: dict, abs_: dict) -> Entry:
    entry = Entry(*head.key, COMPARED, base, head)
    if base.backend != head.backend:
        entry.state = INCOMPARABLE
        entry.note = f"backend {base.backend} vs {head.backend}: not compared"
        return entry
    if not head.ok or not base.ok:
        entry.state = FAILED
        entry.note = "; ".join(f"{side} {_failure(s)}" for side, s in (("base", base), ("head", head))
                               if not s.ok)
        return entry
    limits = tolerances(head, rel=rel, abs_=abs_)
    for name in METRICS:
        b, h = base.metric(name), head.metric(name)
        if b is not None and h is not None:
            entry.deltas.append(MetricDelta(name, b, h, limits[name]))
    if _versions(base) != _versions(head):
        entry.note = "mlx/mlx-lm {} vs {}".format(*("/".join(_versions(s)) for s in (base, head)))
    return entry


def _index(summaries: list[Summary]) -> dict[tuple[str, str, str], Summary]:
    index: dict[tuple[str, str, str], Summary] = {}
    for s in summaries:
        key = (*s.key, s.backend)
        if key in index:
            raise CompareError(f"two summaries for {s.label} on backend {s.backend}: "
                               f"{index[key].path} and {s.path}")
        index[key] = s
    return index


def compare(base: list[Summary], head: list[Summary], rel: dict[str, float] | None = None,
            abs_: dict[str, float] | None = None) -> Comparison:
    """Match summaries by (scenario, variant, backend) and compare each pair metric by metric.

    A head summary whose variant exists in the base only on another backend becomes an
    `incomparable` entry; base summaries on other backends for a variant that was compared are
    left out with a note.
    """
    rel, abs_ = rel or {}, abs_ or {}
    base_index, head_index = _index(base), _index(head)
    entries: dict[tuple[str, str], Entry] = {}
    for key, h in head_index.items():
        if key in base_index:
            entries[key[:2]] = _pair(base_index.pop(key), h, rel, abs_)
    skipped = 0
    for key, h in head_index.items():
        if key[:2] in entries:
            continue
        other = next((k for k in base_index if k[:2] == key[:2]), None)
        if other is not None:
            entries[key[:2]] = _pair(base_index.pop(other), h, rel, abs_)
        else:
            state = NEW if h.ok else FAILED
            note = "" if h.ok else f"head {_failure(h)}"
            entries[key[:2]] = Entry(*h.key, state, None, h, note=note)
    for key, b in base_index.items():
        if key[:2] in entries:
            skipped += 1
        else:
            entries[key[:2]] = Entry(*b.key, REMOVED, b, None)
    notes = _environment_notes(base, head)
    if skipped:
        notes.append(f"{skipped} base summaries on other backends left out")
    return Comparison(sorted(entries.values(), key=lambda e: (e.scenario, e.variant)), notes)


def _environment_notes(base: list[Summary], head: list[Summary]) -> list[str]:
    notes = []
    if not base:
        notes.append("the base has no summaries: every variant is new")
    backends = [sorted({s.backend for s in side}) for side in (base, head)]
    if base and head and backends[0] != backends[1]:
        notes.append("backends differ (base {}, head {}): results across backends are not "
                     "compared".format(*(", ".join(b) for b in backends)))
    versions = [sorted({"/".join(_versions(s)) for s in side}) for side in (base, head)]
    if base and head and versions[0] != versions[1]:
        notes.append("mlx/mlx-lm versions differ (base {}, head {}): deltas include MLX's own "
                     "changes".format(*(", ".join(v) for v in versions)))
    return notes


def _metric_values(pairs: list[str], flag: str, convert) -> dict[str, float]:
    values = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in METRICS:
            raise CompareError(f"{flag} {pair}: expected METRIC=VALUE with METRIC among "
                               f"{', '.join(METRICS)}")
        values[name] = convert(value)
    return values


def _fraction(value: str) -> float:
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if not fraction >= 0:
        raise CompareError(f"not a fraction: {value!r} (expected e.g. 0.05)")
    return fraction


def add_options(parser: argparse.ArgumentParser) -> None:
    """Output and tolerance options shared by `compare` and `baseline check`."""
    parser.add_argument("--format", choices=("text", "markdown", "json", "junit"),
                        default="text")
    parser.add_argument("--out", help="write the result to FILE instead of stdout")
    parser.add_argument("--rel", action="append", default=[], metavar="METRIC=X",
                        help="relative threshold for a metric, e.g. peak=0.05")
    parser.add_argument("--abs", action="append", default=[], metavar="METRIC=SIZE",
                        help="absolute noise floor for a metric, e.g. 'peak=8 MiB'")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare", help="compare run summaries of a base and a head; exit 1 on regression")
    parser.add_argument("base", help="report folder, summary.json or baselines folder")
    parser.add_argument("head", help="report folder, summary.json or baselines folder")
    add_options(parser)
    parser.set_defaults(handler=run_compare)


def emit(comparison: Comparison, args: argparse.Namespace) -> int:
    """Render in the requested format to --out (the verdict still goes to stdout) or stdout."""
    from harness.formats import render, render_text  # formats imports this module

    if args.out:
        try:
            atomic_text(Path(args.out), render(comparison, args.format))
        except OSError as exc:
            print(f"error: {args.out}: cannot write: {exc.strerror or exc}", file=sys.stderr)
            return 2
        sys.stdout.write(render_text(comparison))
    else:
        sys.stdout.write(render(comparison, args.format))
    return comparison.exit_code


def thresholds(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, float]]:
    return (_metric_values(args.rel, "--rel", _fraction),
            _metric_values(args.abs, "--abs", size))


def run_compare(args: argparse.Namespace, console=None) -> int:
    try:
        rel, abs_ = thresholds(args)
        base, head = load(args.base), load(args.head)
        if not head:
            raise CompareError(f"{args.head}: no summaries found")
        comparison = compare(base, head, rel, abs_)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return emit(comparison, args)
