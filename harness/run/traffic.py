"""HTTP traffic for a server: the plan a scenario's `workload.http` makes, and one client call.

The plan is drawn from the seed alone (prompt text from `harness.model_folder.sentence`), so
every run sends the same requests; only a session's history also holds the server's replies,
as a chat client's does. Requests go out in rounds: a round is sent together (one thread per
client), and the engine samples the server at rest after each round.

Calls use the standard library's `http.client`: a streamed reply is read as server-sent events
line by line, and a client that disconnects closes its socket after the chunks it was told to
read, as a user who closes a tab.
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass, field

import numpy as np

from ..models.folder import sentence
from ..scenario.server import Distinct, HttpSpec, Idle, Sessions, SharedPrefix


class TrafficError(Exception):
    """A request the server did not answer as an OpenAI-compatible server would."""


class NoReply(TrafficError):
    """A request with no reply within its timeout: the server may be dead, or wedged (its port
    answering while no request completes)."""


@dataclass
class Session:
    """One conversation: its messages so far, the server's replies included."""

    messages: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class Call:
    """One request as planned: `text` is the new user message (chat) or the prompt's new part."""

    index: int
    text: str
    endpoint: str
    max_tokens: int
    stream: bool
    disconnect: int | None
    session: Session | None = None
    turn: int = -1


@dataclass(frozen=True)
class Reply:
    text: str
    prompt_tokens: int
    completion_tokens: int
    disconnected: bool


Step = list[Call] | float  # a round sent together, or seconds of idleness


def plan(http: HttpSpec, seed: int) -> list[Step]:
    """Every round (and idle period) of the traffic, in order."""
    steps: list[Step] = []
    index = 0
    for number, phase in enumerate(http.phases):
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
        if isinstance(phase, Sessions):
            rounds = _sessions(phase, clients, seed, number, index, settings)
        else:
            rounds = _requests(phase, clients, seed, number, index, settings)
        steps.extend(rounds)
        index += sum(len(r) for r in rounds)
    return steps


def _requests(phase: Distinct | SharedPrefix, clients: int, seed: int, number: int, first: int,
              settings: dict) -> list[list[Call]]:
    shared = ""
    if isinstance(phase, SharedPrefix):
        shared = sentence(np.random.default_rng([seed, number, 0]), phase.prefix) + " "
    calls = [Call(first + i, shared + sentence(np.random.default_rng([seed, number, 1, i]),
                                               phase.words), **settings)
             for i in range(phase.requests)]
    return [calls[i:i + clients] for i in range(0, len(calls), clients)]


def _sessions(phase: Sessions, clients: int, seed: int, number: int, first: int,
              settings: dict) -> list[list[Call]]:
    """Sessions in groups of `clients`; each round is one turn of every session in a group."""
    rounds: list[list[Call]] = []
    index = first
    for group in range(0, phase.sessions, clients):
        members = [Session() for _ in range(min(clients, phase.sessions - group))]
        for turn in range(phase.turns):
            round_ = []
            for offset, session in enumerate(members):
                rng = np.random.default_rng([seed, number, group + offset, turn])
                round_.append(Call(index, sentence(rng, phase.words), session=session,
                                   turn=turn, **settings))
                index += 1
            rounds.append(round_)
    return rounds


TOKENS_PER_WORD = 2  # an upper bound for the generated models' tokenizer (one or two a word)


def longest_context(http: HttpSpec) -> int:
    """An upper bound on the tokens of the longest request the traffic sends, for estimates."""
    longest = 0
    for phase in http.phases:
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
    return longest


def body(call: Call, model: str | None = None) -> dict:
    """The JSON body of a call, naming `model` if given: greedy, so the same prompts give the
    same replies."""
    request: dict = {"max_tokens": call.max_tokens, "temperature": 0.0, "stream": call.stream}
    if model is not None:
        request["model"] = model
    if call.stream:
        request["stream_options"] = {"include_usage": True}
    history = call.session.messages if call.session is not None else []
    if call.endpoint == "chat":
        request["messages"] = [*history, {"role": "user", "content": call.text}]
    else:
        request["prompt"] = " ".join([*(m["content"] for m in history), call.text])
    return request


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
        call.session.messages += [{"role": "user", "content": call.text},
                                  {"role": "assistant", "content": reply.text}]
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
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        event = json.loads(payload)
        usage = event.get("usage") or usage
        parts.extend(_text(c) for c in event.get("choices") or [])
        chunks += 1
        if call.disconnect is not None and chunks >= call.disconnect:
            return Reply("".join(parts), 0, chunks, True)
    return Reply("".join(parts), int(usage.get("prompt_tokens", 0)),
                 int(usage.get("completion_tokens", 0)), False)
