"""Trace replay, open-loop arrivals, soaks and --fail-fast on the fake server
(tests/fixtures/server): the traffic's schedule from the seed, what a replayed session sends,
samples at rest under constant traffic, and runs that end on time, on count or at a breach."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from harness.judge.detectors import detect
from harness.run import traffic
from harness.run.probe import Probe, to_frame
from harness.run.server_engine import ServerEngine, ServerError
from harness.scenario import ScenarioError, load_variants
from harness.scenario.trace import TraceError, read
from tests.conftest import make_spec
from tests.test_serve import ENTRY, FIXTURES, MiB, servers

SYSTEM = {"role": "system", "content": "be brief"}


def write_trace(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def fake_spec(model_path: str, http: dict, *args: str, detect: dict | None = None,
              **server: object):
    spec = {"engine": "server", "model": {"path": model_path},
            "server": {"command": f"{{python}} -m fake_server --port {{port}} --entry {ENTRY}",
                       "args": list(args), "env": {"PYTHONPATH": str(FIXTURES)},
                       "logical": "fake_store:Store.nbytes", "settle": 0.05, **server},
            "workload": {"http": http}}
    if detect:
        spec["detect"] = detect
    return make_spec(**spec)


def serve(spec, tmp_path: Path) -> tuple[ServerEngine, Probe]:
    probe = Probe(spool=tmp_path)
    engine = ServerEngine(spec, probe)
    try:
        engine.serve()
    finally:
        engine.close()
    return engine, probe


# -- the trace file ---------------------------------------------------------------------------

@pytest.mark.parametrize(("line", "message"), [
    ("not json", "line 2: not JSON: Expecting value"),
    ("[1, 2]", "line 2: expected a JSON object (a request body)"),
    ('{"max_tokens": 4}', "line 2: expected exactly one of messages (chat) or prompt"),
    ('{"prompt": "a", "messages": []}', "line 2: expected exactly one of messages"),
    ('{"messages": [{"role": "user"}]}', "line 2: messages.0: expected {\"role\": text"),
    ('{"prompt": "a", "max_tokens": 0}', "line 2: max_tokens: expected a whole number from 1"),
    ('{"prompt": "a", "stream": "yes"}', "line 2: stream: expected true or false, got 'yes'"),
    ('{"prompt": "a", "at": -1}', "line 2: at: expected the arrival offset in seconds"),
    ('{"prompt": "a", "session": 7}', "line 2: session: expected a session id (text), got 7"),
    ('{"prompt": "b", "session": "s"}', "line 2: session 's' mixes chat (messages) and"),
])
def test_a_bad_line_is_named_by_its_number(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}], "session": "s"}\n'
                    + line + "\n")
    with pytest.raises(TraceError) as raised:
        read(path)
    assert str(raised.value).startswith(f"{path}: {message}")


def test_an_empty_or_missing_trace_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="expected at least one request"):
        read(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="cannot read the trace: No such file"):
        read(tmp_path / "missing.jsonl")


def test_a_scenario_with_a_bad_trace_is_bad_input_exit_2(tmp_path, model_path):
    write_trace(tmp_path / "t.jsonl", [{"prompt": "a"}, {"prompt": "b", "max_tokens": -3}])
    scenario = {"name": "traced", "engine": "server", "model": {"path": model_path},
                "workload": {"http": {"trace": "t.jsonl"}}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(scenario))
    with pytest.raises(ScenarioError) as raised:
        load_variants(tmp_path / "s.yaml")
    assert str(raised.value) == (
        f"{tmp_path / 's.yaml'}: workload.http.trace: {tmp_path / 't.jsonl'}: line 2: "
        "max_tokens: expected a whole number from 1 to 100,000, got -3")
    done = subprocess.run([sys.executable, "-m", "harness", "run", str(tmp_path / "s.yaml"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "300"}, timeout=120)
    assert done.returncode == 2 and "line 2: max_tokens" in done.stdout + done.stderr


@pytest.mark.parametrize(("http", "message"), [
    ({}, "expected exactly one of phases (generated traffic) or trace"),
    ({"trace": "t.jsonl", "phases": [{"kind": "distinct", "requests": 1, "words": 2}]},
     "expected exactly one of phases"),
    ({"trace": "t.jsonl", "rate": "2/d"}, "expected an arrival rate such as 2/s"),
    ({"trace": "t.jsonl", "rate": 0},
     "expected an arrival rate such as 2/s, 90/m or 500/h (a second), more than zero and at "
     "most 10,000"),
    ({"trace": "t.jsonl", "duration": "forever"}, "expected a duration in seconds such as 90"),
    ({"rate": "1/s", "phases": [{"kind": "distinct", "requests": 1, "words": 2},
                                {"kind": "idle", "seconds": 1}]},
     "open-loop arrivals and idle phases do not mix"),
])
def test_bad_long_run_settings_name_the_field(http, message):
    with pytest.raises(Exception) as raised:
        make_spec(model="qwen3-tiny", engine="server", workload={"http": http})
    assert message in str(raised.value)


# -- the schedule -----------------------------------------------------------------------------

def phases_http(rate: str | None = "20/s", **more):
    return make_spec(model="qwen3-tiny", engine="server", workload={"http": {
        "rate": rate, "phases": [{"kind": "distinct", "requests": 400, "words": 2}], **more}}
    ).workload.http


def test_poisson_arrivals_come_from_the_seed_at_the_rate():
    http = phases_http()
    offsets = [at for at, _ in traffic.schedule(http, seed=0)]
    assert offsets == [at for at, _ in traffic.schedule(http, seed=0)]
    assert offsets != [at for at, _ in traffic.schedule(http, seed=1)]
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and len(offsets) == 400
    assert abs(gaps.mean() - 1 / 20) < 0.01        # 1/rate, over 399 exponential gaps
    assert gaps.std() > 0.6 * gaps.mean()          # exponential, not evenly spaced
    even = [at for at, _ in traffic.schedule(phases_http(arrivals="even"), seed=0)]
    assert np.allclose(np.diff(even), 0.05)


def test_a_trace_keeps_its_own_offsets_and_a_next_pass_starts_where_it_ended(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [{"prompt": "a", "at": 0.5}, {"prompt": "b"},
                                             {"prompt": "c", "at": 2.0}])
    http = make_spec(model="qwen3-tiny", engine="server",
                     workload={"http": {"trace": str(path)}}).workload.http
    arrivals = traffic.schedule(http, 0, read(path), passes=2)
    assert [(at, call.index, call.text) for at, call in arrivals] == [
        (0.5, 0, "a"), (0.5, 1, "b"), (2.0, 2, "c"), (2.5, 3, "a"), (2.5, 4, "b"), (4.0, 5, "c")]
    assert traffic.open_loop(http, read(path))


def test_a_trace_without_offsets_replays_in_rounds_that_hold_one_turn_of_a_session(tmp_path):
    lines = [{"messages": [{"role": "user", "content": f"{s}{t}"}], "session": s}
             for t in range(2) for s in "ab"] + [{"prompt": "x"}]
    path = write_trace(tmp_path / "t.jsonl", lines)
    http = make_spec(model="qwen3-tiny", engine="server",
                     workload={"http": {"trace": str(path), "clients": 3}}).workload.http
    assert not traffic.open_loop(http, read(path))
    rounds = list(traffic.plan(http, 0, read(path)))
    assert [[(c.messages[0]["content"] if c.messages else c.text, c.turn) for c in r]
            for r in rounds] == [[("a0", 0), ("b0", 0)], [("a1", 1), ("b1", 1), ("x", -1)]]


class Clock:
    """A clock that moves only when told: drawing a prompt costs `per_prompt` seconds."""

    def __init__(self, per_prompt: float):
        self.now, self.per_prompt = 100.0, per_prompt

    def __call__(self) -> float:
        return self.now

    def sentence(self, rng, words: int) -> str:
        self.now += self.per_prompt
        return "word " * words


def test_open_loop_keeps_its_rate_from_the_first_arrival_and_after_each_pass(monkeypatch):
    """A pass's 1,000 prompts are drawn as the pass begins (0.315 s, as 10,000 took 3.15 s):
    that time is left out of the schedule, so at 250/s no second holds more than 250 arrivals,
    at the start or after the next pass is drawn; a rest's pause moves the rest along."""
    clock = Clock(0.315 / 1000)
    monkeypatch.setattr(traffic, "sentence", clock.sentence)
    http = make_spec(model="qwen3-tiny", engine="server", workload={"http": {
        "rate": "250/s", "arrivals": "even",
        "phases": [{"kind": "distinct", "requests": 1000, "words": 2}]}}).workload.http
    offsets = [at for at, _ in traffic.schedule(http, 0, passes=2)]
    began = clock.now
    paced = traffic.Pacer(traffic.schedule(http, 0, passes=2), clock)
    due = []
    for at, call in paced:
        due.append(at)
        if call.index == 1500:  # a rest of 2 s after request 1500
            paced.pause(2.0)
            clock.now += 2.0
    assert due[0] == pytest.approx(began + 0.315)  # at once, once the first pass is drawn
    # The schedule's own offsets, later by the second pass's drawing and then by the rest.
    late = np.array(due) - due[0] - offsets
    assert np.allclose(late[:1000], 0.0)
    assert np.allclose(late[1000:1501], 0.315) and np.allclose(late[1501:], 2.315)
    windows = np.searchsorted(due, np.array(due) + 1.0 - 1e-9) - np.arange(len(due))
    assert windows.max() == 250  # never more than the rate in any second: no burst


