"""Detectors: functions from one run's samples to a finding, registered in `DETECTORS`.

The registry drives what a detector does: `detect()` runs each entry, `expect.<name>` defaults
to the entry's `expected`, and the plot marks its steps with the entry's marker. A scenario's
`detect.<name>` and `expect.<name>` are declared fields (`DetectSpec` here, `ExpectSpec` in
expect.py), one per entry. Adding a detector is one function and one thresholds class (in
per_step.py or at_rest.py, by what it reads), one registry entry here and those two fields.
Each thresholds class holds its defaults; docs/detectors.md gives every rule with them (a test
holds the page to the classes).

Notation (harness.judge.frames): all bytes above the run's baseline b; per step `active` a,
the step's `peak` p, the components' `logical` bytes l, the analytic `minimum` m, the step's
own input `work` w, process `rss`. At rest means the quiescent points q (the idle sample after
each request or chat turn, the baseline excluded); there c = the MLX bytes unreachable
reference cycles hold (`cyclic`, found without freeing them) and u = a − b − l − c is the
memory nothing accounts for. Each byte at rest is attributed once: cycle garbage to
gc_deferred, reported bytes to unbounded, the rest to leak or retained, split by S (the trend
test T and the split S: harness.judge.trend). Active bytes are exact on a given backend, so
detectors on active memory use small floors; the step peak is noisy (an allocator thread frees
inputs asynchronously), so the spike detector needs a floor of a few MiB.

spike      s_i = max(a_{i-1}, a_i); excess_i = p_i − s_i − w_i; ratio_i = (p_i − b) / max(s_i − b, 1);
           flagged where excess_i > min_bytes and ratio_i ≥ min_ratio.
growth     excess_i = (a_i − a_{i-1}) − max(m_i − m_{i-1}, 0) over prefill and decode steps whose
           previous step holds tokens; flagged where excess_i > min_bytes.
leak       T(u) with floor min_bytes, and u not in step (S); the rate per request (or turn).
held       h_q = min(l_q, a_q − b + min(l_0, a_0)): the components' count as far as memory
           confirms it, MLX above the baseline and, of the baseline's own count l_0 (a cache
           reloaded before the first sample), what MLX held in all then, a_0. Claimed is not
           held: budgets and caps judge h; a count no memory backs is overclaimed's (or, from
           before the baseline, nothing's), never memory over a bound.
limit      over a bound B with slack (s, ρ): h_q − B > s and h_q − B > ρ·B. A budget the
           scenario states has none (s = ρ = 0: the user's own hard bound); breached where
           over at the last point at rest. A cap enforced at admission (over_cap's) has its
           thresholds' slack, and is breached where over at the last point and at more than
           half of the points since the first over.
unbounded  with a stated budget: h breaches it (limit), however it got there (T(h) rising,
           held flat, or over it from the first point), an error; with none, nothing where
           the agent read a cap (over_cap judges that bound), else T(h) with floor min_bytes,
           a warning.
plateau    a − b at rest rose by at least min_bytes, then held (flat: each |Δ| and their sum
           < flat over the last `hold` deltas or more, more than any pause before).
preallocated  on runs of requests with no store, session or server, at a decode step one
           token after another of the same request: spare = l − m > m and > 512 (m_i − m_{i-1});
           a warning, at the largest spare.
retained   excess_i = a_i − b − l_i − c_i (c_i the larger measurement at rest around step i),
           over every step but a server's in flight, > max(min_bytes, ratio × l_i); else T(u)
           with floor min_rate in step (S); nothing when T(u) rises not in step (leak's), or
           when memory is kept at rest but l is 0 at every point (no accounting to hold to).
aliased    over_i = (l_i − l_0) − (a_i − b) > min_bytes on a prefill or decode step and the step
           before it: the same arrays counted twice.
host_memory  o = rss − active − cache on CPU (its buffers live in RSS), else rss; rise_i =
           o_i − o_0 at rest > min_bytes and > a_i − b; else the trend: T(rise) with floor
           min_rate (elsewhere than CPU, of rise − (a − b)), r = the lower median of its deltas
           from the onset, flagged when r ≥ min_rate and r × deltas ≥ min_trend_bytes; the
           rate r per request (or turn).
gc_deferred  c_q > min_bytes at a quiescent point.
pooled     MLX's buffer cache at a quiescent point > min_bytes (on CPU twice its default limit
           when unset; elsewhere checked only with a stated min_bytes).
over_cap   h against cap_q, where the agent read a cap (the bytes the cache allows itself), by
           limit as a cap enforced at admission, slack (min_bytes, ratio); the largest excess.
           With no budget stated it answers for unbounded (the cap is the bound then).
overclaimed  e_q = (l_q − l_0) − (a_q − b) > max(min_bytes, ratio × (l_q − l_0)) at the
           last quiescent point (l_0 the baseline's count): the accounting grew more than what
           is held.
drift      a_t = b + r·t + ε over the samples in flight of a run with no request boundaries and
           under three points at rest (`kvmem record`), least squares, for MLX active memory and
           for RSS alike: an error where either's r·T or last a_t − b exceeds budget, or its r
           exceeds rate; a warning where either has r·T ≥ min_bytes with r² ≥ r2 and no budget
           is breached.
buffers    over the points at rest past the warm-up, from the first to the last where live buffers
           n were counted (n ≥ 0; at least 3; the walk counts the baseline, each power of two
           and the last), n read as linear between them: T(n) with floor min_buffers, and
           between the counted points from its onset Δa < max_bytes_per_buffer × Δn (small
           arrays piling up, not entries of K/V: those are unbounded's or leak's); the rate
           Δn per token served where the rows count tokens (decode steps, a server's request
           marks), else per request (or turn), else per second; projected to L − n_last over
           the rate, L = limit, else expect.buffers's bound, else the backend's
           (frame.attrs["buffer_limit"]).

The detectors of steps are in harness.judge.per_step, those of memory at rest in
harness.judge.at_rest, the trend against time of a recorded process (`drift`) in
harness.judge.over_time, the count of buffers at rest in harness.judge.buffers. A per-step
detector reports, through `from_hits`, the step of its largest excess, that excess in bytes,
how many steps it hit and MAX_STEPS_LISTED of them spread over the hits (`records.listed`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    model_serializer,
    model_validator,
)

from ..common.strict import Strict
from .at_rest import (
    GcThresholds,
    HostThresholds,
    LeakThresholds,
    OverCapThresholds,
    OverclaimThresholds,
    PlateauThresholds,
    PooledThresholds,
    RetainedThresholds,
    UnboundedThresholds,
    gc_deferred,
    host_memory,
    leak,
    over_cap,
    overclaimed,
    plateau,
    pooled,
    retained,
    unbounded,
)
from .buffers import BuffersThresholds, buffers
from .over_time import DriftThresholds, drift
from .per_step import (
    AliasThresholds,
    GrowthThresholds,
    PreallocatedThresholds,
    SpikeThresholds,
    aliased,
    growth,
    preallocated,
    spike,
)
from .records import Finding
from .thresholds import Thresholds

# numpy and pandas are imported where a frame is read: the scenario schema imports this module
# for the registry alone, and rejecting a bad file must not wait for them.
if TYPE_CHECKING:
    import pandas as pd

Presence = Literal["none", "detected"]


@dataclass(frozen=True)
class Marker:
    """How the plot marks a finding's steps: a matplotlib marker and colour, on the `active`
    line or at the step `peak`."""

    symbol: str
    color: str
    level: Literal["active", "peak"] = "active"


@dataclass(frozen=True)
class Detector:
    """One registry entry. `find(frame, thresholds, backend)` returns a finding or None;
    `expected` is what `expect.<name>` holds when a scenario states nothing (None: not checked);
    `supersedes`: findings this one makes moot when it is found (they judge what it judges),
    save one against a budget the scenario states, the user's own bound."""

    find: Callable[[pd.DataFrame, Any, str], Finding | None]
    thresholds: type[Thresholds]
    expected: Presence | None
    marker: Marker
    supersedes: tuple[str, ...] = ()


