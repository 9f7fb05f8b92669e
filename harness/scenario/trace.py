"""A trace of requests to replay (`workload.http.trace`): one JSON object a line, an
OpenAI-compatible chat (`messages`) or completions (`prompt`) body with `max_tokens` and
`stream`, and two keys of kvmem's own: `at`, the arrival offset in seconds, and `session`, the
conversation a line is a turn of (a later turn carries only its new messages; the replay
prepends the earlier turns and the server's real replies). docs/traces.md has the format.

Read and checked whole before any run, so a bad line is bad input naming the file and the line.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.echo import echo
from ..common.errors import KvmemError
from ..common.units import MiB

MAX_TRACE_BYTES = 256 * MiB
MAX_LINES = 100_000
MAX_TOKENS = 100_000
OWN = ("at", "session")  # kvmem's keys; the rest is the body
SET = ("model", "max_tokens", "stream", "stream_options", "messages", "prompt")  # set by kvmem


class TraceError(KvmemError, ValueError):
    """A trace that cannot be replayed; the message names the file and, where one, the line."""


@dataclass(frozen=True)
class Line:
    """One request of a trace: its new messages (chat) or prompt (completions), its settings,
    and what of the body kvmem passes on as it is (`extra`: temperature, stop, ...)."""

    number: int  # the line in the file, from 1
    endpoint: str  # chat | completions
    messages: tuple[dict, ...] | None
    prompt: str | None
    max_tokens: int | None
    stream: bool | None
    at: float | None
    session: str | None
    extra: dict[str, Any] = field(default_factory=dict)


def read(path: Path) -> list[Line]:
    """Every request of the trace at `path`, in order; TraceError on the first bad line.

    Parsed once per process while the file is unchanged: in kvmem's the loader's check and the
    progress plan ask, in a variant's the size check and the replay."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from None
    return list(_parsed(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=2)
def _parsed(path: Path, mtime_ns: int, size: int) -> tuple[Line, ...]:
    """The trace at `path` as it was when it had this modification time and size."""
    try:
        if size > MAX_TRACE_BYTES:
            raise TraceError(f"{path}: expected a trace of at most "
                             f"{MAX_TRACE_BYTES // MiB} MiB")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text: invalid byte at offset {exc.start}") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from None
    lines: list[Line] = []
    endpoints: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if len(lines) == MAX_LINES:
            raise TraceError(f"{path}: line {number}: expected at most {MAX_LINES:,} requests")
        try:
            line = _line(number, raw)
        except ValueError as exc:
            raise TraceError(f"{path}: line {number}: {exc}") from None
        if line.session is not None:
            first = endpoints.setdefault(line.session, line.endpoint)
            if first != line.endpoint:
                raise TraceError(f"{path}: line {number}: session {echo(line.session)} mixes "
                                 "chat (messages) and completions (prompt) turns")
        lines.append(line)
    if not lines:
        raise TraceError(f"{path}: expected at least one request (one JSON object a line)")
    return tuple(lines)


def _line(number: int, raw: str) -> Line:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON: {getattr(exc, 'msg', exc)}") from None
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object (a request body)")
    has_messages, has_prompt = "messages" in data, "prompt" in data
    if has_messages == has_prompt:
        raise ValueError("expected exactly one of messages (chat) or prompt (completions)")
    messages = _messages(data["messages"]) if has_messages else None
    prompt = data.get("prompt")
    if has_prompt and not isinstance(prompt, str):
        raise ValueError(f"prompt: expected text, got {echo(prompt)}")
    max_tokens = data.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or not 1 <= max_tokens <= MAX_TOKENS):
        raise ValueError(f"max_tokens: expected a whole number from 1 to {MAX_TOKENS:,}, got "
                         f"{echo(max_tokens)}")
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ValueError(f"stream: expected true or false, got {echo(stream)}")
    at = data.get("at")
    if at is not None and (not isinstance(at, (int, float)) or isinstance(at, bool)
                           or not math.isfinite(at) or at < 0):
        raise ValueError(f"at: expected the arrival offset in seconds (0 or more), got {echo(at)}")
    session = data.get("session")
    if session is not None and (not isinstance(session, str) or not session):
        raise ValueError(f"session: expected a session id (text), got {echo(session)}")
    extra = {key: value for key, value in data.items() if key not in OWN + SET}
    return Line(number, "chat" if has_messages else "completions", messages, prompt,
                max_tokens, stream, None if at is None else float(at), session, extra)


def _messages(value: Any) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("messages: expected a list of {role, content} objects")
    for index, message in enumerate(value):
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)):
            raise ValueError(f"messages.{index}: expected {{\"role\": text, \"content\": text}}, "
                             f"got {echo(message)}")
    return tuple(value)
