"""What the holder walk costs against the number of live Python objects it visits.

Run with `python -m pytest benchmarks/test_holders_walk.py --benchmark-only` (figures in
docs/holders.md and docs/benchmarks.md; `extra_info` records the objects each walk visited). The
walk is one pass over every gc-tracked object reachable from a module global or a frame, so its
time grows with the process: kvmem's own test process as it is, the same after importing mlx_lm
(its models, generation and tokenizer modules, as a server has them), and that with 100,000 small
dicts and 100,000 lists more (a server's bookkeeping) held by a frame. A model's weights add one
node per array: few next to the modules' objects.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import pytest

from harness.agent.kvmem_holders import census

PROCESSES = {"kvmem": ((), 0), "mlx_lm": (("mlx_lm", "mlx_lm.generate"), 0),
             "mlx_lm_plus_200k_objects": (("mlx_lm", "mlx_lm.generate"), 100_000)}


@pytest.mark.parametrize("process", list(PROCESSES))
def test_census(benchmark, process):
    modules, extra = PROCESSES[process]
    for module in modules:
        importlib.import_module(module)
    held = [{"request": [n]} for n in range(extra)]
    found = benchmark.pedantic(census, args=(mx,), rounds=5, warmup_rounds=1)
    benchmark.extra_info["objects"] = found.objects
    assert found.objects > 2 * len(held)
