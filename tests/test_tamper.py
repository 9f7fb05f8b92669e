"""Code that tampers with its own measurement shows: a reset of MLX's peak lowers no step's peak
and is counted, a rebinding of the probe's counters fails the variant, and a process the
variant left running is killed before kvmem writes its report, failing the variant by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pandas as pd
import psutil
import pytest

from harness.run import probe as probe_module
from harness.run.probe import BOUND, CounterReplaced, Probe
from harness.run.rows import Rows
from tests.test_gate_pr import branch, commit, edit, gate, recorded  # noqa: F401 (fixtures)

SPIKE = 1 << 22  # 4 MiB of float32, freed within the step that made it
SCALAR = 4  # mx.zeros allocates the float32 it broadcasts as well

# Layer caches that tamper in their update, the measured code's hottest path.
TAMPER = """\
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

HERE = Path(__file__).parent
FORGED = "reports/tamper/detaches/summary.json"
# Started once, in its own session, it forks again and its parent exits: init, or kvmem as
# the subreaper, adopts it. It notes its pid, sleeps, then forges the variant's summary.
FORGER = '''
import os, sys, time
if os.fork():
    os._exit(0)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(30)
open(sys.argv[2], "w").write('{"status": "ok", "passed": true}')
'''


def nothing() -> int:
    return 0


class Clean(KVCache):
    def __init__(self, spec):
        super().__init__()


class Resets(Clean):
    def update_and_fetch(self, keys, values):
        spike = mx.zeros((1 << 20,), dtype=mx.float32)
        mx.eval(spike)
        del spike
        mx.reset_peak_memory()
        count = HERE / f"resets-{os.getpid()}.count"  # one a variant's process
        count.write_text(str(int(count.read_text()) + 1 if count.exists() else 1))
        return super().update_and_fetch(keys, values)


class Rebinds(Clean):
    def update_and_fetch(self, keys, values):
        sys.modules["harness.run.probe"].BOUND.active = nothing
        return super().update_and_fetch(keys, values)


class Detaches(Clean):
    started = False

    def update_and_fetch(self, keys, values):
        if not Detaches.started:
            Detaches.started = True
            target = HERE / FORGED
            noted = HERE / "forger.pid"
            subprocess.Popen([sys.executable, "-c", FORGER, str(noted), str(target)],
                             start_new_session=True)
            while not noted.exists() or not noted.read_text():
                time.sleep(0.01)
        return super().update_and_fetch(keys, values)
"""
SCENARIO = """\
name: tamper
model: {dtype: float16, vocab: 256, layers: [{count: 2, kind: full, kv_heads: 2, head_dim: 32}]}
cache: {layer: {component: "tamper:Clean"}}
workload:
  prefill_chunk: 16
  requests: [{prompt: 32, decode: 4}]
variants:
  clean: {}
  resets: {cache: {layer: {component: "tamper:Resets"}}}
  rebinds: {cache: {layer: {component: "tamper:Rebinds"}}}
  detaches: {cache: {layer: {component: "tamper:Detaches"}}}
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A repository with the caches above, after `kvmem run scenarios` there; its exit status."""
    root = tmp_path_factory.mktemp("tamper")
    (root / "tamper.py").write_text(TAMPER)
    (root / "scenarios").mkdir()
    (root / "scenarios" / "tamper.yaml").write_text(SCENARIO)
    kvmem = Path(sys.executable).with_name("kvmem")
    done = subprocess.run([str(kvmem), "run", "scenarios", "--out", "reports"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    return root, done.returncode


def summary(root: Path, variant: str) -> dict:
    return json.loads((root / "reports" / "tamper" / variant / "summary.json").read_text())


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch, exact_allocator) -> Probe:
    """A probe guarded in this process, MLX's reset and the bound counters put back after."""
    monkeypatch.setattr(mx, "reset_peak_memory", mx.reset_peak_memory)
    monkeypatch.setitem(BOUND.bound, "reset_peak_memory", BOUND.bound["reset_peak_memory"])
    probe = Probe()
    probe.guard()
    return probe


