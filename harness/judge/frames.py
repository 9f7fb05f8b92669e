"""One run's samples as the detectors and metrics read them: the rows at rest, the transient
of each step, and what neither the components nor cycle garbage account for.

A frame has one row per step (harness.run.probe.ROW; its phases are the sample's own,
harness.agent.kvmem_sample.PHASES): `active` (a), the step's `peak` (p),
the components' `logical` bytes (l), the analytic `minimum`, the step's own input `work`,
`cache`, `rss`, and at idle samples `cyclic` (c). Bytes are taken above the run's baseline b,
its first sample. numpy and pandas are imported where a frame is read: the scenario schema
imports the detectors' registry alone, and rejecting a bad file must not wait for them.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from ..agent.kvmem_sample import IN_FLIGHT

if TYPE_CHECKING:
    import pandas as pd


def where(frame: pd.DataFrame, at: Hashable) -> str:
    """A row as a finding names it: `step 105 (idle)`; on a server's run with its request too,
    `step 105 (idle, request 13)`."""
    step, phase, request = frame["step"][at], frame["phase"][at], frame["request"][at]
    if request >= 0 and frame["phase"].isin(IN_FLIGHT).any():
        return f"step {step} ({phase}, request {request})"
    return f"step {step} ({phase})"


def quiescent(frame: pd.DataFrame) -> pd.DataFrame:
    """Samples taken with nothing in flight: after each request, or each chat turn."""
    idle = frame[frame["phase"] == "idle"]
    return idle.iloc[1:]  # the first is the baseline


def unexplained(rows: pd.DataFrame, frame: pd.DataFrame) -> pd.Series:
    """Active memory above the run's baseline that neither the components' reported bytes nor
    unreachable cycles (gc_deferred's) account for: what the allocator holds that nothing
    says it keeps."""
    return rows["active"] - frame["active"].iloc[0] - rows["logical"] - cycles_around(rows, frame)


def cycles_around(rows: pd.DataFrame, frame: pd.DataFrame) -> pd.Series:
    """What cycle garbage may hold at each of `rows`: measured at idle points only, so a step
    takes the larger of the measurements at rest before and after it (garbage made during a
    request is still there at its end, unless the collector ran)."""
    import numpy as np

    measured = frame["cyclic"].where(frame["phase"] == "idle")
    spread = np.maximum(measured.ffill().fillna(0), measured.bfill().fillna(0))
    return spread.loc[rows.index]



def _previous_active(frame: pd.DataFrame) -> pd.Series:
    return frame["active"].shift(1, fill_value=frame["active"].iloc[0])


def transients(frame: pd.DataFrame) -> pd.Series:
    """Per step: peak beyond the larger of active before and after, less the step's own input."""
    import numpy as np

    settled = np.maximum(_previous_active(frame), frame["active"])
    return frame["peak"] - settled - frame["work"]


def settled_above(frame: pd.DataFrame) -> pd.Series:
    """Per step: the larger of active before and after, above the baseline."""
    import numpy as np

    return np.maximum(_previous_active(frame), frame["active"]) - frame["active"].iloc[0]


def spike_ratios(frame: pd.DataFrame) -> pd.Series:
    """Per step: peak over the larger of active before and after, both above the baseline; NaN
    where memory settled at the baseline (a spike from nothing has no ratio)."""
    settled = settled_above(frame)
    return (frame["peak"] - frame["active"].iloc[0]) / settled.where(settled > 0)


def point_name(points: pd.DataFrame) -> str:
    """What a point at rest follows: a chat's turn, else a request."""
    return "turn" if (points["turn"] >= 0).any() else "request"

