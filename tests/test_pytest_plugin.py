"""The kv_limit marker, run inside pytester sessions that load the plugin from its entry point."""

from __future__ import annotations

import importlib.metadata

import mlx_lm.models.cache  # noqa: F401

# Imported here so that each in-process pytester session finds them loaded (it drops modules
# first imported inside it).

pytest_plugins = ["pytester"]

CACHE_TESTS = """
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

kept = []

def fill():
    cache = KVCache()
    keys = mx.ones((1, 2, 1, 64), dtype=mx.float16)
    cache.update_and_fetch(keys, keys)
    mx.eval(cache.keys, cache.values)
    return cache

@pytest.mark.kv_limit(final="64 KiB")
def test_keeps_a_cache():
    kept.append(fill())

@pytest.mark.kv_limit(final="0 B")
def test_releases_its_cache():
    fill()

@pytest.mark.kv_limit(peak="{bound}", final="0 B")
def test_transient_4():
    scratch = mx.zeros((2 * 1024 * 1024,), dtype=mx.float32)      # 8 MiB, then released
    mx.eval(scratch)

@pytest.mark.kv_limit(peak="9 MiB", final="0 B")
def test_transient_9():
    scratch = mx.zeros((2 * 1024 * 1024,), dtype=mx.float32)
    mx.eval(scratch)
"""

LEAK_TESTS = """
import mlx.core as mx
import pytest

store = []

def serve(requests, probe, release):
    for request in range(requests):
        store.append(mx.zeros((16384,), dtype=mx.float32))            # 64 KiB per request
        mx.eval(store[-1])
        if release:
            store.clear()
        probe.checkpoint()

@pytest.mark.kv_limit(leak_rate="0 B")
def test_leaks(kv_probe):
    serve(6, kv_probe, release=False)

@pytest.mark.kv_limit(leak_rate="0 B")
def test_releases(kv_probe):
    serve(6, kv_probe, release=True)

@pytest.mark.kv_limit(leak_rate="64 KiB")
def test_leaks_within_bound(kv_probe):
    serve(6, kv_probe, release=False)

@pytest.mark.kv_limit(leak_rate="0 B")
def test_too_few_checkpoints(kv_probe):
    serve(3, kv_probe, release=True)

@pytest.mark.kv_limit(peak="lots")
def test_bad_size():
    pass

@pytest.mark.kv_limit(steady="1 MiB")
def test_unknown_bound():
    pass
"""


def session(pytester, source: str) -> dict[str, str]:
    """Each inner test's failure line ('' when it passed)."""
    pytester.makepyfile(source)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA", "-vv")
    assert "Traceback" not in result.stdout.str()
    assert "another exception occurred" not in result.stdout.str()
    lines = {}
    for line in result.stdout.lines:
        for state in ("PASSED", "FAILED"):
            if line.startswith(state + " "):
                name = line.split("::")[1].split()[0]
                lines[name] = line.partition(" - Failed: ")[2] if state == "FAILED" else ""
    return lines


def test_registered_as_a_pytest11_entry_point():
    points = importlib.metadata.entry_points(group="pytest11")
    assert [p.value for p in points if p.name == "kvmem"] == ["harness.pytest_plugin"]


def test_cache_final_and_transient_peak(pytester):
    assert session(pytester, CACHE_TESTS.format(bound="4 MiB")) == {
        # One KVCache step allocates 256 slots for K and V: 2 x 256 x 2 heads x 64 x 2 B.
        "test_keeps_a_cache":
            "kv_limit exceeded: final 128 KiB (131,072 B) > bound 64 KiB (65,536 B)",
        "test_releases_its_cache": "",
        # The 8 MiB buffer and the 4-byte scalar it is filled from.
        "test_transient_4":
            "kv_limit exceeded: peak 8 MiB (8,388,612 B) > bound 4 MiB (4,194,304 B)",
        "test_transient_9": "",
    }


def test_leak_rate_and_bad_bounds(pytester):
    assert session(pytester, LEAK_TESTS) == {
        "test_leaks": "kv_limit exceeded: leak_rate 64 KiB (65,536 B) per checkpoint > "
                      "bound 0 B (0 B)",
        "test_releases": "",
        "test_leaks_within_bound": "",
        "test_too_few_checkpoints": "kv_limit exceeded: leak_rate needs at least 4 "
                                    "kv_probe.checkpoint() calls (warmup 1), got 3",
        "test_bad_size": "kv_limit: peak='lots': expected a size in bytes, such as 4096 or "
                         "'512 MiB'",
        "test_unknown_bound": "kv_limit: unknown bound steady (expected peak, final, "
                              "leak_rate or warmup)",
    }


RENAMED_TESTS = """
import mlx.core as mx
import pytest

kept = []

@pytest.mark.kv_limit(retained="1 KiB")
def test_keeps_8_kib():
    kept.append(mx.zeros((2048,), dtype=mx.float32))
    mx.eval(kept[-1])
"""


def test_retained_is_the_old_name_of_final_and_says_so(pytester):
    """The bound summaries call `final` was `retained` here: it still bounds the same figure,
    with a DeprecationWarning naming the new name."""
    pytester.makepyfile(RENAMED_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(failed=1, warnings=1)
    result.stdout.fnmatch_lines(["*kv_limit exceeded: final 8 KiB (8,192 B) > bound 1 KiB*",
                                 "*kv_limit(retained=...) is now kv_limit(final=...)*"])


def test_the_bounds_are_the_metrics_registered_for_pytest(monkeypatch):
    """A metric whose registry entry says `pytest` is a bound, computed as summaries compute it."""
    from harness.judge.metrics import METRICS, Metric
    from harness.pytest_plugin import KVProbe, bounds

    monkeypatch.setitem(METRICS, "rows", Metric(lambda s: len(s.rows), pytest=True))
    assert bounds() == ["peak", "final", "leak_rate", "rows"]
    probe = KVProbe()
    probe.start()
    probe.checkpoint()
    probe.stop()
    assert probe.figures(warmup=1)["rows"] == 3
