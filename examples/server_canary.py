"""A fault for serve mode's canary, loaded into the server by the agent (`server.plugins`).

Imported in `mlx_lm.server`'s process before the server runs, it wraps mlx-lm's
`LRUPromptCache.insert_cache`. With `KVMEM_CANARY_HOARD=1` in the server's environment
(`server.env`) the wrapper also keeps every prompt cache the server stores in a list of its own,
so an entry the LRU evicts stays alive, unreported by the prompt cache's byte count: the leak
a server's detectors must flag. Without it the wrapper keeps nothing: the clean twin runs the
same wrapped method, so the two differ only in the fault.

Loaded by import path, as `examples/canary_stores.py`: from the repository root, or from kvmem's
own copy in any folder.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from mlx_lm.models.cache import LRUPromptCache

HOARD = os.environ.get("KVMEM_CANARY_HOARD") == "1"
kept: list[Any] = []  # every prompt cache stored, while HOARD

_insert = LRUPromptCache.insert_cache


@functools.wraps(_insert)
def insert_cache(self: LRUPromptCache, model: Any, tokens: list[int], prompt_cache: list[Any],
                 **kwargs: Any) -> None:
    if HOARD:
        kept.append(prompt_cache)
    _insert(self, model, tokens, prompt_cache, **kwargs)


LRUPromptCache.insert_cache = insert_cache