def test_later_passes_draw_new_prompts_and_the_first_is_as_ever():
    http = make_spec(model="qwen3-tiny", engine="server", workload={"http": {
        "phases": [{"kind": "distinct", "requests": 400, "words": 8}]}}).workload.http
    once = [c.text for step in traffic.plan(http, 0) for c in step]
    two = [c.text for step in traffic.plan(http, 0, passes=2) for c in step]
    assert two[:400] == once and len(set(two[400:]) & set(once)) < 5


# -- runs -------------------------------------------------------------------------------------

def test_a_replayed_session_sends_its_history_with_the_real_replies(tmp_path, model_path):
    bodies = tmp_path / "bodies.jsonl"
    trace = write_trace(tmp_path / "t.jsonl", [
        {"messages": [SYSTEM, {"role": "user", "content": "one two"}], "session": "s",
         "max_tokens": 2, "stream": True, "top_p": 0.5},
        {"prompt": "alone here", "max_tokens": 3},
        {"messages": [{"role": "user", "content": "three"}], "session": "s", "max_tokens": 1},
    ])
    spec = fake_spec(model_path, {"trace": str(trace), "rate": "40/s", "rest_every": "0.2s"},
                     "--bodies", str(bodies))
    engine, probe = serve(spec, tmp_path)
    sent = [json.loads(line) for line in bodies.read_text().splitlines()][1:]  # after the warm-up
    by_kind = {("messages" in b, len(b.get("messages", []))): b for b in sent}
    assert by_kind[(True, 2)]["messages"] == [SYSTEM, {"role": "user", "content": "one two"}]
    assert by_kind[(True, 2)]["top_p"] == 0.5 and by_kind[(True, 2)]["stream"] is True
    assert by_kind[(True, 4)]["messages"] == [
        SYSTEM, {"role": "user", "content": "one two"},
        {"role": "assistant", "content": "ok ok "}, {"role": "user", "content": "three"}]
    assert by_kind[(False, 0)]["prompt"] == "alone here"
    requests = probe.requests()
    assert sorted(requests["request"]) == [0, 1, 2]
    assert (requests["done"] >= requests["sent"]).all()
    streamed = requests[requests["request"] == 0][0]
    assert streamed["sent"] <= streamed["first"] <= streamed["done"]
    assert np.isnan(requests[requests["request"] == 1][0]["first"])
    facts = engine.facts()
    assert facts.requests == 3 and facts.latency is not None
    assert facts.latency.ttft_p50_s is not None and facts.agent_s > 0


