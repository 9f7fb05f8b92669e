"""Shared helpers: build small scenarios in memory and run them in-process."""

from __future__ import annotations

import mlx.core as mx
import pandas as pd
import pytest

from harness.judge.detectors import detect
from harness.judge.expect import check
from harness.judge.metrics import RunFacts, Samples, figures
from harness.judge.records import Expectation, Finding
from harness.models.folder import folder
from harness.models.loading import ModelChoice
from harness.run.engine_choice import create
from harness.run.engines import Engine
from harness.run.probe import Probe, to_frame
from harness.scenario import ScenarioSpec

SMALL_MODEL = {"dtype": "float16", "vocab": 1024,
               "layers": [{"count": 4, "kind": "full", "kv_heads": 8, "head_dim": 128}]}
TOKEN_BYTES = 4 * 2 * 8 * 128 * 2  # 4 layers, K and V, float16: 16 KiB per token


@pytest.fixture(autouse=True)
def one_job_by_default(monkeypatch):
    """`kvmem run` defaults to one job per core; the tests say `--jobs` where they mean it, so
    that timings and the order of a run's output do not depend on the machine's cores."""
    monkeypatch.setattr("harness.cli.options.usable_cores", lambda: 1)


def make_spec(**fields) -> ScenarioSpec:
    fields.setdefault("name", "test")
    fields.setdefault("model", SMALL_MODEL)
    return ScenarioSpec.model_validate(fields)


def serve_with_engine(spec: ScenarioSpec) -> tuple[Engine, pd.DataFrame, list[Finding], dict]:
    """Run a spec in this process on the engine it names; the engine (closed), samples,
    findings and metrics (a run's facts as 0: no process, no estimate)."""
    probe = Probe()
    engine = create(spec, probe)
    try:
        engine.serve()
    finally:
        engine.close()
    frame = to_frame(probe.rows())
    findings = detect(frame, spec.detect, "cpu")
    facts = engine.facts()
    weights = facts.weights if facts is not None else None
    return engine, frame, findings, figures(Samples(frame, findings, spec.detect,
                                                    RunFacts(0.0, 0, weights)))


def serve(spec: ScenarioSpec) -> tuple[pd.DataFrame, list[Finding], dict]:
    """Run a spec in this process; samples, findings and metrics."""
    _engine, frame, findings, figures = serve_with_engine(spec)
    return frame, findings, figures


def kinds_and_failures(spec: ScenarioSpec) -> tuple[set[str], list[Expectation]]:
    """The finding kinds of a spec served in this process, and its failed expectations."""
    _, findings, values = serve(spec)
    failed = [c for c in check(spec.expect, findings, values) if not c.ok]
    return {f.kind for f in findings}, failed


def active() -> int:
    """MLX active bytes once pending work has run (arrays are freed when their last reference
    goes; no garbage collection, which would cost more than the step it measures)."""
    mx.synchronize()
    return mx.get_active_memory()


@pytest.fixture
def exact_allocator():
    """No buffer reuse from MLX's cache, so active bytes are the arrays' own bytes."""
    limit = mx.set_cache_limit(0)
    mx.clear_cache()
    yield
    mx.set_cache_limit(limit)


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A generated model folder for serve mode's fake server: the server ignores it, the engine
    reads its geometry."""
    choice = ModelChoice("qwen3-tiny", None, None, None, "float32", None, 64)
    return str(folder(choice, tmp_path_factory.mktemp("models")))
