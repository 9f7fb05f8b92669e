"""HTTP traffic for a server: the requests a scenario's `workload.http` sends, when, one client
call, and the latency the requests had.

Generated traffic is drawn from the seed alone (prompt text from `harness.models.folder.sentence`),
a replayed trace (`harness.scenario.trace`) is read from its file; only a session's history also
holds the server's replies, as a chat client's does. Closed loop, requests go out in rounds: a
round is sent together (one thread per client), and the engine samples the server at rest after
each round. Open loop (`schedule`), each request has an arrival offset: drawn at `rate` from the
seed (a Poisson process, or evenly spaced), or a trace's own `at`. With `duration` the traffic
starts over each time it ends (new prompts drawn for each pass; a trace's sessions begin anew).
`Pacer` says when each arrival is due on the clock: a pass's prompts are drawn as it begins
(seconds for thousands), and that time, as the engine's pauses for a sample at rest, is left out
of the schedule, so the rate holds from the first arrival and after each pass's start.

Calls use the standard library's `http.client`: a streamed reply is read as server-sent events
line by line (the first content chunk's arrival is its time to first token), and a client that
disconnects closes its socket after the chunks it was told to read, as a user who closes a tab.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from ..common.errors import KvmemError
from ..judge.summary import Latency
from ..models.folder import sentence
from ..scenario import trace
from ..scenario.server import Distinct, HttpSpec, Idle, Sessions, SharedPrefix


class TrafficError(KvmemError):
    """A request the server did not answer as an OpenAI-compatible server would."""


class NoReply(TrafficError):
    """A request with no reply within its timeout: the server may be dead, or wedged (its port
    answering while no request completes)."""


class Conversation:
    """One conversation: its messages so far, the server's replies included, and how many of
    its turns have ended (open loop, a turn waits for the one before it, as a user does)."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.ended = 0
        self._turned = threading.Condition()

    def wait_for(self, turn: int, timeout: float) -> bool:
        """Wait until the turns before `turn` have ended; False if `timeout` passed first."""
        with self._turned:
            return self._turned.wait_for(lambda: self.ended >= turn, timeout)

    def end_turn(self) -> None:
        with self._turned:
            self.ended += 1
            self._turned.notify_all()


@dataclass(frozen=True)
class Call:
    """One request as planned: `text` is the new user message (chat) or the prompt's new part;
    a trace's chat line gives its new `messages` instead, and `extra` the rest of its body."""

    index: int
    text: str
    endpoint: str
    max_tokens: int
    stream: bool
    disconnect: int | None
    session: Conversation | None = None
    turn: int = -1
    messages: tuple[dict, ...] | None = None
    extra: dict = field(default_factory=dict, hash=False)
    at: float | None = None  # a trace's arrival offset, seconds from the start of its pass


@dataclass(frozen=True)
class Reply:
    text: str
    prompt_tokens: int
    completion_tokens: int
    disconnected: bool
    first: float | None = None  # time.monotonic() at the first streamed content; None unstreamed


Step = list[Call] | float  # a round sent together, or seconds of idleness


def lines(http: HttpSpec) -> list[trace.Line] | None:
    """The trace's requests, or None for generated traffic (the loader has checked the file)."""
    return None if http.trace is None else trace.read(Path(http.trace))


def open_loop(http: HttpSpec, replayed: list[trace.Line] | None) -> bool:
    """Requests arrive on a schedule, not in rounds: a rate, or a trace's own offsets (unless
    `arrivals: ordered` replays them in order)."""
    return http.arrivals != "ordered" and (
        http.rate is not None or any(line.at is not None for line in replayed or []))


def plan(http: HttpSpec, seed: int, replayed: list[trace.Line] | None = None,
         passes: int | None = 1) -> Iterator[Step]:
    """Every round (and idle period) of the traffic, in order, pass after pass (`passes` None:
    without end, for a run that stops on time or count); drawn lazily, so a soak holds one pass
    at a time."""
    for rounds in _passes(http, seed, replayed, passes):
        yield from rounds