def test_open_loop_traffic_pauses_for_samples_at_rest(tmp_path, model_path):
    spec = fake_spec(model_path, {"rate": "50/s", "rest_every": "0.25s", "phases": [
        {"kind": "distinct", "requests": 60, "words": 4}]})
    engine, probe = serve(spec, tmp_path)
    frame = to_frame(probe.rows())
    rests = frame[frame["phase"] == "idle"]
    # about 1.2 s of arrivals: a rest every 0.25 s of traffic, the baseline and the last
    assert len(rests) >= 5
    assert engine.facts().requests == 60
    # No request is marked in the server (its period shows memory in flight); each rest says
    # the last request sent before it, and the last rest follows request 59.
    assert frame["phase"].eq("request").sum() == 0 and frame["phase"].eq("serve").any()
    assert rests["request"].is_monotonic_increasing and rests["request"].iloc[-1] == 59


def test_a_soak_starts_the_traffic_over_until_its_duration(tmp_path, model_path):
    trace = write_trace(tmp_path / "t.jsonl", [{"prompt": "a b c", "max_tokens": 1}] * 3)
    spec = fake_spec(model_path, {"trace": str(trace), "rate": "30/s", "duration": "1.5s",
                                  "rest_every": "0.5s"}, "--limit", "2")
    engine, probe = serve(spec, tmp_path)
    served = engine.facts().requests
    assert served > 3 * 4  # several passes of the three lines
    assert len(probe.requests()) == served
    capped = fake_spec(model_path, {"trace": str(trace), "rate": "30/s", "duration": "60s",
                                    "max_requests": 7})
    (tmp_path / "capped").mkdir()
    engine, probe = serve(capped, tmp_path / "capped")
    # Open loop: a request may finish before the one sent ahead of it (once seen beside a second
    # suite run), so the rows come in completion order.
    assert engine.facts().requests == 7 and sorted(probe.requests()["request"]) == list(range(7))


