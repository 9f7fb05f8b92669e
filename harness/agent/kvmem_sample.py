"""The sample row, defined once: what one reading of a process's memory holds, and the phases a
row may name. Below both the agent, which takes samples in a server, and kvmem's probe and
judge, which take and read them in kvmem's own processes.

The standard library alone, as the agent is: it sits beside `kvmem_agent` on a server's
PYTHONPATH (`kvmem_sample` there, `harness.agent.kvmem_sample` in kvmem).
"""

from __future__ import annotations

from typing import NamedTuple

# What a sample's process was doing: a step of kvmem's own loop (at rest, a prefill chunk, a
# decode step, a store's fetch, store or eviction), or in a server a request boundary ("request")
# and the samples taken on the period ("serve"). While a server's requests are in flight, its
# logical size is what it stores, not its requests' working memory: those rows are judged at
# rest only.
PHASES = ("idle", "prefill", "decode", "fetch", "store", "evict", "request", "serve")
IN_FLIGHT = ("request", "serve")


class Sample(NamedTuple):
    """One reading of a process's memory, as the agent takes it in a server and kvmem's probe
    in its own process (harness.run.probe adds each step's own columns). The agent sends its
    samples as plain tuples, read back with `Sample._make`: this module is `kvmem_sample` in a
    server and `harness.agent.kvmem_sample` in kvmem, so an instance would not unpickle."""

    time: float   # seconds: the agent's `time.monotonic()`, the probe's since it began
    phase: str
    request: int
    turn: int
    tokens: int
    active: int   # MLX's active bytes
    peak: int     # MLX's highest active bytes since the previous sample
    cache: int    # MLX's buffer cache
    rss: int
    logical: int  # what the components (a server: `KVMEM_AGENT_LOGICAL`) say they hold
    entries: int  # how many entries they hold (a server's; 0 in kvmem's own process)
    cyclic: int   # MLX bytes only unreachable reference cycles hold (at rest, when asked)
    cap: int      # the bytes the components allow themselves (a server's cache's own cap), or 0
    buffers: int = -1  # live unique MLX buffers, graphs' pending inputs too (at rest, when walked)
    arrays: int = -1   # live MLX arrays (at rest, when walked); -1: not measured
