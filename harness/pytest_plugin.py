"""pytest integration: bound a test's MLX memory, in the style of pytest-memray's `limit_memory`.

    @pytest.mark.kv_limit(peak="64 MiB", retained="1 MiB", leak_rate="0 B")
    def test_store_serves_requests(kv_probe):
        for request in requests:
            serve(store, request)
            kv_probe.checkpoint()          # a quiescent point: one request done

The test call is bracketed with the harness probe (synchronize, reset the peak, read active
before and after). Bounds are bytes above the active memory when the call started:
- `peak`: the highest step peak during the call;
- `retained`: active memory still held once the call has returned and garbage is collected;
- `leak_rate`: bytes per checkpoint by which memory at rest keeps rising, as the harness's leak
  detector measures it (after `warmup` checkpoints; needs `warmup + 3` checkpoints).
"""

from __future__ import annotations

import gc

import pytest

from harness.common.units import format_bytes, parse_size

BOUNDS = ("peak", "retained", "leak_rate")


class KVProbe:
    """The harness probe around one test call; `checkpoint()` marks a quiescent point."""

    def __init__(self) -> None:
        from harness.run.probe import Probe

        self._probe = Probe(capacity=64)
        self.before = 0

    def _mark(self) -> None:
        self._probe.end("idle", request=0, turn=-1, tokens=0, logical=0, host=0, minimum=0, work=0)
        self._probe.begin()

    def start(self) -> None:
        self._probe.begin()
        self._mark()                            # the baseline the leak detector starts from
        self.before = int(self._probe.rows()["active"][0])

    def checkpoint(self) -> None:
        self._mark()

    def stop(self) -> None:
        gc.collect()
        self._mark()

    @property
    def peak(self) -> int:
        return int(self._probe.rows()["peak"].max()) - self.before

    @property
    def retained(self) -> int:
        return int(self._probe.rows()["active"][-1]) - self.before

    @property
    def checkpoints(self) -> int:
        return len(self._probe.rows()) - 2      # less the rows of the call's start and end

    def leak_rate(self, warmup: int) -> int:
        """Bytes per checkpoint, or 0 when memory at rest does not keep rising."""
        from harness.judge.detectors import LeakThresholds, leak
        from harness.run.environment import backend
        from harness.run.probe import to_frame

        at_rest = to_frame(self._probe.rows()[:-1])      # the start and the checkpoints
        found = leak(at_rest, LeakThresholds(warmup=warmup, min_bytes=1), backend())
        return found.bytes if found else 0


def _bytes(value: int) -> str:
    return f"{format_bytes(value)} ({value:,} B)"


def _bounds(marker: pytest.Mark) -> tuple[dict[str, int], int]:
    if marker.args:
        pytest.fail("kv_limit takes keyword bounds only, e.g. kv_limit(peak='64 MiB')", pytrace=False)
    options = dict(marker.kwargs)
    warmup = options.pop("warmup", 1)
    unknown = sorted(set(options) - set(BOUNDS))
    if unknown:
        pytest.fail(f"kv_limit: unknown bound {', '.join(unknown)} (expected "
                    f"{', '.join(BOUNDS)} or warmup)", pytrace=False)
    bounds, errors = {}, []
    for name, value in options.items():
        try:
            bounds[name] = parse_size(value)
        except ValueError as exc:
            errors.append(f"kv_limit: {name}={value!r}: {exc}")
    if errors:
        pytest.fail("; ".join(errors), pytrace=False)
    return bounds, warmup


def _violations(probe: KVProbe, bounds: dict[str, int], warmup: int) -> list[str]:
    measured = {"peak": probe.peak, "retained": probe.retained}
    if "leak_rate" in bounds:
        if probe.checkpoints < warmup + 3:
            return [f"leak_rate needs at least {warmup + 3} kv_probe.checkpoint() calls "
                    f"(warmup {warmup}), got {probe.checkpoints}"]
        measured["leak_rate"] = probe.leak_rate(warmup)
    return [f"{name} {_bytes(measured[name])}{' per checkpoint' if name == 'leak_rate' else ''}"
            f" > bound {_bytes(limit)}" for name, limit in bounds.items() if measured[name] > limit]


@pytest.fixture
def kv_probe() -> KVProbe:
    """The probe bracketing this test's call; call `checkpoint()` after each request."""
    return KVProbe()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kv_limit(peak=None, retained=None, leak_rate=None, warmup=1): fail the test "
        "when its MLX memory above the start exceeds a bound (sizes such as '64 MiB')")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    marker = item.get_closest_marker("kv_limit")
    if marker is None:
        return (yield)
    bounds, warmup = _bounds(marker)
    probe = getattr(item, "funcargs", {}).get("kv_probe") or KVProbe()
    probe.start()
    result = yield
    probe.stop()
    failures = _violations(probe, bounds, warmup)
    if failures:
        pytest.fail("kv_limit exceeded: " + "; ".join(failures), pytrace=False)
    return result
