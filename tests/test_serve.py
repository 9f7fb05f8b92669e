"""Serve mode on a fake server (tests/fixtures/server): no model runs, so each case takes about a
second. The agent, the traffic, server failures and the detectors on a server's samples; the real
`mlx_lm.server` is tests/test_serve_mlx_lm.py's."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
from multiprocessing.connection import Listener
from pathlib import Path

import mlx.core as mx
import psutil
import pytest

from harness.agent import kvmem_agent
from harness.agent.kvmem_sample import PHASES
from harness.common.units import MiB
from harness.judge import frames
from harness.judge.summary import Environment
from harness.pipeline.isolation import estimate_bytes, execute
from harness.pipeline.suite import summarize
from harness.run import traffic
from harness.run.server_engine import AGENT_DIR
from harness.scenario import ScenarioError, load_variants
from harness.scenario.server import HttpSpec
from tests.conftest import make_spec, serve_with_engine

FIXTURES = Path(__file__).parent / "fixtures" / "server"
ENTRY = 16384  # bytes per prompt word: a 64-word prompt stores 1 MiB


def fake(model_path: str, *args: str, requests: int = 8, **server: object) -> dict:
    """A scenario serving the fake server with `args`, `requests` distinct 64-word prompts."""
    return {
        "name": "fake", "engine": "server", "model": {"path": model_path},
        "server": {"command": f"{{python}} -m fake_server --port {{port}} --entry {ENTRY}",
                   "args": list(args), "env": {"PYTHONPATH": str(FIXTURES)},
                   "logical": "fake_store:Store.nbytes", **server},
        "workload": {"http": {"phases": [{"kind": "distinct", "requests": requests,
                                          "words": 64}]}},
    }


def servers() -> set[int]:
    """The fake servers among this process's descendants."""
    found = set()
    for process in psutil.Process().children(recursive=True):
        try:
            if "fake_server" in " ".join(process.cmdline()):
                found.add(process.pid)
        except psutil.Error:  # gone meanwhile, or a zombie
            pass
    return found


# -- the schema ----------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "message"), [
    ({"engine": "mlx_lm"}, "workload.http: HTTP traffic needs engine: server"),
    ({"workload": {"requests": [{"prompt": 8}]}},
     "workload: engine server sends HTTP traffic: expected workload.http"),
    ({"server": {"command": "serve --model {model}"}},
     "server.command: the command must say where to listen with {port}"),
    ({"server": {"command": "serve --port {port} {weights}"}},
     "server.command: unknown placeholder {weights}: expected {python}, {model}, {model_dir}, "
     "{model_name}, {host}, {port}"),
    ({"server": {"command": "serve 'unclosed {port}"}},
     "server.command: cannot split the command: No closing quotation"),
    ({"server": {"command": []}}, "server.command: expected a command line"),
    ({"server": {"logical": "mlx_lm.models.cache.LRUPromptCache"}},
     "server.logical: expected module:Class.attribute"),
    ({"server": {"env": {"KVMEM_AGENT": "x"}}}, "server: env: 'KVMEM_AGENT' is not a variable"),
    ({"server": {"cap": "max bytes"}},
     "server.cap: expected an attribute of the `logical` class's instances (max_bytes) or "
     "module:Class.attribute"),
    ({"server": {"logical": None, "cap": "max_bytes"}},
     "cap: names an attribute of the `logical` class's instances: set logical too"),
    ({"server": {"requires": ["vllm mlx"]}},
     "server.requires.0: expected a requirement such as vllm-mlx==0.6.0, got 'vllm mlx'"),
    ({"server": {"requires_no_deps": [6]}},
     "server.requires_no_deps.0: expected a requirement (text), got 6"),
    ({"server": {"python": "/usr/bin/python3", "requires": ["mlx-lm"]}},
     "python: an interpreter of your own, or requires: an environment kvmem builds; not both"),
    ({"server": {"plugins": ["not a module"]}}, "server.plugins.0: expected a module's import"),
    ({"server": {"period": 0}}, "server.period: Input should be greater than or equal to 0.01"),
    ({"cache": {"store": {"component": "mlx_lm.LRUPromptCache"}}},
     "cache: the server uses its own caches"),
    ({"workload": {"http": {"phases": []}}}, "workload.http.phases: List should have at least 1"),
    ({"workload": {"http": {"phases": [{"kind": "idle", "seconds": 1}]}}},
     "phases: expected at least one phase that sends requests"),
    ({"workload": {"http": {"phases": [{"kind": "distinct", "requests": 0, "words": 8}]}}},
     "workload.http.phases.0.distinct.requests: Input should be greater than or equal to 1"),
    ({"workload": {"http": {"phases": [{"kind": "burst", "requests": 2}]}}},
     "workload.http.phases.0: Input tag 'burst' found using 'kind' does not match any"),
    ({"workload": {"http": {"clients": 65, "phases": [{"kind": "distinct", "requests": 1,
                                                       "words": 8}]}}},
     "workload.http.clients: Input should be less than or equal to 64"),
    ({"workload": {"http": {"phases": [{"kind": "distinct", "requests": 2, "words": 8,
                                        "disconnect": 2}]}}},
     "phases.0.disconnect: a client disconnects mid-stream: set stream: true"),
    ({"workload": {"http": {"model": "{name}", "phases": [
        {"kind": "distinct", "requests": 1, "words": 8}]}}},
     "workload.http.model: unknown placeholder {name}"),
    ({"workload": {"http": {"endpoint": "embeddings", "phases": [
        {"kind": "distinct", "requests": 1, "words": 8}]}}},
     "workload.http.endpoint: Input should be 'chat' or 'completions'"),
])
def test_bad_server_scenarios_name_the_field(tmp_path: Path, model_path: str, change: dict,
                                             message: str) -> None:
    import yaml

    scenario = fake(model_path)
    for key, value in change.items():
        if isinstance(value, dict) and key == "server":
            scenario["server"] = {**scenario["server"], **value}
        else:
            scenario[key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(scenario))
    with pytest.raises(ScenarioError) as error:
        load_variants(path)
    assert message in str(error.value)


