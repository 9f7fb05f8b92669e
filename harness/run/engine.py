"""Engine loop: serves a scenario's workload as an MLX server would, one probed step at a time.

For each request: look the prompt up in the store (if any), prefill the rest in chunks, decode,
store, release. A chat runs its turns against one session. Every chunk, token, fetch and store is
one step bracketed by the probe, and an idle sample follows each request or turn.

`Engine` is the loop with a synthetic forward pass (seeded K/V fed straight to the caches); the
loop calls `generate` for a prompt's prefill and decode, and `make_caches` for fresh caches, the
two seams `harness.run.model_engine.ModelEngine` replaces to serve a real mlx-lm model through
`generate_step`; `harness.run.engines.create` picks the engine a scenario names. The engine
serves in whatever process creates it: `harness.run.isolation.execute` creates one in a child
process per variant (so a variant that segfaults or is killed for memory becomes a failed run
instead of taking the others down), the scenario tests and the benchmark in their own.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from ..components.adapters import store_stats
from ..components.protocols import LayerCache, Session, Store
from ..components.registry import construct
from ..models.geometry import KIND_RECURRENT, KIND_SLIDING, Geometry
from ..scenario import ChatSpec, ScenarioSpec, WorkloadSpec
from .probe import Probe, cycle_garbage, release_freed_heap
from .recurrent import RecurrentState
from .synthetic import SyntheticKV


def request_plan(workload: WorkloadSpec, vocab: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, generated) token ids per served request, in order.

    Ids are drawn per request from (seed, request index), so requests differ unless a `prefix`
    copies an earlier prompt's head or `repeat` serves the very same request again.
    """
    prompts: list[np.ndarray] = []
    plan = []
    for index, request in enumerate(workload.requests or []):
        rng = np.random.default_rng([seed, index])
        prompt = rng.integers(0, vocab, request.prompt, dtype=np.int64)
        if request.prefix is not None:
            prompt[: request.prefix.tokens] = prompts[request.prefix.request][: request.prefix.tokens]
        prompts.append(prompt)
        generated = rng.integers(0, vocab, request.decode, dtype=np.int64)
        plan.extend([(prompt, generated)] * request.repeat)
    return plan


def planned_steps(spec: ScenarioSpec) -> int:
    """Steps the workload takes with no prefix hit and no eviction: the progress bar's estimate
    (requests, for a server)."""
    workload = spec.workload
    chunk = workload.prefill_chunk
    if workload.http is not None:  # a server's progress counts requests
        return workload.http.requests()
    if workload.chat is not None:
        chat = workload.chat
        return chat.turns * (math.ceil(chat.user / chunk) + chat.model + 1) + 1
    extra = 3 if spec.cache.store is not None else 1  # fetch, store, idle
    return 1 + sum(
        r.repeat * (math.ceil(r.prompt / chunk) + r.decode + extra) for r in workload.requests or []
    )


