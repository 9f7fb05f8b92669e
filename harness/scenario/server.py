"""The server engine's part of a scenario: how to start the server (`server:`) and the HTTP
traffic to send it (`workload.http`). Validated as strictly as the rest of the schema."""

from __future__ import annotations

import re
import shlex
import string
from typing import Annotated, Literal, Union

from pydantic import BeforeValidator, Discriminator, Field, model_validator

from ..common.echo import echo
from ..common.strict import Strict
from ..common.units import Duration, PerSecond

MAX_REQUESTS = 100_000
MAX_WORDS = 1_000_000
MAX_CLIENTS = 64
MAX_SECONDS = 86_400.0

Requests = Annotated[int, Field(strict=True, ge=1, le=MAX_REQUESTS)]
Words = Annotated[int, Field(strict=True, ge=1, le=MAX_WORDS)]
Clients = Annotated[int, Field(strict=True, ge=1, le=MAX_CLIENTS)]
Tokens = Annotated[int, Field(strict=True, ge=1, le=MAX_REQUESTS)]
Seconds = Annotated[float, Field(strict=True, gt=0.0, le=MAX_SECONDS, allow_inf_nan=False)]

# The server kvmem starts by default: mlx-lm's, on the generated model, on a free port. Started
# as `python -m mlx_lm server` (mlx-lm's own advice; `-m mlx_lm.server` is deprecated), so its
# module is imported once, as `mlx_lm.server`, and the agent sees the classes the server uses.
DEFAULT_COMMAND = "{python} -m mlx_lm server --model {model} --host {host} --port {port}"
# mlx_lm.server's prompt cache: its own byte count, what it holds by design, and the bytes it
# allows itself: `--prompt-cache-bytes`, kept on the server's arguments (its LRUPromptCache's
# own `max_bytes` stays unset there).
DEFAULT_LOGICAL = "mlx_lm.models.cache:LRUPromptCache.nbytes"
DEFAULT_CAP = "mlx_lm.server:ModelProvider.cli_args.prompt_cache_bytes"
# {model}: the model folder; {model_dir}: the folder holding it; {model_name}: its name.
PLACEHOLDERS = ("python", "model", "model_dir", "model_name", "host", "port")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+$")
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# A cap: an attribute path on the `logical` class's instances (`max_bytes`), or on another
# class's instances (`module:Class.attribute.path`).
_CAP = re.compile(r"^([A-Za-z_][\w.]*:)?[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _words(command: str | list[str]) -> list[str]:
    """The command as its words: a string is split as a POSIX shell would (no shell runs it)."""
    if isinstance(command, list):
        return command
    try:
        return shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"cannot split the command: {exc}") from None


def _placeholders(words: list[str]) -> set[str]:
    found: set[str] = set()
    for word in words:
        try:
            parsed = list(string.Formatter().parse(word))
        except ValueError as exc:
            raise ValueError(f"{echo(word)}: {exc} (write a literal brace as {{{{ or }}}})") from None
        found.update(name for _, name, _, _ in parsed if name is not None)
    return found


def _check_command(value: str | list[str]) -> list[str]:
    words = _words(value)
    if not words or not all(isinstance(w, str) and w for w in words):
        raise ValueError("expected a command line: a non-empty string, or a list of words")
    names = _placeholders(words)
    unknown = names - set(PLACEHOLDERS)
    if unknown:
        raise ValueError(f"unknown placeholder {{{sorted(unknown)[0]}}}: expected "
                         + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS))
    if "port" not in names:
        raise ValueError("the command must say where to listen with {port}: kvmem picks a free "
                         "port for each run")
    return words


def _check_model_name(value: str | None) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError("expected a model name (text)")
    unknown = _placeholders([value]) - set(PLACEHOLDERS)
    if unknown:
        raise ValueError(f"unknown placeholder {{{sorted(unknown)[0]}}}: expected "
                         + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS))
    return value


def _check_import_path(value: str | None) -> str | None:
    if value is not None and not _IMPORT_PATH.match(value):
        raise ValueError(f"expected module:Class.attribute, got {echo(value)}")
    return value


def _check_cap_path(value: str | None) -> str | None:
    if value is not None and not (isinstance(value, str) and _CAP.match(value)):
        raise ValueError("expected an attribute of the `logical` class's instances (max_bytes) "
                         f"or module:Class.attribute, got {echo(value)}")
    return value


def _check_requirement(value: object) -> str:
    """A requirement as pip and uv read it (`vllm-mlx==0.6.0`, `mlx[cpu]>=0.32; sys_platform ==
    'linux'`): a name, extras, a version specifier, markers, or `name @ URL`."""
    from packaging.requirements import InvalidRequirement, Requirement

    if not isinstance(value, str):
        raise ValueError(f"expected a requirement (text), got {echo(value)}")
    try:
        Requirement(value)
    except InvalidRequirement as exc:
        raise ValueError(f"expected a requirement such as vllm-mlx==0.6.0, got {echo(value)}: "
                         f"{str(exc).splitlines()[0]}") from None
    return value


