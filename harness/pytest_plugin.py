"""pytest integration: bound a test's MLX memory, in the style of pytest-memray's `limit_memory`.

    @pytest.mark.kv_limit(peak="64 MiB", final="1 MiB", leak_rate="0 B")
    def test_store_serves_requests(kv_probe):
        for request in requests:
            serve(store, request)
            kv_probe.checkpoint()          # a quiescent point: one request done

The test call is bracketed with the harness probe (synchronize, reset the peak, read active
before and after). The bounds are the metrics a summary records under the same names, those
whose registry entry says `pytest` (harness.judge.metrics.METRICS), in bytes above the active
memory when the call started:
- `peak`: the highest step peak during the call;
- `final`: active memory still held once the call has returned and garbage is collected
  (`retained` before summaries named it: still accepted, with a DeprecationWarning);
- `leak_rate`: bytes per checkpoint by which memory at rest keeps rising, as the harness's leak
  detector measures it (after `warmup` checkpoints; needs `warmup + 3` checkpoints).
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest

from harness.common.units import exact_bytes, format_bytes, parse_size

# A bound's name before it was the summaries' own, and the metric it bounds.
RENAMED = {"retained": "final"}


def bounds() -> list[str]:
    """The metrics `kv_limit` bounds, in the registry's order."""
    from harness.judge.metrics import METRICS

    return [name for name, metric in METRICS.items() if metric.pytest]


class KVProbe:
    """The harness probe around one test call; `checkpoint()` marks a quiescent point."""

    def __init__(self) -> None:
        from harness.run.probe import Probe

        self._probe = Probe(capacity=64)

    def _mark(self) -> None:
        self._probe.end(phase="idle", request=0, turn=-1, tokens=0, logical=0, host=0,
                        minimum=0, work=0)
        self._probe.begin()

    def start(self) -> None:
        self._probe.begin()
        self._mark()                            # the baseline the leak detector starts from

    def checkpoint(self) -> None:
        self._mark()

    def stop(self) -> None:
        gc.collect()
        self._mark()

    @property
    def checkpoints(self) -> int:
        return len(self._probe.rows()) - 2      # less the rows of the call's start and end

    def figures(self, warmup: int) -> dict[str, Any]:
        """Each bound's metric over the call: computed as a summary's are, from the rows of the
        call's start, its checkpoints and its end; the leak is fitted over the checkpoints (the
        start and the checkpoints), after `warmup` of them, with a floor of one byte."""
        from harness.judge.at_rest import LeakThresholds, leak
        from harness.judge.detectors import DetectSpec
        from harness.judge.metrics import METRICS, RunFacts, Samples
        from harness.run.environment import backend
        from harness.run.probe import to_frame

        rows = self._probe.rows()
        found = leak(to_frame(rows[:-1]), LeakThresholds(warmup=warmup, min_bytes=1), backend())
        samples = Samples(to_frame(rows), [found] if found else [], DetectSpec(),
                          RunFacts(0.0, 0))
        return {name: METRICS[name].compute(samples) for name in bounds()}


def _bytes(value: int) -> str:
    return f"{format_bytes(value)} ({exact_bytes(value)})"


def _bounds(marker: pytest.Mark) -> tuple[dict[str, int], int]:
    if marker.args:
        pytest.fail("kv_limit takes keyword bounds only, e.g. kv_limit(peak='64 MiB')", pytrace=False)
    options = dict(marker.kwargs)
    warmup = options.pop("warmup", 1)
    for old, new in RENAMED.items():
        if old in options:
            warnings.warn(f"kv_limit({old}=...) is now kv_limit({new}=...), the name summaries "
                          f"give the same figure", DeprecationWarning, stacklevel=1)
            options.setdefault(new, options.pop(old))
    known = bounds()
    unknown = sorted(set(options) - set(known))
    if unknown:
        pytest.fail(f"kv_limit: unknown bound {', '.join(unknown)} (expected "
                    f"{', '.join(known)} or warmup)", pytrace=False)
    parsed, errors = {}, []
    for name, value in options.items():
        try:
            parsed[name] = parse_size(value)
        except ValueError as exc:
            errors.append(f"kv_limit: {name}={value!r}: {exc}")
    if errors:
        pytest.fail("; ".join(errors), pytrace=False)
    return parsed, warmup


def _violations(probe: KVProbe, limits: dict[str, int], warmup: int) -> list[str]:
    if "leak_rate" in limits and probe.checkpoints < warmup + 3:
        return [f"leak_rate needs at least {warmup + 3} kv_probe.checkpoint() calls "
                f"(warmup {warmup}), got {probe.checkpoints}"]
    measured = probe.figures(warmup)
    return [f"{name} {_bytes(measured[name])}{' per checkpoint' if name == 'leak_rate' else ''}"
            f" > bound {_bytes(limit)}" for name, limit in limits.items() if measured[name] > limit]


@pytest.fixture
def kv_probe() -> KVProbe:
    """The probe bracketing this test's call; call `checkpoint()` after each request."""
    return KVProbe()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kv_limit(peak=None, final=None, leak_rate=None, warmup=1): fail the test "
        "when its MLX memory above the start exceeds a bound (sizes such as '64 MiB')")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    marker = item.get_closest_marker("kv_limit")
    if marker is None:
        return (yield)
    limits, warmup = _bounds(marker)
    probe = getattr(item, "funcargs", {}).get("kv_probe") or KVProbe()
    probe.start()
    result = yield
    probe.stop()
    failures = _violations(probe, limits, warmup)
    if failures:
        pytest.fail("kv_limit exceeded: " + "; ".join(failures), pytrace=False)
    return result
