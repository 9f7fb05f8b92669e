"""A detector's settings: the base every `detect.<name>` block validates against, and the trend
settings the detectors of memory at rest share (harness.judge.trend)."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from ..common.strict import Strict

MAX_WARMUP = 2**31 - 1          # an int32, as every count of a scenario


class Thresholds(Strict):
    """A detector's settings, `detect.<name>` in a scenario: sizes take units, numbers are
    finite and strict (a bool is not 1), and an unknown key is an error, not ignored."""

    # strict: a scenario's `1` is not `true`, nor `"4"` 4; a threshold is a finite number.
    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class TrendThresholds(Thresholds):
    """How a series at rest must rise to count (`rising`): past `warmup` quiescent points,
    every delta positive or a line fit with r² ≥ `r2`; and not held: a series whose last
    `hold` deltas or more are flat, longer than any pause while it rose, has filled and
    stopped. Each detector adds its own floor."""

    warmup: Annotated[int, Field(ge=0, le=MAX_WARMUP)] = 1
    r2: Annotated[float, Field(ge=0.0, le=1.0)] = 0.9
    hold: Annotated[int, Field(ge=1, le=MAX_WARMUP)] = 3
