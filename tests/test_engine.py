"""The engine loop and detectors against mlx-lm's KVCache and the test fixtures, in bytes."""

from __future__ import annotations

from harness.common.units import MiB
from tests.conftest import TOKEN_BYTES, make_spec, serve

STEP_SLOTS = 256  # mlx-lm's KVCache grows in blocks of 256 slots


def growth_spec(**extra):
    return make_spec(
        workload={"prefill_chunk": 100, "requests": [{"prompt": 100, "decode": 700}]},
        # Below the smallest transient a growth step must make (at the first boundary, one
        # array's 256 old slots and 256 new ones: 1 MiB, see below), so every boundary is found
        # in every run; the other steps' peak noise measured under 4 KiB, three runs at once.
        detect={"spike": {"min_bytes": "512 KiB"}, "growth": {"min_bytes": "64 KiB"}},
        **extra,
    )


def test_kvcache_steady_bytes_equal_the_analytic_capacity():
    _frame, _findings, figures = serve(growth_spec())
    # 800 tokens sit in 1024 slots: 4 blocks of 256.
    assert figures["steady"] == 1024 * TOKEN_BYTES == 16 * MiB
    assert figures["minimum"] == 800 * TOKEN_BYTES
    assert figures["overhead_ratio"] == round(1024 / 800, 4)
    assert figures["retained"] == 0
    assert figures["final"] == 0  # everything released after the request


def test_kvcache_growth_steps_are_found_at_every_256_token_boundary():
    _frame, findings, _figures = serve(growth_spec())
    # Row 0 is the baseline, row 1 the 100-token prefill, row k >= 2 decodes token 99 + k.
    boundaries = [t + 1 for t in (256, 512, 768)]
    expected_steps = [t - 99 for t in boundaries]
    by_kind = {f.kind: f for f in findings}
    assert set(by_kind) == {"spike", "growth"}
    assert by_kind["spike"].steps == expected_steps
    assert by_kind["growth"].steps == expected_steps
    # Each growth step grows the buffer by 256 slots for one token.
    assert by_kind["growth"].bytes == STEP_SLOTS * TOKEN_BYTES - TOKEN_BYTES
    # How many of the eight K/V arrays still hold their old buffer while the others' results
    # exist depends on when MLX's worker thread frees them (measured 8 to 16 MiB at the last
    # boundary). What the physics guarantees: while the last concatenation of the step runs,
    # every other array holds its grown buffer and this one holds its old buffer, its new
    # block and the result, so the peak exceeds the settled memory by at least one array's
    # old buffer and block (its 1024 slots: a layer's K, an eighth of a token's bytes over the
    # four layers), less the token's own K/V. At most, all eight are alive at once.
    last_array = 1024 * TOKEN_BYTES // 8
    assert last_array - TOKEN_BYTES <= by_kind["spike"].bytes <= 1024 * TOKEN_BYTES + MiB



def test_a_store_keeping_every_request_and_reporting_it_is_unbounded_not_a_leak():
    spec = make_spec(
        cache={"store": {"component": "examples.leaky_store:LeakyStore",
                         "options": {"leak": True}}},
        workload={"prefill_chunk": 128, "requests": [{"prompt": 200, "decode": 56, "repeat": 6}]},
        detect={"unbounded": {"budget": "1 MiB"}},
    )
    frame, findings, figures = serve(spec)
    assert [f.kind for f in findings] == ["unbounded"]
    # Layer 0's keys of each request: 256 slots x 8 heads x 128 x 2 bytes, all in its nbytes.
    assert findings[0].bytes == 256 * 8 * 128 * 2
    assert findings[0].count == 4  # 6 requests, 1 of warm-up: 5 points, 4 deltas
    assert figures["leak_rate"] == 0 and frame["logical"].iloc[-1] == 6 * 256 * 8 * 128 * 2