def test_server_section_needs_the_server_engine(model_path: str) -> None:
    with pytest.raises(ValueError, match="server: needs engine: server"):
        make_spec(server={}, workload={"requests": [{"prompt": 8}]})


# -- the traffic ---------------------------------------------------------------------------

def http(**fields: object) -> HttpSpec:
    return HttpSpec.model_validate(fields)


def test_the_plan_is_the_same_for_a_seed_and_rounds_hold_one_call_per_client() -> None:
    spec = http(clients=2, phases=[
        {"kind": "distinct", "requests": 3, "words": 5},
        {"kind": "idle", "seconds": 0.5},
        {"kind": "prefix", "requests": 2, "prefix": 6, "words": 2, "clients": 1},
        {"kind": "sessions", "sessions": 3, "turns": 2, "words": 4},
    ])
    steps = list(traffic.plan(spec, seed=3))
    shape = [s if isinstance(s, float) else [(c.index, c.turn) for c in s] for s in steps]
    assert shape == [[(0, -1), (1, -1)], [(2, -1)], 0.5, [(3, -1)], [(4, -1)],
                     [(5, 0), (6, 0)], [(7, 1), (8, 1)], [(9, 0)], [(10, 1)]]
    again = list(traffic.plan(spec, seed=3))
    texts = [c.text for s in steps if not isinstance(s, float) for c in s]
    assert texts == [c.text for s in again if not isinstance(s, float) for c in s]
    assert texts != [c.text for s in traffic.plan(spec, seed=4) if not isinstance(s, float)
                     for c in s]
    assert [len(t.split()) for t in texts] == [5, 5, 5, 8, 8, 4, 4, 4, 4, 4, 4]
    first, second = steps[3][0].text.split(), steps[4][0].text.split()
    assert first[:6] == second[:6] and first[6:] != second[6:]
    assert spec.requests() == 11


def test_a_session_sends_its_whole_history() -> None:
    spec = http(phases=[{"kind": "sessions", "sessions": 1, "turns": 2, "words": 3}])
    (first,), (second,) = traffic.plan(spec, seed=0)
    assert traffic.body(first)["messages"] == [{"role": "user", "content": first.text}]
    assert first.session is not None
    first.session.messages += [{"role": "user", "content": first.text},
                               {"role": "assistant", "content": "a reply"}]
    assert traffic.body(second)["messages"] == [
        {"role": "user", "content": first.text}, {"role": "assistant", "content": "a reply"},
        {"role": "user", "content": second.text}]
    completion = http(endpoint="completions", stream=True,
                      phases=[{"kind": "distinct", "requests": 1, "words": 3}])
    (call,), = traffic.plan(completion, seed=0)
    assert traffic.body(call) == {"max_tokens": 16, "temperature": 0.0, "stream": True,
                                  "stream_options": {"include_usage": True},
                                  "prompt": call.text}


