"""Each variant in its own process: a dying child is a failed run, not the end of the suite."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from harness.cli import main
from harness.common.units import GiB, MiB
from harness.report import writing as report
from harness.report.writing import reserve
from tests.signals import interruptible

CRASHES = """
model:
  dtype: float16
  vocab: 256
  layers: [{count: 2, kind: full, kv_heads: 2, head_dim: 32}]
workload:
  prefill_chunk: 16
  requests: [{prompt: 32, decode: 20}]
cache: {layer: {component: "tests.fixtures.components:CrashingCache", options: {at: 8}}}
variants:
  killed: {cache: {layer: {options: {how: kill}}}}
  segfault: {cache: {layer: {options: {how: segv}}}}
  raises: {cache: {layer: {options: {how: raise}}}}
  healthy: {cache: {layer: {component: mlx_lm.KVCache}}}
"""


def summary(out, variant, scenario="crashes"):
    return json.loads((out / scenario / variant / "summary.json").read_text())


def test_dead_children_are_failed_runs_and_the_others_still_report(tmp_path, capsys):
    path = tmp_path / "crashes.yaml"
    path.write_text(textwrap.dedent(CRASHES))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 2

    # Row 0 is the baseline and each layer's cache counts its own updates, so the 8th update
    # comes at step 8: steps 0-7 were recorded, step 8 never finished.
    killed = summary(out, "killed")
    assert killed["status"] == "failed" and killed["exit_status"] == -9
    assert killed["last_step"] == 8
    assert "killed by signal 9 at step 8" in killed["error"]

    segfault = summary(out, "segfault")
    assert segfault["status"] == "failed" and segfault["exit_status"] == -11
    assert "killed by signal 11" in segfault["error"]

    raises = summary(out, "raises")
    assert raises["status"] == "failed" and raises["exit_status"] == 1
    assert "RuntimeError: cache gave up at update 8" in raises["error"]
    # A run that raised still hands back the steps it recorded before the error.
    assert len((out / "crashes" / "raises" / "samples.csv").read_text().splitlines()) == 1 + 8

    healthy = summary(out, "healthy")
    assert healthy["status"] == "ok" and healthy["passed"]
    assert healthy["metrics"]["steady"] == 256 * 2 * 2 * 2 * 32 * 2  # 52 tokens in 256 slots
    assert (out / "crashes" / "healthy" / "memory.png").stat().st_size > 0
    assert "killed by signal 9" in " ".join(capsys.readouterr().out.split())


def test_a_variant_that_cannot_fit_is_refused_with_its_estimate(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("model: qwen3-8b\nworkload: {requests: [{prompt: 4000000}]}\n")
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 2
    refused = summary(out, "default", "huge")
    assert refused["status"] == "refused"
    # 4,000,256 tokens x 144 KiB, twice, plus two 512-token chunks and the runtime slack.
    estimate = 2 * 4_000_256 * 147456 + 2 * 512 * 147456 + 256 * MiB
    assert refused["metrics"]["estimate"] == estimate
    assert f"{estimate / GiB:.2f} GiB" in refused["error"]


EARLY = CRASHES.replace("killed: {cache: {layer: {options: {how: kill}}}}", "").replace(
    "segfault: {cache: {layer: {options: {how: segv}}}}\n  raises: {cache: {layer: {options: "
    "{how: raise}}}}",
    "exits: {cache: {layer: {options: {how: exit}}}}\n  os_exit: {cache: {layer: {options: "
    "{how: os_exit}}}}\n  hangs: {cache: {layer: {options: {how: hang}}}, timeout: 15}")


def test_a_child_that_stops_early_with_status_0_is_a_failed_run(tmp_path):
    path = tmp_path / "crashes.yaml"
    path.write_text(textwrap.dedent(EARLY))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 2

    exits = summary(out, "exits")  # sys.exit(0) inside a component
    assert exits["status"] == "failed" and not exits["passed"]
    assert exits["error"].startswith("SystemExit: 0")
    assert exits["last_step"] == 8

    os_exit = summary(out, "os_exit")  # os._exit(0): no clean-up, no message, status 0
    assert os_exit["status"] == "failed" and os_exit["exit_status"] == 0
    assert os_exit["error"] == ("the variant's process exited with status 0 at step 8 before "
                                "completing its workload")
    assert os_exit["metrics"] == {"wall_s": os_exit["metrics"]["wall_s"], "estimate": 0}

    hangs = summary(out, "hangs")  # the scenario's own timeout of 15 s (reaching step 8 took
    # over 3 s beside a second suite run)
    assert hangs["status"] == "failed" and hangs["exit_status"] == -9
    assert hangs["error"].startswith("timed out after 15 s at step 8")
    assert 15 <= hangs["metrics"]["wall_s"] < 60

    assert summary(out, "healthy")["passed"]


def test_the_command_line_timeout_overrides_the_scenario(tmp_path):
    path = tmp_path / "crashes.yaml"
    path.write_text(textwrap.dedent(EARLY))
    out = tmp_path / "out"
    assert main(["run", str(path), "--variant", "hangs", "--timeout", "1.5", "--out", str(out)]) == 2
    assert summary(out, "hangs")["error"].startswith("timed out after 1.5 s")


@pytest.mark.parametrize("module, how", [("exits_at_import", "exited with status 0"),
                                         ("crashes_at_import", "was killed by signal 11")])
def test_a_user_module_that_ends_its_process_at_import_is_bad_input(tmp_path, capsys, module, how):
    path = tmp_path / "user.yaml"
    path.write_text("model: qwen3-8b\nworkload: {requests: [{prompt: 8}]}\n"
                    f"cache: {{store: {{component: 'tests.fixtures.{module}:factory'}}}}\n")
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"cache.store.component: the process importing tests.fixtures.{module}:factory {how}" in err
    assert str(path) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_cache_that_allocates_its_window_up_front_is_refused_by_its_own_estimate(tmp_path):
    path = tmp_path / "window.yaml"
    path.write_text("model: {preset: qwen3-8b, layers: 2}\nworkload: {requests: [{prompt: 8}]}\n"
                    "cache: {layer: {component: reference.rotating, "
                    "options: {max_size: 33554432}}}\n")
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 2
    refused = summary(out, "default", "window")
    assert refused["status"] == "refused" and refused["last_step"] == 0
    # Two layers of 33,554,432 slots x 4 KiB (K and V, 8 heads x 128 x bf16), a prefill
    # chunk's K/V twice (512 tokens, the default chunk, over 2 layers) and the runtime slack.
    assert refused["metrics"]["estimate"] == (2 * 33554432 * 4096 + 2 * 2 * 512 * 4096
                                              + 256 * MiB)


def test_an_out_that_is_a_file_or_held_by_another_run_is_refused_before_anything_runs(
        tmp_path, capsys):
    path = tmp_path / "crashes.yaml"
    path.write_text(textwrap.dedent(CRASHES))
    file = tmp_path / "file"
    file.write_text("x")
    assert main(["run", str(path), "--variant", "healthy", "--out", str(file)]) == 2
    assert f"{file}: cannot write: " in " ".join(capsys.readouterr().err.split())

    out = tmp_path / "out"
    with reserve(out):
        assert main(["run", str(path), "--variant", "healthy", "--out", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"another kvmem run (pid {os.getpid()}) is writing reports there" in err
    assert not (out / "crashes").exists()


def test_a_report_that_cannot_be_written_fails_its_variant_and_keeps_the_previous_one(
        tmp_path, monkeypatch, capsys):
    path = tmp_path / "crashes.yaml"
    path.write_text(textwrap.dedent(CRASHES))
    out = tmp_path / "out"
    assert main(["run", str(path), "--variant", "healthy", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in (out / "crashes" / "healthy").iterdir()}

    plot = report.plot_variant

    def full_disk(frame, findings, title, path, **limits):
        if "healthy" in title:  # samples.csv is written, then the plot finds the disk full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        plot(frame, findings, title, path, **limits)

    monkeypatch.setattr(report, "plot_variant", full_disk)
    assert main(["run", str(path), "--variant", "healthy", "--variant", "raises",
                 "--out", str(out)]) == 2
    after = {p.name: p.read_bytes() for p in (out / "crashes" / "healthy").iterdir()}
    assert after == before  # the previous report, whole
    assert sorted(p.name for p in (out / "crashes").iterdir()) == ["healthy", "raises"]
    assert "RuntimeError" in summary(out, "raises")["error"]  # the next variant still ran
    out_text = " ".join(capsys.readouterr().out.split())
    assert "cannot write the report: [Errno 28] No space left on device" in out_text


def _variant_processes(parent: subprocess.Popen, seconds: float = 60) -> list[psutil.Process]:
    """The parent's children once the variant's own (multiprocessing's spawn_main) is up."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        children = psutil.Process(parent.pid).children(recursive=True)
        if any("spawn_main" in " ".join(c.cmdline()) for c in children):
            return children
        time.sleep(0.1)
    raise AssertionError("the variant's process never started")


def _ended(process: psutil.Process) -> bool:
    """Gone, or a zombie: it has ended, and reaping an orphan is the init process's business
    (this machine's may take its time when busy)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _described(process: psutil.Process) -> str:
    """A survivor as the failure should name it: pid, status and command line."""
    try:
        return f"{process.pid} {process.status()} {' '.join(process.cmdline())[:120]}"
    except psutil.Error as exc:
        return f"{process.pid} ({exc})"


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_the_child_ends_with_its_parent(tmp_path, how):
    path = tmp_path / "crashes.yaml"
    path.write_text(textwrap.dedent(EARLY))
    out = tmp_path / "out"
    parent = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", str(path), "--variant", "hangs",
         "--timeout", "600", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    children = _variant_processes(parent)
    time.sleep(1)  # let the child get into its work
    parent.send_signal(getattr(signal, how))
    stdout, stderr = parent.communicate(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert [_described(p) for p in alive if not _ended(p)] == []
    if how == "SIGKILL":
        assert parent.returncode == -9
    else:
        assert parent.returncode == 130
        assert "interrupted" in stderr and "Traceback" not in stderr + stdout
    assert not [p for p in out.rglob(".*") if p.name != ".kvmem.lock"]
