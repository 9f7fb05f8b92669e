"""Per-step memory probe: MLX counters and process RSS, in compact columns.

The MLX counters cost well under a microsecond each; what a step pays is the synchronize that
makes them exact (tens of microseconds, a round trip to MLX's worker thread) and the RSS read.
Rows go into a numpy structured array (`harness.run.rows`: under 120 bytes a row, in memory or
spilled to a spool file as they come, so a soak's memory stays flat) and become a DataFrame only
at the end.

`cyclic` is nonzero only at idle points: the MLX bytes that only Python's cycle collector would
free there (`at_rest`), memory that unreachable reference cycles hold until it runs; there too
the holders of the live arrays are walked (`at_rest`'s census: the rows' `buffers` and
`arrays`, and the holder log, holders.csv).
`time` is seconds since the probe began; a server's rows (`add`, from its agent) count from the
run's baseline sample.

MLX's functions are bound when this module is imported, which in a variant's process is before
any component (`harness.pipeline.isolation` imports it as the child starts), and read through those
references: a component that replaces `mx.get_active_memory` changes no reading, and the next
step fails the run naming what replaced it (`CounterReplaced`).

In a variant's process `Probe.guard` goes further before the variant's code is imported: a call
of `mx.reset_peak_memory` by that code first folds the peak so far into kvmem's own mark for the
step (`PeakMark`, counted in `resets`), so no reset lowers a spike; and the probe's bindings are
sealed (`harness.run.seal`), so code that rebinds one (`BOUND.active`, a method of the probe,
`Rows.append`) fails the run at the next step's end, or before the run is accepted.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

# The readers the in-server agent uses too, so both measure alike.
from ..agent.kvmem_agent import COUNTERS, Counters, current_rss
from ..agent.kvmem_rest import Rest, at_rest
from ..agent.kvmem_sample import PHASES, Sample
from ..common.errors import KvmemError
from .holders_log import HOLDERS_SPOOL, HolderLog
from .rows import BLOCK, Rows
from .seal import seal

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["REQUEST", "ROW", "CounterReplaced", "NullProbe", "PeakMark", "Probe",
           "Sample", "current_rss", "to_frame", "walked"]

BOUND = Counters(mx, (*COUNTERS, "synchronize"))
_synchronize = BOUND.bound["synchronize"]


# A sample's columns (less `entries`), the step's index and its own columns: `host` (bytes the
# components hold outside MLX), `minimum` (the analytic bytes of the tokens held) and `work`
# (the step's own input), in the order of samples.csv. `buffers` and `arrays` are counted where
# the holders were walked (at rest), -1 elsewhere.
ROW = np.dtype([
    ("step", np.int32), ("phase", np.uint8), ("request", np.int32), ("turn", np.int32),
    ("tokens", np.int64), ("active", np.int64), ("peak", np.int64), ("cache", np.int64),
    ("rss", np.int64), ("logical", np.int64), ("host", np.int64), ("minimum", np.int64),
    ("work", np.int64), ("cyclic", np.int64), ("time", np.float32), ("cap", np.int64),
    ("buffers", np.int32), ("arrays", np.int32),
])
COLUMNS: tuple[str, ...] = ROW.names or ()  # a structured dtype's names: never None
# The step's own columns, appended to a sample's fields; `phase` is the sample's, as an index.
OWN = ("step", "phase", "host", "minimum", "work")
# A row's values picked by name once, here, not per step: `add` runs on every step.
_PICK = itemgetter(*(len(Sample._fields) + OWN.index(name) if name in OWN
                     else Sample._fields.index(name) for name in COLUMNS))


# One request a server was sent (serve mode): when it was sent, when its first streamed token
# came (NaN unstreamed), when it ended, on the samples' clock; its tokens, and whether the
# client disconnected on purpose.
REQUEST = np.dtype([
    ("request", np.int32), ("sent", np.float64), ("first", np.float64), ("done", np.float64),
    ("prompt_tokens", np.int32), ("completion_tokens", np.int32), ("disconnected", np.uint8),
])
SAMPLES_SPOOL, REQUESTS_SPOOL = "samples.rows", "requests.rows"


def walked(point: int, last: bool = False) -> bool:
    """Whether the holders are walked at the run's `point`-th point at rest (0: the baseline):
    the baseline, each power of two and the last (where the caller knows it is). A walk costs
    about a microsecond per live Python object, a tenth of a second in a process that imported
    mlx-lm; so spaced, a soak of 10,000 points at rest walks 15 times and still sees how the
    holders grew from the first point to the latest (docs/holders.md)."""
    return last or point & (point - 1) == 0


def imported() -> frozenset[str]:
    """The modules imported so far and the packages they belong to."""
    names = list(sys.modules)
    return frozenset(names) | {name.partition(".")[0] for name in names}


class CounterReplaced(KvmemError, RuntimeError):
    """The code under test replaced a function kvmem reads MLX's memory with; the message
    names which, and with what."""


class PeakMark:
    """kvmem's high-water mark of MLX's peak within a step, kept across the measured code's
    resets.

    `mx.reset_peak_memory` sets MLX's peak to zero, so code that calls it mid-step (code that
    measures itself does, so it cannot be forbidden) would erase a spike it had freed. Put in
    its place (`Probe.guard`), a reset first waits for the queued work (the default stream and
    the probe's watched ones), folds the peak so far into `mark` and counts itself in
    `resets`, then resets MLX's counter.
    """

    def __init__(self, streams: list[mx.Stream | mx.ThreadLocalStream]) -> None:
        self._streams = streams
        self.mark = 0
        self.resets = 0

    def __call__(self) -> None:
        for stream in self._streams:
            _synchronize(stream)
        _synchronize()
        self.mark = max(self.mark, BOUND.peak())
        self.resets += 1
        BOUND.reset_peak()


class Probe:
    """Brackets each step: `begin()` before the work, `end(...)` after it.

    The step peak is max(peak since reset, the mark of resets the measured code made,
    active before, active after), because `reset_peak_memory` sets the counter to zero rather
    than to the active bytes.
    `end` synchronizes the default stream and every stream given to `watch` (a real model's
    generation stream, where work is still queued when a decode step yields its token).
    """

    def __init__(self, capacity: int = BLOCK, spool: Path | None = None,
                 own_modules: Collection[str] | None = None):
        self._rows = Rows(ROW, capacity, spool and spool / SAMPLES_SPOOL)
        # Whose globals a walk takes for no roots: kvmem's, the modules (and their packages)
        # imported before the probe, which comes before the variant's code (`imported`).
        self.own_modules = imported() if own_modules is None else own_modules
        self._requests = Rows(REQUEST, BLOCK, spool and spool / REQUESTS_SPOOL)
        self.holders = HolderLog(spool and spool / HOLDERS_SPOOL)
        self._before = 0
        self._streams: list[mx.Stream | mx.ThreadLocalStream] = []
        self._mark = PeakMark(self._streams)
        self._sealed: Callable[[], str | None] | None = None
        self._start = time.perf_counter()

    def guard(self) -> Callable[[], str | None]:
        """In a variant's process, before its code is imported: put the step's high-water mark
        in place of `mx.reset_peak_memory` (where the probe's counters now expect it) and seal
        the probe's bindings. `verify` checks the seal at each step; the check is returned too,
        for the caller to keep where the measured code does not look."""
        BOUND.mx.reset_peak_memory = self._mark
        BOUND.bound["reset_peak_memory"] = self._mark
        self._sealed = seal(self._bindings())
        return self._sealed

    def _bindings(self) -> dict[str, Callable[[], Any]]:
        """Each binding a reading goes through, by name, with a function reading it now."""
        module, counters, own = vars(sys.modules[__name__]), vars(BOUND), vars(self)
        readers: dict[str, Callable[[], Any]] = {
            f"{__name__}.{name}": partial(module.__getitem__, name)
            for name in ("BOUND", "_synchronize", "current_rss")}
        readers |= {f"BOUND.{name}": partial(counters.__getitem__, name) for name in counters}
        readers |= {f"BOUND.bound[{name!r}]": partial(BOUND.bound.__getitem__, name)
                    for name in BOUND.bound}
        for kind in {Probe, PeakMark, Rows, Counters, type(self)}:
            space = vars(kind)
            readers |= {f"{kind.__qualname__}.{name}": partial(space.__getitem__, name)
                        for name, value in space.items()
                        if callable(value) or isinstance(value, property)}
        readers |= {f"the probe's {name}": partial(own.__getitem__, name)
                    for name in ("_rows", "_requests", "holders", "_mark", "_streams")}
        return readers

    @property
    def resets(self) -> int:
        """How many times the measured code reset MLX's peak (counted once `guard`ed)."""
        return self._mark.resets

    def watch(self, stream: mx.Stream | mx.ThreadLocalStream) -> None:
        """Synchronize `stream` too before each reading."""
        self._streams.append(stream)

    def begin(self) -> None:
        # The previous step ended synchronized and only Python ran since (frees are immediate),
        # so active is exact here without a second synchronize, which costs ~10 us on CPU.
        self._before = BOUND.active()
        self._mark.mark = 0
        BOUND.reset_peak()

    def end(self, *, phase: str, request: int, turn: int, tokens: int, logical: int, host: int,
            minimum: int, work: int, cyclic: int = 0, census: Any = None) -> None:
        """End the step with its row; `census` (at rest: `kvmem_holders.Census`), the holders
        walked before it, whose groups go to the holder log under this row's step."""
        for stream in self._streams:
            _synchronize(stream)
        _synchronize()
        active = BOUND.active()
        peak = max(BOUND.peak(), self._mark.mark, self._before, active)
        self.add(Sample(time=time.perf_counter() - self._start, phase=phase, request=request,
                        turn=turn, tokens=tokens, active=active, peak=peak,
                        cache=BOUND.cache(), rss=current_rss(), logical=logical,
                        entries=0, cyclic=cyclic, cap=0,
                        buffers=-1 if census is None else census.buffers,
                        arrays=-1 if census is None else census.arrays),
                 host=host, minimum=minimum, work=work)
        if census is not None:
            self.holders.add(self.steps - 1, request, turn, census.groups, census.approximate,
                             census.objects, census.seconds)
        self.verify()

    def rest(self, cycles: bool, holders: bool, skip_frame: Any) -> Rest:
        """Measure a point at rest (`kvmem_rest.at_rest`), kvmem's own modules' globals no
        roots of the walk."""
        return at_rest(cycles, holders, skip_frame=skip_frame, skip_modules=self.own_modules)

    def verify(self) -> None:
        """Raise CounterReplaced if the code under test has replaced one of MLX's functions
        this probe reads, or rebound one of the probe's own once `guard`ed (a check of a few
        identities, at each step and at the end)."""
        problem = (self._sealed and self._sealed()) or BOUND.replaced("the variant's process")
        if problem:
            raise CounterReplaced(problem)

    def add(self, sample: Sample, *, host: int = 0, minimum: int = 0, work: int = 0) -> None:
        """Append one sample with the step's own columns (a server's agent takes its samples
        elsewhere; `end` takes its own)."""
        self._rows.append(_PICK((*sample, len(self._rows), PHASES.index(sample.phase), host,
                                 minimum, work)))

    def request(self, index: int, sent: float, first: float | None, done: float,
                prompt_tokens: int, completion_tokens: int, disconnected: bool) -> None:
        """Record one request a server was sent (times on the samples' clock)."""
        self._requests.append((index, sent, np.nan if first is None else first, done,
                               prompt_tokens, completion_tokens, disconnected))

    @property
    def steps(self) -> int:
        return len(self._rows)

    def last(self) -> np.void | None:
        """The latest row, or None before the first."""
        return self._rows.last()

    def rows(self) -> np.ndarray:
        return self._rows.all()

    def requests(self) -> np.ndarray:
        return self._requests.all()

    def spill(self) -> None:
        """Write what the spool files have not yet got (a server's run does at each sample at
        rest, so a variant killed later still reports up to there)."""
        self._rows.spill()
        self._requests.spill()

    def close(self) -> None:
        """Write out what the spool files have not yet got."""
        self._rows.close()
        self._requests.close()
        self.holders.close()


class NullProbe(Probe):
    """The same loop with the measurement left out: the benchmark's reference."""

    _skipped = 0

    def begin(self) -> None:
        pass

    def end(self, *args, **kwargs) -> None:
        self._skipped += 1

    @property
    def steps(self) -> int:
        return self._skipped


def to_frame(rows: np.ndarray) -> pd.DataFrame:
    """Samples as a DataFrame with the phase spelled out (in the parent: pandas is imported
    here so that a variant's child, which never needs it, starts 0.3 s sooner)."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    frame["phase"] = pd.Categorical.from_codes(frame["phase"], categories=PHASES)
    return frame
