"""Which variants run, and when: memory-aware admission for `--jobs`, and `--shard i/n`.

Admission: a variant's footprint estimate is computed in its own child (it may import user
components, which the parent never does), so the parent learns it before the child serves
(`harness.pipeline.isolation.execute` asks `Scheduler.admit`). A variant starts only when one of the
`jobs` is free and its estimate fits in the available memory minus the estimates of the
variants already serving; the memory the running ones use is then counted twice (once in what
is available, once in their estimates), which errs on the side of waiting. A variant that does
not fit while nothing else serves is refused, exactly as a lone run would refuse it. With more
than one job, one child more than `jobs` is started ahead: it imports and estimates while the
others serve, then waits ("queued") for a free job, so a finishing variant's successor starts
at once.

Sharding splits a suite without running anything: every variant's planned steps
(`planned_steps`) go greedily, longest first, to the lightest of n bins, ties
broken by scenario and variant name, so the same inputs always give the same split.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..scenario import ScenarioSpec, Variant, trace
from . import isolation

T = TypeVar("T")
RECHECK_S = 1.0  # a waiting variant looks at available memory again this often
POLL_S = 0.2  # how often the supervisor of parallel runs looks for an interrupt


@dataclass(frozen=True)
class Entry:
    """One admission decision or release, for the log a test (or a curious user) reads."""

    at: float  # time.monotonic()
    event: str  # start | end | refuse | wait
    index: int
    label: str
    estimate: int
    available: int | None


class Scheduler:
    """Admits up to `jobs` serving variants by their estimates; thread-safe, one per suite run."""

    def __init__(self, jobs: int = 1, available: Callable[[], int] | None = None):
        self.jobs = jobs
        # Looked up at run time, so `isolation.available_memory` can be patched by tests.
        self._available = available or (lambda: isolation.available_memory())
        self._serving: dict[int, int] = {}
        self._changed = threading.Condition()
        self._cancelled = False
        self.log: list[Entry] = []

    def admit(self, index: int, label: str, estimate: int,
              on_wait: Callable[[str], None] | None = None) -> str | None:
        """Block until a job is free and the variant fits beside those serving: None, or the
        refusal message when it cannot fit alone. `on_wait` hears why it waits, when that
        changes ("queued": every job is taken; "waiting for memory")."""
        with self._changed:
            reason = None
            while not self._cancelled:
                if len(self._serving) < self.jobs:
                    available = self._available()
                    if estimate <= available - sum(self._serving.values()):
                        self._serving[index] = estimate
                        self._note("start", index, label, estimate, available)
                        return None
                    if not self._serving:
                        self._note("refuse", index, label, estimate, available)
                        return isolation.refusal(estimate, available)
                    now = "waiting for memory"
                else:
                    now = "queued"
                if now != reason:
                    reason = now
                    if reason != "queued":
                        self._note("wait", index, label, estimate, available)
                    if on_wait is not None:
                        on_wait(reason)
                self._changed.wait(RECHECK_S)
            return "interrupted before it started"

    def release(self, index: int, label: str) -> None:
        """The variant's process has ended (or never served): its estimate is free again."""
        with self._changed:
            estimate = self._serving.pop(index, None)
            if estimate is not None:
                self._note("end", index, label, estimate, None)
            self._changed.notify_all()

    def cancel(self) -> None:
        """Refuse every waiting and later variant (the suite was interrupted)."""
        with self._changed:
            self._cancelled = True
            self._changed.notify_all()

    def _note(self, event: str, index: int, label: str, estimate: int,
              available: int | None) -> None:
        self.log.append(Entry(time.monotonic(), event, index, label, estimate, available))


def in_parallel(count: int, jobs: int, run: Callable[[int, threading.Event], T],
                on_stop: Callable[[], None],
                stop: threading.Event | None = None) -> Iterator[tuple[int, T]]:
    """(index, run(index, stop)) for indices 0..count-1, `jobs` at a time, as they finish.

    Each run supervises one child from a worker thread. Once `stop` is set (an interrupt's
    handler sets it), `on_stop` is called so no waiting variant starts, every worker stops its
    child, and their runs are still yielded as they end. When the consumer stops early (an
    error), `stop` is set too, and this returns only once every child has ended.
    """
    stop = threading.Event() if stop is None else stop
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="kvmem-variant")
    futures: dict[Future[T], int] = {pool.submit(run, index, stop): index for index in range(count)}
    pending = set(futures)
    stopping = False
    try:
        while pending:
            done, pending = wait(pending, POLL_S, return_when=FIRST_COMPLETED)
            if stop.is_set() and not stopping:
                stopping = True
                on_stop()
            for future in sorted(done, key=futures.__getitem__):
                yield futures[future], future.result()
    finally:
        if pending:
            stop.set()
            on_stop()
        pool.shutdown(wait=True, cancel_futures=True)


def planned_steps(spec: ScenarioSpec) -> int:
    """Steps the workload takes with no prefix hit and no eviction: the progress bar's estimate
    (requests, for a server)."""
    workload = spec.workload
    chunk = workload.prefill_chunk
    if workload.http is not None:  # a server's progress counts requests (a pass of them)
        http = workload.http
        if http.trace is not None:
            return len(trace.read(Path(http.trace)))
        return min(http.requests(), http.max_requests or http.requests())
    if workload.chat is not None:
        chat = workload.chat
        return chat.turns * (math.ceil(chat.user / chunk) + chat.model + 1) + 1
    extra = 3 if spec.cache.store is not None else 1  # fetch, store, idle
    return 1 + sum(
        r.repeat * (math.ceil(r.prompt / chunk) + r.decode + extra) for r in workload.requests or []
    )


def shards(variants: list[Variant], count: int) -> list[list[int]]:
    """Indices of `variants` in each of `count` bins, each bin in suite order.

    Longest first (by planned steps) into the bin with the fewest steps so far (the lowest
    bin on a tie); equal steps go by scenario, variant name, then position.
    """
    steps = [planned_steps(v.spec) for v in variants]
    order = sorted(range(len(variants)),
                   key=lambda i: (-steps[i], variants[i].scenario, variants[i].name, i))
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in order:
        lightest = min(range(count), key=lambda b: (loads[b], b))
        bins[lightest].append(i)
        loads[lightest] += steps[i]
    return [sorted(b) for b in bins]


def shard(variants: list[Variant], index: int, count: int) -> list[Variant]:
    """Shard `index` (1-based) of `count`: its variants, in suite order."""
    return [variants[i] for i in shards(variants, count)[index - 1]]
