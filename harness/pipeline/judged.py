"""A run's summary: its samples judged (harness.judge.verdict) and written down with what the run
says of itself. One recipe for every command that measures: `run` (harness.pipeline.suite), with
`noise` and `baseline update --runs` through it (harness.pipeline.repeat), and `record`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..judge.detectors import AppliedDetect
from ..judge.metrics import RunFacts
from ..judge.summary import SCHEMA, Environment, Series, Summary
from ..judge.verdict import SERVED, judge
from ..report.plots import series

if TYPE_CHECKING:
    import pandas as pd

    from ..judge.detectors import DetectSpec
    from ..judge.expect import ExpectSpec


@dataclass(frozen=True)
class Measured:
    """What a run says of itself beside its samples: its names, how it ended, its facts, the
    environment that measured it, and the summary's other fields this kind of run records
    (`given`: a scenario run's file, tolerances, store and model; a recording's processes);
    a field None is left out of the summary, unless `nulls` names it."""

    scenario: str
    variant: str
    description: str
    status: str
    error: str | None
    exit_status: int | None
    last_step: int
    facts: RunFacts
    environment: Environment
    given: dict[str, Any] = field(default_factory=dict)
    nulls: tuple[str, ...] = ()  # fields written even as null (a recording's `holders`)


def summarize(run: Measured, frame: pd.DataFrame, holders: pd.DataFrame,
              thresholds: DetectSpec, expect: ExpectSpec) -> Summary:
    """The summary of a run that sampled `frame` (empty: nothing) and walked `holders`, judged
    under `thresholds` and `expect`; it passes when it completed and every expectation held."""
    served = run.status in SERVED and not frame.empty
    verdict = judge(frame if served else None, holders, thresholds, expect, run.facts,
                    run.environment)
    optional = {**run.given, "holders": verdict.holders}
    return Summary(
        schema=SCHEMA, scenario=run.scenario, variant=run.variant, description=run.description,
        status=run.status, error=run.error, exit_status=run.exit_status,
        last_step=run.last_step, metrics=verdict.metrics, findings=verdict.findings,
        expectations=verdict.expectations, passed=verdict.held and run.status == "ok",
        # Every detector's thresholds as applied: the gate sees a pull request that moves one.
        detect=AppliedDetect.of(thresholds), series=Series(active=series(frame)),
        environment=run.environment,
        **{name: value for name, value in optional.items()
           if value is not None or name in run.nulls})