def _passes(http: HttpSpec, seed: int, replayed: list[trace.Line] | None,
            passes: int | None) -> Iterator[list[Step]]:
    """Each pass's rounds, its requests numbered on from the last pass's."""
    index = 0
    for number in itertools.count() if passes is None else range(passes):
        rounds = (_trace(http, replayed, index) if replayed is not None
                  else _phases(http, seed, number, index))
        index += sum(len(step) for step in rounds if not isinstance(step, float))
        yield rounds


ARRIVALS = 7  # the arrivals' own stream of the seed, apart from the prompts' draws


def schedule(http: HttpSpec, seed: int, replayed: list[trace.Line] | None = None,
             passes: int | None = 1) -> Iterator[tuple[float, Call]]:
    """Each request with its arrival offset in seconds from the start of the traffic: at
    `rate` (Poisson from the seed, or evenly spaced), else the trace's `at` (a line without
    one arrives with the line before it); a trace's next pass starts where its last ended."""
    rng = np.random.default_rng([seed, ARRIVALS])
    clock, start, sent = 0.0, 0.0, 0
    for rounds in _passes(http, seed, replayed, passes):
        for step in rounds:
            assert not isinstance(step, float), "the schema keeps idle phases out of open loop"
            for call in step:
                if http.rate is None:
                    clock = max(clock, start + (call.at or 0.0))
                elif sent:
                    clock += (rng.exponential(1 / http.rate) if http.arrivals == "poisson"
                              else 1 / http.rate)
                sent += 1
                yield clock, call
        start = clock


class Pacer:
    """When each arrival of `arrivals` (offsets from the start of the traffic, as `schedule`
    gives them) is due on `clock`: the first at once, each later one at its offset from the
    first, plus the time spent drawing the arrivals themselves and in `pause`s. Arrivals are
    then never late because kvmem was busy, and never sent in a burst to catch up."""

    def __init__(self, arrivals: Iterator[tuple[float, Call]],
                 clock: Callable[[], float] = time.monotonic):
        self._arrivals = arrivals
        self._clock = clock
        self._start: float | None = None  # the clock's time at offset 0

    def __iter__(self) -> Iterator[tuple[float, Call]]:
        while True:
            before = self._clock()
            try:
                offset, call = next(self._arrivals)
            except StopIteration:
                return
            now = self._clock()
            if self._start is None:
                self._start = now - offset
            else:
                self._start += now - before
            yield self._start + offset, call

    def pause(self, seconds: float) -> None:
        """Hold the schedule for `seconds` (a rest the traffic paused for)."""
        if self._start is not None:
            self._start += seconds


def _rng(seed: int, number: int, *keys: int) -> np.random.Generator:
    """The generator of one draw: the first pass's as ever, a later pass's its own."""
    return np.random.default_rng([seed, *keys] if number == 0 else [seed, *keys, number])


def _phases(http: HttpSpec, seed: int, number: int, index: int) -> list[Step]:
    steps: list[Step] = []
    for phase_number, phase in enumerate(http.phases or []):
        if isinstance(phase, Idle):
            steps.append(phase.seconds)
            continue
        settings = {
            "endpoint": phase.endpoint or http.endpoint,
            "max_tokens": phase.max_tokens or http.max_tokens,
            "stream": http.stream if phase.stream is None else phase.stream,
            "disconnect": phase.disconnect,
        }
        clients = phase.clients or http.clients
        draw = (lambda *keys, p=phase_number: _rng(seed, number, p, *keys))
        if isinstance(phase, Sessions):
            rounds = _sessions(phase, clients, draw, index, settings)
        else:
            rounds = _requests(phase, clients, draw, index, settings)
        steps.extend(rounds)
        index += sum(len(r) for r in rounds)
    return steps


def _requests(phase: Distinct | SharedPrefix, clients: int, draw, first: int,
              settings: dict) -> list[list[Call]]:
    shared = ""
    if isinstance(phase, SharedPrefix):
        shared = sentence(draw(0), phase.prefix) + " "
    calls = [Call(first + i, shared + sentence(draw(1, i), phase.words), **settings)
             for i in range(phase.requests)]
    return [calls[i:i + clients] for i in range(0, len(calls), clients)]


