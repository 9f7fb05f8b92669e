"""The mlx_lm engine: a real mlx-lm model with random weights served through generate_step.

Tiny models (one layer of Qwen3-0.6B's geometry with a 256-token vocabulary, or a 2-layer llama
written to a folder) keep each test to about a second; byte figures are exact on the CPU backend.
"""

from __future__ import annotations

from itertools import pairwise

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.utils import _get_classes, save_config, save_model

from harness.judge.summary import ModelFacts
from harness.models import loading as models
from harness.models import presets
from harness.pipeline.isolation import estimate_bytes
from harness.run.engine_choice import create
from harness.run.model_engine import ModelEngine
from harness.run.probe import Probe
from harness.scenario import ScenarioSpec
from tests.conftest import serve_with_engine as serve

TINY = {"preset": "qwen3-0.6b", "layers": 1, "vocab": 256}
# One layer: embedding 256 x 1024, q/k/v/o, MLP, two head norms and three RMS norms, in bf16.
TINY_WEIGHTS = 2 * (256 * 1024 + 1024 * (2048 + 1024 + 1024) + 2048 * 1024
                    + 3 * 1024 * 3072 + 2 * 128 + 3 * 1024)
TOKEN_BYTES = 2 * 8 * 128 * 2  # one layer, K and V, 8 KV heads of 128, bf16: 4 KiB
LOGITS = 256 * 2  # one step's log probabilities over the vocabulary, bf16


def real_spec(**fields) -> ScenarioSpec:
    fields.setdefault("name", "real")
    fields.setdefault("engine", "mlx_lm")
    fields.setdefault("model", TINY)
    return ScenarioSpec.model_validate(fields)


SHARED_PRESETS = sorted(set(presets.geometric()) & set(presets.buildable()))


def test_qwen3_8b_is_a_preset_of_both_engines():
    assert "qwen3-8b" in SHARED_PRESETS


@pytest.mark.parametrize("name", SHARED_PRESETS)
def test_a_preset_of_both_engines_builds_the_geometry_preset_of_its_name(name):
    """`model: NAME` is one geometry on either engine: the real model, as built, holds what the
    synthetic engine's preset says."""
    choice = models.ModelChoice(name, None, None, None, "bfloat16", None, 64)
    assert models.describe(choice)[0] == presets.geometry(name)


def test_weights_are_counted_before_evaluation_and_sit_under_the_baseline():
    spec = real_spec(workload={"prefill_chunk": 16, "requests": [{"prompt": 40, "decode": 4}]})
    assert spec.weights_bytes() == TINY_WEIGHTS
    engine, frame, _findings, figures = serve(spec)
    assert isinstance(engine, ModelEngine)
    assert engine.facts() == ModelFacts(engine="mlx_lm", name="qwen3-0.6b", layers=1,
                                        weights=TINY_WEIGHTS, quantize_bits=None)
    # The baseline holds the evaluated weights; the analytic minimum counts KV bytes only.
    assert frame["active"].iloc[0] >= TINY_WEIGHTS
    assert figures["minimum"] == 44 * TOKEN_BYTES
    assert figures["final"] == 0


def test_one_row_per_prefill_chunk_and_per_decoded_token():
    spec = real_spec(workload={"prefill_chunk": 16, "requests": [{"prompt": 40, "decode": 5}]})
    _engine, frame, _findings, _figures = serve(spec)
    # generate_step feeds 39 prompt tokens in chunks of 16, 16, 7; the last one with the first
    # decode step, which holds the prompt and the first generated token.
    assert frame["phase"].tolist() == ["idle"] + ["prefill"] * 3 + ["decode"] * 5 + ["idle"]
    assert frame["tokens"].tolist() == [0, 16, 32, 39, 41, 42, 43, 44, 45, 0]
    assert frame["work"].tolist()[1:9] == [t * TOKEN_BYTES for t in (16, 16, 7, 2, 1, 1, 1, 1)]


