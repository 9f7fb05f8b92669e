"""Third-party stores through kvmem's adapters: `mlx_lm.LRUPromptCache` and `adapt.remaining`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from mlx_lm.models.cache import KVCache

from harness.cli import main
from harness.components.adapters import RemainingStore, store_stats
from harness.components.registry import remaining
from harness.run.probe import Probe, to_frame
from harness.run.synthetic_engine import SyntheticEngine

from .conftest import TOKEN_BYTES, make_spec, serve

# Request 1 shares request 0's 300-token head; request 2 is served twice.
WORKLOAD = {"prefill_chunk": 128, "requests": [
    {"prompt": 300, "decode": 4},
    {"prompt": 400, "decode": 4, "prefix": {"request": 0, "tokens": 300}},
    {"prompt": 200, "decode": 4, "repeat": 2},
]}
LRU = {"layer": {"component": "mlx_lm.KVCache"}, "store": {"component": "mlx_lm.LRUPromptCache"}}


def _served(cache: dict) -> tuple[dict | None, list[int]]:
    """The store's stats after the workload, and the tokens each fetch matched."""
    spec = make_spec(cache=cache, workload=WORKLOAD)
    probe = Probe()
    engine = SyntheticEngine(spec, probe)
    try:
        engine.serve()
        stats = engine.store_stats()
    finally:
        engine.close()
    frame = to_frame(probe.rows())
    return stats, frame.loc[frame["phase"] == "fetch", "tokens"].tolist()


def test_lru_prompt_cache_counts_hits_misses_and_matched_tokens():
    stats, matched = _served(LRU)
    # Request 0 and 2 miss. Request 1 finds request 0's entry (its 300 prompt tokens and 4
    # generated) as a longer match and gets it trimmed to the 300 shared tokens. The repeat of
    # request 2 finds request 2's entry; mlx-lm leaves one prompt token to prefill (199).
    assert matched == [0, 300, 0, 199]
    assert stats == {"entries": 3, "hits": 2, "misses": 2, "matched_tokens": 499}


def test_lru_prompt_cache_evicts_to_max_size():
    stats, matched = _served({**LRU, "store": {"component": "mlx_lm.LRUPromptCache",
                                               "options": {"max_size": 1}}})
    # One entry kept: each insert evicts the one before, after its successor has fetched it,
    # so the hits are the same and only the last entry is left.
    assert matched == [0, 300, 0, 199]
    assert stats == {"entries": 1, "hits": 2, "misses": 2, "matched_tokens": 499}


def test_lru_prompt_cache_clean_run_has_no_retained_or_leak():
    spec = make_spec(cache=LRU, workload=WORKLOAD)
    frame, findings, _ = serve(spec)
    kinds = {f.kind for f in findings}
    assert not kinds & {"retained", "leak", "host_memory"}, findings
    # At rest what the store reports is what the allocator holds beyond the baseline: its three
    # entries' KVCache buffers (mlx-lm grows them in steps of 256 slots): 304 and 404 tokens in
    # 512 slots each, 204 in 256.
    idle = frame[frame["phase"] == "idle"]
    baseline = int(idle["active"].iloc[0])
    for _, row in idle.iterrows():
        assert int(row["active"]) - baseline == int(row["logical"])
    assert int(idle.iloc[-1]["logical"]) == (512 + 512 + 256) * TOKEN_BYTES


def test_lru_prompt_cache_hit_is_copy_on_write():
    """mlx-lm returns a deep copy on a hit, and the copy's `nbytes` counts its whole buffer, but
    MLX's copy shares the stored buffer until the first write into it. So at the fetch step the
    components report one buffer more than the allocator holds (over-, never under-reporting),
    and the next prefill step allocates it."""
    frame, _, _ = serve(make_spec(cache=LRU, workload=WORKLOAD))
    baseline = int(frame["active"].iloc[0])
    fetch = frame.index[(frame["phase"] == "fetch") & (frame["request"] == 1)][0]
    reported = frame.loc[fetch, "logical"] - (frame.loc[fetch, "active"] - baseline)
    assert reported == 512 * TOKEN_BYTES  # request 0's entry, 512 slots, trimmed to 300 tokens
    grown = frame.loc[fetch + 1, "active"] - frame.loc[fetch, "active"]
    assert grown == 512 * TOKEN_BYTES  # the first prefill write gives the copy its own buffer


