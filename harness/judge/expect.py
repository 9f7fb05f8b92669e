"""Expectations: the scenario's `expect:` block, and its check against a run's findings and
metrics.

Findings are facts; expectations decide pass or fail. Each registered detector's presence is
checked when the scenario states it or its registry entry expects one (detectors.DETECTORS);
spike's expectation may instead bound the spike_ratio metric. A metric with a `budget`
(metrics.METRICS) is bounded under that key: bytes (peak, steady, final, per_token) or a ratio
(overhead). `compare:` holds the scenario's tolerances, which the gate applies to the base.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, Discriminator, Field, Tag

from ..common.strict import Number, Strict, tagged
from ..common.units import Size, exact_bytes
from .detectors import DETECTORS, Presence
from .metrics import BYTES, METRICS, gated
from .records import Expectation, Finding, Severity


class SpikeBound(Strict):
    max_ratio: Annotated[Number, Field(ge=1.0)]


class ToleranceSpec(Strict):
    """`expect.compare.<metric>`: the tolerance the gate applies to it, where the scenario sets
    one (the gate takes the base's)."""

    rel: Annotated[Number, Field(ge=0.0)] | None = None
    abs: Size | None = None


if TYPE_CHECKING:
    SpikeExpectation = Presence | SpikeBound
else:
    SpikeExpectation = tagged(scalar=Presence, mapping=SpikeBound)

# `expect.buffers`: the finding's presence (a string), or the most live MLX buffers at rest (a
# count); each input is told what is wrong with it as the one it is.
BufferExpectation = Annotated[
    Annotated[Presence, Tag("presence")] | Annotated[int, Field(strict=True, ge=0), Tag("bound")],
    Discriminator(lambda v: "presence" if isinstance(v, str) else "bound")]


def _gated(name: str) -> str:
    """A metric `kvmem compare` gates on: a typo would silently tolerate nothing."""
    if name not in gated():
        raise ValueError(f"expected a metric compare gates on: {', '.join(gated())}")
    return name


GatedName = Annotated[str, AfterValidator(_gated)]


Ratio = Annotated[Number, Field(gt=0.0)]
Expected = Presence | None  # a presence, or null: not checked


def _presence_field(name: str, description: str) -> Any:
    """A detector's presence, defaulting to its registry entry's `expected`."""
    return Field(default=DETECTORS[name].expected, description=description)


class ExpectSpec(Strict):
    """`expect:`: each detector's presence (`none` or `detected`; null: not checked), spike's
    presence or bound, each metric's budget, and `kvmem compare`'s tolerances. One presence
    per entry of DETECTORS, defaulting to its `expected`, and one budget per metric with a
    `budget` (tests/test_detect.py and tests/test_metrics.py hold them equal)."""

    spike: SpikeExpectation | None = Field(default=None, description=(
        "`none`, `detected`, or {max_ratio: X}, a bound on the spike ratio."))
    compare: dict[GatedName, ToleranceSpec] = Field(default_factory=dict, description=(
        "The gate's tolerance per metric ({rel, abs}), applied to the base."))
    growth: Expected = _presence_field("growth", "Growth beyond the tokens' bytes.")
    leak: Expected = _presence_field("leak", "Memory at rest nothing accounts for, rising.")
    unbounded: Expected = _presence_field("unbounded", "Reported bytes growing unbounded.")
    plateau: Expected = _presence_field("plateau", "Memory at rest that rose, then held.")
    preallocated: Expected = _presence_field("preallocated", "Caches allocated ahead.")
    retained: Expected = _presence_field("retained", "More held than the components report.")
    aliased: Expected = _presence_field("aliased", "The same arrays counted twice.")
    host_memory: Expected = _presence_field("host_memory", "Process memory outside MLX.")
    gc_deferred: Expected = _presence_field("gc_deferred", "Cycles holding MLX buffers.")
    pooled: Expected = _presence_field("pooled", "Freed buffers kept in MLX's cache.")
    over_cap: Expected = _presence_field("over_cap", "A server's cache over its own cap.")
    overclaimed: Expected = _presence_field("overclaimed", "A byte count beyond memory.")
    buffers: BufferExpectation | None = _presence_field("buffers", (
        "`none`, `detected`, or the most live MLX buffers at rest (a count)."))
    drift: Expected = _presence_field("drift", "A recorded process's trend against time.")
    peak: Size | None = Field(default=None, description="A budget for the peak metric (bytes).")
    steady: Size | None = Field(default=None, description="A budget for the steady metric (bytes).")
    final: Size | None = Field(default=None, description="A budget for the final metric (bytes).")
    per_token: Size | None = Field(default=None, description="A budget for the bytes per token.")
    overhead: Ratio | None = Field(default=None, description=(
        "A budget for the overhead ratio against the analytic minimum."))


def _presence(name: str, expected: Presence, findings: list[Finding],
              stated: bool = True) -> Expectation:
    """A presence expectation; one the scenario did not state (the registry's default) is not
    failed by a warning. Where another finding answered for this one (it supersedes it), the
    result names it."""
    found = [f for f in findings if f.kind == name and (stated or f.severity == "error")]
    actual = "detected" if found else "none"
    by = next((f for f in findings if name in f.supersedes), None)
    message = (found[0].message if found else
               f"no {name} finding: superseded by {by.kind}: {by.message}" if by else
               f"no {name} finding")
    return Expectation(name=name, expected=expected, actual=actual, ok=actual == expected,
                       message=message, superseded_by=by.kind if by and not found else None)


def _bound(name: str, actual: float | None, limit: float, in_bytes: bool) -> Expectation:
    ok = actual is not None and actual <= limit
    shown = "n/a" if actual is None else (exact_bytes(actual) if in_bytes else f"{actual:.3f}")
    limit_shown = exact_bytes(limit) if in_bytes else f"{limit:.3f}"
    return Expectation(name=name, expected=f"<= {limit_shown}", actual=shown, ok=ok,
                       message=f"{name} {shown} {'within' if ok else 'exceeds'} {limit_shown}")


def _presences(expect: ExpectSpec, findings: list[Finding]) -> list[Expectation]:
    """The stated presences: first those the registry expects absent unless a scenario says
    otherwise, then those checked only when stated; spike's comes after them (`_spiked`)."""
    detectors = sorted(DETECTORS.items(), key=lambda item: item[1].expected is None)
    stated = ((name, getattr(expect, name)) for name, _ in detectors if name != "spike")
    return [_presence(name, expected, findings, name in expect.model_fields_set)
            for name, expected in stated if expected is not None and not isinstance(expected, int)]


def _buffers_bound(expected: Presence | int | None, figures: dict[str, Any]) -> list[Expectation]:
    """`expect.buffers: 20000`: the most live MLX buffers at rest stay within it (a run whose
    buffers were not counted has no figure and fails it, as a missing budget figure does)."""
    if not isinstance(expected, int):
        return []
    actual = figures.get("most_buffers")
    ok = actual is not None and actual <= expected
    shown = "n/a" if actual is None else f"{actual:,}"
    return [Expectation(name="buffers", expected=f"<= {expected:,}", actual=shown, ok=ok,
                        message=f"live buffers at rest {shown} "
                                f"{'within' if ok else 'exceed'} {expected:,}")]


def _spiked(expected: Presence | SpikeBound | None, findings: list[Finding],
            figures: dict[str, Any]) -> list[Expectation]:
    """Spike's expectation: a presence, or `{max_ratio: X}`, a bound on the spike_ratio metric
    (a growing cache spikes by design; the scenario says how large a spike it accepts)."""
    if isinstance(expected, SpikeBound):
        return [_bound("spike_ratio", figures["spike_ratio"], expected.max_ratio, False)]
    return [] if expected is None else [_presence("spike", expected, findings)]


def _budgets(expect: ExpectSpec, figures: dict[str, Any]) -> list[Expectation]:
    """Each stated budget against its metric, in the registry's order."""
    return [_bound(m.budget, figures[name], limit, m.unit == BYTES)
            for name, m in METRICS.items()
            if m.budget is not None and (limit := getattr(expect, m.budget)) is not None]


def graded(findings: list[Finding], expect: ExpectSpec) -> list[Finding]:
    """Each finding with the severity that says whether it can fail this run: "error" where an
    expectation of none fails on it; "warning" where a detector said so and the expectation is
    the registry's default, which lets it pass; "info" where nothing the scenario expects fails
    on it (a detector checked only when stated, or one expected detected)."""
    def severity(finding: Finding) -> Severity:
        if getattr(expect, finding.kind, None) != "none":
            return "info"
        stated = finding.kind in expect.model_fields_set
        return "warning" if finding.severity == "warning" and not stated else "error"

    return [replace(f, severity=severity(f)) for f in findings]


def check(expect: ExpectSpec, findings: list[Finding],
          figures: dict[str, Any]) -> list[Expectation]:
    """Each expectation of the scenario against the findings and metrics: presences, spike,
    budgets, the order summaries (and the baselines kept from them) have always had."""
    return [*_presences(expect, findings), *_spiked(expect.spike, findings, figures),
            *_budgets(expect, figures), *_buffers_bound(expect.buffers, figures)]
