"""Live MLX buffers at rest: the `buffers` detector, its metric and its expectation, on samples
built by hand (exact counts), and the canary of mlx-lm PR #1642 that reproduces the leak."""

from __future__ import annotations

import functools
from pathlib import Path

import pandas as pd
import pytest

from harness.common.units import KiB, MiB
from harness.judge import detectors as detect
from harness.judge.buffers import BuffersThresholds, buffers
from harness.judge.expect import check
from harness.judge.metrics import RunFacts, Samples, figures
from harness.scenario import ScenarioSpec, load_variants
from tests.conftest import make_spec, serve

BASE = 100 * MiB
WORKLOAD = {"requests": [{"prompt": 16, "decode": 4}]}


def served(buffers: list[int], active: list[int], decode: int = 8,
           logical: list[int] | None = None) -> pd.DataFrame:
    """The baseline (100 live buffers, nothing held), then per request `decode` decode steps
    and an idle point with the given live buffers and bytes above the baseline."""
    rows = [("idle", -1, 100, 0, 0)]
    for request, (count, held) in enumerate(zip(buffers, active, strict=True)):
        rows += [("decode", request, -1, held, 0)] * decode
        rows.append(("idle", request, count, held, (logical or active)[request]))
    phase, request, counted, held, reported = zip(*rows, strict=True)
    n = len(rows)
    frame = pd.DataFrame({
        "step": range(n), "phase": pd.Categorical(phase), "request": request, "turn": -1,
        "tokens": 0, "active": [BASE + a for a in held], "peak": [BASE + a for a in held],
        "cache": 0, "logical": reported, "host": 0, "minimum": 0, "work": 0, "cyclic": 0,
        "time": [float(i) for i in range(n)], "cap": 0, "buffers": counted,
        "arrays": counted,
    })
    return frame.assign(rss=frame["active"])


def found(frame: pd.DataFrame, **thresholds) -> dict:
    spec = make_spec(workload=WORKLOAD, detect=thresholds)
    return {f.kind: f for f in detect.detect(frame, spec.detect, "cpu")}


# One 4-byte scalar kept per decoded token: 8 tokens a request, 32 B a request.
LEAKING = served([100 + 8 * k for k in range(1, 13)], [32 * k for k in range(1, 13)])


def test_buffers_kept_per_token_are_flagged_with_their_rate_and_projection():
    finding = found(LEAKING, buffers={"limit": 20_000})["buffers"]
    assert (finding.kind, finding.bytes, finding.count, finding.step) == ("buffers", 32, 10, 108)
    assert finding.severity == "error"
    assert finding.message == (
        "live MLX buffers at rest grow +1.00 a token (4 B each), 116 to 196 over 10 requests "
        "while memory at rest grew 320 B (fit r²=1.000): the stated limit of 20,000 buffers in "
        "about 19,804 more tokens")


def test_a_count_walked_at_powers_of_two_reads_as_the_count_at_every_point():
    """The walk counts the baseline, each power of two and the last point at rest: between
    them the count is read as linear, so the finding is the dense one's."""
    walked = [0, 1, 2, 4, 8, 12]
    sparse = LEAKING.copy()
    idle = sparse.index[sparse["phase"] == "idle"]
    skipped = [at for point, at in enumerate(idle) if point not in walked]
    sparse.loc[skipped, "buffers"] = -1
    dense = found(LEAKING, buffers={"limit": 20_000})["buffers"]
    assert found(sparse, buffers={"limit": 20_000})["buffers"] == dense


def test_the_backends_limit_is_projected_to_where_the_scenario_states_none():
    frame = LEAKING.copy()
    frame.attrs["buffer_limit"] = 499_000
    (finding,) = detect.detect(frame, make_spec(workload=WORKLOAD).detect, "metal")
    assert finding.message.endswith(": Metal's 499,000 live buffers in about 498,804 more tokens")


def test_with_no_limit_known_the_rate_stands_alone():
    assert found(LEAKING)["buffers"].message.endswith("(fit r²=1.000)")


def test_an_expected_bound_is_the_limit_projected_to_and_bounds_the_most_buffers():
    spec = make_spec(workload=WORKLOAD, expect={"buffers": 120})
    assert spec.detect.buffers.limit == 120
    findings = detect.detect(LEAKING, spec.detect, "cpu")
    assert findings[0].message.endswith(": 196 live, over the stated limit of 120 buffers")
    values = figures(Samples(LEAKING, findings, spec.detect, RunFacts(1.0, 0)))
    (bound,) = [e for e in check(spec.expect, findings, values) if e.name == "buffers"]
    assert (bound.ok, bound.expected, bound.actual) == (False, "<= 120", "196")
    assert make_spec(workload=WORKLOAD, expect={"buffers": 120},
                     detect={"buffers": {"limit": 9}}).detect.buffers.limit == 9