# In the order findings are reported. A growing cache spikes and grows by design, so only the
# scenario can say whether it should, a plateau is what a filling cache does and preallocated
# what a window allocated up front does; unbounded growth with no budget stated is a warning,
# which the default expectation lets pass; the others are expected absent everywhere.
DETECTORS: dict[str, Detector] = {
    "spike": Detector(spike, SpikeThresholds, None, Marker("v", "tab:red", "peak")),
    "growth": Detector(growth, GrowthThresholds, None, Marker("^", "tab:orange")),
    "leak": Detector(leak, LeakThresholds, "none", Marker("o", "tab:purple")),
    "unbounded": Detector(unbounded, UnboundedThresholds, "none", Marker("P", "tab:green")),
    "plateau": Detector(plateau, PlateauThresholds, None, Marker("_", "tab:olive")),
    "preallocated": Detector(preallocated, PreallocatedThresholds, None, Marker("d", "tab:olive")),
    "retained": Detector(retained, RetainedThresholds, "none", Marker("s", "tab:brown")),
    "aliased": Detector(aliased, AliasThresholds, "none", Marker("*", "tab:red")),
    "host_memory": Detector(host_memory, HostThresholds, "none", Marker("D", "tab:pink")),
    "gc_deferred": Detector(gc_deferred, GcThresholds, "none", Marker("X", "tab:cyan")),
    "pooled": Detector(pooled, PooledThresholds, "none", Marker("h", "tab:gray")),
    # With no budget stated, a cache's own cap is unbounded's bound too: over_cap judges it.
    "over_cap": Detector(over_cap, OverCapThresholds, "none", Marker("p", "tab:red"),
                         supersedes=("unbounded",)),
    "overclaimed": Detector(overclaimed, OverclaimThresholds, "none", Marker("8", "tab:blue")),
    # Small buffers piling up at rest: a buffer limit (Metal's) ends the server, not its bytes.
    "buffers": Detector(buffers, BuffersThresholds, "none", Marker("1", "tab:purple")),
    # A recorded process's trend against time (`kvmem record`): no request boundaries, nothing
    # at rest, so it never reads a scenario's run. A warning with no budget stated.
    "drift": Detector(drift, DriftThresholds, "none", Marker(">", "tab:orange")),
}


