"""The detector registry: one entry in harness/judge/detectors.py runs, checks and draws a
detector, and one field in DetectSpec and one in ExpectSpec configure it; nothing else changes
when one is added."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.axes import Axes
from pydantic import TypeAdapter

from harness.common.units import KiB, MiB, Size, format_bytes
from harness.judge import detectors as detect
from harness.judge import expect
from harness.judge.at_rest import LeakThresholds
from harness.judge.detectors import DETECTORS, Detector, Marker
from harness.judge.metrics import METRICS
from harness.judge.records import MAX_STEPS_LISTED, Expectation, Finding, from_hits
from harness.judge.thresholds import Thresholds
from harness.report import writing as report
from harness.scenario import ScenarioError, load_variants
from tests.conftest import make_spec, serve

WORKLOAD = {"requests": [{"prompt": 64, "decode": 4}]}   # 64 tokens of 16 KiB: a 1 MiB prefill


class TinyRiseThresholds(Thresholds):
    min_bytes: Size = MiB


def tiny_rise(frame: pd.DataFrame, t: TinyRiseThresholds, backend: str) -> Finding | None:
    """Any step whose active memory rose by more than `min_bytes`."""
    excess = frame["active"].diff()
    hits = frame[excess > t.min_bytes]
    return from_hits("tiny_rise", hits, excess,
                     lambda at: f"active rose {excess[at]:,.0f} B at step {frame['step'][at]}")


TINY_RISE = Detector(tiny_rise, TinyRiseThresholds, None, Marker("*", "tab:olive"))


def scenario(tmp_path, text: str):
    path = tmp_path / "s.yaml"
    path.write_text("model: qwen3-8b\nworkload: {requests: [{prompt: 16}]}\n" + text)
    return path


@pytest.mark.parametrize("text, message", [
    ("detect: {tiny_rise: {min_bytes: 1 KiB}}\n", "detect.tiny_rise: unknown field"),
    ("expect: {tiny_rise: detected}\n", "expect.tiny_rise: unknown field"),
])
def test_an_unregistered_detector_is_an_unknown_field(tmp_path, text, message):
    with pytest.raises(ScenarioError, match=message):
        load_variants(scenario(tmp_path, text))


class TinyDetect(detect.DetectSpec):
    """`detect:` with the new detector's field, as DetectSpec declares each detector's."""

    tiny_rise: TinyRiseThresholds = TinyRiseThresholds()


class TinyExpect(expect.ExpectSpec):
    """`expect:` with the new detector's presence, defaulting to its entry's `expected`."""

    tiny_rise: expect.Expected = None


def test_detect_declares_one_field_per_detector_with_its_defaults():
    """A detector added to DETECTORS and not to DetectSpec fails here, not in a user's file."""
    fields = detect.DetectSpec.model_fields
    assert list(fields) == list(DETECTORS)
    for name, entry in DETECTORS.items():
        assert fields[name].annotation is entry.thresholds
        assert fields[name].default == entry.thresholds()
        assert fields[name].description


def test_expect_declares_each_detectors_presence_and_each_metrics_budget():
    """ExpectSpec's fields: spike's (a presence or a bound), the gate's tolerances, each other
    detector's presence defaulting to its entry's `expected`, then each budget of METRICS."""
    fields = expect.ExpectSpec.model_fields
    presences = [name for name in DETECTORS if name != "spike"]
    budgets = [m.budget for m in METRICS.values() if m.budget is not None]
    assert list(fields) == ["spike", "compare", *presences, *budgets]
    assert {name: fields[name].default for name in presences} == \
        {name: DETECTORS[name].expected for name in presences}
    assert all(field.description for field in fields.values())


def test_one_registry_entry_and_its_fields_are_configured_expected_checked_and_drawn(
        tmp_path, monkeypatch):
    monkeypatch.setitem(DETECTORS, "tiny_rise", TINY_RISE)
    spec = make_spec(workload=WORKLOAD).model_copy(update={
        "detect": TinyDetect.model_validate({"tiny_rise": {"min_bytes": "64 KiB"}}),
        "expect": TinyExpect.model_validate({"tiny_rise": "detected"})})
    assert spec.detect.tiny_rise == TinyRiseThresholds(min_bytes=64 * KiB)
    assert spec.detect.leak == LeakThresholds()           # detectors not named: defaults
    assert pickle.loads(pickle.dumps(spec)) == spec                # as sent to a variant's child

    frame, findings, figures = serve(spec)
    (found,) = [f for f in findings if f.kind == "tiny_rise"]
    checks = {c.name: c for c in expect.check(spec.expect, findings, figures)}
    assert checks["tiny_rise"] == Expectation(name="tiny_rise", expected="detected",
                                              actual="detected", ok=True, message=found.message)

    drawn = []
    monkeypatch.setattr(Axes, "scatter", lambda ax, *args, **kw: drawn.append(kw))
    report.plot_variant(frame, findings, "tiny", tmp_path / "memory.png")
    assert {"marker": "*", "color": "tab:olive", "zorder": 5,
            "label": f"tiny_rise ({found.count})"} in drawn


