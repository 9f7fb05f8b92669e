"""Judging a run: its rows and what its scenario asks give the findings, figures and
expectations its summary records.

One recipe, applied twice: the run judges what it sampled (harness.pipeline.judged, for `run`,
`noise` and `record` alike), and the gate judges again the rows a report folder holds, with its
own code and the scenario as it reads it (harness.gate.rejudge), so that the figures a measured
process could rewrite in summary.json never decide a verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .detectors import DetectSpec, detect
from .expect import ExpectSpec, check, graded
from .holders import largest, named
from .metrics import RunFacts, Samples, figures, recorded
from .records import Expectation, Finding, HeldAtRest
from .summary import Environment

if TYPE_CHECKING:
    import pandas as pd

SERVED = ("ok", "interrupted")  # statuses whose samples are judged: an interrupted run on what
# it sampled, as a shorter run would be (it never passes)


@dataclass(frozen=True)
class Verdict:
    """What the judge makes of one run: the figures a summary records, the findings graded
    against the expectations, the expectations as checked, who held the arrays at the last
    point at rest (None where nothing was walked), and whether every expectation held."""

    metrics: dict[str, Any]
    findings: list[Finding]
    expectations: list[Expectation]
    holders: HeldAtRest | None
    held: bool


def judge(frame: pd.DataFrame | None, holders: pd.DataFrame, thresholds: DetectSpec,
          expect: ExpectSpec, facts: RunFacts, environment: Environment) -> Verdict:
    """The verdict on a run's samples (`frame`, None for a run that served nothing: its facts
    alone) and its holders' rows, under the scenario's thresholds and expectations. The
    environment's backend says what host memory is there (host_memory, host_rate), and its
    buffer limit, where it has one, bounds the live buffers (`frame.attrs`)."""
    backend = environment.backend
    if frame is not None:
        frame.attrs.update(backend=backend, buffer_limit=environment.buffer_limit)
    findings = named(detect(frame, thresholds, backend), holders, frame) if frame is not None else []
    values = figures(Samples(frame, findings, thresholds, facts))
    expectations = check(expect, findings, values) if frame is not None else []
    return Verdict(metrics=recorded(values), findings=graded(findings, expect),
                   expectations=expectations,
                   holders=largest(holders, frame) if frame is not None else None,
                   held=frame is not None and all(e.ok for e in expectations))
