"""Deprecated: the component protocols moved to `harness.components.protocols`; import them
from `harness` (docs/api.md). This path warns, and works until kvmem 0.3.0 removes it."""

from __future__ import annotations

from typing import Any

from .common.moved import forward


def __getattr__(name: str) -> Any:
    return forward(__name__, name, "harness")