def test_each_detector_declares_what_is_expected_when_a_scenario_states_nothing(monkeypatch):
    spec = make_spec(workload=WORKLOAD)
    assert (spec.expect.leak, spec.expect.retained, spec.expect.host_memory) == ("none",) * 3
    assert spec.expect.growth is None and spec.expect.spike is None

    monkeypatch.setitem(DETECTORS, "tiny_rise", dataclasses.replace(TINY_RISE, expected="none"))
    _, findings, figures = serve(spec.model_copy(update={"detect": TinyDetect()}))
    (check,) = [c for c in expect.check(TinyExpect(tiny_rise="none"), findings, figures)
                if c.name == "tiny_rise"]
    assert check.expected == "none" and not check.ok
    assert all(c.name != "tiny_rise" for c in expect.check(TinyExpect(), findings, figures))


def test_a_finding_is_reported_at_its_largest_excess_listing_steps_spread_over_its_hits():
    frame = pd.DataFrame({"step": range(30)})
    excess = pd.Series([float(i % 7) for i in range(30)])
    finding = from_hits("k", frame[excess > 0], excess, lambda at: f"worst at {at}")
    assert (finding.step, finding.bytes, finding.count) == (6, 6, 25)
    assert finding.message == "worst at 6"
    # 20 of the 25 hits, the first and the last among them (tests/test_plots.py: the rule).
    assert len(finding.steps) == MAX_STEPS_LISTED
    assert finding.steps == [1, 2, 4, 5, 6, 8, 10, 11, 12, 13, 16, 17, 18, 19, 22, 23, 24, 25,
                             27, 29]
    assert from_hits("k", frame[excess > 9], excess, str) is None


DETECTORS_PAGE = Path(__file__).parent.parent / "docs" / "detectors.md"


def _stated(field: str, value: object) -> str:
    """A threshold as the page states it: `min_bytes 64 KiB`, `r2 0.9`, `budget none`."""
    if value is None:
        return f"{field} none"
    if (isinstance(value, int) and "bytes" in field) or field in ("budget", "flat", "min_rate"):
        return f"{field} {format_bytes(value)}"
    return f"{field} {value}"


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_the_detectors_page_gives_each_detectors_defaults_and_expectation(name):
    """docs/detectors.md's table states every threshold's default as its class holds it, and
    what is expected where a scenario says nothing, as its registry entry does."""
    entry = DETECTORS[name]
    (row,) = [line for line in DETECTORS_PAGE.read_text().splitlines()
              if line.startswith(f"| `{name}` |")]
    cells = [cell.strip() for cell in row.strip("|").split(" | ")]
    defaults, expected = cells[-3], cells[-2]
    fields = entry.thresholds().model_dump()
    stated = [_stated(field, value) for field, value in fields.items()]
    assert sorted(part.split(" (")[0] for part in defaults.split(", ")) == sorted(stated) \
        or (not fields and defaults == "none")
    assert expected.startswith("none" if entry.expected == "none" else "checked only when stated")


# At-rest detectors on constructed samples: a baseline, then one quiescent point per request.
BASE = 100 * MiB


def at_rest(active: list[int], logical: list[int], cache: list[int] | None = None,
            cyclic: list[int] | None = None) -> pd.DataFrame:
    """The baseline (nothing held) and one idle sample per request, bytes above the baseline."""
    n = len(active)
    zeros = [0] * n
    frame = pd.DataFrame({
        "step": range(n + 1), "phase": pd.Categorical(["idle"] * (n + 1)),
        "request": [-1, *range(n)], "turn": -1, "tokens": 0,
        "active": [BASE, *(BASE + a for a in active)], "peak": [BASE, *(BASE + a for a in active)],
        "cache": [0, *(cache or zeros)], "logical": [0, *logical], "host": 0,
        "minimum": 0, "work": 0, "cyclic": [0, *(cyclic or zeros)],
    })
    return frame.assign(rss=frame["active"] + frame["cache"])   # nothing outside MLX


