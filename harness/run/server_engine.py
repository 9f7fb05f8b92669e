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
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import psutil
from packaging.requirements import Requirement

from ..common.units import format_bytes, mib
from ..judge.at_rest import Limit, held_at_rest
from ..judge.summary import ModelFacts
from ..models.loading import ModelError
from ..models.serving import ServedModel, prepare
from ..scenario import ScenarioSpec
from ..scenario.server import Idle, ServerSpec
from . import traffic, workdirs
from .agented import AGENT_DIR, HOST, Agented, AgentSettings, ServerError
from .engines import RUNTIME_SLACK, Progress
from .probe import Probe, Sample, walked
from .server_env import activated, environment

__all__ = ["AGENT_DIR", "HOST", "ServerEngine", "ServerError", "free_port"]

REPLY_SLACK = 30.0  # seconds the agent may take beyond its settle time to answer
# Open loop: the most requests in flight at once (each holds a client thread); an arrival
# beyond it waits for one to end, and the run's summary counts how often that happened.
OPEN_LOOP_CLIENTS = 256
NOTE_EVERY = 1.0  # seconds between progress notes
DRAIN_EVERY = 1.0  # open loop: seconds between two drains of the agent's samples in flight


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
                 progress: Progress | None = None):
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
        self._workdir = workdirs.made(workdirs.SERVER)
        self._agented: Agented | None = None
        self._lock = threading.Lock()
        self._origin: float | None = None  # the baseline's time, on the agent's clock
        self._served = 0
        self._disconnects = 0
        self._ready_s = 0.0
        self._rss_gap = 0
        self._last = (0, 0)  # the logical bytes and entries at the last sample
        self._model_name: str | None = None  # what each request names (workload.http.model)
        self._lines = traffic.lines(self.http)  # a replayed trace's requests
        self._began = 0.0  # when the traffic began (time.monotonic())
        self._ended_early: str | None = None  # why the traffic stopped before its end
        self._noted = 0.0
        self._queued = 0  # open-loop arrivals that waited for a free client
        self._base: dict[str, float] | None = None  # the baseline's sample, as _rest
        self._rests = 0  # samples at rest after the baseline
        self._breached: str | None = None  # what the last of them holds over its budget
        self._agent_s = 0.0  # seconds the agent has spent sampling, in all
        self._rest: dict[str, float] | None = None  # the last sample at rest: time, active, ...

    @classmethod
    def estimate_bytes(cls, spec: ScenarioSpec) -> int:
        """A server's footprint: its weights, then its longest context's KV for every
        prompt-cache entry mlx-lm keeps by default (10) and every client in flight, twice (a
        fetch copies an entry), and a runtime for the server as for the variant's own process."""
        http = spec.workload.http
        assert http is not None
        clients = max([phase.clients or http.clients for phase in http.phases or []
                       if not isinstance(phase, Idle)] or [http.clients])
        if http.open_loop:
            clients = max(clients, OPEN_LOOP_CLIENTS // 4)  # a queue in flight, bounded
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
        return activated(self.python, {**os.environ, **self._home(), **self.server.env})

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
            self._agent_s = float(answer.get("busy", 0.0))
            self._record(answer["rows"])
            if "holders" in answer:  # an idle's walk: its groups go under the idle row's step
                last = self.probe.last()
                assert last is not None, "an idle command answers with its sample"
                walk = answer.get("census", {})
                self.probe.holders.add(self.probe.steps - 1, int(last["request"]),
                                       int(last["turn"]), answer["holders"],
                                       bool(walk.get("approximate")), int(walk.get("objects", 0)),
                                       float(walk.get("seconds", 0.0)))
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

    def _at_rest(self, when: str, request: int | None = None, final: bool = False) -> None:
        """A sample at rest; `request`, the last request sent, where no mark has said it;
        `final`, the traffic's last (the holders are walked where `walked` says)."""
        where = {} if request is None else {"request": request, "turn": -1}
        sampling = self.spec.sampling
        holders = sampling.holders and walked(self._rests + (self._base is not None), final)
        self._command({"op": "idle", "cycles": sampling.find_cycles, "holders": holders,
                       "settle": self.server.settle, **where}, when)
        last = self.probe.last()
        assert last is not None, "an idle command answers with its sample"
        rest = {name: float(last[name]) for name in ("time", "active", "logical", "cap", "rss")}
        with self._lock:
            self.probe.spill()
            self._rest = rest
        if self._base is None:
            self._base = rest
        else:
            self._rests += 1
            self._breached = self._breach(rest, self._base)
        with contextlib.suppress(psutil.Error):  # RSS read from outside, beside the agent's
            outside = psutil.Process(self._running.pid).memory_info().rss
            self._rss_gap = max(self._rss_gap, abs(outside - int(rest["rss"])))

    # -- traffic ------------------------------------------------------------------------------

    def _call(self, port: int, call: traffic.Call, marked: bool = True) -> None:
        """One request, bracketed by samples where `marked`; its times go to the probe's
        request log. Open-loop traffic marks none: at hundreds of requests a second, two
        samples a request would cost the server more than its requests (a round trip to the
        agent each), and the agent's samples on its period show memory in flight."""
        if call.session is not None and call.turn > 0 and not call.session.wait_for(
                call.turn, self.server.request_timeout):
            raise self._running.failure(f"request {call.index}: the turn before it in its "
                                        f"session did not end within "
                                        f"{self.server.request_timeout:g} s")
        where = {"request": call.index, "turn": call.turn}
        if marked:
            self._command({"op": "mark", **where}, f"at the start of request {call.index}")
        sent = time.monotonic()
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
        done = time.monotonic()
        if call.session is not None:
            call.session.end_turn()
        if marked:
            self._command({"op": "mark", **where,
                           "tokens": reply.prompt_tokens + reply.completion_tokens},
                          f"at the end of request {call.index}")
        with self._lock:
            origin = self._origin or 0.0
            self.probe.request(call.index, sent - origin,
                               None if reply.first is None else reply.first - origin,
                               done - origin, reply.prompt_tokens, reply.completion_tokens,
                               reply.disconnected)
            self._served += 1
            self._disconnects += reply.disconnected
        self._progress()

    def _progress(self) -> None:
        """Requests served to the bar; at most every NOTE_EVERY seconds, a note of the elapsed
        time, MLX memory now and at rest, and what is over its budget so far."""
        if self.progress is None:
            return
        now = time.monotonic()
        if now - self._noted < NOTE_EVERY:
            self.progress(self._served)
            return
        self._noted = now
        with self._lock:
            last, rest = self.probe.last(), self._rest
        parts = [f"{now - self._began:.0f} s"]
        base = int(self._base["active"]) if self._base is not None else 0
        if last is not None:
            parts.append(f"active {format_bytes(int(last['active']) - base, signed=True)}")
        if rest is not None:
            parts.append(f"at rest {format_bytes(int(rest['active']) - base, signed=True)}")
        parts.append(self._breached or "nothing over its budget so far")
        self.progress(self._served, "[" + ", ".join(parts) + "]")

    def _wedged(self, request: int, answers: str) -> str:
        """A server alive and answering on its port whose request did not complete: when, and
        the memory it held then (the agent's latest reading: a marked request's start; the
        process's resident memory now, read from outside)."""
        last = self.probe.last()
        held = []
        if last is not None:
            held.append(f"at {float(last['time']):.1f} s, "
                        f"{format_bytes(int(last['active']))} of MLX memory active")
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

    def _done(self, sent: int) -> bool:
        """The traffic has reached its duration or its count (`max_requests`), or the run its
        first breach of the budget under `fail_fast`."""
        if self.http.fail_fast and self._breached is not None:
            self._ended_early = f"fail_fast: {self._breached}"
            return True
        if self.http.max_requests is not None and sent >= self.http.max_requests:
            return True
        return (self.http.duration is not None
                and time.monotonic() - self._began >= self.http.duration)

    def _breach(self, rest: dict[str, float], base: dict[str, float]) -> str | None:
        """What a sample at rest holds over its budget: the stated one (detect.unbounded.budget,
        past its warm-up), else the cache's own cap; None while within. Held and judged by the
        detectors' own rule (`harness.judge.at_rest`), so a run stops at a point its finding
        reads, with the same figure."""
        import pandas as pd

        held = int(held_at_rest(pd.DataFrame([rest]), pd.DataFrame([base])).iloc[0])
        when = f"at rest at {rest['time']:.1f} s"
        unbounded = self.spec.detect.unbounded
        if unbounded.budget is not None:
            over = Limit().over(held, unbounded.budget) and self._rests > unbounded.warmup
            return (f"the components hold {mib(held)} MiB {when}, over the budget of "
                    f"{mib(unbounded.budget)} MiB" if over else None)
        cap, slack = int(rest["cap"]), self.spec.detect.over_cap
        if cap > 0 and Limit(slack.min_bytes, slack.ratio, admitted=True).over(held, cap):
            return (f"the cache holds {mib(held)} MiB {when} against its own {mib(cap)} MiB "
                    "cap")
        return None

    @property
    def _passes(self) -> int | None:
        """One pass of the traffic, or (a soak, `duration`) as many as the time takes."""
        return None if self.http.duration is not None else 1

    def _closed_loop(self, port: int) -> None:
        """Rounds of `clients` requests, a sample at rest after each (and after each idle
        period)."""
        steps = traffic.plan(self.http, self.spec.sampling.seed, self._lines, self._passes)
        for step, last in traffic.with_last(steps):
            if self._done(self._served):
                return
            if isinstance(step, float):
                self._pause(step)
                self._at_rest("after an idle period", final=last)
            else:
                if self.http.max_requests is not None:
                    step = step[:self.http.max_requests - self._served]
                self._round(port, step)
                self._at_rest(f"after request {step[-1].index}", final=last)

    def _open_loop(self, port: int) -> None:
        """Requests sent when due (`traffic.Pacer`), whether or not earlier ones are done; every
        `rest_every` seconds the arrivals pause while the requests in flight end, for a sample
        at rest, and the schedule resumes where it stood (the pause does not count as traffic
        time for the schedule). The traffic ends at a rest, where it checks `_done` again: under
        `fail_fast`, nothing is sent after the rest that breached."""
        paced = traffic.Pacer(traffic.schedule(self.http, self.spec.sampling.seed, self._lines,
                                               self._passes))
        rest_due = time.monotonic() + self.http.rest_every
        pending: set[Future] = set()
        sent, last, rested = 0, -1, -1  # requests sent, the last one's index, the last rest's
        drained, ending = time.monotonic(), False
        with ThreadPoolExecutor(OPEN_LOOP_CLIENTS, thread_name_prefix="kvmem-client") as pool:
            try:
                for due, call in paced:
                    if self._done(sent):
                        break
                    while True:  # a rest when due, even while arrivals are late
                        now = time.monotonic()
                        if now >= rest_due:
                            paced.pause(self._rest_pause(pending, last))
                            pending, rested = set(), last
                            rest_due = time.monotonic() + self.http.rest_every
                            ending = self._done(sent)
                            if ending:
                                break
                            continue
                        if now >= drained + DRAIN_EVERY:  # memory in flight, for the note
                            self._command({"op": "rows"}, "while requests were in flight")
                            drained = now
                        if now >= due:
                            break
                        time.sleep(min(due - now, rest_due - now, 0.05))
                        pending = _settled(pending)
                        self._running.check_alive(f"before request {call.index}")
                    if ending:
                        break
                    pending = _settled(pending)
                    if len(pending) >= OPEN_LOOP_CLIENTS:
                        self._queued += 1
                        wait(pending, return_when=FIRST_COMPLETED)
                        pending = _settled(pending)
                    pending.add(pool.submit(self._call, port, call, False))
                    sent, last = sent + 1, call.index
                if pending or last != rested:  # the last rest already follows the last request
                    self._rest_pause(pending, last, final=True)
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise

    def _rest_pause(self, pending: set[Future], request: int, final: bool = False) -> float:
        """Let the requests in flight end, sample at rest (after `request`, the last sent;
        `final`, the traffic's last): the seconds it took."""
        began = time.monotonic()
        _settled(set(wait(pending).done))
        self._at_rest(f"after request {request}", request, final)
        return time.monotonic() - began

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
        self._began = time.monotonic()
        if traffic.open_loop(self.http, self._lines):
            self._open_loop(port)
        else:
            self._closed_loop(port)
        self._progress()

    # -- what the summary says --------------------------------------------------------------

    def facts(self) -> ModelFacts:
        """The model served (its folder by name: a committed baseline holds no local path)
        and the server that served it."""
        return ModelFacts(engine="server", name=self.spec.model.choice().name,
                          layers=len(self.geometry.layers), weights=self.weights,
                          folder=self.model.name, ready_s=round(self._ready_s, 3),
                          requests=self._served, disconnects=self._disconnects,
                          rss_outside_gap=self._rss_gap, packages=self.packages, queued=self._queued,
                          latency=traffic.latency(self.probe.requests()), stopped=self._ended_early,
                          ordered=self.http.arrivals == "ordered" or None, agent_s=round(self._agent_s, 6))

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


def _settled(pending: set[Future]) -> set[Future]:
    """The requests still in flight; a request that failed ends the run with its error."""
    for future in [f for f in pending if f.done()]:
        future.result()
    return {f for f in pending if not f.done()}

