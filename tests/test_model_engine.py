"""The mlx_lm engine: a real mlx-lm model with random weights served through generate_step.

Tiny models (one layer of Qwen3-0.6B's geometry with a 256-token vocabulary, or a 2-layer llama
written to a folder) keep each test to about a second; byte figures are exact on the CPU backend.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.utils import _get_classes, save_config, save_model

from harness import detect, expect, models
from harness.run.engine import create
from harness.run.isolation import estimate_bytes
from harness.run.model_engine import ModelEngine
from harness.run.probe import Probe, to_frame
from harness.scenario import ScenarioSpec

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


def serve(spec: ScenarioSpec):
    probe = Probe()
    engine = create(spec, probe)
    try:
        engine.serve()
    finally:
        engine.close()
    frame = to_frame(probe.rows())
    findings = detect.detect(frame, spec.detect, "cpu")
    return engine, frame, findings, expect.metrics(frame, findings, spec.detect)


def test_weights_are_counted_before_evaluation_and_sit_under_the_baseline():
    spec = real_spec(workload={"prefill_chunk": 16, "requests": [{"prompt": 40, "decode": 4}]})
    assert spec.weights_bytes() == TINY_WEIGHTS
    engine, frame, _findings, figures = serve(spec)
    assert isinstance(engine, ModelEngine)
    assert engine.facts() == {"engine": "mlx_lm", "name": "qwen3-0.6b", "layers": 1,
                              "weights": TINY_WEIGHTS, "quantize_bits": None}
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
    assert engine.facts()["quantize_bits"] == 4
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
    assert engine.facts()["name"] == tmp_path.name
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
