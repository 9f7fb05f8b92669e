"""memory.png: a server's run of any length draws a bounded figure (memory at rest as the line,
requests in flight as a band per time bucket, latency below), and a finding lists steps spread
over the whole run so its markers are seen where it happened."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection, PathCollection

from harness.agent.kvmem_sample import PHASES
from harness.common.units import GiB, MiB
from harness.judge.records import MAX_STEPS_LISTED, Finding, listed
from harness.report.plots import BUCKETS, buckets, draw_variant, plot_variant

PERIOD = 0.1          # the agent's sampling period in a server
REST_EVERY = 600      # a sample at rest every 60 s


def server_frame(samples: int, every: int) -> pd.DataFrame:
    """A server's samples on the period: request `k` begins at sample `every * k` and ends 3
    samples later, a sample at rest every REST_EVERY; at rest, memory rises 1 MiB a minute."""
    rng = np.random.default_rng(0)
    i = np.arange(samples)
    phase = np.full(samples, "serve", dtype=object)
    bound = (i % every == 1) | (i % every == 4)
    phase[bound] = "request"
    phase[i % REST_EVERY == 0] = "idle"          # the first: the baseline
    rise = (i // REST_EVERY) * MiB
    active = GiB + rise + np.where(phase == "idle", 0, rng.integers(0, 64 * MiB, samples))
    return pd.DataFrame({
        "step": i, "phase": pd.Categorical(phase, categories=PHASES),
        "request": np.where(bound, i // every, -1), "turn": -1, "tokens": 0,
        "active": active, "peak": active + rng.integers(0, 16 * MiB, samples),
        "cache": 0, "rss": 3 * GiB + rise, "logical": rise, "host": 0, "minimum": 0, "work": 0,
        "cyclic": 0, "time": i * PERIOD, "cap": 0,
    })


def requests_frame(count: int, every: float) -> pd.DataFrame:
    """`count` requests sent `every` seconds apart; each 97th timed out."""
    rng = np.random.default_rng(1)
    sent = np.arange(count) * every
    failed = np.arange(count) % 97 == 96
    return pd.DataFrame({
        "request": np.arange(count), "sent": sent,
        "first": sent + 0.05 + rng.exponential(0.02, count),
        "done": np.where(failed, np.nan, sent + 0.3 + rng.exponential(0.1, count)),
        "status": np.where(failed, "timeout", "ok"), "prompt_tokens": 64,
        "completion_tokens": 16,
    })


def a_leak(frame: pd.DataFrame) -> Finding:
    rest = frame[frame["phase"] == "idle"]
    return Finding(kind="leak", step=int(rest["step"].iloc[-1]), bytes=MiB, count=len(rest),
                   message="memory at rest grows", steps=listed(rest["step"]))


def drawn_points(ax: Axes) -> int:
    """Every point the axis draws: its lines' vertices, its polygons' and its markers."""
    lines = sum(len(line.get_xdata()) for line in ax.get_lines())
    shapes = 0
    for collection in ax.collections:
        if isinstance(collection, PathCollection):
            shapes += len(collection.get_offsets())
        else:
            shapes += sum(len(path.vertices) for path in collection.get_paths())
    return lines + shapes


def labelled(ax: Axes, start: str) -> list[PathCollection]:
    return [c for c in ax.collections
            if isinstance(c, PathCollection) and c.get_label().startswith(start)]


@pytest.fixture(scope="module")
def hour() -> tuple[pd.DataFrame, pd.DataFrame]:
    """An hour's run: 36,000 samples at 0.1 s, 7,200 requests (one each 0.5 s)."""
    return server_frame(36_000, every=5), requests_frame(7_200, every=0.5)