def test_the_estimate_covers_the_weights_and_the_longest_context(model_path: str) -> None:
    spec = make_spec(**fake(model_path))
    context = traffic.longest_context(spec.workload.http)
    assert context == 2 * 64 + 16 + 64
    kv = spec.geometry().minimum_bytes(context)
    assert estimate_bytes(spec) == spec.weights_bytes() + 2 * 11 * kv + 2 * 256 * MiB


# -- the agent -----------------------------------------------------------------------------

class Held:
    """A store the agent tracks in the tests."""

    def __init__(self, size: int, limit: int | None = None):
        self.size = size
        self.limit = limit

    def __len__(self) -> int:
        return 2


class Hoard:
    """A server's store as the walk finds it: a list of arrays on an instance."""

    def __init__(self) -> None:
        self.kept: list = []


HOARD = Hoard()


def test_the_agents_idle_walks_the_holders_when_asked_and_counts_their_buffers(
        exact_allocator: None) -> None:
    """An idle command with `holders` answers the groups (plain tuples) and the walk's cost,
    and its row counts the live buffers and arrays; without it the row says -1."""
    HOARD.kept = [mx.zeros((256,), dtype=mx.float32) for _ in range(3)]
    mx.eval(HOARD.kept)
    agent = kvmem_agent.Agent(60.0, None)
    try:
        walked = agent.handle({"op": "idle", "holders": True, "settle": 0.05})
        (group,) = [g for g in walked["holders"] if g[0] == f"{__name__}:Hoard.kept[*]"]
        assert group[2:8] == ("global", 3 * 1024, 3 * 1024, 3, 3, 0)
        assert walked["census"]["objects"] > 0 and not walked["census"]["approximate"]
        (row,) = walked["rows"]
        assert row[13] >= 3 and row[14] >= 3  # buffers, arrays: at least the hoard's
        plain = agent.handle({"op": "idle", "settle": 0.05})
        assert "holders" not in plain and plain["rows"][0][13:] == (-1, -1)
    finally:
        HOARD.kept = []