def test_buffers_that_bring_their_bytes_are_entries_not_this_finding():
    """A store keeping real K/V adds buffers of many KiB each: unbounded's or leak's."""
    entries = served([100 + 8 * k for k in range(1, 13)], [64 * KiB * k for k in range(1, 13)])
    assert "buffers" not in found(entries)


def test_a_flat_count_a_small_rise_and_a_filled_count_are_clean():
    flat = served([140] * 12, [0] * 12)
    slow = served([100 + k for k in range(1, 13)], [0] * 12)       # under 8 buffers a request
    filled = served([min(100 + 16 * k, 164) for k in range(1, 13)], [0] * 12)
    assert [found(f).get("buffers") for f in (flat, slow, filled)] == [None, None, None]
    assert "buffers" in found(slow, buffers={"min_buffers": 1})


def test_unmeasured_points_and_old_samples_are_not_judged():
    unmeasured = LEAKING.assign(buffers=-1)
    old = LEAKING.drop(columns=["buffers", "arrays"])
    assert buffers(unmeasured, BuffersThresholds(), "cpu") is None
    assert buffers(old, BuffersThresholds(), "cpu") is None


def test_with_no_tokens_the_rate_is_per_request_and_with_no_requests_per_second():
    per_request = served([100 + 8 * k for k in range(1, 13)], [32 * k for k in range(1, 13)],
                         decode=0)
    assert "+8.00 a request" in found(per_request)["buffers"].message
    per_second = per_request.assign(request=-1)
    assert "+8.00 a second" in found(per_second)["buffers"].message


def test_the_metric_is_the_last_count_at_rest_above_the_baseline_and_none_unmeasured():
    spec = make_spec(workload=WORKLOAD)

    def metric(frame: pd.DataFrame) -> tuple:
        values = figures(Samples(frame, [], spec.detect, RunFacts(1.0, 0)))
        return values["buffers"], values["most_buffers"]

    assert metric(LEAKING) == (96, 196)
    assert metric(LEAKING.assign(buffers=-1)) == (None, None)
    assert metric(LEAKING.drop(columns=["buffers", "arrays"])) == (None, None)


# mlx-lm PR #1642's leak beside its fix: 4 recurrent layers, 12 chat turns of a 16-token prompt
# and 48 decoded tokens; each forward of each layer keeps a 4-byte scalar in the lazy variant.
CANARY = Path(__file__).resolve().parent.parent / "scenarios" / "arrays_cache_advance.yaml"
RUNS = 10
PER_TURN = 4 * (1 + 48)          # buffers a turn: a prefill and 48 decode forwards, 4 layers


@functools.cache
def canary_specs() -> dict[str, ScenarioSpec]:
    return {v.name: v.spec for v in load_variants(CANARY)}


def canary(variant: str) -> tuple[dict, list, dict]:
    """The findings by kind of one in-process run, its failed expectations and its figures."""
    spec = canary_specs()[variant]
    _frame, findings, values = serve(spec)
    failed = [c for c in check(spec.expect, findings, values) if not c.ok]
    return {f.kind: f for f in findings}, failed, values


def test_the_lazy_advance_keeps_a_buffer_a_layer_a_token_and_its_fix_keeps_none():
    found, failed, values = canary("lazy")
    assert (set(found), failed) == ({"buffers"}, [])
    finding = found["buffers"]
    assert (finding.bytes, finding.count) == (4 * PER_TURN, 10)     # 4 B a buffer, 10 turns
    assert "grow +4.08 a token (4 B each)" in finding.message
    assert "the stated limit of 20,000 buffers in about" in finding.message
    held = 2 * 4                 # each layer's state and its left_padding, in either variant
    assert values["buffers"] == held + 12 * PER_TURN
    found, failed, values = canary("folded")
    assert (found, failed, values["buffers"]) == ({}, [], held)


@pytest.mark.slow
@pytest.mark.parametrize("variant, kinds", [("lazy", {"buffers"}), ("folded", set())])
def test_the_canary_and_its_twin_hold_over_ten_runs(variant, kinds):
    for run in range(RUNS):
        found, failed, _values = canary(variant)
        assert (set(found), failed) == (kinds, []), (run, found)