class DetectSpec(Strict):
    """`detect:` in a scenario: each detector's settings under its name, its defaults where the
    scenario states none. One field per entry of DETECTORS, in its order (tests/test_detect.py
    holds them equal), so editors, the JSON Schema and mypy all see every detector."""

    spike: SpikeThresholds = Field(default=SpikeThresholds(), description=(
        "A step's peak above the memory before and after it: a buffer rebuilt while the old "
        "one was alive."))
    growth: GrowthThresholds = Field(default=GrowthThresholds(), description=(
        "Active memory rising by more than the step's tokens explain."))
    leak: LeakThresholds = Field(default=LeakThresholds(), description=(
        "Memory at rest that nothing accounts for, rising request after request."))
    unbounded: UnboundedThresholds = Field(default=UnboundedThresholds(), description=(
        "The bytes the components report growing with no plateau, or over `budget`."))
    plateau: PlateauThresholds = Field(default=PlateauThresholds(), description=(
        "Memory at rest that rose, then held: a cache filled to its budget."))
    preallocated: PreallocatedThresholds = Field(default=PreallocatedThresholds(), description=(
        "Caches allocated ahead of their tokens and mostly empty."))
    retained: RetainedThresholds = Field(default=RetainedThresholds(), description=(
        "The allocator holding more than the components report (a slice keeping its buffer)."))
    aliased: AliasThresholds = Field(default=AliasThresholds(), description=(
        "The components reporting more than MLX holds: arrays counted twice."))
    host_memory: HostThresholds = Field(default=HostThresholds(), description=(
        "Process memory growing outside MLX: bytes or NumPy copies held on the host."))
    gc_deferred: GcThresholds = Field(default=GcThresholds(), description=(
        "Unreachable reference cycles holding MLX buffers until the collector runs."))
    pooled: PooledThresholds = Field(default=PooledThresholds(), description=(
        "MLX's buffer cache holding freed buffers at rest."))
    over_cap: OverCapThresholds = Field(default=OverCapThresholds(), description=(
        "A server's cache holding more at rest than its own configured cap."))
    overclaimed: OverclaimThresholds = Field(default=OverclaimThresholds(), description=(
        "The cache's own byte count growing beyond what memory holds."))
    buffers: BuffersThresholds = Field(default=BuffersThresholds(), description=(
        "Live MLX buffers at rest piling up while bytes hardly grow."))
    drift: DriftThresholds = Field(default=DriftThresholds(), description=(
        "A recorded process's memory trending up against time (`kvmem record`)."))


class AppliedDetect(DetectSpec):
    """`detect` in a summary: the thresholds a run applied, typed, and the file's blocks kept
    as its writer gave them. A detector, or a threshold, newer than the file stays absent (the
    gate tells a check a pull request adds from one it moves); one newer than this kvmem, a
    whole detector or a key in a known one (the judge reads what a pull request's kvmem
    wrote), is kept, and typed access has none of it. A known threshold of a type this kvmem
    does not read is bad input: no default may stand for what the run applied, and a change of
    type is a new summary schema, not an addition."""

    model_config = ConfigDict(extra="allow")

    _file: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _read(cls, data: Any,
              handler: ModelWrapValidatorHandler[AppliedDetect]) -> AppliedDetect:
        if not isinstance(data, dict):
            return handler(data)
        known = {name: ({key: value for key, value in block.items()
                         if key in DETECTORS[name].thresholds.model_fields}
                        if name in DETECTORS and isinstance(block, dict) else block)
                 for name, block in data.items()}
        applied = handler(known)
        applied._file = copy.deepcopy(data)  # a caller's dict may change later
        return applied

    @model_serializer(mode="plain")
    def _given(self) -> dict[str, Any]:
        return self._file

    @classmethod
    def of(cls, spec: DetectSpec) -> AppliedDetect:
        """Every detector's thresholds a run applies under `spec`, each of them given."""
        return cls.model_validate(spec.model_dump(mode="json"))

    def given(self) -> dict[str, dict[str, Any]]:
        """Each detector's thresholds the file gave, by name, in its order, as JSON values."""
        return copy.deepcopy(self._file)


def detect(frame: pd.DataFrame, thresholds: DetectSpec, backend: str) -> list[Finding]:
    """Every registered detector over one run's samples, each with its `thresholds.<name>`,
    less the findings another one found supersedes; each superseding finding lists the kinds
    it answers for (`Finding.supersedes`), so an expectation of them can say so."""
    found = [finding for name, d in DETECTORS.items()
             if (finding := d.find(frame, getattr(thresholds, name), backend)) is not None]
    answered = {kind: f.kind for f in found if f.kind in DETECTORS
                for kind in DETECTORS[f.kind].supersedes
                if getattr(getattr(thresholds, kind, None), "budget", None) is None}
    return [replace(f, supersedes=[kind for kind, by in answered.items() if by == f.kind])
            for f in found if f.kind not in answered]