def test_fail_fast_ends_the_traffic_at_the_first_rest_over_the_budget(tmp_path, model_path):
    spec = fake_spec(model_path, {"rate": "40/s", "rest_every": "0.2s", "fail_fast": True,
                                  "phases": [{"kind": "distinct", "requests": 400, "words": 64}]},
                     detect={"unbounded": {"budget": "3 MiB"}})
    engine, probe = serve(spec, tmp_path)
    facts = engine.facts()
    frame = to_frame(probe.rows())
    last = frame.query("phase == 'idle'").iloc[-1]
    assert last["logical"] > 3 * MiB and facts.requests < 400
    # Nothing is sent after the rest that breached, and that rest is the run's last sample.
    assert probe.requests()["sent"].max() < last["time"] and last.name == frame.index[-1]
    assert facts.stopped is not None
    held = re.fullmatch(rf"fail_fast: the components hold ([\d,]+\.\d\d MiB) at rest at "
                        rf"{last['time']:.1f} s, over the budget of 3\.00 MiB", facts.stopped)
    assert held is not None, facts.stopped
    # One figure: the finding reads the point the run stopped at, as the stop reason does.
    found = {f.kind: f for f in detect(frame, spec.detect, "cpu")}
    assert found["unbounded"].message.startswith(
        f"components hold {held[1]} at rest, over the budget of 3.00 MiB")


def test_a_wedged_server_under_open_loop_traffic_is_named_within_the_timeout(tmp_path,
                                                                             model_path):
    spec = fake_spec(model_path, {"rate": "20/s", "phases": [
        {"kind": "distinct", "requests": 10, "words": 4}]}, "--hang-after", "4",
        request_timeout=2.0)
    with pytest.raises(ServerError) as raised:
        serve(spec, tmp_path)
    assert "the server stopped completing requests at request 2; its port still answers " \
           "(GET /v1/models answers HTTP 200): no reply within 2 s" in str(raised.value)
    assert not servers()


def test_kvmem_run_replays_a_trace_and_shows_its_latency(tmp_path, model_path):
    """End to end: the report folder holds each request's times beside the samples, and
    `kvmem show` says the traffic's latency."""
    write_trace(tmp_path / "t.jsonl", [
        {"messages": [{"role": "user", "content": "one two three"}], "session": "s",
         "max_tokens": 3, "stream": True},
        {"messages": [{"role": "user", "content": "four"}], "session": "s", "max_tokens": 2}])
    scenario = {"name": "replay", "engine": "server", "model": {"path": model_path},
                "server": {"command": f"{{python}} -m fake_server --port {{port}} --entry {ENTRY}",
                           "env": {"PYTHONPATH": str(FIXTURES)},
                           "logical": "fake_store:Store.nbytes", "settle": 0.05},
                "workload": {"http": {"trace": "t.jsonl", "rate": "20/s"}}}
    (tmp_path / "replay.yaml").write_text(yaml.safe_dump(scenario))
    out = tmp_path / "out"
    env = {**os.environ, "COLUMNS": "300"}
    done = subprocess.run([sys.executable, "-m", "harness", "run", str(tmp_path / "replay.yaml"),
                           "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    folder = out / "replay" / "default"
    assert {"samples.csv", "requests.csv", "memory.png", "summary.json"} <= {
        p.name for p in folder.iterdir()}
    lines = (folder / "requests.csv").read_text().splitlines()
    assert lines[0] == "request,sent,first,done,prompt_tokens,completion_tokens,status"
    assert [line.split(",")[-1] for line in lines[1:]] == ["ok", "ok"]
    shown = subprocess.run([sys.executable, "-m", "harness", "show", str(folder)],
                           capture_output=True, text=True, env=env, timeout=60)
    assert "replay/default: 2 requests; latency " in shown.stdout
    assert " s median, " in shown.stdout and "first token " in shown.stdout
    assert not servers()


def test_a_long_run_in_a_log_prints_its_note_once_a_minute(monkeypatch):
    """Where no bar is drawn (CI), a server's note (time, memory, breaches) is a line a minute."""
    import io

    from rich.console import Console
    from rich.progress import Progress

    from harness.pipeline import suite

    out = io.StringIO()
    progress = Progress(console=Console(file=out))
    task = progress.add_task("soak/default", total=None)
    clock = iter([0.0, 30.0, 61.0, 90.0, 122.0])
    monkeypatch.setattr(suite.time, "monotonic", lambda: next(clock))
    for served in range(5):
        suite._advance(progress, task, "soak/default", served, f"[{served} s]")
    suite._advance(progress, task, "soak/default", 5)  # no note: nothing printed
    assert out.getvalue().splitlines() == ["soak/default: 2 requests [2 s]",
                                           "soak/default: 4 requests [4 s]"]