class RemainingFake:
    """A store in mlx-lm's shape: fetch gives `(cache, remaining_tokens)`."""

    def __init__(self, geometry, answer: str = "hit", keep: int = 3):
        self.answer, self.keep, self.stored = answer, keep, 0

    def fetch(self, tokens):
        if self.answer == "miss":
            return None, list(tokens)
        return [KVCache()], [0] * self.keep  # only its length counts

    def store(self, tokens, caches):
        self.stored += 1

    @property
    def nbytes(self) -> int:
        return 7

    @property
    def stats(self) -> dict:
        return {"stored": self.stored}


def test_remaining_adapter_converts_cache_and_remaining_tokens():
    geometry = make_spec(workload=WORKLOAD).geometry()
    store = remaining(geometry, store="tests.test_adapters:RemainingFake", keep=3)
    assert isinstance(store, RemainingStore)
    caches, matched = store.fetch(tuple(range(10)))
    assert caches is not None and len(caches) == 1 and matched == 7
    store.inner.keep = 0  # an exact hit: nothing left to prefill
    assert store.fetch(tuple(range(10)))[1] == 10
    miss = remaining(geometry, store="tests.test_adapters:RemainingFake", answer="miss")
    assert miss.fetch(tuple(range(10))) == (None, 0)
    store.store((1, 2), [])
    assert store.nbytes == 7 and store.host_bytes == 0
    assert store_stats(store) == {"stored": 1, "hits": 2, "misses": 0, "matched_tokens": 17}
    store.inner.keep = 11  # more remaining tokens than the prompt has
    with pytest.raises(ValueError, match="11 remaining tokens for a prompt of 10"):
        store.fetch(tuple(range(10)))


def test_store_stats_must_be_flat_numbers():
    class Odd:
        @property
        def stats(self) -> dict:
            return {"hits": "many"}

    with pytest.raises(TypeError, match=r"stats\['hits'\]: expected a number"):
        store_stats(Odd())
    assert store_stats(object()) is None


def _scenario(tmp_path: Path, store: dict) -> Path:
    path = tmp_path / "lru.yaml"
    path.write_text(yaml.safe_dump({
        "name": "lru", "model": {"dtype": "float16", "vocab": 1024, "layers": [
            {"count": 2, "kind": "full", "kv_heads": 2, "head_dim": 64}]},
        "cache": {"layer": {"component": "mlx_lm.KVCache"}, "store": store},
        "workload": WORKLOAD, "timeout": 300}))
    return path


def test_cli_run_writes_store_stats_and_show_prints_them(tmp_path, capsys):
    path = _scenario(tmp_path, {"component": "mlx_lm.LRUPromptCache"})
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 0
    summary = json.loads((out / "lru" / "default" / "summary.json").read_text())
    assert summary["store_stats"] == {"entries": 3, "hits": 2, "misses": 2,
                                      "matched_tokens": 499}
    capsys.readouterr()
    main(["show", str(out)])
    assert "store entries 3, hits 2, misses 2, matched_tokens 499" in capsys.readouterr().out


def test_bad_store_option_is_exit_2_naming_the_field(tmp_path, capsys):
    path = _scenario(tmp_path, {"component": "mlx_lm.LRUPromptCache",
                                "options": {"max_sise": 3}})
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cache.store.options" in err and "max_sise" in err, err
    assert not (tmp_path / "out" / "lru").exists()
