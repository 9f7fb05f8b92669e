"""The synthetic engine: the engine loop with seeded K/V fed straight to the cache components,
no model (`engine: synthetic`, the default).

Each step's K/V come from `harness.run.synthetic.SyntheticKV`, in the geometry's shapes and
dtype; recurrent layers keep a fixed state (`RecurrentState`, or the scenario's
`cache.recurrent`), sliding layers the scenario's `cache.sliding`, full layers its
`cache.layer`. A session is handed a vocabulary-wide logits array at every decode step, as a
model would produce one.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..components.protocols import LayerCache
from ..components.registry import construct
from ..models.geometry import KIND_RECURRENT, KIND_SLIDING, Geometry
from .loop import Loop
from .recurrent import RecurrentState
from .synthetic import SyntheticKV


class SyntheticEngine(Loop):
    """Serves one variant with synthetic K/V, one probe row per step."""

    def prepare(self) -> Geometry:
        """What the engine needs before the baseline (the K/V pools), and the geometry."""
        geometry = self.spec.geometry()
        self.source = SyntheticKV(self.spec.sampling.seed, geometry.layers)
        return geometry

    def make_caches(self) -> list[LayerCache]:
        """A fresh cache per layer: recurrent layers hold a fixed state, sliding layers a window."""
        caches: list[LayerCache] = []
        for layer in self.geometry.layers:
            if layer.kind == KIND_RECURRENT:
                recurrent = self.spec.cache.recurrent
                caches.append(RecurrentState(layer) if recurrent is None
                              else construct(recurrent, layer))
            elif layer.kind == KIND_SLIDING:
                caches.append(construct(self.spec.cache.sliding, layer))
            else:
                caches.append(construct(self.spec.cache.layer, layer))
        return caches

    def _forward(self, caches: list[LayerCache], tokens: int) -> int:
        """One model step over every layer: fresh K/V in, cache update, evaluated together."""
        outputs, work = [], 0
        for layer, cache in zip(self.geometry.layers, caches, strict=True):
            keys, values = self.source.make(layer, tokens)
            work += self.source.input_bytes(layer, tokens)
            outputs.append(cache.update_and_fetch(keys, values))
        mx.eval(outputs)
        return work

    def generate(self, caches: list[LayerCache], prompt: np.ndarray, start: int,
                 planned: np.ndarray, held: int = 0, phase: str = "prefill") -> np.ndarray:
        """Prefill in chunks, then decode one token per entry of `planned`; the tokens
        generated are the planned ones."""
        self.prefill(caches, prompt, start, held, phase)
        self.decode(caches, len(planned))
        return planned

    def prefill(self, caches: list[LayerCache], prompt: np.ndarray, start: int, held: int = 0,
                phase: str = "prefill") -> None:
        """Prefill `prompt[start:]` in chunks onto caches already holding `held` other tokens."""
        chunk = self.spec.workload.prefill_chunk
        ids = tuple(prompt.tolist())
        for pos in range(start, len(prompt), chunk):
            done = min(pos + chunk, len(prompt))
            self.probe.begin()
            work = self._forward(caches, done - pos)
            self._tokens = held + done
            if self.store is not None:
                self.store.on_prefill(ids[:done], done, caches)
            self._record(phase, work)

    def decode(self, caches: list[LayerCache], steps: int) -> None:
        for _ in range(steps):
            self.probe.begin()
            work = self._forward(caches, 1)
            if self.session is not None:
                logits = self.source.logits(self.geometry.vocab)
                mx.eval(logits)
                work += logits.nbytes
                self.session.keep_logits(logits)
                del logits
            self._tokens += 1
            self._record("decode", work)
