"""What the probe costs on the mlx_lm engine, as a share of a real model's step.

Run with `python -m pytest benchmarks/test_real_probe.py --benchmark-only` (figures in
docs/benchmarks.md). One engine serves Qwen3-0.6B's geometry (all 28 layers, its 151,936-token
vocabulary, bf16, random weights): its weights are built and evaluated once, and each round
serves one request (a 32-token prompt, 32 decode steps) on fresh caches, with the probe on or
off (`NullProbe`, which also leaves out the synchronize of the generation stream).

The probe costs a real step in two ways: its own reads (synchronize, counters, RSS, the row),
timed inside the loop by `TimedProbe` once the step's work has completed; and the overlap it
takes away, because `generate_step` queues the next step before yielding a token and the probe
waits for it, so the next graph is built while nothing computes. The loop-against-loop ratio
(`test_real_loop`) holds both but lies within this machine's noise; `test_probe_share_of_a_real
_step` records the in-loop share, the figure the target (at most 1%) is about.
"""

from __future__ import annotations

import time
from functools import cache

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generation_stream

from harness.run.model_engine import ModelEngine
from harness.run.probe import NullProbe, Probe
from harness.scenario import ScenarioSpec

SPEC = ScenarioSpec.model_validate({
    "name": "bench", "engine": "mlx_lm", "model": "qwen3-0.6b",
    "workload": {"prefill_chunk": 32, "requests": [{"prompt": 32, "decode": 32}]},
})
PROMPT = np.arange(32, dtype=np.int64) * 37
PLANNED = np.zeros(32, dtype=np.int64)


class TimedProbe(Probe):
    """The probe, with the seconds spent in its own reads summed (the step's work waited for
    first, untimed, so the figure is the probe's and not the step's)."""

    def __init__(self) -> None:
        super().__init__(capacity=1 << 16)
        self.seconds = 0.0

    def begin(self) -> None:
        start = time.perf_counter()
        super().begin()
        self.seconds += time.perf_counter() - start

    def end(self, **kwargs) -> None:
        for stream in self._streams:
            mx.synchronize(stream)
        mx.synchronize()
        start = time.perf_counter()
        super().end(**kwargs)
        self.seconds += time.perf_counter() - start


@cache
def engine() -> ModelEngine:
    return ModelEngine(SPEC, Probe())


def serve_one(probe: Probe) -> int:
    """One request on fresh caches; the probe rows it took."""
    server = engine()
    server.probe = probe
    caches = server.make_caches()
    server._live = [caches]
    server.generate(caches, PROMPT, 0, PLANNED)
    server._live = []
    return probe.steps


@pytest.mark.parametrize("probe", [Probe, NullProbe], ids=["probe_on", "probe_off"])
def test_real_loop(benchmark, probe):
    fresh = probe()
    if probe is Probe:
        fresh.watch(generation_stream)
    steps = benchmark.pedantic(lambda: serve_one(fresh), rounds=5, warmup_rounds=1)
    assert steps % 33 == 0  # one prefill chunk (31 tokens) and 32 decode rows per round


def test_probe_share_of_a_real_step(benchmark):
    probe = TimedProbe()
    probe.watch(generation_stream)

    def round_share() -> float:
        before, start = probe.seconds, time.perf_counter()
        serve_one(probe)
        return (probe.seconds - before) / (time.perf_counter() - start)

    benchmark.pedantic(round_share, rounds=5, warmup_rounds=1)
    share = round_share()
    benchmark.extra_info["probe_share"] = share
    benchmark.extra_info["probe_us_per_step"] = 1e6 * probe.seconds / probe.steps
    assert 0 < share < 1