def _check_module(value: str) -> str:
    if not _MODULE.match(value):
        raise ValueError(f"expected a module's import path (a.b.c), got {echo(value)}")
    return value


class ServerSpec(Strict):
    """`server:`: the command kvmem starts (placeholders {python}, {model}, {host}, {port}),
    what it adds to it, the environment it runs in, and what the agent inside reads."""

    command: Annotated[list[str], BeforeValidator(
        _check_command, json_schema_input_type=str | list[str])] = Field(
        default_factory=lambda: _words(DEFAULT_COMMAND))
    args: list[Annotated[str, Field(strict=True)]] = Field(default_factory=list)
    env: dict[str, Annotated[str, Field(strict=True)]] = Field(default_factory=dict)
    # The server's own environment: what it needs, built once with uv and cached by these exact
    # requirements (`requires_no_deps`: installed without their declared dependencies); or
    # `python`, an interpreter whose environment the server already has. Either way `{python}`
    # is that interpreter, and the model folder is built by it. Neither: kvmem's own.
    requires: list[Annotated[str, BeforeValidator(_check_requirement)]] = Field(
        default_factory=list)
    requires_no_deps: list[Annotated[str, BeforeValidator(_check_requirement)]] = Field(
        default_factory=list)
    python: Annotated[str, Field(strict=True, min_length=1)] | None = None
    # The byte count a server holds by design (its prompt cache): `module:Class.attribute`,
    # summed over every instance; null when the server has none to read.
    logical: Annotated[str | None, BeforeValidator(_check_import_path)] = DEFAULT_LOGICAL
    # How many bytes the cache allows itself (its cap): an attribute path on those instances
    # (`max_bytes`), or `module:Class.attribute.path` on another class's (a server's parsed
    # arguments); summed over instances. Memory held at rest beyond it is the server breaking
    # its own promise (`over_cap`). By default mlx_lm.server's `--prompt-cache-bytes` where
    # `logical` is mlx-lm's prompt cache; null: none read.
    cap: Annotated[str | None, BeforeValidator(_check_cap_path)] = None
    # Modules the agent imports in the server before it runs (a canary's fault).
    plugins: list[Annotated[str, BeforeValidator(_check_module)]] = Field(default_factory=list)
    period: Annotated[float, Field(strict=True, ge=0.01, le=60.0, allow_inf_nan=False)] = 0.1
    ready_timeout: Seconds = 120.0
    request_timeout: Seconds = 120.0
    # How long an idle sample waits for memory to stand still after the last request ended.
    settle: Annotated[float, Field(strict=True, ge=0.0, le=60.0, allow_inf_nan=False)] = 2.0

    @model_validator(mode="after")
    def _check_cap(self) -> ServerSpec:
        if "cap" in self.model_fields_set:
            if self.cap is not None and ":" not in self.cap and self.logical is None:
                raise ValueError("cap: names an attribute of the `logical` class's instances: "
                                 "set logical too, or name module:Class.attribute")
        elif self.logical == DEFAULT_LOGICAL:
            object.__setattr__(self, "cap", DEFAULT_CAP)  # mlx-lm's own, where it is read
        return self

    @model_validator(mode="after")
    def _check_python(self) -> ServerSpec:
        if self.python is not None and (self.requires or self.requires_no_deps):
            raise ValueError("python: an interpreter of your own, or requires: an environment "
                             "kvmem builds; not both")
        return self

    @property
    def own_environment(self) -> bool:
        """The server runs in an environment other than kvmem's."""
        return bool(self.python or self.requires or self.requires_no_deps)

    @model_validator(mode="after")
    def _check_env(self) -> ServerSpec:
        for name in self.env:
            if not name or "=" in name or "\0" in name or name.startswith("KVMEM_AGENT"):
                raise ValueError(f"env: {echo(name)} is not a variable kvmem can set "
                                 "(no '=', not KVMEM_AGENT*)")
        return self


class _Calls(Strict):
    """What every kind of traffic may set for its own requests; unset, the `http:` defaults."""

    endpoint: Literal["chat", "completions"] | None = None
    max_tokens: Tokens | None = None
    clients: Clients | None = None
    stream: Annotated[bool, Field(strict=True)] | None = None
    # Close the connection after this many streamed chunks, as a client that gives up.
    disconnect: Tokens | None = None


class Distinct(_Calls):
    """`requests` prompts of `words` words each, none sharing a prefix with another."""

    kind: Literal["distinct"]
    requests: Requests
    words: Words


class SharedPrefix(_Calls):
    """`requests` prompts that share their first `prefix` words, then `words` of their own."""

    kind: Literal["prefix"]
    requests: Requests
    prefix: Words
    words: Words


