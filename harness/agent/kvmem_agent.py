"""The agent kvmem runs inside a server process: samples of MLX memory and RSS, on a period and
on command, sent to kvmem over one authenticated local connection.

Standalone on purpose (the standard library, and MLX where the server has it): the server may
run in another environment than kvmem's. kvmem's in-process probe imports the readers below
(`current_rss`, and from `kvmem_rest`, beside it, what a point at rest measures), so both
measure alike.

Protocol (version 1), over `multiprocessing.connection` with the key kvmem gives:

- the agent connects to `KVMEM_AGENT` (host:port) with `KVMEM_AGENT_KEY` (hex) and sends
  `{"hello": 1, "pid", "parent", "argv", "forked", "python", "mlx", "errors"}`; `errors` lists
  what it could not set up (a logical path or a plugin that does not import), which kvmem
  reports as the run's failure;
- then it answers each command with `{"rows": [...], "now": t, "busy": s, "replaced": r}`, the
  rows sampled since its last answer (`busy`: the CPU seconds its sampling took, in all;
  `replaced`: None, or which of MLX's counters the server's code replaced, which kvmem reports
  as the run's failure):
  `{"op": "mark", "request": i, "turn": t}` samples now (a request boundary);
  `{"op": "idle", "cycles": bool, "holders": bool, "settle": s}` (with `request` and `turn`
  where no mark has said them: open-loop traffic) waits until active memory and the logical
  size stand still (at most `s` seconds), measures what unreachable reference cycles hold
  (without freeing it) when asked, walks the objects that hold MLX arrays when asked
  (`kvmem_holders`: the answer's `holders`, each group a plain tuple, and `census`, what the
  walk cost), hands freed heap back to the system and samples;
  `{"op": "rows"}` only drains, and with `"holders": true` walks as well (nothing collected, no
  row at rest: a recorded program is at work); `{"op": "stop"}` drains and ends the agent.
- if the connection ends without a stop, kvmem is gone: the agent kills its process (and the
  process group it leads), so a server never outlives the kvmem that started it.
- a row is a `Sample` as a plain tuple: `time.monotonic()`, phase "serve" (the period),
  "request" (a mark) or "idle"; request and turn those of the last mark, tokens a mark's own
  (`"tokens"` in the command); `peak` is the highest active since the previous row.

`KVMEM_AGENT_PERIOD` sets the period (seconds), `KVMEM_AGENT_LOGICAL` names
`module:Class.attribute`: every instance of that class made in the process is tracked (weakly)
and `logical` is the sum of their attribute (`entries` of their `len()`). `KVMEM_AGENT_CAP` names
the bytes each allows itself: an attribute path of those instances (`max_bytes`), or of another
class's (`module:Class.attribute.path`, as mlx_lm.server's `--prompt-cache-bytes` on its parsed
arguments): `cap` is their sum, 0 where one does not say (None, or 2**53 bytes or more).
`KVMEM_AGENT_PLUGINS` lists modules to import first, separated by commas (a canary's).

`KVMEM_AGENT_FOLLOW` (`kvmem record`): the agent is started by `kvmem_follow` instead, which
follows the process's children.
"""

from __future__ import annotations

import atexit
import ctypes
import hmac  # noqa: F401  # imported by connecting (below)
import importlib
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Client
from typing import Any

if __package__:  # harness.agent.kvmem_agent, in kvmem
    from .kvmem_rest import at_rest
    from .kvmem_sample import Sample
else:  # kvmem_agent, beside it on a server's PYTHONPATH
    from kvmem_rest import at_rest  # type: ignore[import-not-found, no-redef]
    from kvmem_sample import Sample  # type: ignore[import-not-found, no-redef]

# hmac and Client: here, not in the agent's thread (a fork mid-import leaves a module half made)