def test_the_agent_tracks_instances_and_answers_commands() -> None:
    tracked = kvmem_agent.Tracked(f"{__name__}:Held.size", "limit")
    kept = [Held(1000, 4096), Held(24, 2048)]
    assert tracked.read() == (1024, 4, 6144)  # sizes, lengths, caps
    agent = kvmem_agent.Agent(60.0, tracked)
    buffer = mx.zeros((MiB // 4,), dtype=mx.float32)
    mx.eval(buffer)
    rows = agent.handle({"op": "mark", "request": 3, "turn": 1, "tokens": 12})["rows"]
    del buffer
    rows += agent.handle({"op": "idle", "cycles": True, "settle": 0.1})["rows"]
    assert [row[1:5] for row in rows] == [("request", 3, 1, 12), ("idle", 3, 1, 0)]
    assert [row[9:] for row in rows] == [(1024, 4, 0, 6144, -1, -1), (1024, 4, 0, 6144, -1, -1)]
    assert rows[0][5] - rows[1][5] == MiB  # active dropped by the freed buffer
    assert rows[1][6] >= rows[0][5]  # the idle row's peak covers the buffer it saw
    assert agent.handle({"op": "rows"})["rows"] == []
    assert agent.handle({"op": "jump"})["error"] == "unknown op 'jump'"
    # One instance with no cap, or one that caps nothing (mlx-lm's default 2**63): no cap at all.
    for limit in (None, kvmem_agent.NO_CAP):
        kept.append(Held(0, limit))
        assert tracked.read() == (1024, 6, 0)
        kept.pop()
    del kept


def test_the_agent_in_a_process_says_hello_samples_and_leaves_children_alone(
        tmp_path: Path) -> None:
    """The sitecustomize starts the agent in the first Python process alone: a child that
    process starts runs without it."""
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent("""
        import os, subprocess, sys, time
        import mlx.core as mx
        child = subprocess.run([sys.executable, "-c",
                                "import os; print(os.environ.get('KVMEM_AGENT', 'none'))"],
                               capture_output=True, text=True)
        print("child agent:", child.stdout.strip(), flush=True)
        keep = mx.zeros((2**18,)); mx.eval(keep)
        time.sleep(30)
    """))
    key = os.urandom(32)
    with Listener(("127.0.0.1", 0), authkey=key) as listener:
        env = {**os.environ, "PYTHONPATH": str(AGENT_DIR),
               "KVMEM_AGENT": "{}:{}".format(*listener.address), "KVMEM_AGENT_KEY": key.hex(),
               "KVMEM_AGENT_PERIOD": "0.05", "KVMEM_AGENT_LOGICAL": "",
               "KVMEM_AGENT_PLUGINS": "no_such_plugin"}
        server = subprocess.Popen([sys.executable, str(script)], env=env,
                                  stdout=subprocess.PIPE, text=True)
        try:
            accepted: list = []
            waiter = threading.Thread(target=lambda: accepted.append(listener.accept()))
            waiter.start()
            waiter.join(30)
            connection = accepted[0]
            hello = connection.recv()
            assert hello["hello"] == kvmem_agent.PROTOCOL and hello["pid"] == server.pid
            assert hello["errors"] == ["plugin no_such_plugin: ModuleNotFoundError: No module "
                                       "named 'no_such_plugin'"]
            assert server.stdout is not None
            assert server.stdout.readline().strip() == "child agent: none"
            connection.send({"op": "idle", "cycles": False, "settle": 0.2})
            rows = connection.recv()["rows"]
            assert {row[1] for row in rows[:-1]} <= {"serve"} and rows[-1][1] == "idle"
            assert rows[-1][5] >= MiB  # the server's own array, read inside it
            connection.send({"op": "stop"})
            assert "rows" in connection.recv()
        finally:
            server.kill()
            server.wait()


# -- a server under traffic ------------------------------------------------------------------

def test_a_clean_server_fills_its_store_and_holds(model_path: str) -> None:
    engine, frame, findings, figures = serve_with_engine(
        make_spec(**fake(model_path, "--limit", "3")))
    kinds = {f.kind for f in findings}
    assert "leak" not in kinds and "retained" not in kinds and "plateau" in kinds
    resting = frames.quiescent(frame)
    # The baseline holds the warm-up's one-word entry, which the third request evicts.
    assert list(resting["logical"]) == [MiB + ENTRY, 2 * MiB + ENTRY] + [3 * MiB] * 6
    assert list(resting["active"] - frame["active"].iloc[0]) == [MiB, 2 * MiB] + [
        3 * MiB - ENTRY] * 6
    ends = frame[(frame["phase"] == "request") & (frame["tokens"] > 0)]
    assert list(ends["request"]) == list(range(8)) and set(ends["tokens"]) == {64 + 16}
    assert frame["time"].is_monotonic_increasing and frame["time"].iloc[0] == 0.0
    assert engine.facts().requests == 8
    assert engine.store_stats() == {"nbytes": 3 * MiB, "entries": 3}
    assert figures["final"] == 3 * MiB - ENTRY


@pytest.mark.parametrize("jitter", [0, 3 * ENTRY])
def test_a_leaking_server_is_a_leak_per_request(model_path: str, jitter: int) -> None:
    """Whether its full store's size stands still or wanders (entries of different lengths
    replacing one another), what nothing reports keeps rising: a leak, not retained."""
    _, _, findings, _ = serve_with_engine(make_spec(**fake(
        model_path, "--limit", "3", "--leak", "--jitter", str(jitter), requests=12)))
    (leak,) = [f for f in findings if f.kind == "leak"]
    assert abs(leak.bytes - MiB) <= jitter
    assert "retained" not in {f.kind for f in findings}


# A server that says why and exits at once. It leaves through os._exit: an interpreter that
# imported MLX (the agent binds its counters at start) and finalizes while the agent's thread
# is still connecting was seen, once in a dozen suite runs on two loaded cores, to die of
# SIGSEGV at exit instead of its status 1, which is not what these tests are about.
EXITS_AT_ONCE = ("{python} -c \"import os, sys; print('no model here', file=sys.stderr, "
                 "flush=True); os._exit(1)\" {port}")


# A server held to its own cap and its own accounting: each canary beside its clean twin.
OWN_CAP = 3 * MiB
HOLDING = {  # variant: (server arguments, scenario additions, the at-rest findings it must get)
    "ignores_its_cap": (["--max-bytes", str(OWN_CAP), "--ignore-cap"], {"cap": "max_bytes"},
                        {"over_cap"}),
    "keeps_its_cap": (["--max-bytes", str(OWN_CAP)], {"cap": "max_bytes"}, {"plateau"}),
    "lying_counter": (["--overcount"], {}, {"overclaimed"}),
    "honest_counter": ([], {}, {"unbounded"}),
    "reloaded_over_budget": (["--preload", "4", "--limit", "4"], {}, {"unbounded"}),
    "reloaded_within_budget": (["--preload", "1", "--limit", "2"], {}, set()),
}
AT_REST = {"leak", "unbounded", "plateau", "retained", "over_cap", "overclaimed", "gc_deferred"}


def holding(model_path: str, variant: str):
    """The canary or twin's samples and findings; a 3 MiB budget where it reloads."""
    args, server, _ = HOLDING[variant]
    spec = fake(model_path, *args, **server)
    if variant.startswith("reloaded"):
        spec["detect"] = {"unbounded": {"budget": "3 MiB"}}
    _, frame, findings, _ = serve_with_engine(make_spec(**spec))
    return frame, findings


@pytest.mark.parametrize("variant", list(HOLDING))
def test_a_server_is_held_to_its_own_cap_and_its_own_accounting(model_path: str,
                                                                variant: str) -> None:
    frame, findings = holding(model_path, variant)
    assert {f.kind for f in findings} & AT_REST == HOLDING[variant][2]
    resting = frames.quiescent(frame)
    found = {f.kind: f for f in findings}
    if variant == "ignores_its_cap":  # 8 entries of 1 MiB and the warm-up's against 3 MiB
        assert list(resting["cap"]) == [OWN_CAP] * 8
        assert found["over_cap"].bytes == 5 * MiB + ENTRY
        assert "holds 8.02 MiB at rest against its own 3.00 MiB cap" in found["over_cap"].message
    if variant == "keeps_its_cap":
        assert resting["logical"].max() == OWN_CAP
    if variant == "lying_counter":  # counts 8 MiB, keeps nothing
        assert list(resting["logical"] - frame["logical"].iloc[0]) == [
            k * MiB for k in range(1, 9)]
        assert found["overclaimed"].bytes == 8 * MiB
        assert "0.00 MiB are held above the baseline" in found["overclaimed"].message
    if variant == "honest_counter":
        assert found["unbounded"].severity == "warning" and set(resting["cap"]) == {0}
    if variant == "reloaded_over_budget":  # over 3 MiB from the first point at rest
        # The warm-up's entry evicts one reloaded entry and stays until the fourth request.
        assert list(resting["logical"]) == [3 * MiB + ENTRY] * 3 + [4 * MiB] * 5
        assert found["unbounded"].bytes == MiB and found["unbounded"].severity == "error"
        assert "from the first point at rest, not rising" in found["unbounded"].message
    if variant == "reloaded_within_budget":
        assert list(resting["logical"]) == [MiB + ENTRY] + [2 * MiB] * 7
        assert resting["logical"].max() <= 3 * MiB


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(HOLDING))
def test_each_cap_and_accounting_verdict_holds_ten_runs_out_of_ten(model_path: str,
                                                                   variant: str) -> None:
    verdicts = [{f.kind for f in holding(model_path, variant)[1]} & AT_REST
                for _ in range(10)]
    assert verdicts == [HOLDING[variant][2]] * 10


