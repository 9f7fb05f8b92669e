"""What the probe costs: the engine loop with the probe on against the same loop with it off.

Run with `python -m pytest benchmarks --benchmark-only` (figures in docs/benchmarks.md). The two
engine benchmarks resolve the probe's overhead per step only on a quiet machine: on the shared
2-core machine this project is built on, their means lie within a run-to-run noise larger than
what the probe costs (about 120 us of a 2.2 ms synthetic step, timed inside the loop).
`test_probe_alone_per_step` times one step's probe with no MLX work in flight (about 10 us
there), which leaves out most of the synchronize a real step waits for.
"""

from __future__ import annotations

import pytest

from harness.run.probe import NullProbe, Probe
from harness.run.synthetic_engine import SyntheticEngine
from harness.scenario import ScenarioSpec

# Qwen3-8B geometry: 36 layers, 8 KV heads, head dim 128, bf16; decode dominates.
SPEC = ScenarioSpec.model_validate({
    "name": "bench", "model": "qwen3-8b",
    "workload": {"prefill_chunk": 256, "requests": [{"prompt": 256, "decode": 256}]},
})


def serve(probe: Probe) -> int:
    engine = SyntheticEngine(SPEC, probe)
    engine.serve()
    return probe.steps


@pytest.mark.parametrize("probe", [Probe, NullProbe], ids=["probe_on", "probe_off"])
def test_engine_loop(benchmark, probe):
    steps = benchmark.pedantic(serve, setup=lambda: ((probe(),), {}), rounds=20, warmup_rounds=2)
    assert steps == 1 + 1 + 256 + 1


def test_probe_alone_per_step(benchmark):
    probe = Probe(capacity=1 << 20)

    def one_step() -> None:
        probe.begin()
        probe.end(phase="decode", request=0, turn=-1, tokens=1, logical=0, host=0, minimum=0,
                  work=0)

    benchmark(one_step)