def spiked_step(probe: Probe, reset: bool) -> int:
    """A step that allocates SPIKE, frees it and (`reset`) resets MLX's peak: its row's peak."""
    probe.begin()
    spike = mx.zeros((SPIKE // 4,), dtype=mx.float32)
    mx.eval(spike)
    del spike
    if reset:
        mx.reset_peak_memory()
    probe.end(phase="decode", request=0, turn=0, tokens=0, logical=0, host=0, minimum=0, work=0)
    return int(probe.rows()["peak"][-1])


def test_a_reset_by_the_measured_code_lowers_no_step_peak_and_is_counted(guarded) -> None:
    base = BOUND.active()
    assert spiked_step(guarded, reset=False) == base + SPIKE + SCALAR
    assert spiked_step(guarded, reset=True) == base + SPIKE + SCALAR
    assert guarded.resets == 1
    guarded.verify()  # the mark in MLX's place is the guard's own, not a replacement


def test_an_unguarded_probe_lets_a_reset_erase_the_spike(exact_allocator) -> None:
    """What the guard prevents: without it, the same step reads the spike away."""
    assert spiked_step(Probe(), reset=True) == BOUND.active()


@pytest.mark.parametrize(("owner", "name", "label"), [
    (BOUND, "active", "BOUND.active"),
    (BOUND, "mx", "BOUND.mx"),
    (probe_module, "current_rss", "harness.run.probe.current_rss"),
    (Probe, "end", "Probe.end"),
    (Rows, "append", "Rows.append"),
])
def test_a_rebound_counter_fails_the_check_naming_it(guarded, monkeypatch, owner, name,
                                                     label) -> None:
    monkeypatch.setattr(owner, name, len)
    with pytest.raises(CounterReplaced) as failed:
        guarded.verify()
    assert str(failed.value) == (f"the probe's counters were rebound by the measured code: "
                                 f"{label} is now builtins.len")


def test_a_rebound_entry_of_the_bound_counters_fails_the_check(guarded, monkeypatch) -> None:
    monkeypatch.setitem(BOUND.bound, "get_peak_memory", len)
    with pytest.raises(CounterReplaced, match=r"BOUND.bound\['get_peak_memory'\] is now "
                                              r"builtins.len$"):
        guarded.verify()


def test_in_a_variant_a_reset_is_counted_and_each_step_keeps_its_spike(repository) -> None:
    root, _ = repository
    resets = summary(root, "resets")
    assert (resets["status"], resets["passed"]) == ("ok", True)
    (count,) = root.glob("resets-*.count")
    assert resets["peak_resets"] == int(count.read_text()) > 0
    steps = pd.read_csv(root / "reports" / "tamper" / "resets" / "samples.csv")
    served = steps[steps["phase"].isin(["prefill", "decode"])]
    assert len(served) > 0 and (served["peak"] >= SPIKE).all()
    clean = pd.read_csv(root / "reports" / "tamper" / "clean" / "samples.csv")
    assert clean["peak"].max() < SPIKE  # the spike is the resetting cache's alone
    assert "peak_resets" not in summary(root, "clean")  # written only where a reset came


def test_in_a_variant_rebinding_the_probes_counter_fails_it(repository) -> None:
    root, code = repository
    assert code == 2
    rebinds = summary(root, "rebinds")
    assert (rebinds["status"], rebinds["error"]) == (
        "failed", "the probe's counters were rebound by the measured code: BOUND.active is now "
                  "tamper.nothing")


def test_a_process_the_variant_left_running_is_killed_and_fails_it(repository) -> None:
    root, _ = repository
    forged = root / "reports" / "tamper" / "detaches" / "summary.json"
    pid = int((root / "forger.pid").read_text())  # the forger started, detached
    assert not psutil.pid_exists(pid)
    detaches = json.loads(forged.read_text())  # kvmem's, not the forger's
    assert detaches["status"] == "failed" and detaches["variant"] == "detaches"
    # The forger named, and the session leader that started it where it had not exited yet.
    assert detaches["error"].startswith("the variant's process left ")
    assert "running after it ended, killed by kvmem: pid " in detaches["error"]
    assert f"pid {pid} ({sys.executable} -c " in detaches["error"]
    assert summary(root, "clean")["status"] == "ok"


@pytest.mark.parametrize(("cache", "failure"), [
    ("Resets", None),
    ("Rebinds", "failed: the probe's counters were rebound by the measured code: BOUND.active "
                "is now tamper.nothing"),
    ("Detaches", "failed: the variant's process left "),
])
def test_the_gate_fails_a_branch_whose_cache_tampers(branch, cache, failure) -> None:  # noqa: F811
    """A reset hides no spike from the gate (each update's 4 MiB is a peak regression), and a
    rebinding or a process left running fails each variant."""
    Path("tamper.py").write_text(TAMPER.replace("reports/tamper/detaches",
                                                "reports-pr/gate_pr/after"))
    edit("layer: {component: mlx_lm.KVCache}", f'layer: {{component: "tamper:{cache}"}}')
    commit(f"a layer cache that tampers: {cache}")
    code, _, result = gate()
    assert result["verdict"] == "regression" and code != 0
    if failure is None:
        peaks = [e["metrics"]["peak"] for e in result["entries"]]
        assert all(p["head"] >= SPIKE > p["base"] and p["verdict"] == "regression"
                   for p in peaks), peaks
    else:
        assert all(e["failure"].startswith(failure) for e in result["entries"]), result


def test_an_older_process_that_comes_back_is_not_blamed_on_the_variant() -> None:
    """A process created before the variant's child (another test's, another tool's orphan that
    comes back to kvmem meanwhile) is not what the variant left behind; one created since is."""
    from harness.common.child import stop_left_behind

    older = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        created = psutil.Process(older.pid).create_time()
        assert stop_left_behind(set(), [], started=created + 1) == []
        assert older.poll() is None
        named = stop_left_behind(set(), [], started=created)
        assert named == [f"pid {older.pid} ({sys.executable} -c import time; time.sleep(60))"]
        older.wait(timeout=5)  # killed (and reaped by kvmem's wait, so no status is left)
    finally:
        older.kill()
        older.wait()
