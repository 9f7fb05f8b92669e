"""Ctrl-C and SIGTERM on `kvmem run`: the variant running stops and reports what it sampled,
marked interrupted, no other starts, exit 130; nothing kvmem started outlives it, and the
temporary folders of a run killed outright go at the next start (harness.run.workdirs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness.run import workdirs
from tests.signals import interruptible
from tests.test_serve import ENTRY, FIXTURES, servers


def soak(model_path: str) -> dict:
    """Two variants of a five-minute soak of the fake server at 20 requests a second."""
    return {"name": "soak", "engine": "server", "model": {"path": model_path},
            "server": {"command": f"{{python}} -m fake_server --port {{port}} --entry {ENTRY}",
                       "env": {"PYTHONPATH": str(FIXTURES)},
                       "logical": "fake_store:Store.nbytes", "settle": 0.05},
            "workload": {"http": {"rate": "20/s", "rest_every": "1s", "duration": "5m",
                                  "phases": [{"kind": "distinct", "requests": 50,
                                              "words": 8}]}},
            "variants": {"first": {}, "second": {}}}


def _serving(temp: Path, seconds: float = 90) -> None:
    """Wait until the first variant has spooled some of its requests."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if any(spool.stat().st_size for spool in temp.glob("kvmem-rows-*/requests*")):
            return
        time.sleep(0.2)
    raise AssertionError("the soak never served a request")


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_an_interrupted_soak_writes_what_it_sampled(tmp_path, model_path, how):
    (tmp_path / "soak.yaml").write_text(yaml.safe_dump(soak(model_path)))
    temp, out = tmp_path / "temp", tmp_path / "out"
    temp.mkdir()
    kvmem = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", str(tmp_path / "soak.yaml"), "--out", str(out),
         "--jobs", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible,
        env={**os.environ, "TMPDIR": str(temp), "COLUMNS": "300"}, start_new_session=True)
    _serving(temp)
    os.killpg(kvmem.pid, getattr(signal, how))  # a terminal's Ctrl-C reaches the whole group
    stdout, stderr = kvmem.communicate(timeout=120)
    assert kvmem.returncode == 130, stdout + stderr
    summary = json.loads((out / "soak" / "first" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["passed"] is False
    assert summary["error"].startswith("interrupted at step ")
    assert "the variant's process stopped; the report holds what was sampled" in summary["error"]
    requests = (out / "soak" / "first" / "requests.csv").read_text().splitlines()[1:]
    assert summary["model"]["requests"] == len(requests) > 0
    assert not (out / "soak" / "second").exists()  # never started
    assert "│ interrupted │" in stdout and "Traceback" not in stdout + stderr
    assert ("interrupted: 1 variant(s) stopped, each report holding what was sampled until "
            "then; 0 finished before; 1 not run") in stderr
    assert list(temp.iterdir()) == [] and not servers()


def test_folders_left_by_a_killed_run_go_at_the_next_start(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(gone.stdout)
    left = [tmp_path / f"{workdirs.ROWS}{dead}-abc", tmp_path / f"{workdirs.SERVER}{dead}-x_1"]
    kept = [tmp_path / f"{workdirs.SERVER}{os.getpid()}-live",  # a live run's
            tmp_path / "kvmem-server-ingh_ivh",  # named before owners were: not kvmem's to judge
            tmp_path / f"other-{dead}-abc"]
    for folder in left + kept:
        folder.mkdir()
        (folder / "server.log").write_text("log")
    assert sorted(workdirs.sweep(where=tmp_path)) == sorted(left)
    assert sorted(tmp_path.iterdir()) == sorted(kept)
    made = workdirs.made(workdirs.SERVER)
    made.rmdir()
    assert workdirs.owner(made, workdirs.SERVER) == os.getpid()
