"""Chat session: rolling eviction keeps the history under the threshold; top-k keeps k*8 bytes
per step where full logits keep vocab*4."""

from __future__ import annotations

import mlx.core as mx
import pytest

from harness.models.geometry import build
from reference_impl.chat import ChatSession
from tests.conftest import active

VOCAB = 4096
GEOMETRY = build([{"count": 1, "kind": "full", "kv_heads": 2, "head_dim": 64}],
                 dtype="float16", vocab=VOCAB)


pytestmark = pytest.mark.usefixtures("exact_allocator")


def logits(step: int, batch: int = 1) -> mx.array:
    out = mx.random.normal((batch, VOCAB), key=mx.random.key(step))
    mx.eval(out)
    return out


def test_no_threshold_never_evicts():
    assert ChatSession(GEOMETRY).evict([10_000] * 50) == 0


def test_rolling_threshold_drops_the_oldest_turns_until_under_it():
    session = ChatSession(GEOMETRY, rolling_threshold=1000)
    assert session.evict([300, 300, 300]) == 0          # 900: under
    assert session.evict([300] * 5) == 2                # 1500 -> 900
    turns = []
    for _ in range(20):
        turns.append(192)
        turns = turns[session.evict(turns):]
        assert sum(turns) <= 1000
    assert sum(turns) == 5 * 192
    assert session.evict([5000]) == 0                   # the newest turn always stays


@pytest.mark.parametrize("batch", [1, 2])
def test_full_logits_keep_vocab_times_4_bytes_per_step(batch):
    session = ChatSession(GEOMETRY, logits="full")
    base = active()
    for step in range(5):
        session.keep_logits(logits(step, batch))
    assert session.nbytes == 5 * batch * VOCAB * 4
    assert active() - base == session.nbytes
    session.start_turn()
    assert session.nbytes == 0 and active() == base


@pytest.mark.parametrize("batch", [1, 2])
def test_top_k_keeps_k_times_8_bytes_per_step(batch):
    session = ChatSession(GEOMETRY, logits="top_k", k=16)
    base = active()
    for step in range(5):
        full = logits(step, batch)
        session.keep_logits(full)
        del full  # the vocabulary-wide logits must die with the step
    assert session.nbytes == 5 * batch * 16 * 8
    assert active() - base == session.nbytes
    values, indices = session.kept[-2:]
    assert indices.dtype == mx.int32 and values.shape == (batch, 16)
    expected = mx.sort(logits(4, batch), axis=-1)[:, -16:]
    assert mx.array_equal(mx.sort(values, axis=-1), expected)
    del values, indices, expected
    session.start_turn()
    assert active() == base


def test_rejects_bad_options():
    with pytest.raises(ValueError, match="logits"):
        ChatSession(GEOMETRY, logits="some")
    with pytest.raises(ValueError, match="k must"):
        ChatSession(GEOMETRY, logits="top_k", k=VOCAB + 1)
    with pytest.raises(ValueError, match="rolling_threshold"):
        ChatSession(GEOMETRY, rolling_threshold=0)
