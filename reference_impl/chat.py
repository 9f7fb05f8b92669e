"""Chat session with rolling turn eviction and top-k logits (seed 003, gemma's ChatSampler).

Two bug switches:
- `rolling_threshold: null` (before) never evicts, so the history re-fed every turn grows without
  bound; a number N evicts the oldest turns (user + model tokens) once the history passes N
  tokens, and the runner re-prefills what is left (old and new caches coexist meanwhile).
- `logits: full` (before) keeps the (batch, vocab) float32 logits of every decode step of the
  turn; `top_k` keeps k float32 values and k int32 indices per step, taken at once so the full
  logits die with the step.
"""

from __future__ import annotations

import mlx.core as mx

from harness.components.protocols import SessionBase
from harness.models.geometry import Geometry

LOGITS = ("full", "top_k")


class ChatSession(SessionBase):
    """A chat session (`harness.protocols.Session`) with the two switches above."""

    def __init__(self, geometry: Geometry, rolling_threshold: int | None = None,
                 logits: str = "top_k", k: int = 64):
        if logits not in LOGITS:
            raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
        if rolling_threshold is not None and rolling_threshold <= 0:
            raise ValueError(f"rolling_threshold must be positive or null, got {rolling_threshold}")
        if not 0 < k <= geometry.vocab:
            raise ValueError(f"k must be in 1..vocab ({geometry.vocab}), got {k}")
        super().__init__(geometry)
        self.rolling_threshold = rolling_threshold
        self.logits = logits
        self.k = k
        self.kept: list[mx.array] = []

    def evict(self, turns: list[int]) -> int:
        """How many oldest turns to drop so the history is at most the threshold.

        The newest turn is always kept, even when it alone passes the threshold.
        """
        if self.rolling_threshold is None:
            return 0
        total, dropped = sum(turns), 0
        while total > self.rolling_threshold and dropped < len(turns) - 1:
            total -= turns[dropped]
            dropped += 1
        return dropped

    def keep_logits(self, logits: mx.array) -> None:
        if self.logits == "full":
            self.kept.append(logits)
            return
        # argpartition's slice is a view of a vocab-wide index array (so is a same-size cast of
        # it): copy it, so only (batch, k) arrays survive the step.
        ranked = mx.argpartition(-logits, kth=self.k - 1, axis=-1)
        top = mx.array(ranked[..., : self.k], dtype=mx.int32)
        values = mx.take_along_axis(logits, top, axis=-1)
        mx.eval(top, values)
        self.kept.extend((values, top))

    def start_turn(self) -> None:
        self.kept = []

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.kept)

