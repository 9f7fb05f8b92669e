"""The gate on a slow runner and on host memory (issue 37): open-loop traffic is measured as an
ordered replay, so what it sends and how many requests are in flight do not follow the server's
speed, and unchanged code on a slowed server gives no regression; rss_peak is judged against
the base's own RSS, and host memory gained request after request is a gated figure."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from harness.common.units import KiB, MiB
from harness.judge.at_rest import HostThresholds, host_rate
from harness.run.probe import to_frame
from harness.scenario import load_variants
from tests import test_gate_pr as scratch
from tests.test_gate_pr import commit, gate, git, init_repository
from tests.test_init import SPEC
from tests.test_long_traffic import fake_spec, serve, write_trace
from tests.test_serve import FIXTURES

# The scratch repository of tests/test_gate_pr.py and a pull request's branch of it.
recorded, branch = scratch.recorded, scratch.branch

# Three conversations and two lone prompts, arriving faster than a slow server answers them.
TRACE = [
    {"messages": [{"role": "user", "content": f"turn {turn} of {name}"}], "session": name,
     "max_tokens": 2, "at": 0.02 * (3 * turn + index), "stream": bool(turn % 2)}
    for turn in range(3) for index, name in enumerate("abc")
] + [{"prompt": f"alone {n}", "max_tokens": 3, "at": 0.2} for n in range(2)]


def in_flight(requests) -> int:
    """The most requests in flight at once, from the request log's times."""
    events = sorted([(t, 1) for t in requests["sent"]] + [(t, -1) for t in requests["done"]])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def replay(tmp_path: Path, model_path: str, delay: float, **http) -> tuple[list, list, int]:
    """The trace replayed on the fake server answering every other request `delay` seconds late,
    as the gate runs it: the bodies the server received (sorted), each request with the number
    of samples at rest before it was sent (its round), and the most requests in flight."""
    trace = write_trace(tmp_path / "trace.jsonl", TRACE)
    bodies = tmp_path / f"bodies-{delay}.jsonl"
    spec = fake_spec(model_path, {"trace": str(trace), "rate": "50/s", "clients": 2, **http},
                     "--bodies", str(bodies), "--delay", str(delay))
    gated = spec.workload.model_copy(update={"http": spec.workload.http.gated()})
    spool = tmp_path / f"rows-{delay}"
    spool.mkdir()
    engine, probe = serve(spec.model_copy(update={"workload": gated}), spool)
    sent = sorted(bodies.read_text().splitlines()[1:])       # after the readiness request
    frame = to_frame(probe.rows())
    rests = frame[frame["phase"] == "idle"]["time"]
    requests = probe.requests()
    rounds = sorted((int((rests < sent_at).sum()), int(index))
                    for index, sent_at in zip(requests["request"], requests["sent"], strict=True))
    assert engine.facts().ordered
    return sent, rounds, in_flight(requests)


def test_the_ordered_replay_sends_the_same_whatever_the_servers_speed(tmp_path, model_path):
    fast = replay(tmp_path, model_path, 0.0)
    slow = replay(tmp_path, model_path, 0.15)
    assert fast[:2] == slow[:2]                       # the same bodies, in the same rounds
    assert len(fast[0]) == len(TRACE)
    # One request at a time in the trace's order, each after a sample at rest, whatever the
    # scenario's `clients` (two in flight would overlap or not as the server's speed decides).
    assert [index for _, index in fast[1]] == list(range(len(TRACE)))
    assert [round_ for round_, _ in fast[1]] == list(range(1, len(TRACE) + 1))
    assert fast[2] == slow[2] == 1


def test_open_loop_as_declared_piles_requests_up_on_a_slow_server(tmp_path, model_path):
    """What the ordered replay avoids: on its schedule, a slow server has more in flight."""
    trace = write_trace(tmp_path / "trace.jsonl", TRACE)
    spec = fake_spec(model_path, {"trace": str(trace), "rate": "50/s", "clients": 2,
                                  "gate": "as_declared"}, "--delay", "0.3")
    assert spec.workload.http.gated() is spec.workload.http
    engine, probe = serve(spec, tmp_path)
    assert not engine.facts().ordered
    assert in_flight(probe.requests()) > 2