PROTOCOL = 1
VARIABLES = ("KVMEM_AGENT", "KVMEM_AGENT_KEY", "KVMEM_AGENT_PERIOD", "KVMEM_AGENT_LOGICAL",
             "KVMEM_AGENT_CAP", "KVMEM_AGENT_PLUGINS", "KVMEM_AGENT_FOLLOW")
NO_CAP = 2**53  # a cap this large, or larger (mlx-lm's default is 2**63), caps nothing
# The MLX functions kvmem reads memory with, in a server and (with `synchronize`) in its probe.
COUNTERS = ("get_active_memory", "get_peak_memory", "get_cache_memory", "reset_peak_memory")


class Counters:
    """MLX's memory counters as they were when bound, and a check that they still are.

    kvmem binds them before it imports the code it measures and reads memory through these
    references, so code that replaces `mlx.core.get_active_memory` (to subtract its own bytes)
    changes no reading; `replaced` names what it did, and kvmem fails the run with that.
    """

    def __init__(self, mx: Any, names: tuple[str, ...] = COUNTERS) -> None:
        self.mx = mx
        self.bound = {name: getattr(mx, name) for name in names}
        self.active: Callable[[], int] = self.bound["get_active_memory"]
        self.peak: Callable[[], int] = self.bound["get_peak_memory"]
        self.cache: Callable[[], int] = self.bound["get_cache_memory"]
        self.reset_peak: Callable[[], None] = self.bound["reset_peak_memory"]

    def replaced(self, where: str) -> str | None:
        """Which bound function `mlx.core` no longer holds, and what took its place, as the
        run's failure says it; None while all are MLX's own."""
        for name, bound in self.bound.items():
            now = getattr(self.mx, name, None)
            if now is not bound:
                by = "removed" if now is None else f"replaced by {_origin(now)}"
                return (f"mlx.core.{name} was {by} in {where}: kvmem reads MLX's memory through "
                        "it, and the code it measures may not change it")
        return None


def _origin(replacement: Any) -> str:
    """Where a replacement says it was defined: `module.qualified_name`."""
    module = getattr(replacement, "__module__", None) or "?"
    name = getattr(replacement, "__qualname__", None) or type(replacement).__qualname__
    return f"{module}.{name}"


def bind() -> Counters | None:
    """MLX's counters as they are now, or None in a process without MLX."""
    mx = _mlx()
    return None if mx is None else Counters(mx)


def _mlx() -> Any:
    """mlx.core if this process can import it, else None (a server without MLX)."""
    try:
        import mlx.core as mx
    except ImportError:
        return None
    return mx


def current_rss() -> int:
    """This process's resident set size in bytes; on macOS its physical footprint, which is
    what the system charges it (RSS there under-reports memory an MLX server holds).

    On Linux one `pread` of /proc/<pid>/statm on a descriptor kept open (about 1.5 us);
    elsewhere psutil where installed. Readers are kept per pid, so a forked child never reads
    its parent's figure.
    """
    pid = os.getpid()
    reader = _RSS_READERS.get(pid)
    if reader is None:
        reader = _RSS_READERS[pid] = _rss_reader(pid)
    return reader()


def _rss_reader(pid: int) -> Callable[[], int]:
    if sys.platform.startswith("linux"):
        try:
            fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
        except OSError:
            pass
        else:
            page = os.sysconf("SC_PAGE_SIZE")
            return lambda: int(os.pread(fd, 128, 0).split()[1]) * page
    if sys.platform == "darwin":
        footprint = _darwin_footprint(pid)
        if footprint is not None:
            return footprint
    try:
        import psutil
    except ImportError:
        return lambda: 0
    process = psutil.Process(pid)
    return lambda: process.memory_info().rss


_RSS_READERS: dict[int, Callable[[], int]] = {}
_RUSAGE_INFO_V2 = 2
_FOOTPRINT_WORD = 9  # ri_phys_footprint: after a 16-byte uuid, the 8th uint64 field