def kinds(frame: pd.DataFrame, **thresholds) -> dict[str, Finding]:
    spec = make_spec(workload=WORKLOAD, detect=thresholds)
    return {f.kind: f for f in detect.detect(frame, spec.detect, "cpu")}


def evicting(broken: bool) -> pd.DataFrame:
    """A store of 1 MiB entries that fills 8, then evicts one per request for 12 more; broken,
    the evicted entry stays alive and unreported."""
    held = [min(k, 8) * MiB for k in range(1, 21)]
    alive = [k * MiB for k in range(1, 21)] if broken else held
    return at_rest(alive, held)


def test_a_store_filling_to_its_limit_then_evicting_is_not_a_leak_but_a_plateau():
    found = kinds(evicting(broken=False))
    assert set(found) == {"plateau"}             # with no budget stated too: it stopped growing
    assert (found["plateau"].step, found["plateau"].bytes, found["plateau"].count) == (8, 8 * MiB, 12)
    assert "rose to 8.00 MiB by step 8 and held there over the last 12 requests" \
        in found["plateau"].message


def test_broken_eviction_is_a_leak_of_the_unreported_bytes_and_nothing_else():
    found = kinds(evicting(broken=True))
    assert set(found) == {"leak"}                  # not retained, though 12 MiB > 25% of 8 MiB
    found = kinds(evicting(broken=True), leak={"warmup": 8}, retained={"warmup": 8})
    assert set(found) == {"leak"}
    assert (found["leak"].bytes, found["leak"].count) == (MiB, 11)   # the warm-up covers the fill


def test_honest_unlimited_growth_is_unbounded_past_a_stated_budget_never_a_leak():
    growing = at_rest([k * MiB for k in range(1, 21)], [k * MiB for k in range(1, 21)])
    warned = kinds(growing)                                      # no budget: a warning
    assert set(warned) == {"unbounded"} and warned["unbounded"].severity == "warning"
    assert "20.00 MiB at rest, with no budget stated" in warned["unbounded"].message
    assert kinds(growing, unbounded={"budget": "20 MiB"}) == {}  # 20 MiB at the end: within it
    found = kinds(growing, unbounded={"budget": "10 MiB"})
    assert set(found) == {"unbounded"} and found["unbounded"].severity == "error"
    assert (found["unbounded"].bytes, found["unbounded"].count) == (MiB, 18)
    assert "20.00 MiB at rest, over the budget of 10.00 MiB" in found["unbounded"].message


def test_reported_bytes_over_a_stated_budget_are_unbounded_whether_rising_flat_or_from_the_start():
    flat_after_rise = [min(k, 8) * MiB for k in range(1, 13)]
    found = kinds(at_rest(flat_after_rise, flat_after_rise), unbounded={"budget": "6 MiB"})
    assert set(found) == {"unbounded", "plateau"} and found["unbounded"].severity == "error"
    assert (found["unbounded"].bytes, found["unbounded"].count) == (2 * MiB, 6)  # points 7..12
    assert "over the budget of 6.00 MiB since request 6, not rising" in found["unbounded"].message
    from_start = at_rest([8 * MiB] * 6, [8 * MiB] * 6)
    found = kinds(from_start, unbounded={"budget": "6 MiB"})
    assert set(found) == {"unbounded"} and found["unbounded"].bytes == 2 * MiB
    assert "from the first point at rest" in found["unbounded"].message
    assert kinds(from_start, unbounded={"budget": "8 MiB"}) == {}


