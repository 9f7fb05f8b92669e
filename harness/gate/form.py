"""Whether the head measured open-loop traffic in the form the gate asks.

The gate replays open-loop traffic in order, arrival times ignored (`workload.http.gate:
ordered`, harness.scenario.server), so that a slow runner does not change what is measured. The
reports CI judges are written by the pull request's own workflow (`kvmem run --gated`); a run
that kept the schedule (the flag dropped, an adopter's older workflow) measured something else,
and its figures are refused, not compared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import TYPE_CHECKING

from ..scenario import Variant
from .compare import FAILED, Comparison, VariantComparison

if TYPE_CHECKING:
    from .definition import Definitions


def as_gated(variants: list[Variant]) -> list[Variant]:
    """The variants as the gate measures them: open-loop traffic replayed in order, arrival
    times ignored, where the scenario's `workload.http.gate` says so (HttpSpec.gated)."""
    changed = []
    for variant in variants:
        http = variant.spec.workload.http
        if http is not None and http.gated() is not http:
            workload = variant.spec.workload.model_copy(update={"http": http.gated()})
            variant = dataclasses.replace(
                variant, spec=variant.spec.model_copy(update={"workload": workload}))
        changed.append(variant)
    return changed


def _gated_in_order(spec: dict) -> bool:
    """The variant's traffic is open loop (a rate or a trace) and the gate replays it in order."""
    http = (spec.get("workload") or {}).get("http") or {}
    scheduled = http.get("rate") is not None or bool(http.get("trace"))
    return scheduled and http.get("arrivals") != "ordered" and http.get("gate") == "ordered"


def _kept_schedule(entry: VariantComparison, defined: Definitions) -> bool:
    """The head's files ask the variant to be gated as an ordered replay, and its summary says
    its traffic kept the schedule."""
    spec = defined.get(entry.key)
    if entry.head is None or spec is None or not _gated_in_order(spec):
        return False
    return entry.head.model is None or not entry.head.model.ordered


def unordered(comparison: Comparison, defined: Definitions) -> Comparison:
    """Fail each variant whose summary says its traffic kept the schedule the gate replays in
    order."""
    failed = lambda e: replace(e, state=FAILED, refusal=(
        "the head's run kept the open-loop schedule; the gate measures this variant as an "
        "ordered replay (workload.http.gate: ordered), so its figures follow the runner's "
        "speed and are not compared: run it with `kvmem run --gated`"))
    return replace(comparison, entries=tuple(failed(e) if _kept_schedule(e, defined) else e
                                             for e in comparison.entries))