def _darwin_footprint(pid: int) -> Callable[[], int] | None:
    """libproc's `proc_pid_rusage` physical footprint reader, or None where it is missing."""
    try:
        libproc = ctypes.CDLL("/usr/lib/libproc.dylib")
    except OSError:
        return None
    buffer = (ctypes.c_uint64 * 64)()

    def read() -> int:
        if libproc.proc_pid_rusage(pid, _RUSAGE_INFO_V2, ctypes.byref(buffer)) != 0:
            return 0
        return int(buffer[_FOOTPRINT_WORD])

    return read


def _watch(path: str) -> tuple[weakref.WeakSet[Any], str]:
    """Track every instance of the class `path` names (`module:Class.attribute.path`) made from
    now on, weakly; the set and the attribute path after the class."""
    module_name, _, qualified = path.partition(":")
    parts = qualified.split(".")
    owner: Any = importlib.import_module(module_name)
    cls: Any = None
    while parts and isinstance(getattr(owner, parts[0], None), type):  # nested classes too
        owner = cls = getattr(owner, parts.pop(0))
    if cls is None:
        raise ValueError(f"no class {qualified.split('.')[0]} in {module_name}")
    if not parts:
        raise ValueError(f"{qualified} names a class: expected module:Class.attribute")
    instances: weakref.WeakSet[Any] = weakref.WeakSet()
    original = cls.__init__

    def tracked_init(obj: Any, *args: Any, **kwargs: Any) -> None:
        original(obj, *args, **kwargs)
        instances.add(obj)

    cls.__init__ = tracked_init
    return instances, ".".join(parts)