def test_kvcache_under_a_real_decode_grows_at_the_256_slot_boundary():
    spec = real_spec(workload={"prefill_chunk": 50, "requests": [{"prompt": 100, "decode": 200}]},
                     detect={"growth": {"min_bytes": "64 KiB"}})
    _engine, frame, findings, figures = serve(spec)
    growth = next(f for f in findings if f.kind == "growth")
    # The decode row that takes the cache to 257 tokens allocates 256 more slots.
    assert frame["tokens"][growth.steps[0]] == 257
    assert growth.bytes == 256 * TOKEN_BYTES - TOKEN_BYTES
    # 300 tokens in 512 slots; the generator holds this step's and the next step's logits.
    decode = frame[frame["phase"] == "decode"]
    assert decode["logical"].iloc[-1] == 512 * TOKEN_BYTES + 2 * LOGITS
    assert 0 <= figures["steady"] - decode["logical"].iloc[-1] < 4096
    assert figures["retained"] < 4096


def test_named_layer_caches_replace_the_models_own():
    spec = real_spec(workload={"requests": [{"prompt": 8}]})
    engine = create(spec, Probe())
    assert all(isinstance(c, KVCache) for c in engine.make_caches())
    rotating = real_spec(workload={"requests": [{"prompt": 8}]},
                         cache={"layer": {"component": "mlx_lm.RotatingKVCache",
                                          "options": {"max_size": 64}}})
    (cache,) = create(rotating, Probe()).make_caches()
    assert isinstance(cache, RotatingKVCache) and cache.max_size == 64


def test_a_request_without_decode_ends_with_its_last_prompt_token():
    spec = real_spec(workload={"prefill_chunk": 16, "requests": [{"prompt": 20}]})
    _engine, frame, _findings, _figures = serve(spec)
    assert frame["phase"].tolist() == ["idle", "prefill", "prefill", "prefill", "idle"]
    assert frame["tokens"].tolist() == [0, 16, 19, 20, 0]


def test_lru_prompt_cache_under_a_real_model_is_clean_and_hits():
    spec = real_spec(
        cache={"store": {"component": "mlx_lm.LRUPromptCache", "options": {"max_size": 4}}},
        workload={"prefill_chunk": 32, "requests": [
            {"prompt": 64, "decode": 4, "repeat": 3},
            {"prompt": 80, "decode": 4, "prefix": {"request": 0, "tokens": 64}}]})
    engine, _frame, findings, figures = serve(spec)
    # A hit's deep copy shares the stored buffer until its first write, which allocates it:
    # that first step after each hit is a growth step, by design; nothing leaks or is retained.
    assert [f.kind for f in findings] == ["growth"]
    assert figures["leak_rate"] == 0 and figures["retained"] < 4096
    stats = engine.store_stats()
    assert stats is not None and stats["hits"] == 3 and stats["misses"] == 1
    # A repeat hit leaves one prompt token to prefill; the longer prompt shares 64 tokens.
    assert stats["matched_tokens"] == 63 + 63 + 64


def test_the_seed_makes_runs_identical():
    spec = real_spec(workload={"prefill_chunk": 16, "requests": [{"prompt": 24, "decode": 6}]})
    first = create(spec, Probe())
    planned = np.zeros(6, dtype=np.int64)
    prompt = np.arange(24)
    tokens = first.generate(first.make_caches(), prompt, 0, planned)
    second = create(spec, Probe())
    assert tokens.tolist() == second.generate(second.make_caches(), prompt, 0, planned).tolist()


def test_quantized_weights_are_counted_as_quantized():
    spec = real_spec(model={**TINY, "quantize": {"bits": 4}},
                     workload={"requests": [{"prompt": 8, "decode": 2}]})
    assert spec.weights_bytes() < TINY_WEIGHTS // 3
    engine, _frame, findings, _figures = serve(spec)
    assert engine.facts().quantize_bits == 4
    assert [f.kind for f in findings if f.kind in ("leak", "retained")] == []