def test_a_count_the_baseline_had_is_held_as_far_as_the_memory_it_held_then_confirms_it():
    """A server restarted onto a cache it reloads counts it from its first sample. Loaded, its
    bytes are in the baseline's memory (here 100 MiB in all); loaded lazily (`mx.load`), MLX
    holds none of them (1 MiB in all): claimed, not held."""
    reloaded = at_rest([0] * 6, [8 * MiB] * 6)
    reloaded.loc[0, "logical"] = 8 * MiB
    found = kinds(reloaded, unbounded={"budget": "6 MiB"})
    assert set(found) == {"unbounded"} and found["unbounded"].bytes == 2 * MiB
    assert "from the first point at rest" in found["unbounded"].message
    lazy = reloaded.assign(active=reloaded["active"] - BASE + MiB,
                           peak=reloaded["peak"] - BASE + MiB, rss=reloaded["rss"] - BASE + MiB)
    assert kinds(lazy, unbounded={"budget": "6 MiB"}) == {}
    assert kinds(lazy) == {}                     # no budget: flat is not growth
    # Held in part above the baseline: the budget judges the part MLX holds.
    half = at_rest([7 * MiB] * 6, [8 * MiB] * 6)
    found = kinds(half, unbounded={"budget": "6 MiB"})
    assert set(found) == {"unbounded"} and found["unbounded"].bytes == MiB
    assert "components hold 7.00 MiB at rest, over the budget of 6.00 MiB" \
        in found["unbounded"].message


def capped(logical: list[int], cap: int) -> pd.DataFrame:
    """A store of `logical` bytes at rest that reports a cap of `cap` bytes."""
    frame = at_rest(logical, logical)
    return frame.assign(cap=cap)


def test_a_cache_over_its_own_cap_where_the_run_ends_and_mostly_since_is_over_cap():
    cap = 8_000_000
    persistent = [3 * MiB, 6 * MiB, 9 * MiB, *[10 * MiB] * 9]
    found = kinds(capped(persistent, cap))
    assert set(found) == {"over_cap", "plateau"}    # no unbounded: the cap says it better
    assert (found["over_cap"].bytes, found["over_cap"].count) == (10 * MiB - cap, 10)
    assert found["over_cap"].supersedes == ["unbounded"]   # no budget stated: it answers
    assert "holds 10.00 MiB at rest against its own 7.63 MiB cap" in found["over_cap"].message
    # Enforced when the next request is admitted: the entry a request stores sits over the cap
    # until then (mlx_lm.server's batched path), at one point in several, which is the cap.
    admitted = [3 * MiB, 6 * MiB, 8_454_144, *[7_995_392, 7_864_320, 8_208_384] * 4, 7_995_392]
    assert set(kinds(capped(admitted, cap))) <= {"plateau"}
    ends_over = [*admitted[:-1], 8_454_144]         # over at the end, but rarely since
    assert "over_cap" not in kinds(capped(ends_over, cap))
    assert "over_cap" not in kinds(capped(persistent, 0))          # no cap known
    assert "over_cap" not in kinds(capped(persistent, 11 * MiB))  # within it


# mlx_lm.server, dense, --prompt-cache-bytes 64MB, 12 sessions of 3 turns (issue 35): the
# cache fills towards its cap, and the entries the last requests stored sit 581,386 B over it
# (61.59 MiB against 61.04 MiB) at the last 5 of 36 points, until the next request is admitted.
CAP_64MB = 64_000_000
ADMITTED = [*(min((k + 1) * 2_000_000, 63_000_000) for k in range(31)), *[64_581_386] * 5]


def test_a_cap_is_judged_by_one_rule_its_slack_the_cap_working():
    found = kinds(capped(ADMITTED, CAP_64MB))
    assert "unbounded" not in found and "over_cap" not in found
    # More than 5% over (3,200,000 B), at the same points: the cap is not working.
    broken = [*ADMITTED[:31], *[67_200_001] * 5]
    found = kinds(capped(broken, CAP_64MB))
    assert "unbounded" not in found
    assert (found["over_cap"].bytes, found["over_cap"].count) == (3_200_001, 5)
    assert found["over_cap"].supersedes == ["unbounded"]
    assert "over_cap" not in kinds(capped([*ADMITTED[:31], *[67_200_000] * 5], CAP_64MB))


def test_a_stated_budget_is_the_users_hard_bound_and_is_never_superseded():
    found = kinds(capped(ADMITTED, CAP_64MB), unbounded={"budget": CAP_64MB})
    assert set(found) == {"unbounded", "plateau"} and found["unbounded"].severity == "error"
    assert (found["unbounded"].bytes, found["unbounded"].count) == (581_386, 5)
    assert ("components hold 61.59 MiB at rest, over the budget of 61.04 MiB since request 31, "
            "not rising: over it at 5 of 35 points at rest") in found["unbounded"].message
    assert "unbounded" not in kinds(capped(ADMITTED, CAP_64MB), unbounded={"budget": 64_581_386})
    # Over its cap and over a budget restated: two bounds, two findings, neither moot.
    broken = [*ADMITTED[:31], *[67_200_001] * 5]
    found = kinds(capped(broken, CAP_64MB), unbounded={"budget": CAP_64MB})
    assert {"unbounded", "over_cap"} <= set(found) and found["over_cap"].supersedes == []


