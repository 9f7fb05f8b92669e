"""The mlx_lm engine: the same loop as `Engine`, with a real mlx-lm model as the forward pass.

The model comes from `harness.models` (a config preset with random weights, or a local folder),
seeded from `sampling.seed`, and its weights are evaluated before the baseline sample: detectors
see what the caches add above the weights, and `weights_bytes` is reported beside the KV
minimum. The geometry (layer kinds, KV heads, head dim, window, recurrent state) is read from
the built model.

Caches: the model's own `make_cache()` unless the scenario names `cache.layer` or
`cache.sliding`; then full and sliding layers get those factories' caches (so mlx-lm's KVCache,
RotatingKVCache or a reference cache runs under a real model) and recurrent layers keep the
model's own.

A prompt is served by mlx-lm's `generate_step` with the request's caches as its prompt cache
and `prefill_step_size = prefill_chunk`, greedy decoding. How its steps map to probe rows:

- prefill: `generate_step` feeds the prompt less its last token in chunks, evaluating the
  caches' state after each and then calling `prompt_progress_callback`; one prefill row per
  chunk ends there. Its chunks are `prefill_chunk` tokens except the last, one token short of
  the synthetic engine's (the prompt's last token is fed with the first decode step). A
  store's `on_prefill` is called at each of these rows, so never with the whole prompt.
- decode: each token is yielded after the step that feeds it into the caches has been queued
  (`async_eval`): the pipeline keeps one step in flight. The row synchronizes the generation
  stream before reading, so it sees that step completed: at the n-th yield the caches hold the
  prompt and n + 1 generated tokens, and the first decode row also covers the prompt's last
  token. A request of `decode: 0` ends with one prefill row for that token.
- logits: while decoding, `generate_step` holds the current and the next step's log
  probabilities (vocabulary-wide each); the engine counts them as held bytes beside the
  components' (`logical`), so `retained` measures only what the caches keep.
- `generate_step` calls `mx.clear_cache()` after every prefill chunk and every 256 decode
  steps: the `cache` column (and RSS) drops there, active memory does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import trim_prompt_cache

from .. import models
from ..geometry import KIND_RECURRENT, KIND_SLIDING, Geometry
from ..protocols import LayerCache
from ..scenario import ScenarioSpec
from .engine import Engine, _component
from .probe import Probe


class ModelEngine(Engine):
    """Serves one variant with a real mlx-lm model, through `generate_step`."""

    def __init__(self, spec: ScenarioSpec, probe: Probe,
                 progress: Callable[[int], None] | None = None):
        self.model: Any = None
        self.weights_bytes = 0
        probe.watch(generation_stream)  # the step generate_step queued, completed at each row
        super().__init__(spec, probe, progress)

    def prepare(self) -> Geometry:
        """Build the model (seeded), read its geometry lazily, then evaluate its weights."""
        choice = self.spec.model.choice()
        mx.random.seed(self.spec.sampling.seed)
        self.model = models.build(choice)
        self.weights_bytes = models.weights_bytes(self.model)
        geometry = models.geometry(self.model, choice.name).with_batch(self.spec.workload.batch)
        mx.eval(self.model.parameters())
        mx.clear_cache()  # the random draws' temporaries; the baseline holds the weights only
        return geometry

    def make_caches(self) -> list[LayerCache]:
        """The model's own caches, or the scenario's named factories for full and sliding
        layers (recurrent layers always keep the model's: their state is the model's own)."""
        own = models.make_caches(self.model)
        cache = self.spec.cache
        if not {"layer", "sliding"} & cache.model_fields_set:
            return own
        return [own[layer.index] if layer.kind == KIND_RECURRENT
                else _component(cache.sliding if layer.kind == KIND_SLIDING else cache.layer,
                                layer)
                for layer in self.geometry.layers]

    def _fed(self, tokens: int) -> int:
        """Bytes of K/V the model fed into the caches for `tokens` new tokens."""
        return self.geometry.token_bytes() * self.geometry.batch * tokens

    def generate(self, caches: list[LayerCache], prompt: np.ndarray, start: int,
                 planned: np.ndarray, held: int = 0, phase: str = "prefill") -> np.ndarray:
        """Serve `prompt[start:]` and `len(planned)` greedy tokens through `generate_step`;
        the model's tokens. A store hit that covers the whole prompt gives its last token back
        (generate_step needs one to feed)."""
        if len(prompt) == 0:  # a history evicted whole: nothing to re-prefill
            return planned[:0]
        if start >= len(prompt):
            start = len(prompt) - 1
            trim_prompt_cache(caches, 1)
        base = held + start
        self._tokens = base
        ids = tuple(prompt.tolist())
        steps = len(planned)

        def progress(done: int, total: int) -> None:
            if done == 0:
                self.probe.begin()
            elif done < total:
                work = self._fed(base + done - self._tokens)
                self._tokens = base + done
                if self.store is not None:
                    self.store.on_prefill(ids[: start + done], start + done, caches)
                self._record(phase, work)
                self.probe.begin()

        tokens: list[int] = []
        stream = generate_step(mx.array(prompt[start:]), self.model, max_tokens=steps,
                               prompt_cache=caches, prefill_step_size=self.spec.workload.prefill_chunk,
                               prompt_progress_callback=progress)
        for token, logprobs in stream:
            tokens.append(int(token))
            work = self._fed(base + len(prompt) - start + len(tokens) - self._tokens)
            self._tokens = base + len(prompt) - start + len(tokens)
            if self.session is not None:
                self.session.keep_logits(logprobs[None])
                work += logprobs.nbytes
            in_flight = 2 * logprobs.nbytes  # this step's and the queued step's
            del logprobs  # the generator's own references go with it
            self._record("decode", work, held=in_flight)
            self.probe.begin()
        if not steps:
            work = self._fed(base + len(prompt) - start - self._tokens)
            self._tokens = base + len(prompt) - start
            self._record(phase, work)
        return np.array(tokens, dtype=np.int64)

    def facts(self) -> dict[str, Any]:
        """The model as the summary reports it: name, engine, weights beside the KV minimum."""
        choice = self.spec.model.choice()
        return {"engine": "mlx_lm", "name": choice.name, "layers": len(self.geometry.layers),
                "weights": self.weights_bytes, "quantize_bits": choice.bits}