def test_the_size_check_adds_the_weights():
    spec = real_spec(workload={"requests": [{"prompt": 8, "decode": 2}]})
    synthetic = ScenarioSpec.model_validate({
        "name": "s", "model": {"layers": [{"count": 1, "kind": "full", "kv_heads": 8,
                                           "head_dim": 128}]},
        "workload": {"requests": [{"prompt": 8, "decode": 2}]}})
    # Same KV geometry; the real engine adds the weights and a chunk's activations.
    chunk = 2 * 512 * TOKEN_BYTES  # the default prefill_chunk, twice
    assert estimate_bytes(spec) == estimate_bytes(synthetic) + TINY_WEIGHTS + chunk


def test_a_chat_runs_its_turns_on_the_real_model():
    spec = real_spec(workload={"prefill_chunk": 16, "chat": {"turns": 2, "user": 8,
                                                             "model": 4}})
    _engine, frame, findings, _figures = serve(spec)
    assert frame[frame["phase"] == "idle"]["tokens"].tolist() == [0, 12, 24]
    assert findings == []


def test_a_rolling_chat_re_prefills_its_history_on_the_real_model():
    spec = real_spec(
        cache={"session": {"component": "reference.chat",
                           "options": {"rolling_threshold": 24, "logits": "top_k", "k": 8}}},
        workload={"prefill_chunk": 16, "chat": {"turns": 4, "user": 8, "model": 4}})
    _engine, frame, findings, _figures = serve(spec)
    # At turn 3 the history (36 tokens) passes 24: the oldest turn goes and the 24 tokens
    # kept are re-prefilled into fresh caches (16 + 7 + 1: the evict phase's last row feeds the
    # history's last token), then the turn adds its 12.
    evict = frame[frame["phase"] == "evict"]
    assert evict["turn"].tolist() == [3, 3, 3] and evict["tokens"].tolist() == [16, 23, 24]
    assert frame[frame["phase"] == "idle"]["tokens"].tolist() == [0, 12, 24, 36, 36]
    assert [f.kind for f in findings if f.kind in ("leak", "retained")] == []


BATCH_BUFFER = 2 * 256 * TOKEN_BYTES  # BatchKVCache: 256 slots a step, for 2 sequences: 2 MiB


def batch_spec(decode: int, **fields) -> ScenarioSpec:
    return real_spec(workload={"prefill_chunk": 16, "batch": 2,
                               "requests": [{"prompt": 40, "decode": decode}]}, **fields)


def test_a_batch_is_served_by_batch_generator_one_row_per_chunk_and_per_decode_step():
    _engine, frame, _findings, figures = serve(batch_spec(5))
    # As one sequence: chunks of 16, 16, 7, then the first decode step also feeds the last
    # prompt token; `tokens` counts each sequence's, `work` both sequences' K/V.
    assert frame["phase"].tolist() == ["idle"] + ["prefill"] * 3 + ["decode"] * 5 + ["idle"]
    assert frame["tokens"].tolist() == [0, 16, 32, 39, 41, 42, 43, 44, 45, 0]
    assert frame["work"].tolist()[1:9] == [2 * t * TOKEN_BYTES for t in (16, 16, 7, 2, 1, 1, 1, 1)]
    # The generator's BatchKVCache holds 256 slots for both sequences from the first chunk;
    # decoding, it also holds this step's and the queued step's logits, a row each.
    logical = frame["logical"].tolist()
    assert logical[1:8] == [BATCH_BUFFER] * 3 + [BATCH_BUFFER + 2 * 2 * LOGITS] * 4
    active = (frame["active"] - frame["active"].iloc[0]).tolist()
    assert all(0 <= a - held < 4096 for a, held in zip(active[1:8], logical[1:8], strict=True))
    assert figures["minimum"] == 2 * 45 * TOKEN_BYTES
    assert figures["final"] == 0 and frame["cyclic"].sum() == 0


