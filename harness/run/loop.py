"""The engine loop: serves a scenario's workload as an MLX server would, one probed step at a
time, with the forward pass left to the engine (`Loop` is the base of the synthetic and mlx_lm
engines, harness.run.synthetic_engine and harness.run.model_engine).

For each request: look the prompt up in the store (if any), prefill the rest, decode, store,
release. A chat runs its turns against one session. Every chunk, token, fetch and store is one
step bracketed by the probe, and an idle sample follows each request or turn. An engine gives
`prepare` (what exists before the baseline: K/V pools, or a model's weights, and the
geometry), `make_caches` (a request's fresh caches) and `generate` (a prompt's prefill and
decode). The loop serves in whatever process creates it: `harness.pipeline.isolation.execute`
creates one in a child process per variant, the scenario tests and the benchmark in their own.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import mlx.core as mx
import numpy as np

from ..components.adapters import store_stats
from ..components.protocols import LayerCache, Session, Store
from ..components.registry import construct, resolve
from ..judge.summary import ModelFacts
from ..models.geometry import Geometry
from ..scenario import ChatSpec, ComponentSpec, ScenarioSpec, WorkloadSpec
from .engines import RUNTIME_SLACK, Progress
from .probe import Probe, walked
from .synthetic import SyntheticKV


def _context_tokens(workload: WorkloadSpec) -> int:
    """The longest context a request or the chat reaches."""
    if workload.chat is not None:
        return workload.chat.turns * (workload.chat.user + workload.chat.model)
    return max(r.prompt + r.decode for r in workload.requests or [])


def _stated(component: ComponentSpec | None, *args: Any) -> int:
    """What a component's factory says it holds (its `estimate_bytes`), or 0 if it says nothing."""
    if component is None:
        return 0
    estimate = getattr(resolve(component.component), "estimate_bytes", None)
    return 0 if estimate is None else int(estimate(*args, **component.options))


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


class Loop:
    """Serves one scenario variant in this process, recording one probe row per step."""

    def __init__(self, spec: ScenarioSpec, probe: Probe,
                 progress: Progress | None = None):
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
        self._points = 0  # points at rest so far
        self._request = -1
        self._turn = -1
        self._tokens = 0

    @classmethod
    def estimate_bytes(cls, spec: ScenarioSpec) -> int:
        """An upper bound on a variant's footprint, from the geometry, the workload and the
        components.

        Each layer's cache at the longest context, twice (a growth step briefly holds old and
        new buffers), or what its factory's `estimate_bytes(layer, tokens, **options)` says when
        that is more (a cache that allocates its whole window up front); a prefill chunk's K/V
        twice; and whatever a store or session's `estimate_bytes(geometry, workload,
        **options)` adds on top; with a real model its weights too, and a prefill chunk's K/V
        twice more for its activations (an allowance, not a bound). Resolves components, so it
        runs where user code may run: in the variant's process.
        """
        geometry, workload = spec.geometry(), spec.workload
        context = _context_tokens(workload)
        layer_caches = {"full": spec.cache.layer, "sliding": spec.cache.sliding}
        caches = sum(max(2 * layer.minimum_bytes(context + 256),
                         _stated(layer_caches.get(layer.kind), layer, context))
                     for layer in geometry.layers)
        chunk = sum(SyntheticKV.input_bytes(layer, workload.prefill_chunk)
                    for layer in geometry.layers)
        extra = sum(_stated(part, geometry, workload)
                    for part in (spec.cache.store, spec.cache.session))
        weights = spec.weights_bytes()
        activations = 2 * chunk if weights else 0
        return caches + 2 * chunk + activations + extra + weights + RUNTIME_SLACK

    def prepare(self) -> Geometry:
        """What exists before the baseline (K/V pools, a model's weights), and the geometry."""
        raise NotImplementedError

    def make_caches(self) -> list[LayerCache]:
        """A fresh cache per layer, for one request (or a re-prefilled history)."""
        raise NotImplementedError

    def generate(self, caches: list[LayerCache], prompt: np.ndarray, start: int,
                 planned: np.ndarray, held: int = 0, phase: str = "prefill") -> np.ndarray:
        """Prefill `prompt[start:]` onto caches holding `held` other tokens, then decode up to
        one token per entry of `planned`; the tokens generated."""
        raise NotImplementedError

    def _record(self, phase: str, work: int, cyclic: int = 0, held: int = 0,
                census: Any = None) -> None:
        """End the step: one probe row; `held` counts bytes the engine itself holds (a real
        model's logits in flight) with what the components report; `census`, the holders
        walked at rest."""
        logical = held + sum(c.nbytes for caches in self._live for c in caches)
        host = 0
        for part in (self.store, self.session):
            if part is not None:
                logical += part.nbytes
                host += getattr(part, "host_bytes", 0)  # a component without it holds none
        self.probe.end(phase=phase, request=self._request, turn=self._turn, tokens=self._tokens,
                       logical=logical, host=host, minimum=self.geometry.minimum_bytes(self._tokens),
                       work=work, cyclic=cyclic, census=census)
        if self.progress is not None:
            self.progress(self.probe.steps)

    def finished(self, caches: list[LayerCache]) -> list[LayerCache]:
        """The request's caches once it is served: the ones it was served in, here."""
        return caches

    def idle(self, last: bool = False) -> None:
        """A quiescent sample: nothing in flight, what remains is what is held, of that what
        only unreachable reference cycles hold (when the scenario looks for them), and who
        holds the live arrays (when it walks them, at the points `walked` says; `last`: the
        run's last point at rest; this frame and the walk's are not roots)."""
        sampling = self.spec.sampling
        self._points += 1
        holders = sampling.holders and walked(self._points - 1, last)
        rest = self.probe.rest(sampling.find_cycles, holders, sys._getframe())
        self.probe.begin()
        self._record("idle", 0, rest.cyclic, census=rest.census)

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
            self.idle(last=index == len(plan) - 1)

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
            self.idle(last=turn == chat.turns - 1)

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

    def facts(self) -> ModelFacts | None:
        """What the summary reports about the model served (None: synthetic K/V, no model)."""
        return None

    def store_stats(self) -> dict[str, int | float] | None:
        """The store's `stats` (a flat dict of numbers) as it stands, or None without one."""
        return None if self.store is None else store_stats(self.store)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
