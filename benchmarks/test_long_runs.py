"""Long runs in serve mode: kvmem's own cost over 10,000 requests, and the report of an hour.

Run with `python -m pytest benchmarks/test_long_runs.py --benchmark-only` (under a minute;
figures in docs/benchmarks.md). Each benchmark is one measurement that also checks what the
long-run requirement promises, so a regression fails here rather than in a user's soak.

- `test_ten_thousand_requests`: one serve-mode run in this process, as a variant's process runs
  it: `tests/fixtures/server/plain_server.py` (the standard library only, so the server's own
  work per request is as small as it gets and kvmem's share shows) with the agent injected,
  10,000 open-loop requests arriving at 250 a second (Poisson), a sample at rest every 10 s,
  the probe's rows spooled to disk. Checked: every request served; at least 200 a second from
  the first request sent to the last answered (the pauses for samples at rest included); this
  process's RSS grows less than 10 MiB between request 1,000 and request 10,000; the agent's
  sampling takes under 1% of the server's CPU time.
- `test_report_of_an_hour`: summarize and write the report of a one-hour server run built in
  memory (36,000 samples, 7,200 requests): detectors, figures, samples.csv, requests.csv,
  memory.png and summary.json. Checked: under 10 seconds a report.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from harness.agent.kvmem_agent import current_rss
from harness.agent.kvmem_sample import PHASES
from harness.common.units import MiB
from harness.judge.summary import ModelFacts
from harness.models.folder import folder
from harness.models.loading import ModelChoice
from harness.pipeline.isolation import RunOutcome
from harness.pipeline.suite import requests_frame, summarize, write
from harness.run.environment import environment
from harness.run.probe import REQUEST, ROW, Probe
from harness.run.server_engine import ServerEngine
from harness.scenario import ScenarioSpec, Variant

FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures" / "server"

REQUESTS = 10_000
RATE = 250  # requests a second offered
FIRST = 1_000  # RSS is compared between this request and the last
MIN_RATE = 200.0
MAX_GROWTH = 10 * MiB
MAX_AGENT_SHARE = 0.01

HOUR_S = 3600.0
HOUR_SAMPLES = 36_000
HOUR_REQUESTS = 7_200
MAX_REPORT_S = 10.0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A generated model folder: the plain server ignores it, the engine reads its geometry."""
    choice = ModelChoice("qwen3-tiny", None, None, None, "float32", None, 64)
    return str(folder(choice, tmp_path_factory.mktemp("models")))


def plain(model_path: str) -> ScenarioSpec:
    """10,000 distinct 8-word chat requests, 4 tokens each, at 250 a second."""
    return ScenarioSpec.model_validate({
        "name": "long_run", "engine": "server", "model": {"path": model_path},
        "server": {"command": "{python} -m plain_server --port {port}",
                   "env": {"PYTHONPATH": str(FIXTURES)}, "logical": None},
        "workload": {"http": {
            "rate": f"{RATE}/s", "rest_every": "10s", "max_tokens": 4,
            "phases": [{"kind": "distinct", "requests": REQUESTS, "words": 8}]}},
    })


def cpu_seconds(pid: int) -> tuple[float, float]:
    """The process's CPU seconds (user and system, its reaped children's included), and those
    of its threads other than the main one still alive: once the traffic is over the HTTP
    handler threads have ended, so these are the agent's two threads (its connection and its
    sampler) and whatever threads the server's libraries keep idle."""
    times = psutil.Process(pid).cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    ticks = os.sysconf("SC_CLK_TCK")
    others = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        if int(task.name) == pid:
            continue
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        others += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total, others