def _value(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


class Tracked:
    """Every instance of one class made after `track`, weakly, and the sums of one attribute
    (its size) and, where named, of a cap: an attribute path on those instances, or on another
    class's (`module:Class.attribute.path`: a server's parsed arguments)."""

    def __init__(self, path: str, cap: str | None = None):
        self.instances, self.attribute = _watch(path)
        self.capped: weakref.WeakSet[Any] | None = None
        self.cap = cap
        if cap is not None and ":" in cap:
            self.capped, self.cap = _watch(cap)

    def read(self) -> tuple[int, int, int]:
        """(sum of the attribute, sum of the lengths, sum of the caps) over live instances; a
        reading that races another thread's change is taken again."""
        for _ in range(10):
            try:
                live = list(self.instances)
                size = sum(int(getattr(obj, self.attribute)) for obj in live)
                entries = sum(len(obj) for obj in live if hasattr(obj, "__len__"))
                return size, entries, self._caps(live)
            except RuntimeError:  # a set or dict changed size while read
                continue
        return 0, 0, 0

    def _caps(self, live: list[Any]) -> int:
        """What the instances allow themselves, in all: 0 where one has no cap (unset, or too
        large to cap anything)."""
        if self.cap is None:
            return 0
        owners = live if self.capped is None else list(self.capped)
        caps = [_value(obj, self.cap) for obj in owners]
        limits = [int(c) for c in caps
                  if isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < NO_CAP]
        return sum(limits) if caps and len(limits) == len(caps) else 0


class Agent:
    """Samples on a period in one thread and answers kvmem's commands in another, reading MLX
    through `counters` (bound now unless given: bind them before the server's code imports)."""

    def __init__(self, period: float, tracked: Tracked | None, counters: Counters | None = None,
                 lazy: bool = False):
        self.period = period
        self.tracked = tracked
        self.lazy = lazy  # a followed child binds MLX once it has imported it, not before
        self.counters = counters if counters is not None or lazy else bind()
        self.replaced: str | None = None  # the first replacement of a counter seen
        self._request = -1
        self._turn = -1
        self._connection: Any = None
        self.fresh()

    def fresh(self) -> None:
        """The state one process's sampling starts from; again in a forked child, where the
        parent's connection is closed (it would keep kvmem's end open once the parent is gone)."""
        if self._connection is not None:
            self._connection = self._connection.close()  # None
        self.lock = threading.Lock()
        self._threads: set[int] = set()  # the agent's own threads, which a walk skips
        self._rows: list[tuple] = []
        self._last_active = self._active()
        self._stop = threading.Event()
        self._busy = 0.0  # CPU seconds spent taking samples, in all

    def _active(self) -> int:
        return 0 if self.counters is None else int(self.counters.active())

    def _bound(self) -> Counters | None:
        """The counters, bound now where this process has imported MLX since (lazy only)."""
        if self.counters is None and self.lazy:
            mx = sys.modules.get("mlx.core")
            if mx is not None and all(hasattr(mx, name) for name in COUNTERS):
                self.counters = Counters(mx)
        return self.counters

    def logical(self) -> tuple[int, int, int]:
        """What the tracked instances hold: bytes, entries, and the bytes they allow themselves."""
        return (0, 0, 0) if self.tracked is None else self.tracked.read()

    def take(self, phase: str, cyclic: int = 0, tokens: int = 0, census: Any = None) -> None:
        """One row now; the peak counter starts again from here; `census`, the holders walked
        at rest (their buffers and arrays go in the row)."""
        began = time.thread_time()
        with self.lock:
            counters = self._bound()
            active = self._active()
            peak, cache = 0, 0
            if counters is not None:
                peak = int(counters.peak())
                counters.reset_peak()
                cache = int(counters.cache())
                self.replaced = self.replaced or counters.replaced("the server")
            peak = max(peak, self._last_active, active)
            self._last_active = active
            size, entries, cap = self.logical()
            self._rows.append(tuple(Sample(
                time=time.monotonic(), phase=phase, request=self._request, turn=self._turn,
                tokens=tokens, active=active, peak=peak, cache=cache, rss=current_rss(),
                logical=size, entries=entries, cyclic=cyclic, cap=cap,
                buffers=-1 if census is None else census.buffers,
                arrays=-1 if census is None else census.arrays)))
            self._busy += time.thread_time() - began

    def drain(self) -> dict:
        with self.lock:
            rows, self._rows = self._rows, []
            return {"rows": rows, "now": time.monotonic(), "busy": self._busy,
                    "replaced": self.replaced}

    def settle(self, seconds: float) -> None:
        """Wait until active memory and the logical size stand still over three readings
        20 ms apart, at most `seconds`: a server may still be storing a finished request's
        cache after its last byte went out."""
        deadline, last, same = time.monotonic() + seconds, None, 0
        while same < 3 and time.monotonic() < deadline and not self._stop.is_set():
            now = (self._active(), self.logical())
            same = same + 1 if now == last else 0
            last = now
            time.sleep(0.02)

    def handle(self, command: dict) -> dict:
        op = command.get("op")
        rest = None
        if op == "mark":
            self._request, self._turn = command["request"], command.get("turn", -1)
            self.take("request", tokens=command.get("tokens", 0))
        elif op == "idle":
            if "request" in command:  # open-loop traffic marks no request: the idle says
                self._request, self._turn = command["request"], command.get("turn", -1)
            self.settle(float(command.get("settle", 2.0)))
            rest = at_rest(bool(command.get("cycles")), bool(command.get("holders")),
                           skip_threads=self._threads)
            self.take("idle", rest.cyclic, census=rest.census)
        elif op == "rows" and command.get("holders") and "mlx.core" in sys.modules:
            # A program at work (`kvmem record`): nothing collected, no row at rest taken, no
            # MLX imported for it, and no sample taken while the walk's own memory is held.
            with self.lock:
                rest = at_rest(False, True, skip_threads=self._threads)
        elif op == "stop":
            self._stop.set()
        elif op != "rows":
            return {"error": f"unknown op {op!r}", **self.drain()}
        if rest is None or rest.census is None:
            return self.drain()
        return {**self.drain(), "holders": [tuple(g) for g in rest.census.groups],
                "census": {"seconds": rest.census.seconds, "objects": rest.census.objects,
                           "approximate": rest.census.approximate}}

    def sample(self) -> None:
        self._threads.add(threading.get_ident())
        while not self._stop.wait(self.period):
            self.take("serve")

    def quiesce(self) -> None:
        """At the server's exit (an `atexit` hook): no sample starts after this. MLX is torn
        down once the hooks have run, and a daemon thread still reading it then can crash the
        exit of a server that ended on its own."""
        self._stop.set()
        self.lock.acquire()  # held until the process ends: a sample in progress finishes first

    def serve(self, address: tuple[str, int], key: bytes, hello: dict) -> None:
        """Connect, say hello, then answer commands until kvmem stops or goes."""
        try:
            connection = Client(address, authkey=key)
        except OSError:
            return  # kvmem is gone: the server runs on unobserved
        self._connection = connection
        self._threads.add(threading.get_ident())
        with connection:
            connection.send(hello)
            threading.Thread(target=self.sample, name="kvmem-agent-sampler", daemon=True).start()
            try:
                while not self._stop.is_set():
                    connection.send(self.handle(connection.recv()))
            except (EOFError, OSError):
                _orphaned()
            finally:
                self._stop.set()


def _orphaned() -> None:
    """kvmem hung up without saying stop: it is gone, and the server it started goes too, with
    the process group it leads (where no parent-death signal exists, as on macOS, this is
    what keeps a server from outliving kvmem)."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


Follow = Callable[["Agent", tuple[str, int], bytes, dict], None]


def start_from_environment(follow: Follow | None = None) -> Agent:
    """Set up from the KVMEM_AGENT* variables (removed from this process's environment, so the
    server's own children start no agent) and connect in a daemon thread; `follow` is called
    first, with what the agent connects with. MLX's counters are bound first: the plugins and
    the logical class are the server's code."""
    counters = bind()
    settings = {name: os.environ.pop(name, "") for name in VARIABLES}
    errors: list[str] = []
    for plugin in filter(None, settings["KVMEM_AGENT_PLUGINS"].split(",")):
        try:
            importlib.import_module(plugin)
        except Exception as exc:  # reported to kvmem, which fails the run with it
            errors.append(f"plugin {plugin}: {type(exc).__name__}: {exc}")
    tracked = None
    if settings["KVMEM_AGENT_LOGICAL"]:
        try:
            tracked = Tracked(settings["KVMEM_AGENT_LOGICAL"], settings["KVMEM_AGENT_CAP"] or None)
        except Exception as exc:
            cap = f" with cap {settings['KVMEM_AGENT_CAP']}" if settings["KVMEM_AGENT_CAP"] else ""
            errors.append(f"logical {settings['KVMEM_AGENT_LOGICAL']}{cap}: "
                          f"{type(exc).__name__}: {exc}")
    agent = Agent(float(settings["KVMEM_AGENT_PERIOD"] or 0.1), tracked, counters)
    mx = None if counters is None else counters.mx
    version = None if mx is None else getattr(mx, "__version__", "unknown")
    connect(agent, settings, errors, version, follow)
    return agent


def connect(agent: Agent, settings: dict[str, str], errors: list[str], mlx: str | None,
            follow: Follow | None = None) -> None:
    """Quiesce the agent at exit, call `follow` where given, and connect in a daemon thread."""
    atexit.register(agent.quiesce)
    host, _, port = settings["KVMEM_AGENT"].rpartition(":")
    address, key = (host, int(port)), bytes.fromhex(settings["KVMEM_AGENT_KEY"])
    hello = {"hello": PROTOCOL, "pid": os.getpid(), "parent": os.getppid(),
             "argv": list(getattr(sys, "orig_argv", sys.argv)), "forked": False,
             "python": sys.version.split()[0], "errors": errors, "mlx": mlx}
    if follow is not None:
        follow(agent, address, key, hello)
    threading.Thread(target=agent.serve, args=(address, key, hello), name="kvmem-agent",
                     daemon=True).start()
