"""Detectors of single steps: a transient spike, a growth step, caches allocated ahead of their
tokens, arrays counted twice (formulas: harness.judge.detectors)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from ..agent.kvmem_sample import IN_FLIGHT
from ..common.units import KiB, MiB, Size, mib
from .frames import settled_above, spike_ratios, transients, where
from .records import Finding, from_hits
from .thresholds import Thresholds

if TYPE_CHECKING:
    import pandas as pd


class SpikeThresholds(Thresholds):
    min_bytes: Size = 4 * MiB
    min_ratio: Annotated[float, Field(ge=1.0)] = 1.05


def spike(frame: pd.DataFrame, t: SpikeThresholds, backend: str) -> Finding | None:
    """Transient spike: a step whose peak rises above both the memory before and after it.

    A concatenation that builds a new buffer while the old one is alive is the typical cause.
    """
    excess, ratios, settled = transients(frame), spike_ratios(frame), settled_above(frame)
    hits = frame[(excess > t.min_bytes) & ((ratios >= t.min_ratio) | (settled <= 0))]

    def message(at: Hashable) -> str:
        relative = f"{ratios[at]:.2f}x" if settled[at] > 0 else "settled at the baseline"
        return (f"{len(hits)} transient spike(s); largest +{mib(excess[at])} MiB above the "
                f"settled memory ({relative}) at {where(frame, at)}")

    return from_hits("spike", hits, excess, message)


class GrowthThresholds(Thresholds):
    min_bytes: Size = 512 * KiB


def growth(frame: pd.DataFrame, t: GrowthThresholds, backend: str) -> Finding | None:
    """Growth step: active memory rising by more than the tokens of that step explain.

    Compared between consecutive token steps on one live sequence. A cache growing in blocks,
    or logits kept per step, shows here.
    """
    previous = frame.shift(1)
    eligible = frame["phase"].isin(["prefill", "decode"]) & (previous["tokens"] > 0)
    explained = (frame["minimum"] - previous["minimum"]).clip(lower=0)
    excess = frame["active"] - previous["active"] - explained
    hits = frame[eligible & (excess > t.min_bytes)]
    return from_hits("growth", hits, excess, lambda at: (
        f"{len(hits)} step(s) grew active memory beyond their tokens; largest "
        f"+{mib(excess[at])} MiB at {where(frame, at)}"))


class PreallocatedThresholds(Thresholds):
    """No settings: the bounds are what no growing cache reaches, so the finding means the same
    on every geometry (and states only facts: what the components report, what tokens need)."""


GROWTH_STEP = 256  # slots mlx-lm's KVCache and RotatingKVCache grow by


def preallocated(frame: pd.DataFrame, t: PreallocatedThresholds, backend: str) -> Finding | None:
    """Preallocated: at decode steps the caches report more than twice what their tokens need,
    spare capacity a cache growing with its tokens never holds: a window allocated up front,
    which costs its whole size from the first token. Informational, for a reader choosing a
    window: the cost of its size at this workload.

    Only where the reported bytes are the live request's: a store's entries, a session's
    logits or a server's prompt cache would read as spare. Prefill steps are left out: mlx-lm's
    RotatingKVCache keeps a chunk longer than its window until the next decode step.
    """
    if frame["phase"].isin(("fetch", "store", "evict", *IN_FLIGHT)).any() or (frame["turn"] >= 0).any():
        return None
    before = frame.shift(1)
    one_more = ((frame["phase"] == "decode") & (before["phase"] == "decode")
                & (frame["request"] == before["request"]) & (frame["tokens"] - before["tokens"] == 1))
    token = frame["minimum"] - before["minimum"]
    spare = frame["logical"] - frame["minimum"]
    hits = frame[one_more & (token > 0) & (spare > frame["minimum"])
                 & (spare > 2 * GROWTH_STEP * token)]

    def message(at: Hashable) -> str:
        reported, used = frame["logical"][at], frame["minimum"][at]
        return (f"the caches report {mib(reported)} MiB at {where(frame, at)} where the "
                f"request's {frame['tokens'][at]:,} tokens need {mib(used)} MiB "
                f"({used / reported:.0%} used): {mib(reported - used)} MiB allocated ahead of its "
                f"tokens, as a window allocated up front is from the first token")

    found = from_hits("preallocated", hits, spare, message)
    return None if found is None else replace(found, severity="warning")


class AliasThresholds(Thresholds):
    min_bytes: Size = MiB


def aliased(frame: pd.DataFrame, t: AliasThresholds, backend: str) -> Finding | None:
    """Aliased: the components report more than MLX holds above the baseline.

    Every byte reported is an array alive since the baseline, so reporting more than exists
    counts the same arrays twice: a fetch that hands out the store's own cache objects (which
    the request then updates in place, and the store still counts), or two components
    holding one entry. Only where it outlives a write: on a prefill or decode step after
    another. A copy shares its source's buffer until the first write to either (MLX copies
    lazily), so a fetch's copy or a snapshot taken during a step counts twice for that one
    row; and at a store the request hands its caches over. Both are measured from the
    baseline: a count the baseline already had (a cache reloaded before the first sample,
    perhaps lazily) is no array counted twice.
    """
    base = frame.iloc[0]
    over = (frame["logical"] - base["logical"]) - (frame["active"] - base["active"])
    counted_twice = frame["phase"].isin(["prefill", "decode"]) & (over > t.min_bytes)
    hits = frame[counted_twice & counted_twice.shift(1, fill_value=False)]
    return from_hits("aliased", hits, over, lambda at: (
        f"components report {mib(over[at])} MiB more than MLX holds above the baseline at "
        f"{where(frame, at)}: the same arrays counted twice, as when a "
        f"fetch hands out the store's own cache objects"))
