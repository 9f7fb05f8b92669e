"""What serve mode costs a real server: its start, and the agent's share of a request.

Run with `python -m pytest benchmarks/test_serve_cost.py --benchmark-only` (about a minute;
figures in docs/benchmarks.md and docs/serve.md). Two `mlx_lm.server` processes serve the
generated qwen3-tiny folder: one bare, one with the agent injected and connected, sampling on its
default period (0.1 s) and answering a request-boundary mark before and after each request, as
the server engine does. Each round is one chat request of 100 words (about 160 tokens, a new
prompt each round, so no prompt-cache hit) and 8 generated tokens to each server; the bare and
the observed server take turns, so load on this shared machine falls on both alike.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, Listener

import numpy as np
import pytest

from harness.models.folder import folder, sentence
from harness.models.loading import ModelChoice
from harness.run import traffic
from harness.run.server_engine import AGENT_DIR, HOST, free_port

CHOICE = ModelChoice("qwen3-tiny", None, None, None, "bfloat16", None, 64)
WARM = traffic.Call(-1, "Hello", "chat", 1, False, None)


def call(index: int) -> traffic.Call:
    """A distinct prompt (no prompt-cache hit) of 100 words, 8 tokens generated."""
    return traffic.Call(index, sentence(np.random.default_rng(index), 100), "chat", 8, False,
                        None)


class Server:
    """One mlx_lm.server, with or without the agent, answering before it is handed out."""

    def __init__(self, observed: bool):
        self.port = free_port()
        env = dict(os.environ)
        self.listener: Listener | None = None
        self.connection: Connection | None = None
        if observed:
            key = os.urandom(32)
            self.listener = Listener((HOST, 0), authkey=key)
            env.update({"PYTHONPATH": str(AGENT_DIR), "KVMEM_AGENT": "{}:{}".format(
                *self.listener.address), "KVMEM_AGENT_KEY": key.hex()})
        began = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", str(folder(CHOICE)),
             "--port", str(self.port)], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        if self.listener is not None:
            self.connection = self.listener.accept()
            self.connection.recv()  # hello
        while True:
            try:
                traffic.send(HOST, self.port, WARM, 60)
                break
            except traffic.TrafficError:
                time.sleep(0.1)
        self.ready_s = time.perf_counter() - began
        self.lock = threading.Lock()

    def mark(self) -> float:
        """A request-boundary sample; the seconds the agent has spent sampling, in all."""
        if self.connection is None:
            return 0.0
        self.connection.send({"op": "mark", "request": 0})
        return float(self.connection.recv()["busy"])

    def request(self, index: int) -> tuple[float, float]:
        """The request's seconds, and the agent's seconds of sampling while it ran."""
        busy = self.mark()
        began = time.perf_counter()
        traffic.send(HOST, self.port, call(index), 60)
        seconds = time.perf_counter() - began
        return seconds, self.mark() - busy

    def close(self) -> None:
        if self.connection is not None:
            self.connection.send({"op": "stop"})
            self.connection.recv()
            self.connection.close()
        self.process.terminate()
        self.process.wait()
        if self.listener is not None:
            self.listener.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    started = {"bare": Server(False), "observed": Server(True)}
    try:
        yield started
    finally:
        for server in started.values():
            server.close()


@pytest.mark.parametrize("kind", ["bare", "observed"])
def test_server_start(benchmark: pytest.FixtureRequest, kind: str) -> None:
    """Start to first answer, with the agent or without (3 starts each)."""
    def start() -> None:
        Server(kind == "observed").close()

    benchmark.pedantic(start, rounds=3, iterations=1)


def test_agent_share_of_a_request(benchmark: pytest.FixtureRequest,
                                  servers: dict[str, Server]) -> None:
    """20 requests each, taking turns. `extra_info`: both medians, their ratio (within this
    machine's noise), and `agent_busy_share`: the seconds the agent spent sampling while the
    observed server's requests ran, over those requests' seconds (its own cost, measured)."""
    times: dict[str, list[float]] = {"bare": [], "observed": []}
    busy = []

    def round_() -> None:
        index = len(times["bare"])
        for kind, server in servers.items():
            seconds, sampling = server.request(index)
            times[kind].append(seconds)
            if kind == "observed":
                busy.append(sampling)

    benchmark.pedantic(round_, rounds=20, iterations=1)
    bare, observed = (float(np.median(times[k])) for k in ("bare", "observed"))
    benchmark.extra_info.update({"bare_median_s": round(bare, 4),
                                 "observed_median_s": round(observed, 4),
                                 "agent_share": round(observed / bare - 1, 4),
                                 "agent_busy_share": round(sum(busy) / sum(times["observed"]),
                                                           5)})
    print(benchmark.extra_info)
