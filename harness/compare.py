"""Compare two sets of run summaries (base vs head) metric by metric: the regression gate.

Active-byte metrics are exact on one backend, so their tolerance is a tiny floor; the step peak
varies run to run on CPU (an MLX worker thread frees inputs asynchronously), so peak and spike get
a floor that absorbs that noise and no more; RSS includes the interpreter and the allocator cache,
so it gets a generous one. A change counts only when it exceeds both the absolute floor and the
relative threshold. Results from different backends are never compared.

A summary recorded over several runs (`kvmem noise`, `baseline update --runs N`) carries the
measured spread of peak and spike; their floor is then at least NOISE_MARGIN times that spread,
so a value measured once inside the recorded range never fails a pull request.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeGuard

from harness.metrics import METRICS  # all lower-is-better
from harness.report import SCHEMA, atomic_text
from harness.scenario import MAX_SIZE, parse_size

MiB = 1 << 20

# Step-peak metrics move run to run on CPU, so their spread is measured; active-byte metrics are
# exact and must be identical run to run.
NOISY = ("peak", "largest_spike")
EXACT = ("steady", "final", "retained", "leak_rate")
# The spread of N runs is a lower bound of the noise's true range R, and base and head may each
# lie anywhere in R. For noise spread evenly over R, N runs span (N-1)/(N+1) of it on average:
# 2/3 for the default 5, so 1.5x the spread estimates R itself. (A rare value that no run hit
# is not covered by any margin: record with more runs.)
NOISE_MARGIN = 1.5


@dataclass(frozen=True)
class Noise:
    """The run-to-run spread (max - min) of one metric over `runs` runs of a variant."""

    spread: float
    runs: int


@dataclass(frozen=True)
class Tolerance:
    """A change counts when |delta| > abs and |delta| > rel * |base|."""

    rel: float
    abs: float
    noise: Noise | None = None  # the measured spread that set `abs`, when it did

    def exceeded(self, base: float, delta: float) -> bool:
        return abs(delta) > self.abs and abs(delta) > self.rel * abs(base)

    def widened(self, noise: Noise | None) -> Tolerance:
        """This tolerance with its floor raised to NOISE_MARGIN x the spread, where that is more."""
        if noise is None or NOISE_MARGIN * noise.spread <= self.abs:
            return self
        return replace(self, abs=NOISE_MARGIN * noise.spread, noise=noise)


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    # Under load the CPU step peak usually moves by up to ~2 MiB between identical runs; a
    # variant that moves more records its spread (harness.noise), which widens this floor.
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
    """Bytes from an int or a string such as `4 MiB`, as in scenario files.

    Whatever parse_size raises is bad input here, overflow included (`1e400 GiB`, a 400-digit
    integer): never a traceback.
    """
    try:
        return parse_size(value)
    except (ValueError, OverflowError, TypeError) as exc:
        raise CompareError(f"{value!r}: {exc}") from None


def _finite(value: object) -> TypeGuard[float]:
    """A JSON number a metric can hold: not a bool, not NaN or infinite, and within the sizes
    that floats hold exactly (a 400-digit integer would overflow every rendering)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) <= MAX_SIZE if isinstance(value, int) else math.isfinite(value)


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
        return value if _finite(value) else None

    def noise(self, name: str) -> Noise | None:
        """The recorded run-to-run spread of a step-peak metric, from the `noise` block."""
        block = self.data.get("noise")
        if name not in NOISY or not isinstance(block, dict):
            return None
        if not isinstance(block.get(name), dict):
            return None
        return Noise(block[name]["spread"], block["runs"])


