"""The server engine: a real server process under HTTP traffic, sampled from inside.

kvmem starts the scenario's command (`server:`, by default mlx-lm's `mlx_lm.server` on a model
folder `harness.models.folder` generates), in the server's own environment where it has one
(`harness.run.server_env`), on a free port, with the agent (`harness.agent`) on
the server's `PYTHONPATH`. The agent connects back over an authenticated local connection; kvmem
waits for the first request to succeed (a server may answer `/health` before its model has
loaded), takes the baseline at rest, sends the traffic (`harness.run.traffic`), and asks the
agent for a sample at each request's start and end and at rest after each round. The agent's
rows become the probe's rows, so detectors, reports and the gate read a server's run as any
other.

The server never outlives the run: it gets its own session (so a Ctrl-C in kvmem's terminal
reaches kvmem, which decides), dies with the variant's process on Linux (`PR_SET_PDEATHSIG`),
and `close` ends its whole process group, gently and then by force (`harness.run.agented`, which
`kvmem record` shares). A server that will not start, dies or stops answering fails the variant
with the tail of its output.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import site
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from packaging.requirements import Requirement

from ..common.units import format_bytes
from ..judge.summary import ModelFacts
from ..models.loading import ModelError
from ..models.serving import ServedModel, prepare
from ..scenario import ScenarioSpec
from ..scenario.server import Idle, ServerSpec
from . import traffic
from .agented import AGENT_DIR, HOST, Agented, AgentSettings, ServerError
from .engines import RUNTIME_SLACK
from .probe import Probe, Sample
from .server_env import environment

__all__ = ["AGENT_DIR", "HOST", "ServerEngine", "ServerError", "free_port"]

REPLY_SLACK = 30.0  # seconds the agent may take beyond its settle time to answer


def interpreter(server: ServerSpec) -> str | None:
    """The Python of the server's own environment (`server.python`, or the one kvmem builds
    from `server.requires`), or None: kvmem's."""
    if server.python is not None:
        found = shutil.which(server.python)
        if found is None:
            raise ServerError(f"server.python: no interpreter {server.python!r}")
        return found
    return str(environment(server)) if server.own_environment else None