def presences(frame: pd.DataFrame, **fields) -> dict[str, Expectation]:
    """The presence expectations of a spec's `detect` and `expect` over constructed samples."""
    spec = make_spec(workload=WORKLOAD, **fields)
    found = detect.detect(frame, spec.detect, "cpu")
    return {c.name: c for c in expect.check(spec.expect, found, {})}


def test_an_expectation_answered_by_the_finding_that_superseded_it_says_so():
    broken = capped([*ADMITTED[:31], *[67_200_001] * 5], CAP_64MB)
    checks = presences(broken, expect={"unbounded": "detected"})
    assert not checks["unbounded"].ok and checks["unbounded"].superseded_by == "over_cap"
    assert checks["unbounded"].describe() == ("unbounded: expected detected, got none "
                                              "(superseded by over_cap, which judges the same "
                                              "bound)")
    assert checks["unbounded"].message.startswith("no unbounded finding: superseded by "
                                                  "over_cap: the cache holds 64.09 MiB")
    assert checks["over_cap"].describe() == "over_cap: expected none, got detected"
    # A budget restated: unbounded judges it, nothing is superseded.
    checks = presences(broken, detect={"unbounded": {"budget": CAP_64MB}},
                       expect={"unbounded": "detected", "over_cap": "detected"})
    assert all(c.ok and c.superseded_by is None for c in checks.values())


def test_what_a_finding_answers_for_is_written_only_where_it_answers_for_something():
    answered = Finding(kind="over_cap", message="m", supersedes=["unbounded"])
    assert TypeAdapter(Finding).dump_python(answered, mode="json")["supersedes"] == ["unbounded"]
    assert "supersedes" not in TypeAdapter(Finding).dump_python(Finding(kind="leak", message="m"),
                                                                mode="json")
    plain = Expectation(name="leak", expected="none", actual="none", ok=True)
    assert "superseded_by" not in TypeAdapter(Expectation).dump_python(plain, mode="json")


def test_an_accounting_that_claims_more_than_is_held_is_overclaimed_never_unbounded():
    counted = [k * 16 * MiB for k in range(1, 10)]
    found = kinds(at_rest([0] * 9, counted))        # counts 144 MiB, holds nothing
    assert set(found) == {"overclaimed"}
    assert (found["overclaimed"].bytes, found["overclaimed"].count) == (144 * MiB, 9)
    assert "claims 144.00 MiB at rest (144.00 MiB more than at the baseline); 0.00 MiB are " \
        "held above the baseline" in found["overclaimed"].message
    # Counting up to a third more than it holds (entries sharing buffers) is not a wrong count.
    assert "overclaimed" not in kinds(at_rest([k * 12 * MiB for k in range(1, 10)], counted))
    # Wrong early, right where the run ends: a baseline that held the warm-up's buffers.
    early = at_rest([0, *(k * 16 * MiB for k in range(2, 10))], counted)
    assert "overclaimed" not in kinds(early)


def wasteful(tokens: list[int]) -> pd.DataFrame:
    """Entries of `tokens` 4 KiB tokens each, kept as slices of 512-slot buffers."""
    logical = [sum(tokens[: k + 1]) * 4096 for k in range(len(tokens))]
    waste = [sum(512 - t for t in tokens[: k + 1]) * 4096 for k in range(len(tokens))]
    return at_rest([w + h for w, h in zip(waste, logical, strict=True)], logical)


def test_small_waste_in_every_entry_is_retained_by_its_trend():
    tokens = [470] * 5 + [480] * 5 + [490] * 5 + [500] * 5        # 8.9% down to 2.4% waste
    assert set(kinds(wasteful(tokens))) == {"retained", "unbounded"}  # it never evicts, too
    found = kinds(wasteful(tokens), unbounded={"budget": "64 MiB"})
    assert set(found) == {"retained"}
    assert found["retained"].bytes == sum(512 - t for t in tokens) * 4096 == 2_211_840
    assert "rising 90,112 B per request in step" in found["retained"].message  # the median delta
    assert kinds(wasteful(tokens[:3])) == {}                   # 3 points: 2 past the warm-up


