"""The mlx_lm engine: the engine loop (`Loop`) with a real mlx-lm model as the forward pass.

The model comes from `harness.models.loading` (a preset's config with random weights, or a
local folder), seeded from `sampling.seed`, and its weights are evaluated before the baseline
sample: detectors see what the caches add above the weights, and `weights_bytes` is reported
beside the KV minimum. The geometry (layer kinds, KV heads, head dim, window, recurrent state) is read from
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

`batch: B` > 1 is served by mlx-lm's `BatchGenerator` instead (requests only: validation
refuses a chat, a store, a session and caches without `merge`): the request's prompt and B - 1
more drawn from (seed, request, row), inserted together with one set of caches a sequence
(`make_caches`, merged by the generator into its batch caches), `prefill_step_size =
prefill_chunk` and `prefill_batch_size = B`, so each `next()` prefills one chunk of all B
sequences or decodes one step of them; it runs on `generation_stream`, which the probe
synchronizes. The rows are the single-sequence path's: one per chunk of the prompt less its last
token, one per decode step (the first also covers the call that hands the batch over to decoding
and queues the last prompt token), `tokens` per sequence, `work` for all B. The generator's
caches and logits are held bytes: its `prompt_cache_nbytes`, this step's and the queued step's
log probabilities (one row each), and at the last row the finished sequences' caches, which
`BatchKVCache.extract` leaves unevaluated: they report their tokens while keeping the whole
batch buffer alive, and `retained` shows the difference until the request drops them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, generate_step, generation_stream
from mlx_lm.models.cache import trim_prompt_cache

from ..components.protocols import LayerCache
from ..components.registry import construct
from ..judge.summary import ModelFacts
from ..models import loading as models
from ..models.geometry import KIND_RECURRENT, KIND_SLIDING, Geometry
from ..scenario import ScenarioSpec
from .engines import Progress
from .loop import Loop
from .probe import Probe


class ModelEngine(Loop):
    """Serves one variant with a real mlx-lm model, through `generate_step`."""

    def __init__(self, spec: ScenarioSpec, probe: Probe,
                 progress: Progress | None = None):
        self.model: Any = None
        self.weights_bytes = 0
        self._extracted: list[Any] | None = None  # the first sequence's caches, out of a batch
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
                else construct(cache.sliding if layer.kind == KIND_SLIDING else cache.layer,
                               layer)
                for layer in self.geometry.layers]

    def _fed(self, tokens: int) -> int:
        """Bytes of K/V the model fed into the caches for `tokens` new tokens a sequence."""
        return self.geometry.token_bytes() * self.geometry.batch * tokens

    def _step_to(self, phase: str, tokens: int, held: int = 0, kept: int = 0) -> None:
        """End the step that took each sequence to `tokens` tokens and begin the next: its work
        is the K/V fed since the last row (plus `kept`: logits a session kept), `held` the
        bytes mlx-lm holds beyond the components (logits in flight, a generator's caches)."""
        work = self._fed(tokens - self._tokens) + kept
        self._tokens = tokens
        self._record(phase, work, held=held)
        self.probe.begin()

    def generate(self, caches: list[LayerCache], prompt: np.ndarray, start: int,
                 planned: np.ndarray, held: int = 0, phase: str = "prefill") -> np.ndarray:
        """Serve `prompt[start:]` and `len(planned)` greedy tokens: through `generate_step`,
        or `BatchGenerator` for batch > 1; the model's tokens (the first sequence's). A store
        hit that covers the whole prompt gives its last token back (generate_step needs one
        to feed)."""
        if len(prompt) == 0:  # a history evicted whole: nothing to re-prefill
            return planned[:0]
        if start >= len(prompt):
            start = len(prompt) - 1
            trim_prompt_cache(caches, 1)
        if self.geometry.batch > 1:  # validation allows no chat here
            return self._generate_batch(caches, prompt, start, len(planned), phase)
        base = held + start
        self._tokens = base
        ids = tuple(prompt.tolist())
        steps = len(planned)
        fed = base + len(prompt) - start  # each sequence's tokens once the prompt is fed

        def progress(done: int, total: int) -> None:
            if done == 0:
                self.probe.begin()
            elif done < total:
                if self.store is not None:
                    self.store.on_prefill(ids[: start + done], start + done, caches)
                self._step_to(phase, base + done)

        tokens: list[int] = []
        stream = generate_step(mx.array(prompt[start:]), self.model, max_tokens=steps,
                               prompt_cache=caches, prefill_step_size=self.spec.workload.prefill_chunk,
                               prompt_progress_callback=progress)
        for token, logprobs in stream:
            tokens.append(int(token))
            kept = 0
            if self.session is not None:
                self.session.keep_logits(logprobs[None])
                kept = logprobs.nbytes
            in_flight = 2 * logprobs.nbytes  # this step's and the queued step's
            del logprobs  # the generator's own references go with it
            self._step_to("decode", fed + len(tokens), held=in_flight, kept=kept)
        if not steps:
            self._step_to(phase, fed)
        return np.array(tokens, dtype=np.int64)

    def _batch_prompts(self, prompt: np.ndarray, request: int) -> list[list[int]]:
        """The request's prompt and `batch - 1` more of its length, drawn from (seed, request,
        row): distinct sequences, as a server batches different users' requests."""
        seed, vocab = self.spec.sampling.seed, self.geometry.vocab
        others = [np.random.default_rng([seed, request, row]).integers(0, vocab, len(prompt))
                  for row in range(1, self.geometry.batch)]
        return [row.tolist() for row in (prompt, *others)]

    def _generate_batch(self, caches: list[LayerCache], prompt: np.ndarray, start: int,
                        steps: int, phase: str) -> np.ndarray:
        """Serve `prompt` as `batch` sequences through one `BatchGenerator`, inserted together
        with `caches` (holding `prompt[:start]`, from a store's hit, or empty) and fresh ones
        from `make_caches` (it merges them into its batch caches); the first sequence's tokens.
        The first sequence's caches come out of the batch as mlx-lm gives them (`finished`):
        what a store then keeps. Everything else it built goes when this returns."""
        prompts = self._batch_prompts(prompt, self._request)
        prompts[0] = prompts[0][start:]
        generator = BatchGenerator(self.model, max_tokens=max(steps, 1),
                                   prefill_batch_size=len(prompts),
                                   completion_batch_size=len(prompts),
                                   prefill_step_size=self.spec.workload.prefill_chunk)
        uids = generator.insert(prompts, caches=[caches, *(self.make_caches()
                                                           for _ in prompts[1:])])
        tokens: list[int] = []
        self._tokens, self._extracted = start, None
        self.probe.begin()
        while True:
            prompted, generated = generator.next()
            if generated:
                tokens.append(generated[0].token)
                self._step_to("decode", len(prompt) + len(tokens),
                              held=_generation_held(generator, generated))
                if generated[0].finish_reason is not None:
                    self._keep(generated[0].prompt_cache)
                    return np.array(tokens, dtype=np.int64)
            elif not prompted[0].end_of_prompt:
                self._step_to(phase, start + prompted[0].progress[0],
                              held=generator.prompt_cache_nbytes)
            elif not steps:  # the last prompt token's step is queued: take the caches back
                taken = generator.remove(uids, return_prompt_caches=True)
                self._step_to(phase, len(prompt),
                              held=_caches_bytes(c for c, _tokens in taken.values()))
                self._keep(taken[uids[0]][0])
                return np.array(tokens, dtype=np.int64)
            # Otherwise the call queued the last prompt token's step: the first decode row
            # covers it.

    def _keep(self, caches: list[Any]) -> None:
        """Hold the first sequence's extracted caches for the store, which alone keeps them."""
        self._extracted = caches if self.store is not None else None

    def finished(self, caches: list[LayerCache]) -> list[LayerCache]:
        """A batch's first sequence's caches as the generator gave them back (its own were
        merged into the batch caches); otherwise the request's own."""
        extracted, self._extracted = self._extracted, None
        return caches if extracted is None else list(extracted)

    def facts(self) -> ModelFacts:
        """The model as the summary reports it: name, engine, weights beside the KV minimum."""
        choice = self.spec.model.choice()
        return ModelFacts(engine="mlx_lm", name=choice.name, layers=len(self.geometry.layers),
                          weights=self.weights_bytes, quantize_bits=choice.bits)


def _caches_bytes(sequences: Iterable[list[Any] | None]) -> int:
    """What per-sequence caches (a generator's finished or removed sequences) report."""
    return sum(c.nbytes for caches in sequences if caches for c in caches)


def _generation_held(generator: Any, generated: list[Any]) -> int:
    """What a BatchGenerator holds at a decode row beyond the components: its batch caches;
    each row's log probabilities (vocabulary-wide), this step's and, unless the sequences
    finished, the queued step's; and a finished sequence's cache, extracted from the batch."""
    finished = generated[0].finish_reason is not None
    logits = sum(r.logprobs.nbytes for r in generated) * (1 if finished else 2)
    return (generator.prompt_cache_nbytes + logits
            + _caches_bytes(r.prompt_cache for r in generated))