def test_ten_thousand_requests(benchmark, model_path: str, tmp_path: Path) -> None:
    """One run of 10,000 requests; `extra_info` holds the rate, this process's RSS at request
    1,000 and 10,000, the agent's seconds and the server's CPU seconds."""
    spec = plain(model_path)
    rss: dict[int, int] = {}
    trail: dict[int, int] = {}  # RSS every 1,000 requests, to show its course
    result: dict = {}

    def progress(served: int, note: str = "") -> None:
        # Called from the client threads, a count now and then skipped: the first call at or
        # past each mark takes the reading.
        thousand = served // 1000 * 1000
        if thousand and thousand not in trail:
            trail[thousand] = current_rss()
        for mark in (FIRST, REQUESTS):
            if served >= mark and mark not in rss:
                rss[mark] = current_rss()

    def run() -> None:
        probe = Probe(spool=tmp_path)
        engine = ServerEngine(spec, probe, progress)
        try:
            engine.serve()
            result["server_cpu_s"], result["threads_cpu_s"] = cpu_seconds(engine._running.pid)
        finally:
            engine.close()
            probe.close()
        result["facts"] = engine.facts()
        result["requests"] = probe.requests()
        result["rows"] = len(probe.rows())

    benchmark.pedantic(run, rounds=1, iterations=1)

    facts, requests = result["facts"], result["requests"]
    traffic_s = float(requests["done"].max() - requests["sent"].min())
    rate = len(requests) / traffic_s
    growth = rss[REQUESTS] - rss[FIRST]
    agent_s = float(facts.agent_s or 0.0)
    share = agent_s / result["server_cpu_s"]
    benchmark.extra_info.update({
        "requests": facts.requests, "traffic_s": round(traffic_s, 2),
        "requests_per_s": round(rate, 1), "queued": facts.queued,
        "latency_p50_s": facts.latency.total_p50_s if facts.latency else None,
        "latency_p95_s": facts.latency.total_p95_s if facts.latency else None,
        "rss_at_1000_mib": round(rss[FIRST] / MiB, 2),
        "rss_at_10000_mib": round(rss[REQUESTS] / MiB, 2),
        "rss_growth_mib": round(growth / MiB, 2),
        "rss_most_over_1000_mib": round((max(trail.values()) - rss[FIRST]) / MiB, 2),
        "rss_every_1000_mib": {k: round(v / MiB, 1) for k, v in sorted(trail.items())},
        "agent_s": round(agent_s, 3), "server_cpu_s": round(result["server_cpu_s"], 2),
        "agent_share": round(share, 5),
        # The agent's threads as a whole (their commands' pickling and socket work too, and
        # any idle library thread): a bound on everything it costs the server, for comparison.
        "agent_threads_cpu_s": round(result["threads_cpu_s"], 2),
        "agent_threads_share": round(result["threads_cpu_s"] / result["server_cpu_s"], 4),
        "sample_rows": result["rows"],
        "agent_us_per_sample": round(agent_s / result["rows"] * 1e6, 1),
    })
    print(benchmark.extra_info)
    failed = []  # every requirement checked, all failures named at once
    if facts.requests != REQUESTS or len(requests) != REQUESTS:
        failed.append(f"{facts.requests} of {REQUESTS} requests served")
    if rate < MIN_RATE:
        failed.append(f"{rate:.1f} requests a second, under {MIN_RATE:g}")
    if growth >= MAX_GROWTH:
        failed.append(f"RSS grew {growth / MiB:.2f} MiB from request {FIRST:,} to {REQUESTS:,}")
    if share >= MAX_AGENT_SHARE:
        failed.append(f"the agent's sampling took {share:.2%} of the server's CPU time "
                      f"({agent_s:.3f} s of {result['server_cpu_s']:.2f} s)")
    assert not failed, "; ".join(failed)


# -- the report of an hour --------------------------------------------------------------------

def hour_spec(model_path: str) -> ScenarioSpec:
    """The scenario such a run would have come from: two requests a second for an hour."""
    return ScenarioSpec.model_validate({
        "name": "hour", "engine": "server", "model": {"path": model_path},
        "server": {"command": "{python} -m plain_server --port {port}", "logical": None},
        "workload": {"http": {"rate": "2/s", "duration": "1h", "max_tokens": 16,
                              "phases": [{"kind": "distinct", "requests": 64, "words": 64}]}},
    })