def test_finished_sequences_caches_pin_the_whole_batch_buffer_until_dropped():
    _engine, frame, findings, figures = serve(batch_spec(5))
    last = frame[frame["phase"] == "decode"].iloc[-1]
    # The finish responses carry each sequence's cache (BatchKVCache.extract: 45 tokens each)
    # and this step's logits; the queued step's went with the generator's filter.
    assert last["logical"] == 2 * 45 * TOKEN_BYTES + 2 * LOGITS
    # Those caches are unevaluated mx.contiguous slices: they keep the batch buffer alive.
    assert 0 <= last["active"] - frame["active"].iloc[0] - (BATCH_BUFFER + 2 * LOGITS) < 4096
    assert 0 <= figures["retained"] - (BATCH_BUFFER - 2 * 45 * TOKEN_BYTES) < 4096
    assert [f.steps for f in findings if f.kind == "retained"] == [[8]]
    # Dropped with the generator at the end of the request: nothing stays, no cycle holds it.
    assert figures["final"] == 0 and frame["cyclic"].sum() == 0


def test_a_batch_without_decode_ends_with_its_last_prompt_token_and_takes_the_caches_back():
    _engine, frame, _findings, figures = serve(batch_spec(0))
    assert frame["phase"].tolist() == ["idle"] + ["prefill"] * 4 + ["idle"]
    assert frame["tokens"].tolist() == [0, 16, 32, 39, 40, 0]
    assert frame["work"].tolist()[4] == 2 * TOKEN_BYTES
    assert frame["logical"].tolist()[4] == 2 * 40 * TOKEN_BYTES  # removed with their caches
    assert figures["final"] == 0


def test_a_batchs_sequences_are_distinct_and_drawn_from_the_seed():
    spec = batch_spec(2)
    prompt = np.arange(40)
    first, second = create(spec, Probe()), create(spec, Probe())
    rows = first._batch_prompts(prompt, 3)
    assert rows == second._batch_prompts(prompt, 3)
    assert rows[0] == prompt.tolist() and len(rows[1]) == 40 and rows[1] != rows[0]
    assert first._batch_prompts(prompt, 4)[1] != rows[1]  # another request, other sequences


@pytest.mark.parametrize("component, prefill", [
    # BatchGenerator merges a sequence's RotatingKVCache into a BatchRotatingKVCache, which
    # grows by the chunk; the reference cache allocates both rows' windows at the first chunk.
    ("mlx_lm.RotatingKVCache", [2 * t * TOKEN_BYTES for t in (16, 32, 39)]),
    ("mlx_lm.BatchRotatingKVCache", [2 * t * TOKEN_BYTES for t in (16, 32, 39)]),
    ("reference.rotating", [2 * 64 * TOKEN_BYTES] * 3),
])
def test_named_rotating_caches_are_batched_and_hold_their_window(component, prefill):
    spec = batch_spec(40, cache={"layer": {"component": component, "options": {"max_size": 64}}})
    _engine, frame, findings, figures = serve(spec)
    logical = frame["logical"].tolist()
    assert logical[1:4] == prefill
    # 80 tokens a sequence in a 64-slot window, with this step's and the queued step's logits.
    assert logical[4:-2] == [2 * 64 * TOKEN_BYTES + 2 * 2 * LOGITS] * 39
    assert logical[-2] == 2 * 64 * TOKEN_BYTES + 2 * LOGITS
    assert figures["retained"] < 4096 and figures["final"] == 0
    assert [f.kind for f in findings if f.kind in ("leak", "retained")] == []


def test_a_hybrid_models_batch_decode_holds_each_recurrent_state_twice():
    spec = real_spec(model={"preset": "qwen3.5-0.8b", "layers": 4, "vocab": 256},
                     workload={"prefill_chunk": 16, "batch": 2,
                               "requests": [{"prompt": 40, "decode": 4}]})
    _engine, frame, _findings, figures = serve(spec)
    # Batched, each GatedDeltaNet layer's new state is `mx.where(mask, updated, old)`, which
    # the decode step's logits do not need: left unevaluated between steps, it holds the old
    # and the updated state while reporting one (3 layers, 2 sequences, 16 float32 heads of
    # 128 x 128). Its conv state, a lazy slice, pins one more token of the conv input (6,144
    # bf16 channels a sequence), as it does unbatched. Prefill rows evaluate the caches.
    states = 3 * 2 * 16 * 128 * 128 * 4
    conv = 3 * 2 * 6144 * 2
    rows = frame[frame["phase"] != "idle"]
    extra = (rows["active"] - frame["active"].iloc[0] - rows["logical"]).tolist()
    assert all(0 <= e < 4096 for e in extra[:3])
    assert all(0 <= e - states - conv < 4096 for e in extra[3:-1])
    assert figures["final"] < 64  # 2 bytes the model keeps after a first run, unbatched too