def test_each_run_has_a_home_of_its_own_unless_the_scenario_gives_one(tmp_path: Path,
                                                                     model_path: str) -> None:
    """A server that keeps state under HOME (vllm-mlx's prefix cache) cannot carry it from one
    run into the next: each gets a fresh HOME and XDG_CACHE_HOME, gone with the run."""
    homes = []
    for run in range(2):
        note = tmp_path / f"home{run}.txt"
        serve_with_engine(make_spec(**fake(model_path, "--note", str(note), requests=1)))
        home, cache, _ = note.read_text().split()
        assert cache == f"{home}/.cache" and home != os.environ.get("HOME")
        assert not Path(home).exists()  # removed with the run's files
        homes.append(home)
    assert homes[0] != homes[1]
    given = fake(model_path, "--note", str(tmp_path / "given.txt"), requests=1)
    given["server"]["env"] |= {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "c")}
    serve_with_engine(make_spec(**given))
    assert (tmp_path / "given.txt").read_text().split()[:2] == [str(tmp_path), str(tmp_path / "c")]


def test_requests_name_the_model_where_the_scenario_says(model_path: str) -> None:
    """A server that routes by model name (omlx takes a folder's name) gets it in every
    request; without it, the same server fails the first request."""
    name = Path(model_path).name
    scenario = fake(model_path, "--require-model", name, requests=2)
    scenario["workload"]["http"]["model"] = "{model_name}"
    engine, _, _, _ = serve_with_engine(make_spec(**scenario))
    assert engine.facts().requests == 2
    unnamed = fake(model_path, "--require-model", name, requests=2)
    with pytest.raises(RuntimeError) as refused:
        serve_with_engine(make_spec(**unnamed))
    assert str(refused.value).startswith(
        "the server's first request failed: the readiness request: HTTP 404")
    assert ("(the request named no model: if the server needs one, set workload.http.model, "
            "e.g. \"{model}\" or \"{model_name}\")") in str(refused.value)