def test_the_bundled_trace_scenario_is_gated_as_an_ordered_replay():
    [variant] = load_variants(Path("scenarios/mlx_lm_server_trace.yaml"))
    http = variant.spec.workload.http
    assert http.open_loop and http.gate == "ordered"
    assert http.gated().arrivals == "ordered" and not http.gated().open_loop


# -- unchanged code on a slowed server ----------------------------------------------------------

SLOW_SCENARIO = """\
name: gate_slow
description: The fake server under a replayed trace at open-loop arrivals; each request holds
  1 MiB while in flight, so requests piling up on a slow server raise the peak.
engine: server
model: {{path: {model}}}
server:
  command: "{{python}} -m fake_server --port {{port}} --entry 4096 --scratch 1048576"
  env: {{PYTHONPATH: {fixtures}}}
  logical: fake_store:Store.nbytes
  settle: 0.05
workload:
  http: {{trace: trace.jsonl, rate: 50/s, clients: 2{gate}}}
variants:
  default: {{}}
"""


@pytest.mark.parametrize(("form", "code"), [
    ("", 0), pytest.param(", gate: as_declared", 1, marks=pytest.mark.slow)])
def test_unchanged_code_on_a_slowed_server_gives_no_regression(form, code, tmp_path, monkeypatch,
                                                                model_path):
    """Recorded on a fast server, judged on one that answers every other request 0.3 s late:
    the ordered replay passes; the same scenario gated as declared cries wolf (the peak of the
    requests that piled up), which is what the ordered form is for."""
    monkeypatch.chdir(tmp_path)
    init_repository()
    Path("scenarios").mkdir()
    write_trace(Path("scenarios/trace.jsonl"), TRACE)
    Path("scenarios/gate_slow.yaml").write_text(SLOW_SCENARIO.format(
        model=model_path, fixtures=FIXTURES, gate=form))
    Path(".gitignore").write_text("reports*/\nkvmem-gate/\n")
    assert scratch.cli("baseline", "update", "scenarios", "--reason", "first record") == 0
    commit("scenario and baselines")
    git("checkout", "-q", "-b", "pr")
    monkeypatch.setenv("FAKE_SERVER_DELAY", "0.3")
    status, comment, result = gate()
    assert status == code, comment
    assert ("gate_slow: open-loop traffic gated as an ordered replay, arrival times ignored"
            in comment) == (code == 0)
    if code:
        assert any(e["verdict"] == "regression" for e in result["entries"])
        return
    # The same reports measured on the schedule (`kvmem run` without --gated, as a workflow
    # that dropped the flag would) are refused, not compared.
    assert scratch.cli("run", "scenarios", "--out", "reports-declared") == 0
    status, comment, result = gate("--from", "reports-declared")
    assert status == 1
    assert "the head's run kept the open-loop schedule" in comment
    assert [e["state"] for e in result["entries"]] == ["failed"]


# -- host memory against the run's own RSS ------------------------------------------------------

def rests(rss: list[int], active: list[int], cache: list[int] | None = None) -> pd.DataFrame:
    """Samples at rest only: the baseline, then one after each request."""
    return pd.DataFrame({"phase": "idle", "step": range(len(rss)), "rss": rss, "active": active,
                         "cache": cache or [0] * len(rss)})


def test_host_rate_is_what_half_the_points_at_rest_add_outside_mlx():
    """Past the warm-up's first point: the lower median of the deltas, so a one-off jump (an
    arena) does not count; on CPU MLX's active and cached buffers come out of RSS, elsewhere
    its active ones."""
    t = HostThresholds()
    rss = [100 * MiB, 140 * MiB, 141 * MiB, 142 * MiB, 150 * MiB, 151 * MiB]
    assert host_rate(rests(rss, [0] * 6), t, "cpu") == MiB
    grown = [0, 0, MiB, 2 * MiB, 3 * MiB, 4 * MiB]              # MLX's own, in RSS
    assert host_rate(rests(rss, grown), t, "cpu") == 0
    assert host_rate(rests(rss, [0] * 6, grown), t, "metal") == MiB
    assert host_rate(rests(rss[:3], [0] * 3), t, "cpu") is None  # one point past the warm-up


