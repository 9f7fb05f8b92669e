"""Tolerances: how far a gated metric may move before a comparison counts the change.

Active-byte metrics are exact on one backend, so their tolerance is a tiny floor; the step peak
varies run to run on CPU (an MLX worker thread frees inputs asynchronously), so peak and spike get
a floor that absorbs that noise and no more; RSS includes the interpreter and the allocator cache,
so it gets a generous one. A change counts only when it exceeds both the absolute floor and the
relative threshold. Each gated metric's defaults are its registry entry's (harness.judge.metrics).

Small scenarios. The 4 MiB floor of peak and spike is sized for the CPU noise of large
scenarios (up to ~2 MiB on hundreds of MiB), but on a 1.5 MiB scenario it hides a +3 MiB,
+199% change. That noise is a step's buffers freed late (a step input still alive when the next
step allocates), so it scales with what the scenario's steps allocate, never with a fixed
size. So the default floor of peak and spike scales with the scenario, its base peak P:

    floor = min(4 MiB, max(SMALL_LEAST, SMALL_FRACTION x P))        (256 KiB, 1/2)

- P >= 8 MiB: the 4 MiB it always was; large scenarios are judged exactly as before.
- 512 KiB < P < 8 MiB: P / 2. Doubling the scenario (+P) always counts. Noise stays under it:
  8 runs of each, two suites at once on 2 shared cores (load average 5), moved the peak by
  129 KiB on gate_trim (P 1.19-1.31 MiB: 11%), 253 KiB on a 2-layer cache (P 2.25-2.5 MiB:
  11%), 1.88 MiB on a 4-layer one (P 8.13-10 MiB: 23%), 0 B on import_path_leak (P 1.5 MiB):
  at most a quarter of P, half the floor. A late-freed step input is at most what the
  cache receiving it holds, so noise reaches P / 2 only where one step is half the scenario's
  memory (one prefill chunk into an empty cache): such a scenario records its spread
  (`baseline update --runs 5`), and a measured spread is never scaled down (below).
- P <= 512 KiB: SMALL_LEAST, so a few KiB of allocator rounding never fails; only a scenario
  under 256 KiB can double unseen.

The spike's floor scales with the scenario's peak too, not with the spike itself (its noise is
the peak's): a 16 KiB spike on a 432 MiB scenario keeps the 4 MiB floor. A floor that the
scenario (`expect.compare`) or the command line (`--abs`) sets is used as written.

Measured noise. A summary recorded over several runs (`kvmem noise`, `baseline update --runs
N`) carries the measured spread of peak and spike; their floor is then at least NOISE_MARGIN
times the base's spread, after the scaling above (a measured spread is never scaled down), so a
value measured once inside the recorded range never fails a pull request. A spread the head
reports is never used: it would let the head widen the tolerance that judges it.

Host memory. rss_peak counts past 15% of the base's own RSS and 8 MiB (it was 10% and 64 MiB:
a 24 MiB host copy on a 60.5 MiB process, +40%, passed). Measured on 2 shared cores, five runs
alone and three beside a second suite (canaries and mlx_lm_server at --jobs 2): rss_peak moved
by at most 0.28 MiB on the scratch scenario (gate_trim, 66.5-66.8 MiB), 0.16 MiB on
import_path_leak (66.4-66.6 MiB) and 0.5 MiB on mlx_lm_server/default (154.3-154.8 MiB), alike
under load. What moves it more is kvmem itself between two recordings: today's runs of unchanged
scenarios read 5.8-6.2 MiB (6-10%) over baselines recorded two days earlier in kvmem's own
process, and 8.7-13.6 MiB (6-11%) in mlx_lm_server's with the agent; the share and the floor
absorb that, and nothing a pull request adds of its own. host_rate, what at least half the
points at rest add outside MLX, read 0-28 KiB a request on those runs, 40 KiB at most on the
server: its 256 KiB tolerance (host_memory's min_rate) fails a store keeping 1 MiB a request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..common.echo import MAX_ECHO, clip, echo
from ..common.errors import BadInput
from ..common.units import KiB, parse_size
from ..judge.expect import ToleranceSpec
from ..judge.metrics import METRICS, gated
from ..judge.summary import Noise, Summary

# The spread of N runs is a lower bound of the noise's true range R, and base and head may each
# lie anywhere in R. For noise spread evenly over R, N runs span (N-1)/(N+1) of it on average:
# 2/3 for the default 5, so 1.5x the spread estimates R itself. (A rare value that no run hit
# is not covered by any margin: record with more runs.)
NOISE_MARGIN = 1.5
# The default floors of peak and spike scale down to this fraction of a small scenario's base
# peak, and no lower than SMALL_LEAST (see the module's docstring).
SMALL_FRACTION = 0.5
SMALL_LEAST = 256 * KiB

@dataclass(frozen=True)
class Tolerance:
    """A change counts when |delta| > abs and |delta| > rel * |base|.

    `least` is set on the default floors that scale with a small scenario (the lowest they go);
    `size` and `noise` say what set `abs` when it is not the configured floor: the base peak
    that scaled it down, or the measured spread that widened it.
    """

    rel: float
    abs: float
    noise: Noise | None = None
    least: float | None = None
    size: float | None = None

    def exceeded(self, base: float, delta: float) -> bool:
        return abs(delta) > self.abs and abs(delta) > self.rel * abs(base)

    def scaled(self, size: float | None) -> Tolerance:
        """This tolerance for a scenario whose base peak is `size`: a default floor lowered to
        SMALL_FRACTION x size (not below `least`) where that is less."""
        if self.least is None or size is None:
            return self
        floor = max(self.least, SMALL_FRACTION * abs(size))
        if floor >= self.abs:
            return self
        return replace(self, abs=floor, size=size)

    def widened(self, noise: Noise | None) -> Tolerance:
        """This tolerance with its floor raised to NOISE_MARGIN x the spread, where that is more."""
        if noise is None or NOISE_MARGIN * noise.spread <= self.abs:
            return self
        return replace(self, abs=NOISE_MARGIN * noise.spread, noise=noise, size=None)

    def configured(self, abs_: float) -> Tolerance:
        """This tolerance with a floor set by a scenario or a flag: used as written, never scaled."""
        return replace(self, abs=abs_, least=None)


def default_tolerances() -> dict[str, Tolerance]:
    """Each gated metric's tolerance from its registry entry (harness.metrics.METRICS); a floor
    that scales with the scenario goes no lower than SMALL_LEAST."""
    return {name: Tolerance(rel=metric.gate.rel, abs=metric.gate.abs,
                            least=SMALL_LEAST if metric.gate.scales else None)
            for name, metric in METRICS.items() if metric.gate is not None}


class CompareError(BadInput):
    """Bad input: an unreadable or malformed summary, or a bad option. Exit status 2."""


def size(value: int | str) -> int:
    """Bytes from an int or a string such as `4 MiB`, as in scenario files.

    Whatever parse_size raises is bad input here, overflow included (`1e400 GiB`, a 400-digit
    integer): never a traceback.
    """
    try:
        return parse_size(value)
    except (ValueError, OverflowError, TypeError) as exc:
        raise CompareError(f"{echo(value)}: {clip(str(exc))}") from None


def tolerances(summary: Summary, rel: dict[str, float] | None = None,
               abs_: dict[str, float] | None = None) -> dict[str, Tolerance]:
    """Defaults, then the `compare` block `summary` carries (its scenario's `expect.compare`),
    then command-line flags. The gate passes the BASE's summary: a head cannot loosen the
    tolerances that judge it."""
    result = default_tolerances()
    for name, stated in summary.compare.items():
        result[name] = _scenario_tolerance(result[name], stated)
    for name, value in (rel or {}).items():
        result[name] = replace(result[name], rel=value)
    for name, value in (abs_ or {}).items():
        result[name] = result[name].configured(value)
    return result


def _scenario_tolerance(current: Tolerance, stated: ToleranceSpec) -> Tolerance:
    result = current if stated.abs is None else current.configured(stated.abs)
    return result if stated.rel is None else replace(result, rel=stated.rel)


def fraction(value: str | float) -> float:
    """A relative threshold: a finite number of zero or more (`inf` would disable the gate)."""
    try:
        fraction = -1.0 if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        fraction = -1.0
    if not (math.isfinite(fraction) and fraction >= 0):
        raise CompareError(f"not a fraction: {echo(value)} (expected e.g. 0.05)")
    return fraction


def flags(rel: Sequence[str], abs_: Sequence[str]) -> tuple[dict[str, float], dict[str, float]]:
    """`--rel METRIC=X` and `--abs METRIC=SIZE` as the command line gave them, each checked as
    the scenario's would be."""
    def values(pairs: Sequence[str], flag: str,
               convert: Callable[[str], float]) -> dict[str, float]:
        parsed = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep or name not in gated():
                raise BadInput(f"{flag} {clip(pair, MAX_ECHO)}: expected METRIC=VALUE with "
                               f"METRIC among {', '.join(gated())}")
            parsed[name] = convert(value)
        return parsed

    return values(rel, "--rel", fraction), values(abs_, "--abs", size)