def test_the_same_rising_excess_is_a_leak_when_the_reported_bytes_stand_still():
    entry, waste = 470 * 4096, 42 * 4096                 # the store reports one entry only
    frame = at_rest([entry + waste * k for k in range(1, 21)], [entry] * 20)
    found = kinds(frame)
    assert set(found) == {"leak"}
    assert found["leak"].bytes == waste


def test_bytes_only_the_cycle_collector_freed_at_rest_are_gc_deferred():
    frame = at_rest([MiB] * 4, [MiB] * 4, cyclic=[0, MiB, 3 * MiB, 64 * KiB])
    frame.loc[0, "cyclic"] = 50 * MiB                # before the run: not the run's
    found = kinds(frame)
    assert set(found) == {"gc_deferred"}
    assert (found["gc_deferred"].step, found["gc_deferred"].bytes) == (3, 3 * MiB)
    assert found["gc_deferred"].steps == [2, 3]         # 64 KiB is not more than the floor


def test_a_buffer_cache_holding_more_than_the_floor_at_rest_is_pooled():
    frame = at_rest([0] * 3, [0] * 3, cache=[32 * MiB, 64 * MiB, 65 * MiB])
    frame.loc[0, ["cache", "rss"]] += 500 * MiB         # the baseline's cache: not at rest
    found = kinds(frame)
    assert set(found) == {"pooled"}
    assert (found["pooled"].step, found["pooled"].bytes, found["pooled"].count) == (3, 65 * MiB, 1)
    assert kinds(frame, pooled={"min_bytes": "128 MiB"}) == {}
    # Metal's and CUDA's default limits follow the device: no floor unless the scenario says.
    spec = make_spec(workload=WORKLOAD)
    assert detect.detect(frame, spec.detect, "gpu") == []
    stated = make_spec(workload=WORKLOAD, detect={"pooled": {"min_bytes": "64 MiB"}})
    assert [f.kind for f in detect.detect(frame, stated.detect, "gpu")] == ["pooled"]


# preallocated, on served runs: 4 sliding layers of 8 KV heads of 128 in float16 (16 KiB a
# token) with a window of 4,096 tokens, 64 MiB allocated up front by the reference cache.
WINDOWED = {"dtype": "float16", "vocab": 1024,
            "layers": [{"count": 4, "kind": "sliding", "kv_heads": 8, "head_dim": 128, "window": 4096}]}


def windowed(component: str, prompt: int = 90, batch: int = 1) -> pd.DataFrame:
    """The samples of a prompt then 10 decode steps."""
    spec = make_spec(model=WINDOWED, cache={"sliding": {"component": component}},
                     workload={"batch": batch, "requests": [{"prompt": prompt, "decode": 10}]})
    frame, _, _ = serve(spec)
    return frame


def test_a_window_allocated_up_front_and_mostly_empty_is_said_with_what_it_costs():
    found = kinds(windowed("reference.rotating"))["preallocated"]
    assert found.severity == "warning"
    # Judged from the second decode step (92 tokens) on; the largest spare is there.
    assert (found.step, found.count) == (3, 9)
    assert found.bytes == (4096 - 92) * 16 * KiB
    assert found.message == ("the caches report 64.00 MiB at step 3 (decode) where the request's "
                             "92 tokens need 1.44 MiB (2% used): 62.56 MiB allocated ahead of its "
                             "tokens, as a window allocated up front is from the first token")


@pytest.mark.parametrize("component, prompt", [
    ("mlx_lm.RotatingKVCache", 90),    # grows 256 slots at a time
    ("mlx_lm.KVCache", 90),
    ("reference.rotating", 2100),       # more than half the window used
])
def test_caches_that_grow_with_their_tokens_or_are_mostly_used_are_not_preallocated(component, prompt):
    assert "preallocated" not in kinds(windowed(component, prompt))


def test_a_batch_window_allocated_up_front_is_preallocated_and_mlx_lm_s_is_not():
    assert "preallocated" in kinds(windowed("reference.batch_rotating", batch=2))
    assert "preallocated" not in kinds(windowed("mlx_lm.BatchRotatingKVCache", batch=2))


@pytest.mark.parametrize("phase, turn", [("store", -1), ("fetch", -1), ("idle", 0)])
def test_where_a_store_or_a_session_reports_bytes_too_nothing_is_judged(phase, turn):
    frame = windowed("reference.rotating")
    frame.loc[len(frame) - 1, ["phase", "turn"]] = [phase, turn]
    assert "preallocated" not in kinds(frame)