def test_the_same_store_without_the_leak_raises_no_finding():
    spec = make_spec(
        cache={"store": {"component": "examples.leaky_store:LeakyStore",
                         "options": {"leak": False}}},
        workload={"prefill_chunk": 128, "requests": [{"prompt": 200, "decode": 56, "repeat": 6}]},
    )
    _frame, findings, figures = serve(spec)
    assert findings == []
    assert figures["leak_rate"] == 0 and figures["final"] == 0


def trim_spec(trim: str):
    return make_spec(
        cache={"store": {"component": "tests.fixtures.components:TrimStore",
                         "options": {"trim": trim}}},
        workload={"prefill_chunk": 512, "requests": [{"prompt": 300, "decode": 10}]},
    )


def test_a_slice_that_keeps_its_buffer_alive_is_flagged_as_retained():
    frame, findings, figures = serve(trim_spec("slice"))
    assert [f.kind for f in findings] == ["retained"]
    # 310 tokens sit in 512 slots; the stored views report 310 tokens and pin all 512.
    assert findings[0].bytes == (512 - 310) * TOKEN_BYTES
    assert frame["logical"].iloc[-1] == 310 * TOKEN_BYTES
    assert figures["final"] == 512 * TOKEN_BYTES


def test_a_real_copy_frees_the_buffer_and_raises_no_finding():
    frame, findings, figures = serve(trim_spec("copy"))
    assert findings == []
    assert figures["final"] == 310 * TOKEN_BYTES == frame["logical"].iloc[-1]


def test_sliding_layers_hold_their_window_and_recurrent_layers_a_fixed_state():
    spec = make_spec(
        model={"dtype": "float16", "vocab": 1024, "layers": [
            {"count": 2, "kind": "sliding", "kv_heads": 2, "head_dim": 64, "window": 128},
            {"count": 1, "kind": "recurrent", "state_bytes": "64 KiB"},
            {"count": 1, "kind": "full", "kv_heads": 2, "head_dim": 64},
        ]},
        workload={"prefill_chunk": 64, "requests": [{"prompt": 64, "decode": 200}]},
    )
    _frame, findings, figures = serve(spec)
    token = 2 * 2 * 64 * 2
    # 264 tokens: sliding layers keep 128 each, the full layer 512 slots (two 256 blocks),
    # the recurrent layer its 64 KiB state.
    assert figures["minimum"] == 2 * 128 * token + 65536 + 264 * token
    assert figures["steady"] == 2 * 128 * token + 65536 + 512 * token
    assert not [f for f in findings if f.kind in ("leak", "retained", "host_memory")]


def test_an_engine_is_one_module_imported_where_its_name_is_looked_up(monkeypatch):
    """The class `engine_class` imports for a name, at the time it is named, is what sizes,
    serves and is judged as any engine's: a module implementing the engine protocol, put in
    the place of the synthetic engine's."""
    from harness.pipeline.isolation import estimate_bytes
    from harness.run import synthetic_engine
    from tests.conftest import serve_with_engine
    from tests.fixtures.quiet_engine import ESTIMATE, QuietEngine

    monkeypatch.setattr(synthetic_engine, "SyntheticEngine", QuietEngine)
    spec = make_spec(workload={"requests": [{"prompt": 8}] * 3})
    assert estimate_bytes(spec) == ESTIMATE
    engine, frame, findings, figures = serve_with_engine(spec)
    assert isinstance(engine, QuietEngine)
    assert frame["phase"].tolist() == ["idle"] * 4 and findings == []
    assert (figures["steps"], figures["final"]) == (4, 0)


def test_each_engine_name_has_its_entry_and_its_class():
    """`engine:`'s names, the table of what each serves, and the classes serving them agree."""
    from typing import get_args

    from harness.run.engine_choice import engine_class
    from harness.scenario.engines import ENGINES, EngineName

    assert get_args(EngineName) == tuple(ENGINES)
    assert {name: engine_class(name).__name__ for name in ENGINES} == {
        "synthetic": "SyntheticEngine", "mlx_lm": "ModelEngine", "server": "ServerEngine"}