def hour_of_rows(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """36,000 samples and 7,200 requests of a one-hour server run: a request every 0.5 s
    lasting 0.3 s, a "request" row at its start and end, an "idle" row every 60 s and "serve"
    rows between; the weights held throughout, each request's KV while it runs, a prompt cache
    that fills within the first minutes and a slow rise of a few MiB over the hour."""
    rng = np.random.default_rng(seed)
    index = np.arange(HOUR_REQUESTS)
    sent = index * (HOUR_S / HOUR_REQUESTS) + 0.05
    done = sent + 0.3 + rng.exponential(0.02, HOUR_REQUESTS)
    prompt = rng.integers(40, 140, HOUR_REQUESTS).astype(np.int32)
    completion = np.full(HOUR_REQUESTS, 16, dtype=np.int32)
    requests = np.zeros(HOUR_REQUESTS, dtype=REQUEST)
    requests["request"], requests["sent"], requests["done"] = index, sent, done
    requests["first"] = np.nan
    requests["prompt_tokens"], requests["completion_tokens"] = prompt, completion

    idle_t = np.arange(60) * 60.0
    serve_count = HOUR_SAMPLES - 2 * HOUR_REQUESTS - len(idle_t)
    serve_t = np.linspace(0.0, HOUR_S, serve_count, endpoint=False) + 0.01
    times = np.concatenate([idle_t, sent, done, serve_t])
    phase = np.concatenate([np.full(len(idle_t), PHASES.index("idle")),
                            np.full(2 * HOUR_REQUESTS, PHASES.index("request")),
                            np.full(serve_count, PHASES.index("serve"))])
    # Each row carries the last request begun before it, as the agent's rows do.
    owner = np.concatenate([np.searchsorted(sent, idle_t, side="right") - 1, index, index,
                            np.searchsorted(sent, serve_t, side="right") - 1])
    tokens = np.concatenate([np.zeros(len(idle_t) + HOUR_REQUESTS, dtype=np.int64),
                             prompt + completion, np.zeros(serve_count, dtype=np.int64)])
    order = np.argsort(times, kind="stable")
    times, phase, owner, tokens = times[order], phase[order], owner[order], tokens[order]

    token_bytes = 16 * 1024
    weights = 320 * MiB
    cache = np.minimum(times / 300.0, 1.0) * 48 * MiB  # the prompt cache, full after 5 min
    drift = times / HOUR_S * 6 * MiB  # a slow rise over the hour
    in_flight = np.zeros(len(times))
    current = owner >= 0
    busy = current & (times < done[np.clip(owner, 0, None)]) & (phase != PHASES.index("idle"))
    in_flight[busy] = (prompt[owner[busy]] + completion[owner[busy]]) * token_bytes
    active = (weights + cache + drift + in_flight + rng.normal(0, 64 * 1024, len(times)))
    rows = np.zeros(HOUR_SAMPLES, dtype=ROW)
    rows["step"] = np.arange(HOUR_SAMPLES)
    rows["phase"] = phase
    rows["request"] = owner
    rows["turn"] = -1
    rows["tokens"] = tokens
    rows["active"] = active.astype(np.int64)
    rows["peak"] = (active + in_flight * 0.5).astype(np.int64)
    rows["cache"] = (8 * MiB + rng.integers(0, 4 * MiB, len(times))).astype(np.int64)
    rows["rss"] = (active + 180 * MiB + drift + rng.normal(0, MiB, len(times))).astype(np.int64)
    rows["logical"] = cache.astype(np.int64)
    rows["minimum"] = tokens * token_bytes
    rows["time"] = times.astype(np.float32)
    return rows, requests


def test_report_of_an_hour(benchmark, model_path: str, tmp_path: Path) -> None:
    """summarize and write the report of a one-hour run, 3 rounds."""
    spec = hour_spec(model_path)
    rows, requests = hour_of_rows()
    assert len(rows) == HOUR_SAMPLES and len(requests) == HOUR_REQUESTS
    facts = ModelFacts(engine="server", name="qwen3-tiny", layers=2, weights=320 * MiB,
                       folder="qwen3-tiny", ready_s=2.0, requests=HOUR_REQUESTS, disconnects=0,
                       queued=0, agent_s=1.2)
    outcome = RunOutcome(Variant(tmp_path / "hour.yaml", "base", spec), "ok", rows, None, 0,
                         HOUR_SAMPLES, HOUR_S, 0, {"nbytes": int(rows["logical"][-1]),
                                                   "entries": 10}, facts, requests)
    described = environment()
    out = tmp_path / "reports"
    seconds: list[float] = []

    def report() -> None:
        began = time.perf_counter()
        frame, _, summary = summarize(outcome, described, out)
        summary, written = write(summary, frame, requests_frame(outcome.requests))
        seconds.append(time.perf_counter() - began)
        assert written, summary.error

    benchmark.pedantic(report, rounds=3, iterations=1)
    written = out / "hour" / "base"
    files = {p.name for p in written.iterdir()}
    assert {"samples.csv", "requests.csv", "memory.png", "summary.json"} <= files
    benchmark.extra_info.update({"samples": HOUR_SAMPLES, "requests": HOUR_REQUESTS,
                                 "slowest_s": round(max(seconds), 2),
                                 "samples_csv_mib": round(
                                     (written / "samples.csv").stat().st_size / MiB, 2)})
    print(benchmark.extra_info)
    assert max(seconds) < MAX_REPORT_S, f"the report took {max(seconds):.1f} s"
