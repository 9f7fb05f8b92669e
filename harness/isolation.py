"""One process per variant, with a footprint check before it starts.

On the CPU backend an allocation larger than RAM kills the process (SIGSEGV) and
`set_memory_limit` does not raise, so a variant runs in a child: a child that dies becomes a
failed run with its exit status and the last step it reached, and the other variants go on.
A variant whose estimated footprint cannot fit in available memory is refused up front.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

from .components import resolve
from .kv import SyntheticKV
from .probe import ROW, Probe
from .runner import Engine
from .scenario import Scenario, ScenarioSpec

RUNTIME_SLACK = 256 * 2**20  # interpreter, MLX and the sample rows


@dataclass
class RunOutcome:
    scenario: Scenario
    status: str  # ok | failed | refused
    rows: np.ndarray
    error: str | None
    exit_status: int | None
    last_step: int
    wall_s: float
    estimate: int


def estimate_bytes(spec: ScenarioSpec) -> int:
    """An upper bound on a variant's footprint, from the geometry and the workload.

    The longest context's caches twice (a growth step briefly holds old and new buffers), a
    prefill chunk's K/V twice, and whatever a store or session says it adds on top.
    """
    geometry, workload = spec.geometry(), spec.workload
    if workload.chat is not None:
        context = workload.chat.turns * (workload.chat.user + workload.chat.model)
    else:
        context = max(r.prompt + r.decode for r in workload.requests)
    caches = geometry.minimum_bytes(context + 256)
    chunk = sum(SyntheticKV.input_bytes(l, workload.prefill_chunk) for l in geometry.layers)
    extra = 0
    for component in (spec.cache.store, spec.cache.session):
        estimate = getattr(resolve(component.component), "estimate_bytes", None) if component else None
        if estimate is not None:
            extra += estimate(geometry, workload, **component.options)
    return 2 * caches + 2 * chunk + extra + RUNTIME_SLACK


def _child(scenario: Scenario, result: str, last_step) -> None:
    """Runs in the child: serve, then leave the rows and any error where the parent looks."""
    probe = Probe()
    error = None
    engine = None

    def progress(steps: int) -> None:
        last_step.value = steps

    try:
        engine = Engine(scenario.spec, probe, progress)
        engine.serve()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
    finally:
        if engine is not None:
            engine.close()
    np.save(result + ".npy", probe.rows())
    Path(result + ".json").write_text(json.dumps({"error": error}))
    if error is not None:
        raise SystemExit(1)


def execute(scenario: Scenario, on_step: Callable[[int], None] | None = None) -> RunOutcome:
    """Run one variant in a child process; never raises for what happens inside the child."""
    estimate = estimate_bytes(scenario.spec)
    available = psutil.virtual_memory().available
    empty = np.zeros(0, dtype=ROW)
    if estimate > available:
        return RunOutcome(scenario, "refused", empty,
                          f"estimated footprint {estimate / 2**30:.2f} GiB exceeds the "
                          f"{available / 2**30:.2f} GiB available", None, 0, 0.0, estimate)
    context = mp.get_context("spawn")
    last_step = context.Value("q", 0, lock=False)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvmem-") as tmp:
        result = str(Path(tmp) / "result")
        child = context.Process(target=_child, args=(scenario, result, last_step))
        child.start()
        while child.is_alive():
            child.join(0.1)
            if on_step is not None:
                on_step(last_step.value)
        wall = time.perf_counter() - start
        code = child.exitcode
        rows = np.load(result + ".npy") if Path(result + ".npy").exists() else empty
        error = None
        if Path(result + ".json").exists():
            error = json.loads(Path(result + ".json").read_text())["error"]
    if code == 0:
        return RunOutcome(scenario, "ok", rows, None, 0, last_step.value, wall, estimate)
    if error is None:
        how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        error = f"the variant's process {how} at step {last_step.value}"
    return RunOutcome(scenario, "failed", rows, error, code, last_step.value, wall, estimate)