@pytest.fixture(scope="module")
def adopted(tmp_path_factory) -> Path:
    """A repository made by `kvmem init`, its starter run and recorded on main."""
    root = tmp_path_factory.mktemp("adopted")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        init_repository()
        assert scratch.cli("init", "--install", SPEC) == 0
        Path(".gitignore").write_text("reports*/\nkvmem-gate/\n")
        assert scratch.cli("run", "scenarios", "--out", "reports-main") == 0
        assert scratch.cli("baseline", "update", "--reason", "first record", "--from",
                           "reports-main") == 0
        commit("kvmem init, recorded")
    return root


def host_copy(once: int, per_rest: int = 0, to: str = "reports-head",
              variant: str = "after") -> Path:
    """The main branch's reports as the head's, `variant`'s process holding `once` bytes more
    outside MLX from its first request on and `per_rest` more at each point at rest after the
    baseline: its rows and the figures they give (rss_peak, host_rate)."""
    shutil.copytree("reports-main", to)
    for path in Path(to).rglob(f"{variant}/summary.json"):
        rows = path.with_name("samples.csv")
        frame = pd.read_csv(rows)
        rests = (frame["phase"] == "idle").cumsum() - 1          # points at rest so far
        frame.loc[frame.index > 0, "rss"] += once + per_rest * rests[frame.index > 0]
        frame.to_csv(rows, index=False)
        data = json.loads(path.read_text())
        data["metrics"]["rss_peak"] = int(frame["rss"].max())
        data["metrics"]["host_rate"] = host_rate(frame, HostThresholds(), "cpu")
        path.write_text(json.dumps(data, indent=1))
    return Path(to)


def test_the_scratch_scenario_records_its_rss_and_host_rate(branch):
    after = json.loads(Path("reports-main/gate_pr/after/summary.json").read_text())["metrics"]
    assert 40 * MiB < after["rss_peak"] < 100 * MiB
    assert abs(after["host_rate"]) < 256 * KiB


def after(result: dict, variant: str = "after") -> dict:
    """A variant's entry in the gate's JSON."""
    return next(e for e in result["entries"] if e["variant"] == variant)


@pytest.mark.parametrize("repository", ["scratch", "kvmem init"])
def test_a_host_copy_of_24_mib_fails_against_the_runs_own_rss(repository, request, tmp_path,
                                                              monkeypatch):
    """rss_peak about 60 -> 84 MiB: +40% of the base's own RSS, past its 15% share and 8 MiB
    floor (under the 64 MiB floor before, it passed); on this repository's scratch scenario and
    on the starter `kvmem init` writes."""
    source = request.getfixturevalue("recorded" if repository == "scratch" else "adopted")
    shutil.copytree(source, tmp_path / "repo")
    monkeypatch.chdir(tmp_path / "repo")
    git("checkout", "-q", "-b", "pr")
    scenario, variant = (("gate_pr", "after") if repository == "scratch"
                         else ("kvmem_starter", "preallocated"))
    status, comment, result = gate("--from", str(host_copy(24 * MiB, variant=variant)))
    assert status == 1
    rss = after(result, variant)["metrics"]["rss_peak"]
    assert (rss["verdict"], rss["delta"]) == ("regression", 24 * MiB)
    assert rss["tolerance"]["text"] == "8 MiB and 15%"
    assert f"| `{scenario}/{variant}` | rss_peak |" in comment


def test_host_memory_gained_at_1_mib_a_request_fails(branch):
    """1 MiB a request outside MLX: under host_memory's 32 MiB floor over three requests, and
    under the RSS floor, but past host_rate's 256 KiB a request."""
    status, comment, result = gate("--from", str(host_copy(0, per_rest=MiB)))
    assert status == 1
    rate = after(result)["metrics"]["host_rate"]
    assert rate["verdict"] == "regression" and rate["head"] - rate["base"] == MiB
    assert rate["tolerance"]["text"] == "256 KiB"
    assert "| `gate_pr/after` | host_rate |" in comment


def test_noise_in_rss_passes(branch):
    """A few MiB more RSS once (a page cache, an arena) and a few KiB a request pass."""
    status, comment, _ = gate("--from", str(host_copy(3 * MiB, per_rest=8 * KiB)))
    assert status == 0, comment