def test_concurrent_clients_and_interrupted_streams(model_path: str) -> None:
    scenario = fake(model_path, "--limit", "100")
    scenario["workload"]["http"] = {"clients": 3, "stream": True, "max_tokens": 8, "phases": [
        {"kind": "distinct", "requests": 6, "words": 64},
        {"kind": "distinct", "requests": 2, "words": 64, "disconnect": 2, "clients": 1},
        {"kind": "idle", "seconds": 0.3}]}
    engine, frame, _, _ = serve_with_engine(make_spec(**scenario))
    assert len(frames.quiescent(frame)) == 2 + 2 + 1
    assert engine.facts().disconnects == 2
    assert engine.store_stats() == {"nbytes": 8 * MiB + ENTRY, "entries": 9}  # and the warm-up


@pytest.mark.parametrize(("args", "server", "error"), [
    (["--die-after", "4"], {},
     "the server exited with status 7 during request 2; the server's last output:\n"
     "fake server: dying at request 4"),
    # Wedged: requests hang while the port answers, as a server whose generator died does.
    (["--hang-after", "3"], {"request_timeout": 1.0},
     "the server stopped completing requests at request 1; its port still answers (GET "
     "/v1/models answers HTTP 200): no reply within 1 s; at "),
    (["--fail-after", "2"], {}, "request 0: HTTP 500"),
    # When kvmem notices depends on the load: the agent, started with the interpreter, may
    # connect or say hello before the command exits.
    ([], {"command": EXITS_AT_ONCE}, re.compile(
        r"the server exited with status 1 before [^;\n]+; the server's last output:\n"
        r"no model here")),
    ([], {"command": "/no/such/server --port {port}"},
     "cannot start the server '/no/such/server': No such file or directory"),
    ([], {"logical": "fake_store:Nothing.nbytes"},
     "the agent in the server could not set up: logical fake_store:Nothing.nbytes: "
     "ValueError: no class Nothing in fake_store"),
    ([], {"cap": "fake_store:Store"},
     "the agent in the server could not set up: logical fake_store:Store.nbytes with cap "
     "fake_store:Store: ValueError: Store names a class: expected module:Class.attribute"),
])
def test_a_server_that_fails_fails_its_variant_and_leaves_nothing(
        tmp_path: Path, model_path: str, args: list[str], server: dict,
        error: str | re.Pattern) -> None:
    import yaml

    path = tmp_path / "fails.yaml"
    path.write_text(yaml.safe_dump(fake(model_path, *args, **server)))
    (variant,) = load_variants(path)
    outcome = execute(variant, timeout=60)
    found = error.search if isinstance(error, re.Pattern) else lambda text: error in text
    assert outcome.status == "failed"
    assert found(outcome.error), outcome.error
    assert "Traceback" not in outcome.error
    assert not servers()
    _, _, summary = summarize(outcome, Environment(backend="cpu"), tmp_path)
    assert summary.status == "failed" and summary.error == outcome.error