def _sessions(phase: Sessions, clients: int, draw, first: int,
              settings: dict) -> list[list[Call]]:
    """Sessions in groups of `clients`; each round is one turn of every session in a group."""
    rounds: list[list[Call]] = []
    index = first
    for group in range(0, phase.sessions, clients):
        members = [Conversation() for _ in range(min(clients, phase.sessions - group))]
        for turn in range(phase.turns):
            round_ = []
            for offset, session in enumerate(members):
                round_.append(Call(index, sentence(draw(group + offset, turn), phase.words),
                                   session=session, turn=turn, **settings))
                index += 1
            rounds.append(round_)
    return rounds


def _trace(http: HttpSpec, replayed: list[trace.Line], first: int) -> list[Step]:
    """One pass of a trace as calls (its sessions begun anew), in rounds of `clients` that
    never hold two turns of one session."""
    sessions: dict[str, Conversation] = {}
    turns: dict[str, int] = {}
    rounds: list[Step] = []
    current: list[Call] = []
    for offset, line in enumerate(replayed):
        session, turn = None, -1
        if line.session is not None:
            session = sessions.setdefault(line.session, Conversation())
            turn = turns[line.session] = turns.get(line.session, -1) + 1
        if len(current) == http.clients or (session is not None and any(
                call.session is session for call in current)):
            rounds.append(current)
            current = []
        current.append(Call(
            first + offset, line.prompt or "", line.endpoint, line.max_tokens or http.max_tokens,
            http.stream if line.stream is None else line.stream, None, session, turn,
            line.messages, line.extra, line.at))
    return [*rounds, current]


TOKENS_PER_WORD = 2  # an upper bound for the generated models' tokenizer (one or two a word)
TEMPLATE_TOKENS = 16  # what the chat template adds around each message, at most


def longest_context(http: HttpSpec) -> int:
    """An upper bound on the tokens of the longest request the traffic sends, for estimates."""
    longest = 0
    for phase in http.phases or []:
        if isinstance(phase, Idle):
            continue
        reply = phase.max_tokens or http.max_tokens
        if isinstance(phase, Sessions):
            tokens = phase.turns * (TOKENS_PER_WORD * phase.words + reply)
        elif isinstance(phase, SharedPrefix):
            tokens = TOKENS_PER_WORD * (phase.prefix + phase.words) + reply
        else:
            tokens = TOKENS_PER_WORD * phase.words + reply
        longest = max(longest, tokens + 64)  # the chat template's own tokens
    held: dict[str, int] = {}  # a trace's tokens so far, per session (its history is resent)
    for line in lines(http) or []:
        texts = [m["content"] for m in line.messages or ()] + [line.prompt or ""]
        words = sum(len(text.split()) for text in texts)
        tokens = (held.get(line.session, 0) if line.session is not None else 0) + (
            TOKENS_PER_WORD * words + (line.max_tokens or http.max_tokens))
        if line.session is not None:
            held[line.session] = tokens
        longest = max(longest, tokens + TEMPLATE_TOKENS * len(texts))
    return longest


def body(call: Call, model: str | None = None) -> dict:
    """The JSON body of a call, naming `model` if given: a trace line's own fields, else greedy,
    so the same prompts give the same replies."""
    request: dict = {"temperature": 0.0, **call.extra, "max_tokens": call.max_tokens,
                     "stream": call.stream}
    if model is not None:
        request["model"] = model
    if call.stream:
        request["stream_options"] = {"include_usage": True}
    history = call.session.messages if call.session is not None else []
    if call.endpoint == "chat":
        request["messages"] = [*history, *_new(call)]
    else:
        request["prompt"] = " ".join([*(m["content"] for m in history), call.text])
    return request


