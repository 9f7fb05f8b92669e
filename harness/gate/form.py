"""Whether the head measured open-loop traffic in the form the gate asks.

The gate replays open-loop traffic in order, arrival times ignored (`workload.http.gate:
ordered`, harness.scenario.server), so that a slow runner does not change what is measured. The
reports CI judges are written by the pull request's own workflow (`kvmem run --gated`); a run
that kept the schedule (the flag dropped, an adopter's older workflow) measured something else,
and its figures are refused, not compared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .compare import FAILED, Comparison

if TYPE_CHECKING:
    from .definition import Definitions


def _gated_in_order(spec: dict) -> bool:
    """The variant's traffic is open loop (a rate or a trace) and the gate replays it in order."""
    http = (spec.get("workload") or {}).get("http") or {}
    scheduled = http.get("rate") is not None or bool(http.get("trace"))
    return scheduled and http.get("arrivals") != "ordered" and http.get("gate") == "ordered"


def unordered(comparison: Comparison, defined: Definitions) -> None:
    """Fail each variant the head's files ask to be gated as an ordered replay whose summary
    says its traffic kept the schedule."""
    for entry in comparison.entries:
        spec = defined.get(entry.key)
        if entry.head is None or spec is None or not _gated_in_order(spec):
            continue
        if entry.head.model is not None and entry.head.model.ordered:
            continue
        entry.state = FAILED
        entry.refusal = ("the head's run kept the open-loop schedule; the gate measures this "
                         "variant as an ordered replay (workload.http.gate: ordered), so its "
                         "figures follow the runner's speed and are not compared: run it with "
                         "`kvmem run --gated`")