def test_a_variant_killed_mid_run_takes_its_server_with_it(tmp_path: Path,
                                                           model_path: str) -> None:
    """A timeout kills the variant's process with SIGKILL: its server dies with it. (20 s: on
    a machine loaded by a second suite run, starting the server and serving two requests once
    took over 8 s.)"""
    import yaml

    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(fake(model_path, "--hang-after", "3")))
    (variant,) = load_variants(path)
    outcome = execute(variant, timeout=20)
    assert outcome.status == "failed" and outcome.error.startswith("timed out after 20 s")
    # What it sampled up to its last sample at rest was on disk: the baseline and request 0 (the
    # server's third request, after the readiness request, is the one that hangs).
    assert (outcome.rows["phase"] == PHASES.index("idle")).sum() == 2
    assert outcome.requests["request"].tolist() == [0]
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in servers()], timeout=5)
    assert not alive


def test_kvmem_run_shows_a_server_that_exits_at_once_and_exits_2(tmp_path: Path,
                                                                 model_path: str) -> None:
    import yaml

    path = tmp_path / "exits.yaml"
    path.write_text(yaml.safe_dump(fake(
        model_path, command=EXITS_AT_ONCE)))
    done = subprocess.run([sys.executable, "-m", "harness", "run", str(path), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=120)
    assert done.returncode == 2
    # When kvmem sees it go depends on the machine's load: the agent starts with the
    # interpreter, so on a slow machine it may connect, or say hello, before the command exits.
    assert re.search(r"fake/default: the server exited with status 1 before [^;\n]+; the "
                     r"server's last output:\nno model here", done.stdout), done.stdout


def test_a_server_whose_kvmem_hangs_up_without_stop_ends_itself() -> None:
    """Where no parent-death signal exists (macOS), the agent is what ends a server whose
    kvmem is gone: a connection closed without `stop` kills the server's process group."""
    key = os.urandom(32)
    with Listener(("127.0.0.1", 0), authkey=key) as listener:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(AGENT_DIR), str(FIXTURES)]),
               "KVMEM_AGENT": "{}:{}".format(*listener.address), "KVMEM_AGENT_KEY": key.hex()}
        server = subprocess.Popen([sys.executable, "-m", "fake_server", "--port", "0"], env=env,
                                  start_new_session=True)
        try:
            accepted: list = []
            waiter = threading.Thread(target=lambda: accepted.append(listener.accept()))
            waiter.start()
            waiter.join(30)
            accepted[0].recv()  # hello
            accepted[0].close()  # gone, without a word
            assert server.wait(10) == -9
        finally:
            server.kill()
            server.wait()


def test_an_unwritable_model_cache_fails_the_variant_in_one_line(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """The folder kvmem writes for a preset cannot be written: the variant fails naming the
    path, without a traceback."""
    import yaml

    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("KVMEM_CACHE", str(blocked))
    scenario = {"name": "nocache", "engine": "server", "model": "qwen3-tiny",
                "workload": {"http": {"phases": [{"kind": "distinct", "requests": 1,
                                                  "words": 4}]}}}
    path = tmp_path / "nocache.yaml"
    path.write_text(yaml.safe_dump(scenario))
    (variant,) = load_variants(path)
    outcome = execute(variant, timeout=60)
    assert outcome.status == "failed"
    assert str(blocked) in outcome.error and "Traceback" not in outcome.error


def test_a_port_that_no_longer_answers_is_told_from_a_wedged_one() -> None:
    """`still_answers`: nothing listening (the server is gone), a listener that accepts and
    never replies, and one that answers GET /v1/models."""
    import http.server

    from harness.run.traffic import still_answers

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    assert still_answers("127.0.0.1", port, timeout=0.5) is None
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        assert still_answers("127.0.0.1", silent.getsockname()[1], timeout=0.5) == \
            "it accepts connections"
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.handle_request)
    thread.start()
    try:
        assert still_answers("127.0.0.1", server.server_address[1]) == \
            "GET /v1/models answers HTTP 501"
    finally:
        thread.join(5)
        server.server_close()
