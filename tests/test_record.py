"""`kvmem record -- COMMAND`: a command kvmem did not configure, sampled by its agent until it
exits, --duration passes or Ctrl-C; the `drift` detector on its samples against time; and
`--traffic`, a scenario's HTTP traffic sent to it through serve mode; the command's children
followed, each sampled and summed. Each recording is a Python child importing MLX for a second
or three."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest
import yaml

from harness.cli import main
from harness.common.units import MiB
from harness.judge.detectors import DetectSpec
from harness.judge.over_time import DriftThresholds, drift, fit, parse_rate
from harness.models.folder import folder
from harness.models.loading import ModelChoice
from harness.record.followed import Process, Walk, combine, holder_rows, next_walk
from harness.record.recording import default_name
from harness.run.probe import ROW
from tests.conftest import SMALL_MODEL

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "server"

# Keeps 1 MiB of MLX memory for every 0.1 s since it began, catching up when the machine is
# slow: 10 MiB/s on average, however late its sleeps come back.
GROWING = textwrap.dedent("""
    import time
    import mlx.core as mx
    start, kept = time.monotonic(), []
    while True:
        due = int((time.monotonic() - start) / 0.1) + 1
        while len(kept) < due:
            kept.append(mx.zeros((MiB // 4,), dtype=mx.float32))
            mx.eval(kept[-1])
        time.sleep(0.02)
""").replace("MiB", str(MiB))
FLAT = textwrap.dedent("""
    import time
    import mlx.core as mx
    kept = mx.zeros((MiB // 4,), dtype=mx.float32)
    mx.eval(kept)
    while True:
        time.sleep(0.05)
""").replace("MiB", str(MiB))


# Holds 8 MiB of MLX memory, says so in the file given, and waits to be stopped.
HOLDS_8_MIB = textwrap.dedent("""
    import sys, time
    import mlx.core as mx
    kept = mx.zeros((8 * MiB // 4,), dtype=mx.float32)
    mx.eval(kept)
    open(sys.argv[1], "w").close()
    time.sleep(120)
""").replace("MiB", str(MiB))
# The command itself: starts the work in a child (how: `{start}`), waits until the child holds
# its memory, lets the agents sample it, and exits 0 (the child is stopped with the group).
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    ready = sys.argv[1]
    {start}
    while not os.path.exists(ready):
        time.sleep(0.02)
    time.sleep(1.5)  # past kvmem's next drain: a process's rows go with it when it exits
""")
BY_POPEN = "subprocess.Popen([sys.executable, '-c', {script!r}, ready])"
BY_FORK = textwrap.dedent("""
    if os.fork() == 0:
        sys.argv = [sys.argv[0], ready]
        exec({script!r})
""")
# Holds 1 MiB more of bytes (outside MLX) for every 0.1 s since it began: RSS climbs 10 MiB/s.
HOST_GROWING = textwrap.dedent("""
    import time
    start, kept = time.monotonic(), []
    while True:
        due = int((time.monotonic() - start) / 0.1) + 1
        while len(kept) < due:
            kept.append(b"\x01" * MiB)
        time.sleep(0.02)
""").replace("MiB", str(MiB))

# Keeps 1 MiB more of MLX memory every 0.2 s in a module-level list: a holder the walk names.
KEEPING = textwrap.dedent("""
    import time
    import mlx.core as mx
    KEPT = []
    while True:
        KEPT.append(mx.zeros((MiB // 4,), dtype=mx.float32))
        mx.eval(KEPT[-1])
        time.sleep(0.2)
""").replace("MiB", str(MiB))


def record(tmp_path: Path, *options: str, script: str | None = None,
           command: list[str] | None = None) -> int:
    words = command if command is not None else [sys.executable, "-c", script or FLAT]
    return main(["record", "--out", str(tmp_path), *options, "--", *words])


def summary(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "record" / name / "summary.json").read_text())


def samples(tmp_path: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(tmp_path / "record" / name / "samples.csv")


# -- recordings ---------------------------------------------------------------------------

def test_a_growing_process_is_reported_with_its_rate_and_fails_only_past_its_budget(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(a): 10 MiB/s found as such; a budget above the whole run passes (the growth stays a
    warning), one below it fails the run (exit 1)."""
    assert record(tmp_path, "--name", "within", "--duration", "2.5", "--budget", "1 GiB",
                  script=GROWING) == 0
    found = summary(tmp_path, "within")
    (finding,) = found["findings"]
    assert finding["kind"] == "drift" and finding["severity"] == "warning"
    assert abs(finding["bytes"] - 10 * MiB) <= 0.2 * 10 * MiB
    assert "within the budget of 1 GiB" in finding["message"]
    assert f"grows {finding['bytes'] / MiB:.3g} MiB/s" in finding["message"]
    # The same figure from samples.csv: the slope of active memory against time.
    rows = samples(tmp_path, "within")
    slope = np.polyfit(rows["time"], rows["active"], 1)[0]
    assert abs(slope - finding["bytes"]) <= 0.01 * finding["bytes"]
    assert found["status"] == "ok" and found["passed"] is True
    assert (tmp_path / "record" / "within" / "memory.png").is_file()
    assert (tmp_path / "record" / "within" / "command.log").is_file()
    assert "drift (warning) MLX active memory grows" in capsys.readouterr().out

    assert record(tmp_path, "--name", "over", "--duration", "2.5", "--budget", "1 MiB",
                  script=GROWING) == 1
    (finding,) = summary(tmp_path, "over")["findings"]
    assert finding["severity"] == "error"
    assert "the fitted growth is over the budget of 1 MiB" in finding["message"]
    assert "the last sample is over the budget of 1 MiB" in finding["message"]
    assert summary(tmp_path, "over")["passed"] is False


def test_drift_names_the_holder_that_grew_and_no_holders_walks_nothing(tmp_path: Path) -> None:
    """The command's first process is walked at its first drain and at the end (the next walk
    would come at 8 s): holders.csv has the list growing by its 1 MiB arrays, and the drift
    finding names it with what it gained from the first walk to the last."""
    assert record(tmp_path, "--name", "walked", "--duration", "3", script=KEEPING) == 0
    found = summary(tmp_path, "walked")
    (finding,) = found["findings"]
    assert finding["kind"] == "drift"
    holders = pd.read_csv(tmp_path / "record" / "walked" / "holders.csv")
    kept = holders[holders["holder"] == "__main__:KEPT[*]"]
    assert len(kept) == holders["step"].nunique() == 2
    assert list(kept["bytes"]) == [arrays * MiB for arrays in kept["arrays"]]
    assert kept["arrays"].is_monotonic_increasing
    assert kept["arrays"].iloc[-1] > kept["arrays"].iloc[0]
    # The list first; a walk that met the newest array half made (pending, or in the loop's
    # frame) can name a second, smaller group beside it.
    holder = finding["holders"][0]
    assert holder["holder"] == "__main__:KEPT[*]" and holder["root"] == "global"
    assert holder["bytes"] == kept["bytes"].iloc[-1] - kept["bytes"].iloc[0]
    assert found["holders"]["groups"][0]["holder"] == "__main__:KEPT[*]"
    assert found["holders"]["walks"] == 2

    assert record(tmp_path, "--name", "unwalked", "--duration", "3", "--no-holders",
                  script=KEEPING) == 0
    assert not (tmp_path / "record" / "unwalked" / "holders.csv").exists()
    unwalked = summary(tmp_path, "unwalked")
    assert [f["kind"] for f in unwalked["findings"]] == ["drift"]
    assert not unwalked["findings"][0].get("holders") and unwalked.get("holders") is None


def test_a_walk_is_placed_at_the_last_sample_at_or_before_it() -> None:
    """After the first, walks come at 8, 16, 32… s; each goes to the report's last sample at or
    before its answer (times counted from the first sample), the later of two at one sample."""
    assert [next_walk(t) for t in (0.0, 1.02, 7.9, 8.0, 20.0)] == [8, 8, 8, 16, 32]
    rows = np.zeros(4, ROW)
    rows["step"], rows["time"] = np.arange(4), [0.0, 0.1, 0.2, 0.3]
    census = {"approximate": False, "objects": 100, "seconds": 0.01}
    walks = [Walk(10.05, [(name, name, "global", MiB, MiB, 1, 1, 0)], census)
             for name in ("m:A", "m:B")]
    walks.append(Walk(10.25, [("m:C", "m:C", "global", MiB, MiB, 1, 1, 0)], census))
    frame = holder_rows(walks, rows, 10.0)
    assert list(zip(frame["step"], frame["holder"], strict=True)) == [(0, "m:B"), (2, "m:C")]
    assert holder_rows(walks, rows[:0], None).empty


def test_a_growth_rate_over_max_growth_fails_the_run(tmp_path: Path) -> None:
    assert record(tmp_path, "--name", "fast", "--duration", "2", "--max-growth", "1MiB/s",
                  script=GROWING) == 1
    (finding,) = summary(tmp_path, "fast")["findings"]
    assert "faster than the 1 MiB/s allowed" in finding["message"]
    assert summary(tmp_path, "fast")["detect"]["drift"]["rate"] == MiB


def test_a_flat_process_gives_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(b)"""
    assert record(tmp_path, "--duration", "1.5") == 0
    flat = summary(tmp_path, "python")
    assert flat["status"] == "ok" and flat["findings"] == [] and flat["passed"] is True
    assert flat["exit_status"] is None  # kvmem stopped it
    assert len(samples(tmp_path, "python")) >= 3
    out = capsys.readouterr().out
    assert "MLX active memory grows 0 B/s" in out and "stopped after --duration 1.5 s" in out


def test_a_command_that_exits_at_once_fails_with_how_it_exited(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(c): exit 2, the message says how, and the report folder is there."""
    script = "import sys; print('giving up', flush=True); sys.exit(3)"
    assert record(tmp_path, "--name", "three", script=script) == 2
    failed = summary(tmp_path, "three")
    assert failed["status"] == "failed" and failed["exit_status"] == 3
    assert "the command exited with status 3" in failed["error"]
    assert "giving up" in failed["error"]  # the tail of its output
    out = capsys.readouterr().out
    assert "exited with status 3" in out and "giving up" in out
    assert (tmp_path / "record" / "three" / "samples.csv").is_file()
    assert "giving up" in (tmp_path / "record" / "three" / "command.log").read_text()


def test_a_command_that_exits_after_sampling_keeps_its_samples(tmp_path: Path) -> None:
    script = "import sys, time; import mlx.core; time.sleep(1.5); sys.exit(4)"
    assert record(tmp_path, "--name", "four", script=script) == 2
    failed = summary(tmp_path, "four")
    assert failed["status"] == "failed" and failed["exit_status"] == 4
    assert "the command exited with status 4 after" in failed["error"]
    assert len(samples(tmp_path, "four")) > 0


def test_a_command_that_exits_0_is_a_complete_recording(tmp_path: Path) -> None:
    script = "import time; import mlx.core; print('serving'); time.sleep(1.5)"
    assert record(tmp_path, "--name", "done", script=script) == 0
    assert summary(tmp_path, "done")["exit_status"] == 0
    assert (tmp_path / "record" / "done" / "command.log").read_text() == "serving\n"


def test_port_is_replaced_in_every_word(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """(d)"""
    got = tmp_path / "got.txt"
    script = (f"import sys, time; open({str(got)!r}, 'w').write(' '.join(sys.argv[1:])); "
              "time.sleep(60)")
    command = [sys.executable, "-c", script, "--port={port}", "{port}"]
    assert record(tmp_path, "--name", "port", "--duration", "1", command=command) == 0
    (port,) = re.findall(r"\{port\} is port (\d+)", capsys.readouterr().out)
    assert got.read_text() == f"--port={port} {port}"


def test_ctrl_c_stops_the_command_and_writes_the_report(tmp_path: Path) -> None:
    """(e): SIGINT to `python -m harness record`: exit 130, the report written, nothing of the
    command left."""
    kvmem = subprocess.Popen(
        [sys.executable, "-m", "harness", "record", "--out", str(tmp_path), "--name", "intr",
         "--", sys.executable, "-c", GROWING],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_default_sigint)
    try:
        command = _first_child(kvmem.pid)
        descendants = [command, *command.children(recursive=True)]
        time.sleep(2)
        kvmem.send_signal(signal.SIGINT)
        out, _ = kvmem.communicate(timeout=60)
    finally:
        if kvmem.poll() is None:
            kvmem.kill()
    assert kvmem.returncode == 130, out
    assert "stopped by an interrupt (Ctrl-C); report written to" in out
    assert summary(tmp_path, "intr")["status"] == "ok"
    assert len(samples(tmp_path, "intr")) > 0
    assert not [p for p in descendants if _alive(p)]


def _default_sigint() -> None:
    """Ctrl-C's default in the child, whatever the suite inherited (`nohup`, a background job
    of a script, a CI runner ignore it): Python then turns it into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _first_child(pid: int) -> psutil.Process:
    """The command kvmem started, once it has been started."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = psutil.Process(pid).children()
        if children:
            return children[0]
        time.sleep(0.05)
    raise AssertionError("kvmem started no command")


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- the command's children ------------------------------------------------------------------

@pytest.mark.parametrize(("how", "start"), [("popen", BY_POPEN), ("fork", BY_FORK)])
def test_mlx_work_in_a_child_is_sampled_reported_per_process_and_summed(
        tmp_path: Path, how: str, start: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The command's MLX work runs in a child (`subprocess.Popen` of Python, `os.fork`): the
    child's agent samples it, the summary lists both processes, and the report's samples are
    their sum, exact to the byte."""
    parent = PARENT.format(start=start.format(script=HOLDS_8_MIB))
    command = [sys.executable, "-c", parent, str(tmp_path / "ready")]
    assert record(tmp_path, "--name", how, command=command) == 0
    found = summary(tmp_path, how)
    first, child = found["model"]["processes"]
    assert first["active"] == 0 and child["active"] == child["active_max"] == 8 * MiB
    assert child["parent"] == first["pid"] and child["forked"] is (how == "fork")
    assert child["samples"] > 0 and child["rss"] > 8 * MiB
    rows = samples(tmp_path, how)
    assert rows["active"].max() == 8 * MiB  # the first process's 0 B and the child's 8 MiB
    per_process = pd.read_csv(tmp_path / "record" / how / "processes.csv")
    assert set(per_process["pid"]) == {first["pid"], child["pid"]}
    assert per_process[per_process["pid"] == child["pid"]]["active"].max() == 8 * MiB
    assert "never moved" not in " ".join(found["model"]["notes"])
    assert f"process {child['pid']}" in capsys.readouterr().out


def test_combine_sums_each_process_at_its_latest_sample() -> None:
    """A child counts from its first sample; one that exited counts nothing after its last."""
    def process(pid: int, rows: list[tuple[float, int]], exited: bool = False) -> Process:
        kept = Process(pid, None, "python", False, exited=exited)
        kept.keep([(t, "serve", -1, -1, 0, a, a, 0, a + 10, 0, 0, 0, 0, -1, -1) for t, a in rows])
        return kept

    rows = combine([process(1, [(10.0, 1), (10.2, 2), (10.4, 4)]),
                    process(2, [(10.1, 100), (10.3, 200)], exited=True),
                    process(3, [(10.3, 1000)])])
    assert rows["time"].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert rows["active"].tolist() == [1, 101, 102, 1202, 1004]
    assert rows["rss"].tolist() == [11, 121, 122, 1232, 1024]
    assert combine([]).size == 0
    long = process(4, [(float(i), i) for i in range(200)])  # past the first block of 64 rows
    assert len(long) == 200 and long.array()[:, 1].tolist() == list(range(200))


def test_a_command_that_never_moves_mlx_but_grows_rss_is_found(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """RSS is judged as MLX is: 10 MiB/s of bytes on the host is drift, and the report says
    that MLX never moved."""
    assert record(tmp_path, "--name", "host", "--duration", "2.5", script=HOST_GROWING) == 0
    found = summary(tmp_path, "host")
    (finding,) = found["findings"]
    assert finding["kind"] == "drift" and finding["severity"] == "warning"
    assert abs(finding["bytes"] - 10 * MiB) <= 0.2 * 10 * MiB
    assert finding["message"].startswith("MLX active memory grows 0 B/s")
    assert "; RSS grows" in finding["message"]
    assert finding["message"].endswith("against the first; with no budget stated")
    (note,) = found["model"]["notes"]
    assert note.startswith("MLX active memory never moved from 0 B in the 1 process kvmem sampled")
    assert "note: MLX active memory never moved" in capsys.readouterr().out

    assert record(tmp_path, "--name", "host_over", "--duration", "2.5", "--budget", "4 MiB",
                  script=HOST_GROWING) == 1
    (finding,) = summary(tmp_path, "host_over")["findings"]
    assert finding["severity"] == "error"
    assert "RSS grows" in finding["message"] and "over the budget of 4 MiB" in finding["message"]


def test_a_child_kvmem_cannot_sample_is_named(tmp_path: Path) -> None:
    """A child that is not Python runs no agent: the report names it."""
    script = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(60)"
    assert record(tmp_path, "--name", "sleeper", "--duration", "1.5", script=script) == 0
    notes = summary(tmp_path, "sleeper")["model"]["notes"]
    assert any(note.startswith("the command started 1 process kvmem could not sample")
               and note.endswith("sleep 30 (pid " + note.rsplit("(pid ", 1)[1])
               for note in notes), notes


# -- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["record", "--"], "record: no command given"),
    (["record", "--name", "../x", "--", "python"], "--name '../x' contains a path separator"),
    (["record", "--variant", "v", "--", "python"], "--variant: names a variant of --traffic"),
    (["record", "--traffic", "any.yaml", "--", "python", "serve.py"],
     "--traffic: the command must say where to listen with {port}"),
    (["record", "--traffic", "any.yaml", "--budget", "5MiB", "--", "python", "{port}"],
     "--budget: not with --traffic"),
    (["record", "--traffic", "any.yaml", "--no-holders", "--", "python", "{port}"],
     "--no-holders: not with --traffic"),
    (["record", "--logical", "not a path", "--", "python"],
     "--logical: expected module:Class.attribute, got 'not a path'"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """(f)"""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--budget", "12 parsecs", "unknown unit 'parsecs'"),
    ("--max-growth", "fast", "expected a size in bytes"),
    ("--duration", "ten minutes", "expected a duration in seconds such as 90, '90s', '30m' or '2h'"),
    ("--period", "0.001", "expected 0.01 to 60 seconds"),
])
def test_a_bad_option_value_is_refused_before_anything_runs(
        option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["record", option, value, "--", "python"])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_traffic_needs_server_variants(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "synthetic.yaml"
    path.write_text(yaml.safe_dump({
        "name": "synthetic", "model": SMALL_MODEL,
        "workload": {"requests": [{"prompt": 8, "decode": 2}]}}))
    assert main(["record", "--out", str(tmp_path), "--traffic", str(path), "--",
                 "python", "{port}"]) == 2
    assert "--traffic sends the HTTP traffic of engine: server variants" in capsys.readouterr().err


# -- --traffic: a scenario's traffic sent to the command ------------------------------------

@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A generated model folder: the fake server ignores it, the engine reads its geometry."""
    choice = ModelChoice("qwen3-tiny", None, None, None, "float32", None, 64)
    return str(folder(choice, tmp_path_factory.mktemp("models")))


def test_traffic_serves_the_scenario_through_the_command(tmp_path: Path, model_path: str) -> None:
    """(g): the scenario's server command is replaced by the user's; its report is written
    with the requests served."""
    path = tmp_path / "fake.yaml"
    path.write_text(yaml.safe_dump({
        "name": "fake", "engine": "server", "model": {"path": model_path},
        "server": {"command": "{python} -m no_such_server --port {port}",
                   "env": {"PYTHONPATH": str(FIXTURES)}, "logical": "fake_store:Store.nbytes"},
        "workload": {"http": {"phases": [{"kind": "distinct", "requests": 3, "words": 16}]}},
    }))
    command = [sys.executable, "-m", "fake_server", "--port", "{port}", "--entry", "4096"]
    assert main(["record", "--out", str(tmp_path / "out"), "--traffic", str(path), "--",
                 *command]) == 0
    served = json.loads((tmp_path / "out" / "fake" / "default" / "summary.json").read_text())
    assert served["status"] == "ok" and served["model"]["requests"] == 3
    assert not any(f["kind"] == "drift" for f in served["findings"])


# -- the detector and the names, on their own ------------------------------------------------

def recorded(active: list[int], seconds: float = 0.1, phase: str = "serve") -> pd.DataFrame:
    """Samples on the period, `active` bytes each, RSS 100 MiB above them."""
    n = len(active)
    return pd.DataFrame({
        "step": range(n), "phase": pd.Categorical([phase] * n), "request": -1, "turn": -1,
        "tokens": 0, "active": active, "peak": active, "cache": 0,
        "rss": [a + 100 * MiB for a in active], "logical": 0, "host": 0, "minimum": 0,
        "work": 0, "cyclic": 0, "time": [i * seconds for i in range(n)], "cap": 0})


def test_drift_fits_bytes_per_second_and_grades_by_budget() -> None:
    growing = recorded([i * MiB for i in range(21)])  # 10 MiB/s over 2 s
    warned = drift(growing, DriftThresholds(), "cpu")
    assert warned is not None and warned.severity == "warning"
    assert warned.bytes == 10 * MiB and warned.count == 21
    assert warned.message.startswith("MLX active memory grows 10 MiB/s over 2.0 s (fit "
                                     "r²=1.000): +20 MiB fitted, the last sample +20 MiB")
    assert "with no budget stated; RSS grows 10 MiB/s" in warned.message
    over = drift(growing, DriftThresholds(budget=19 * MiB), "cpu")
    assert over is not None and over.severity == "error"
    within = drift(growing, DriftThresholds(budget=21 * MiB, rate=parse_rate("11 MiB/s")), "cpu")
    assert within is not None and within.severity == "warning"
    assert "within the budget of 21 MiB and 11 MiB/s" in within.message
    fast = drift(growing, DriftThresholds(rate=9 * MiB), "cpu")
    assert fast is not None and "faster than the 9 MiB/s allowed" in fast.message


def test_drift_judges_rss_as_it_judges_mlx() -> None:
    """A flat MLX line beside RSS climbing 10 MiB/s: a warning from RSS, an error past the
    budget, with RSS's slope as the finding's bytes."""
    host = recorded([0] * 21).assign(rss=[100 * MiB + i * MiB for i in range(21)])
    warned = drift(host, DriftThresholds(), "cpu")
    assert warned is not None and warned.severity == "warning" and warned.bytes == 10 * MiB
    assert warned.message == (
        "MLX active memory grows 0 B/s over 2.0 s (fit r²=0.000): ±0 B fitted, the last sample "
        "±0 B against the first; RSS grows 10 MiB/s over 2.0 s (fit r²=1.000): +20 MiB fitted, "
        "the last sample +20 MiB against the first; with no budget stated")
    over = drift(host, DriftThresholds(budget=19 * MiB), "cpu")
    assert over is not None and over.severity == "error"
    assert over.message.endswith("the fitted growth is over the budget of 19 MiB; the last "
                                 "sample is over the budget of 19 MiB")


def test_drift_leaves_flat_noisy_small_and_scenario_runs_alone() -> None:
    assert drift(recorded([5 * MiB] * 30), DriftThresholds(), "cpu") is None
    noise = np.random.default_rng(0).integers(0, 64 * MiB, 200).tolist()
    assert drift(recorded(noise), DriftThresholds(), "cpu") is None
    assert drift(recorded([i * 1024 for i in range(30)]), DriftThresholds(), "cpu") is None
    # A run with request boundaries or samples at rest is the other detectors' to read.
    growing = recorded([i * MiB for i in range(21)])
    with_request = growing.assign(phase=pd.Categorical(["request"] + ["serve"] * 20))
    assert drift(with_request, DriftThresholds(), "cpu") is None
    assert drift(recorded([i * MiB for i in range(21)], phase="idle"), DriftThresholds(),
                 "cpu") is None
    assert drift(recorded([0, MiB]), DriftThresholds(), "cpu") is None


def test_drift_thresholds_take_sizes_and_rates() -> None:
    spec = DetectSpec.model_validate({"drift": {"budget": "64 MiB", "rate": "5 MiB/s"}})
    assert (spec.drift.budget, spec.drift.rate) == (64 * MiB, 5 * MiB)
    line = fit([0.0, 1.0, 2.0], [0, 2, 4])
    assert line is not None
    assert (line.slope, line.r2, line.growth) == pytest.approx((2.0, 1.0, 4.0))


@pytest.mark.parametrize(("command", "name"), [
    (["python", "-m", "mlx_lm", "server", "--port", "{port}"], "mlx_lm"),
    (["/usr/bin/python3.11", "serve.py", "--port", "8080"], "serve"),
    (["python", "-c", "pass"], "python"),
    (["./launch.sh", "--fast"], "launch"),
    (["python", "-m", "my.server"], "my.server"),
    (["python", "my script?.py"], "my_script_"),
])
def test_the_default_name_comes_from_the_command(command: list[str], name: str) -> None:
    assert default_name(command) == name