@pytest.mark.parametrize("fields, message", [
    ({"workload": {"batch": 2, "chat": {"turns": 1, "user": 8, "model": 2}}},
     "workload.batch: the mlx_lm engine serves a chat one sequence at a time"),
    ({"cache": {"session": {"component": "reference.chat"}}}, "cache.session: "),
    ({"cache": {"layer": {"component": "mlx_lm.QuantizedKVCache"}}},
     "cache.layer: mlx_lm.QuantizedKVCache cannot be batched"),
])
def test_batch_combinations_the_engine_cannot_serve_are_refused(fields, message):
    fields.setdefault("workload", {"batch": 2, "requests": [{"prompt": 8}]})
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace(">", ".")):
        real_spec(**fields)


def tiny_llama_folder(path):
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "vocab_size": 128, "tie_word_embeddings": True}
    model_class, args_class = _get_classes(config)
    mx.random.seed(1)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float16)
    save_model(path, model)
    save_config(config, path / "config.json")
    return models.weights_bytes(model)


def test_a_local_model_folder_loads_without_a_tokenizer(tmp_path):
    weights = tiny_llama_folder(tmp_path)
    spec = real_spec(model={"path": str(tmp_path)},
                     workload={"prefill_chunk": 8, "requests": [{"prompt": 12, "decode": 3}]})
    geometry = spec.geometry()
    assert [(layer.kind, layer.kv_heads, layer.head_dim) for layer in geometry.layers] == \
        [("full", 2, 16)] * 2
    assert spec.weights_bytes() == weights
    engine, _frame, _findings, figures = serve(spec)
    assert engine.facts().name == tmp_path.name
    # 15 tokens of 2 layers x K and V x 2 heads x 16 dims in float16.
    assert figures["minimum"] == 15 * 2 * 2 * 2 * 16 * 2


@pytest.mark.parametrize("fields, message", [
    ({"model": {"preset": "qwen3-0.6b", "layers": 29}}, "layers: expected at most 28"),
    ({"model": {"layers": [{"kind": "full", "kv_heads": 1, "head_dim": 8}]}},
     "not from layer groups"),
    ({"model": {**TINY, "window": 64}}, "model.window"),
    ({"model": {**TINY, "quantize": {"bits": 7}}}, "model.quantize.bits"),
])
def test_bad_real_model_fields_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        real_spec(workload={"requests": [{"prompt": 8}]}, **fields)


def test_a_store_keeping_what_a_batch_gives_back_pins_a_batch_buffer_per_request():
    """vllm-mlx #641's ratchet: the caches a BatchGenerator hands back for a finished sequence
    are lazy slices of its batch buffer; a store that keeps them as given keeps one whole batch
    buffer alive per request while reporting the slices."""
    spec = real_spec(cache={"store": {"component": "mlx_lm.LRUPromptCache"}},
                     workload={"prefill_chunk": 16, "batch": 2,
                               "requests": [{"prompt": 40 + i, "decode": 5} for i in range(6)]})
    _engine, frame, findings, _figures = serve(spec)
    idle = frame[frame["phase"] == "idle"]
    kept = (idle["active"] - idle["active"].iloc[0] - idle["logical"]).tolist()
    # The first request's store: the whole 256-slot buffer of both sequences, less the slices.
    assert kept[1] == BATCH_BUFFER - idle["logical"].iloc[1]
    assert all(later - earlier > BATCH_BUFFER // 2 for earlier, later in pairwise(kept[1:]))
    assert "retained" in {f.kind for f in findings}