def read_summary(path: Path) -> Summary:
    """Load one summary, naming the file in every error."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CompareError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        # JSONDecodeError and UnicodeDecodeError are ValueErrors, and so is an integer of more
        # than 4,300 digits; nesting deeper than the interpreter's stack is a RecursionError.
        raise CompareError(f"{path}: not a valid summary (corrupt JSON: {exc})") from None
    if not isinstance(data, dict):
        raise CompareError(f"{path}: not a valid summary (expected a JSON object)")
    if data.get("schema") != SCHEMA:
        raise CompareError(f"{path}: unsupported summary schema {data.get('schema')!r}, "
                           f"expected {SCHEMA}")
    return checked(Summary(Path(path), data))


def checked(summary: Summary) -> Summary:
    """The summary, if it can be compared and recorded; bad input naming its file otherwise."""
    problem = invalid(summary.data)
    if problem:
        raise CompareError(f"{summary.path}: not a valid summary ({problem})")
    return summary


def invalid(data: dict) -> str | None:
    """Why a summary dict cannot be compared or recorded, or None.

    A run that says ok must carry every compared metric as a finite number (overhead_ratio may
    be null: no analytic minimum): a child that stopped early once wrote `metrics: {}`, and
    comparing nothing with nothing read as "no change".
    """
    for name in ("scenario", "variant", "status"):
        if not isinstance(data.get(name), str):
            return f"missing or non-string '{name}'"
    environment = data.get("environment")
    if environment is not None and not isinstance(environment, dict):
        return "'environment' is not an object"
    if not isinstance((environment or {}).get("backend", "?"), str):
        return "'environment.backend' is not a string"
    if data["status"] != "ok":
        return None
    metrics = data.get("metrics")
    if not isinstance(metrics, dict):
        return "status ok but no 'metrics' object"
    missing = [name for name in METRICS if name not in metrics]
    if missing:
        return f"status ok but metrics lack {', '.join(missing)}"
    for name in METRICS:
        value = metrics[name]
        if not (_finite(value) or (name == "overhead_ratio" and value is None)):
            return f"metrics.{name}: expected a finite number, got {_brief(value)}"
    return _invalid_noise(data.get("noise"))


def _brief(value: object) -> str:
    """A JSON value as the file holds it, cut to fit an error line."""
    if isinstance(value, int) and abs(value) >= 10**40:
        return "a huge integer"  # json.dumps refuses more than 4,300 digits
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _invalid_noise(block: object) -> str | None:
    """Why a `noise` block (see harness.noise) is malformed, or None when absent or sound."""
    if block is None:
        return None
    if not isinstance(block, dict):
        return "'noise' is not an object"
    runs = block.get("runs")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        return f"noise.runs: expected a count of runs, got {_brief(runs)}"
    for name in NOISY:
        entry = block.get(name)
        if entry is None:
            continue
        spread = entry.get("spread") if isinstance(entry, dict) else None
        if not _finite(spread) or spread < 0:
            return f"noise.{name}.spread: expected a size of zero or more bytes"
    return None


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
    files = _visible(path, "summary.json") or _visible(path, "*.json")
    return [read_summary(f) for f in files]


def _visible(root: Path, pattern: str) -> list[Path]:
    """Files under `root` matching `pattern`, leaving out hidden names at any depth.

    Atomic writes leave `.summary.json.<random>.json` files, and report folders are staged as
    `.<variant>.new.<random>/`, when interrupted: half-written data, never a summary.
    """
    return sorted(f for f in root.rglob(pattern)
                  if not any(part.startswith(".") for part in f.relative_to(root).parts))


@dataclass(frozen=True)
class MetricDelta:
    metric: str
    base: float
    head: float
    tolerance: Tolerance  # as applied: widened by the measured noise where that is larger
    base_noise: Noise | None = None
    head_noise: Noise | None = None

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
    spec = head.data.get("compare") or {}
    if not isinstance(spec, dict):
        raise CompareError(f"{head.path}: compare: expected an object of metric tolerances")
    for name, metric_spec in spec.items():
        if name not in result or not isinstance(metric_spec, dict):
            raise CompareError(f"{head.path}: compare.{name}: expected a metric among "
                               f"{', '.join(METRICS)} with {{rel, abs}}")
        try:
            result[name] = _scenario_tolerance(result[name], metric_spec)
        except CompareError as exc:
            raise CompareError(f"{head.path}: compare.{name}: {exc}") from None
    for name, value in (rel or {}).items():
        result[name] = replace(result[name], rel=value)
    for name, value in (abs_ or {}).items():
        result[name] = replace(result[name], abs=value)
    return result


def _scenario_tolerance(current: Tolerance, spec: dict) -> Tolerance:
    spec_rel, spec_abs = spec.get("rel"), spec.get("abs")
    return Tolerance(rel=current.rel if spec_rel is None else _fraction(spec_rel),
                     abs=current.abs if spec_abs is None else size(spec_abs))


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
            noise = base.noise(name), head.noise(name)
            widest = max((n for n in noise if n), key=lambda n: n.spread, default=None)
            entry.deltas.append(MetricDelta(name, b, h, limits[name].widened(widest), *noise))
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


def _fraction(value: str | float) -> float:
    """A relative threshold: a finite number of zero or more (`inf` would disable the gate)."""
    try:
        fraction = -1.0 if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        fraction = -1.0
    if not (math.isfinite(fraction) and fraction >= 0):
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