class Engine:
    """Serves one scenario variant in this process, recording one probe row per step."""

    def __init__(self, spec: ScenarioSpec, probe: Probe,
                 progress: Callable[[int], None] | None = None):
        self.spec = spec
        self.probe = probe
        self.progress = progress
        self.geometry: Geometry = self.prepare()
        cache = spec.cache
        self.store: Store | None = construct(cache.store, self.geometry) if cache.store else None
        self.session: Session | None = (
            construct(cache.session, self.geometry) if cache.session else None
        )
        self._live: list[list[LayerCache]] = []
        self._request = -1
        self._turn = -1
        self._tokens = 0

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
                caches.append(RecurrentState(layer))
            elif layer.kind == KIND_SLIDING:
                caches.append(construct(self.spec.cache.sliding, layer))
            else:
                caches.append(construct(self.spec.cache.layer, layer))
        return caches

    def _record(self, phase: str, work: int, cyclic: int = 0, held: int = 0) -> None:
        """End the step: one probe row; `held` counts bytes the engine itself holds (a real
        model's logits in flight) with what the components report."""
        logical = held + sum(c.nbytes for caches in self._live for c in caches)
        host = 0
        for part in (self.store, self.session):
            if part is not None:
                logical += part.nbytes
                host += getattr(part, "host_bytes", 0)  # a component without it holds none
        self.probe.end(phase, self._request, self._turn, self._tokens, logical, host,
                       self.geometry.minimum_bytes(self._tokens), work, cyclic)
        if self.progress is not None:
            self.progress(self.probe.steps)

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
        """Prefill `prompt[start:]` onto caches holding `held` other tokens, then decode one
        token per entry of `planned`; the tokens generated (here, the planned ones)."""
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

    def finished(self, caches: list[LayerCache]) -> list[LayerCache]:
        """The request's caches once it is served: the ones it was served in, here."""
        return caches

    def idle(self) -> None:
        """A quiescent sample: nothing in flight, what remains is what is held, and of that
        what only unreachable reference cycles hold (when the scenario looks for them)."""
        cyclic = cycle_garbage() if self.spec.sampling.find_cycles else 0
        release_freed_heap()
        self.probe.begin()
        self._record("idle", 0, cyclic)

    def serve_requests(self) -> None:
        plan = request_plan(self.spec.workload, self.geometry.vocab, self.spec.sampling.seed)
        for index, (prompt, generated) in enumerate(plan):
            self._request, self._tokens = index, 0
            caches, matched = None, 0
            if self.store is not None:
                self.probe.begin()
                caches, matched = self.store.fetch(tuple(prompt.tolist()))
                if caches is not None:
                    mx.eval([c.state for c in caches])
                    self._live, self._tokens = [caches], matched
                self._record("fetch", 0)
            if caches is None:
                caches, matched = self.make_caches(), 0
                self._live = [caches]
            generated = self.generate(caches, prompt, matched, generated)
            if self.store is not None:
                caches = self.finished(caches)
                self.probe.begin()
                self.store.store(tuple(np.concatenate([prompt, generated]).tolist()), caches)
                self._record("store", 0)
            self._live, self._tokens = [], 0
            del caches
            self.idle()

    def serve_chat(self, chat: ChatSpec) -> None:
        rng = np.random.default_rng([self.spec.sampling.seed, 0])
        turn_tokens = rng.integers(0, self.geometry.vocab, chat.user + chat.model)
        caches = self.make_caches()
        self._live, self._request = [caches], 0
        turns: list[int] = []  # tokens of each turn held, oldest first
        for turn in range(chat.turns):
            self._turn = turn
            if self.session is not None:
                self.session.start_turn()
                dropped = self.session.evict(list(turns))
                if dropped:
                    turns = turns[dropped:]
                    # The truncated history is re-prefilled into new caches while the old ones
                    # are still alive: the moment both exist is what the probe must see.
                    fresh = self.make_caches()
                    self._live = [caches, fresh]
                    history = np.resize(turn_tokens, sum(turns))
                    self.generate(fresh, history, 0, history[:0], phase="evict")
                    caches = fresh
                    self._live = [caches]
            self.generate(caches, turn_tokens[: chat.user], 0, turn_tokens[chat.user:],
                          held=sum(turns))
            turns.append(chat.user + chat.model)
            self.idle()

    def serve(self) -> None:
        """Serve the workload with Python's automatic cycle collector as it is, as in a server."""
        finding = self.spec.sampling.find_cycles
        if finding:
            # What exists before the run (the interpreter's modules, the store itself) is set
            # aside, so each idle point's search scans only what the run made: tens of
            # microseconds instead of tens of milliseconds in a process that imported pandas.
            gc.collect()
            gc.freeze()
        # A fresh child's buffer cache is empty; one left by earlier work in this process (a
        # test, a benchmark) would hand out larger cached buffers than asked and move active.
        mx.clear_cache()
        try:
            self.idle()  # the baseline: pools drawn, nothing cached yet
            chat = self.spec.workload.chat
            if chat is not None:
                self.serve_chat(chat)
            else:
                self.serve_requests()
        finally:
            if finding:
                gc.unfreeze()

    def facts(self) -> dict[str, Any] | None:
        """What the summary reports about the model served (None: synthetic K/V, no model)."""
        return None

    def store_stats(self) -> dict[str, int | float] | None:
        """The store's `stats` (a flat dict of numbers) as it stands, or None without one."""
        return None if self.store is None else store_stats(self.store)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