def served(spec: ScenarioSpec) -> ServedModel:
    """The model folder the server loads, its geometry and weights, from the server's own
    Python where it has one."""
    server = spec.serving()
    names = tuple(Requirement(r).name for r in [*server.requires, *server.requires_no_deps])
    try:
        return prepare(spec.model.choice(), interpreter(server), names)
    except ModelError as exc:  # an unwritable cache names the path; a failed build, why
        raise ServerError(str(exc)) from None


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class ServerEngine:
    """Serves one server variant from the variant's process: start, traffic, samples, stop."""

    def __init__(self, spec: ScenarioSpec, probe: Probe,
                 progress: Callable[[int], None] | None = None):
        assert spec.workload.http is not None  # the schema requires it with engine: server
        self.spec = spec
        self.http = spec.workload.http
        self.server = spec.serving()
        self.probe = probe
        self.progress = progress
        self.python = interpreter(self.server) or sys.executable
        model = served(spec)
        self.model, self.geometry, self.weights = model.folder, model.geometry, model.weights
        self.packages = model.packages
        self._workdir = Path(tempfile.mkdtemp(prefix="kvmem-server-"))
        self._agented: Agented | None = None
        self._lock = threading.Lock()
        self._origin: float | None = None  # the baseline's time, on the agent's clock
        self._served = 0
        self._disconnects = 0
        self._ready_s = 0.0
        self._rss_gap = 0
        self._last = (0, 0)  # the logical bytes and entries at the last sample
        self._model_name: str | None = None  # what each request names (workload.http.model)

    @classmethod
    def estimate_bytes(cls, spec: ScenarioSpec) -> int:
        """A server's footprint: its weights, then its longest context's KV for every
        prompt-cache entry mlx-lm keeps by default (10) and every client in flight, twice (a
        fetch copies an entry), and a runtime for the server as for the variant's own process."""
        http = spec.workload.http
        assert http is not None
        clients = max(phase.clients or http.clients for phase in http.phases
                      if not isinstance(phase, Idle))
        model = served(spec)
        kv = model.geometry.minimum_bytes(traffic.longest_context(http))
        return model.weights + 2 * (10 + clients) * kv + 2 * RUNTIME_SLACK

    # -- starting ---------------------------------------------------------------------------

    def _values(self, port: int) -> dict[str, str]:
        """What the placeholders of the command and of `workload.http.model` stand for."""
        return {"python": self.python, "model": str(self.model),
                "model_dir": str(self.model.parent), "model_name": self.model.name,
                "host": HOST, "port": str(port)}

    def command(self, port: int) -> list[str]:
        """The server's command line with its placeholders filled in."""
        values = self._values(port)
        return [word.format(**values) for word in [*self.server.command, *self.server.args]]

    def _home(self) -> dict[str, str]:
        """A fresh HOME and XDG_CACHE_HOME for this run (the scenario's `server.env` may set its
        own): a server that keeps state under them (vllm-mlx saves its prefix cache there at
        shutdown and loads it at start) starts every run and variant as the first. Packages in
        the user's site (`pip install --user`) stay found through PYTHONUSERBASE."""
        home = self._workdir / "home"
        home.mkdir(exist_ok=True)
        return {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
                "PYTHONUSERBASE": os.environ.get("PYTHONUSERBASE") or site.getuserbase()}

    def _environment(self) -> dict[str, str]:
        return {**os.environ, **self._home(), **self.server.env}

    def _wait_ready(self, port: int, deadline: float) -> None:
        """The port accepts connections, then a first one-token request completes."""
        while True:
            self._running.check_alive("before it listened")
            try:
                socket.create_connection((HOST, port), timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise self._running.failure(f"the server did not listen on port {port} within "
                                        f"{self.server.ready_timeout:g} s") from None
                time.sleep(0.1)
        warm = traffic.Call(-1, "Hello", self.http.endpoint, 1, False, None)
        try:
            traffic.send(HOST, port, warm, max(deadline - time.monotonic(), 1.0),
                         self._model_name)
        except traffic.TrafficError as exc:
            self._running.check_alive("on its first request", wait=1.0)
            raise self._running.failure(f"the server's first request failed: {exc}") from None

    # -- sampling -----------------------------------------------------------------------------

    def _command(self, command: dict, when: str) -> None:
        """One command to the agent; its rows become probe rows. A counter the server's code
        replaced (which the agent reads past) fails the run, its rows kept."""
        with self._lock:
            answer = self._running.ask(command, when, self.server.settle + REPLY_SLACK)
            self._record(answer["rows"])
            if answer.get("replaced"):
                raise ServerError(answer["replaced"])

    def _record(self, rows: list[tuple]) -> None:
        samples = [Sample._make(row) for row in rows]
        if self._origin is None:  # the baseline's answer: what came before it is start-up
            starts = [i for i, sample in enumerate(samples) if sample.phase == "idle"]
            samples = samples[starts[-1]:]
            self._origin = samples[0].time
        for sample in samples:
            minimum = self.geometry.minimum_bytes(sample.tokens) if sample.tokens else 0
            self.probe.add(sample._replace(time=sample.time - self._origin), minimum=minimum)
            self._last = (sample.logical, sample.entries)

    def _at_rest(self, when: str) -> None:
        self._command({"op": "idle", "cycles": self.spec.sampling.find_cycles,
                       "settle": self.server.settle}, when)
        with contextlib.suppress(psutil.Error):  # RSS read from outside, beside the agent's
            outside = psutil.Process(self._running.pid).memory_info().rss
            inside = int(self.probe.rows()[-1]["rss"])
            self._rss_gap = max(self._rss_gap, abs(outside - inside))

    # -- traffic ------------------------------------------------------------------------------

    def _call(self, port: int, call: traffic.Call) -> None:
        where = {"request": call.index, "turn": call.turn}
        self._command({"op": "mark", **where}, f"at the start of request {call.index}")
        try:
            reply = traffic.send(HOST, port, call, self.server.request_timeout,
                                 self._model_name)
        except traffic.NoReply as exc:
            self._running.check_alive(f"during request {call.index}", wait=1.0)
            answers = traffic.still_answers(HOST, port)
            raise self._running.failure(self._wedged(call.index, answers) if answers else str(exc)) from None
        except traffic.TrafficError as exc:
            self._running.check_alive(f"during request {call.index}", wait=1.0)
            raise self._running.failure(str(exc)) from None
        self._command({"op": "mark", **where,
                       "tokens": reply.prompt_tokens + reply.completion_tokens},
                      f"at the end of request {call.index}")
        with self._lock:
            self._served += 1
            self._disconnects += reply.disconnected
            served = self._served
        if self.progress is not None:
            self.progress(served)

    def _wedged(self, request: int, answers: str) -> str:
        """A server alive and answering on its port whose request did not complete: when, and
        the memory it held then (the agent's reading at the request's start; the process's
        resident memory now, read from outside)."""
        rows = self.probe.rows()
        held = []
        if len(rows):
            held.append(f"at {float(rows[-1]['time']):.1f} s, "
                        f"{format_bytes(int(rows[-1]['active']))} of MLX memory active")
        with contextlib.suppress(psutil.Error):
            held.append(f"{format_bytes(psutil.Process(self._running.pid).memory_info().rss)} "
                        "resident")
        return (f"the server stopped completing requests at request {request}; its port still "
                f"answers ({answers}): no reply within {self.server.request_timeout:g} s"
                + (f"; {', '.join(held)}" if held else ""))

    def _round(self, port: int, calls: list[traffic.Call]) -> None:
        if len(calls) == 1:
            self._call(port, calls[0])
            return
        with ThreadPoolExecutor(len(calls), thread_name_prefix="kvmem-client") as pool:
            for done in [pool.submit(self._call, port, call) for call in calls]:
                done.result()

    def _pause(self, seconds: float) -> None:
        """Send nothing for `seconds`, the agent sampling on; a server that dies meanwhile
        ends the run."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))
            self._running.check_alive("while idle")

    @property
    def _running(self) -> Agented:
        assert self._agented is not None, "the server is started by serve()"
        return self._agented

    def serve(self) -> None:
        began = time.monotonic()
        deadline = began + self.server.ready_timeout
        port = free_port()
        self._model_name = (None if self.http.model is None
                            else self.http.model.format(**self._values(port)))
        self._agented = Agented(self.command(port), self._environment(), AgentSettings(
            self.server.period, self.server.logical, self.server.cap, tuple(self.server.plugins)),
            self._workdir / "server.log")
        self._agented.start(deadline, self.server.ready_timeout)
        self._wait_ready(port, deadline)
        self._ready_s = time.monotonic() - began
        self._at_rest("at the baseline")
        for step in traffic.plan(self.http, self.spec.sampling.seed):
            if isinstance(step, float):
                self._pause(step)
                self._at_rest("after an idle period")
            else:
                self._round(port, step)
                self._at_rest(f"after request {step[-1].index}")

    # -- what the summary says --------------------------------------------------------------

    def facts(self) -> ModelFacts:
        """The model served (its folder by name: a committed baseline holds no local path)
        and the server that served it."""
        return ModelFacts(engine="server", name=self.spec.model.choice().name,
                          layers=len(self.geometry.layers), weights=self.weights,
                          folder=self.model.name, ready_s=round(self._ready_s, 3),
                          requests=self._served, disconnects=self._disconnects,
                          rss_outside_gap=self._rss_gap, packages=self.packages)

    def store_stats(self) -> dict[str, int | float] | None:
        """The logical size the agent read (`server.logical`) at the last sample."""
        if self.server.logical is None:
            return None
        return {"nbytes": self._last[0], "entries": self._last[1]}

    def close(self) -> None:
        """Stop the agent and the server's whole process group; remove the run's files."""
        if self._agented is not None:
            self._agented.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)