def test_an_hour_of_a_server_draws_a_bounded_figure_with_latency_below(hour, tmp_path):
    frame, requests = hour
    fig = draw_variant(frame, [a_leak(frame)], "an hour", requests=requests)
    memory, latency = fig.axes
    assert memory.get_shared_x_axes().joined(memory, latency)
    assert latency.get_ylabel() == "seconds"
    assert memory.get_xlabel() == "" and latency.get_xlabel() == "seconds since the baseline"
    # What is drawn depends on the bucket count, not on the 36,000 samples or 7,200 requests.
    assert drawn_points(memory) <= 8 * BUCKETS     # band 4, logical 2 a bucket; 60 at rest
    assert drawn_points(latency) <= 16 * BUCKETS
    band, = [c for c in memory.collections if c.get_label().startswith("in flight")]
    assert sum(len(p.vertices) for p in band.get_paths()) <= 4 * BUCKETS + 4
    # No ticks for 7,200 requests: the band shows the traffic.
    assert not [c for c in memory.collections if isinstance(c, LineCollection)]
    # The leak's markers span the run, to its last minute.
    leak, = labelled(memory, "leak")
    times = leak.get_offsets()[:, 0]
    assert len(times) == MAX_STEPS_LISTED and times.max() > 3500 and times.min() < 60
    failed, = labelled(latency, "timeout")
    assert failed.get_label() == "timeout (74)"

    plot_variant(frame, [a_leak(frame)], "an hour", tmp_path / "memory.png", requests=requests)
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_buckets_cover_the_span_in_a_fixed_number(hour):
    frame, _ = hour
    at = buckets(frame["time"], (0.0, float(frame["time"].max())), BUCKETS)
    assert (at.min(), at.max(), at.nunique()) == (0, BUCKETS - 1, BUCKETS)
    assert at.is_monotonic_increasing
    assert buckets(pd.Series([0.0, float("nan"), 10.0]), (0.0, 10.0), 4).tolist() == [0, pd.NA, 3]


def test_a_short_server_run_keeps_its_request_ticks_and_draws_latency_as_points(tmp_path):
    frame, requests = server_frame(1_200, every=50), requests_frame(24, every=5.0)
    fig = draw_variant(frame, [], "short", requests=requests)
    memory, latency = fig.axes
    ticks, = [c for c in memory.collections if isinstance(c, LineCollection)]
    assert len(ticks.get_segments()) == 24
    total, = labelled(latency, "total")
    first, = labelled(latency, "to first token")
    assert len(first.get_offsets()) == 24
    assert np.isfinite(total.get_offsets()[:, 1]).sum() == 24   # no request failed
    assert latency.get_xlabel() == "seconds since the baseline (ticks: requests sent)"


def test_a_server_run_without_requests_is_one_axis():
    frame = server_frame(1_200, every=50)
    for requests in (None, requests_frame(0, every=1.0)):
        fig = draw_variant(frame, [], "no latency", requests=requests)
        assert len(fig.axes) == 1
        assert fig.axes[0].get_xlabel().startswith("seconds since the baseline")


def test_a_run_by_step_draws_as_before():
    steps = 50
    frame = pd.DataFrame({
        "step": range(steps), "phase": pd.Categorical(["idle"] + ["decode"] * (steps - 1),
                                                      categories=PHASES),
        "request": 0, "turn": -1, "tokens": 1, "active": [GiB + s * MiB for s in range(steps)],
        "peak": [GiB + (s + 1) * MiB for s in range(steps)], "cache": 0, "rss": 2**31,
        "logical": [s * MiB for s in range(steps)], "host": 0, "minimum": 0, "work": 0,
        "cyclic": 0, "time": [s * 0.01 for s in range(steps)], "cap": 0,
    })
    fig = draw_variant(frame, [], "by step")
    ax, = fig.axes
    assert ax.get_xlabel().startswith("step")
    assert [line.get_label() for line in ax.get_lines()] == [
        "MLX active", "logical (components' nbytes)", "analytic minimum", "process RSS"]
    assert len(ax.get_lines()[0].get_xdata()) == steps       # sample by sample, step-wise
    assert ax.get_lines()[0].get_drawstyle() == "steps-post"


@pytest.mark.parametrize("hits, expected", [
    (5, [0, 1, 2, 3, 4]),
    (20, list(range(20))),
    (21, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]),
    (1000, [0, 53, 105, 158, 210, 263, 315, 368, 421, 473, 526, 578, 631, 684, 736, 789, 841,
            894, 946, 999]),
])
def test_a_finding_lists_its_steps_spread_over_the_run(hits, expected):
    assert listed(pd.Series(range(0, 3 * hits, 3))) == [3 * i for i in expected]