def _new(call: Call) -> list[dict]:
    """What a call adds to its conversation: a trace's messages, or one user message."""
    if call.messages is not None:
        return list(call.messages)
    return [{"role": "user", "content": call.text}]


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# A request refused as malformed, or for a model the server does not know, where none was named:
# a server that routes by model (vllm-mlx answers 422) needs workload.http.model.
REFUSED = (400, 404, 422)
UNNAMED = (" (the request named no model: if the server needs one, set workload.http.model, "
           "e.g. \"{model}\" or \"{model_name}\")")


def send(host: str, port: int, call: Call, timeout: float, model: str | None = None) -> Reply:
    """Send one call and read its reply (or as many chunks as the call reads before it
    disconnects); its session, if any, gains the user message and the reply."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    name = f"request {call.index}" if call.index >= 0 else "the readiness request"
    try:
        connection.request("POST", PATHS[call.endpoint], json.dumps(body(call, model)),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            text = response.read(400).decode("utf-8", "replace").strip()
            raise TrafficError(f"{name}: HTTP {response.status}: {text}"
                               + (UNNAMED if model is None and response.status in REFUSED
                                  else ""))
        reply = _streamed(response, call) if call.stream else _whole(response)
    except TimeoutError:
        raise NoReply(f"{name}: no reply within {timeout:g} s: the server stopped "
                      "answering") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise TrafficError(f"{name}: {type(exc).__name__}: {exc}") from None
    finally:
        connection.close()
    if call.session is not None:
        call.session.messages += [*_new(call), {"role": "assistant", "content": reply.text}]
    return reply


def still_answers(host: str, port: int, timeout: float = 2.0) -> str | None:
    """How the server's port still answers, where a request got no reply: `GET /v1/models`
    answered (with its status), or at least a connection accepted; None when neither. A
    server that answers so while no request completes is wedged, not gone (mlx-lm's
    BatchGenerator once died so, leaving /v1/models at 200 and every completion hanging)."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/v1/models")
        return f"GET /v1/models answers HTTP {connection.getresponse().status}"
    except TimeoutError:
        return "it accepts connections"
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


def _text(choice: dict) -> str:
    if "message" in choice:
        return choice["message"].get("content") or ""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _whole(response: http.client.HTTPResponse) -> Reply:
    data = json.loads(response.read())
    usage = data.get("usage") or {}
    text = "".join(_text(c) for c in data.get("choices") or [])
    return Reply(text, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)),
                 False)


def _streamed(response: http.client.HTTPResponse, call: Call) -> Reply:
    """Server-sent events until `data: [DONE]`, or until `call.disconnect` chunks were read."""
    parts: list[str] = []
    usage: dict = {}
    chunks = 0
    first: float | None = None
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        event = json.loads(payload)
        usage = event.get("usage") or usage
        texts = [_text(c) for c in event.get("choices") or []]
        if first is None and any(texts):
            first = time.monotonic()
        parts.extend(texts)
        chunks += 1
        if call.disconnect is not None and chunks >= call.disconnect:
            return Reply("".join(parts), 0, chunks, True, first)
    return Reply("".join(parts), int(usage.get("prompt_tokens", 0)),
                 int(usage.get("completion_tokens", 0)), False, first)


def latency(requests: np.ndarray) -> Latency | None:
    """Time to first token (streamed requests) and total latency over the requests that got
    their whole reply, in seconds: medians, 95th percentiles and the longest."""
    whole = requests[requests["disconnected"] == 0]
    if not len(whole):
        return None
    total = whole["done"] - whole["sent"]
    first = (whole["first"] - whole["sent"])[~np.isnan(whole["first"])]
    figures = {"total_p50_s": np.median(total), "total_p95_s": np.percentile(total, 95),
               "total_max_s": total.max()}
    if len(first):
        figures.update(ttft_p50_s=np.median(first), ttft_p95_s=np.percentile(first, 95),
                       ttft_max_s=first.max())
    return Latency(**{name: round(float(value), 4) for name, value in figures.items()})


T = TypeVar("T")


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Each item, and whether it is the last."""
    iterator = iter(items)
    try:
        item = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield item, False
        item = following
    yield item, True