class Sessions(_Calls):
    """`sessions` conversations of `turns` turns: each turn sends the whole history so far (the
    server's own replies included) and a new user message of `words` words."""

    kind: Literal["sessions"]
    sessions: Requests
    turns: Requests
    words: Words


class Idle(Strict):
    """No traffic for `seconds`, with the agent still sampling; then a sample at rest."""

    kind: Literal["idle"]
    seconds: Seconds


Phase = Annotated[Union[Distinct, SharedPrefix, Sessions, Idle], Discriminator("kind")]  # noqa: UP007


class HttpSpec(Strict):
    """`workload.http`: OpenAI-compatible traffic, generated in phases run in order or replayed
    from a trace (`trace:`, JSON lines; see docs/traces.md); defaults for every request.
    Prompts are drawn from `sampling.seed`, so the traffic is identical run to run.

    Closed loop (the default): requests go out in rounds of `clients`, a sample at rest after
    each round. Open loop (`rate:`, or a trace's own `at` offsets): requests arrive on a
    seeded schedule whether or not earlier ones are done, so a slow server builds a queue, and
    the traffic pauses every `rest_every` seconds for a sample at rest. `duration:` repeats the
    traffic until that time has passed (a soak), `max_requests:` stops it at a count.

    What open-loop traffic makes of memory depends on the machine's speed: a slow runner queues
    arrivals into large batches. So the gate (`gate pr`, `baseline update`, `baseline check`,
    `run --gated`) replays it as `gate:` says: `ordered` (the default), the requests in their
    order, one at a time, arrival times ignored (`arrivals: ordered`, `clients: 1`: two
    requests in flight overlap or not as the server's speed decides); `as_declared`, on its
    schedule, for a runner whose speed is known."""

    endpoint: Literal["chat", "completions"] = "chat"
    # The model each request names, for servers that require one (placeholders as in the
    # command: "{model_name}"); none is sent when unset.
    model: Annotated[str | None, BeforeValidator(_check_model_name)] = None
    max_tokens: Tokens = 16
    clients: Clients = 1
    stream: Annotated[bool, Field(strict=True)] = False
    phases: Annotated[list[Phase], Field(min_length=1)] | None = None
    # A JSON-lines file of requests, relative to the scenario file (harness.scenario.trace).
    trace: Annotated[str, Field(strict=True, min_length=1)] | None = None
    # Open-loop arrivals: requests a second, drawn as a Poisson process (or evenly spaced).
    rate: PerSecond | None = None
    # `ordered`: no schedule; the requests go out in order, in rounds of `clients`.
    arrivals: Literal["poisson", "even", "ordered"] = "poisson"
    gate: Literal["ordered", "as_declared"] = "ordered"
    duration: Duration | None = None
    max_requests: Requests | None = None
    # Under open-loop traffic, the longest stretch without a sample at rest: arrivals pause,
    # the requests in flight finish, the agent samples at rest, and the schedule resumes.
    rest_every: Duration = 60.0
    # End the traffic at the first sample at rest over the budget (detect.unbounded.budget)
    # or the cache's own cap, the report written as for any run.
    fail_fast: Annotated[bool, Field(strict=True)] = False

    @model_validator(mode="after")
    def _check(self) -> HttpSpec:
        if (self.phases is None) == (self.trace is None):
            raise ValueError("expected exactly one of phases (generated traffic) or trace "
                             "(a JSON-lines file of requests)")
        for index, phase in enumerate(self.phases or []):
            if isinstance(phase, Idle) or phase.disconnect is None:
                continue
            streaming = phase.stream if phase.stream is not None else self.stream
            if not streaming:
                raise ValueError(f"phases.{index}.disconnect: a client disconnects mid-stream: "
                                 "set stream: true")
        if self.phases is not None and all(isinstance(p, Idle) for p in self.phases):
            raise ValueError("phases: expected at least one phase that sends requests")
        if self.rate is not None and any(isinstance(p, Idle) for p in self.phases or []):
            raise ValueError("rate: open-loop arrivals and idle phases do not mix (the traffic "
                             "pauses for samples at rest every rest_every seconds)")
        return self

    @property
    def open_loop(self) -> bool:
        """Requests arrive on a schedule (a rate, or a trace's offsets) rather than in rounds."""
        return (self.rate is not None or self.trace is not None) and self.arrivals != "ordered"

    def gated(self) -> HttpSpec:
        """The traffic as the gate runs it: open loop replayed in order unless `gate:` keeps
        its schedule (`as_declared`)."""
        if not self.open_loop or self.gate == "as_declared":
            return self
        return self.model_copy(update={"arrivals": "ordered", "clients": 1})

    def requests(self) -> int:
        """How many requests one pass of the generated phases sends (0 for a trace: its
        length is known once the file is read)."""
        total = 0
        for phase in self.phases or []:
            if isinstance(phase, Sessions):
                total += phase.sessions * phase.turns
            elif not isinstance(phase, Idle):
                total += phase.requests
        return total
