"""The files of the memory gate, as one repository gets them: the templates under `templates/`
rendered for that repository's `Setup` (the marks of template.py). `kvmem init` writes them
for a pinned kvmem; kvmem's own workflows are written from the same templates (own.py), so the
two cannot drift apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from typing import TYPE_CHECKING

from .template import render, substitute

if TYPE_CHECKING:
    from importlib.abc import Traversable


@dataclass(frozen=True)
class Setup:
    """What a repository's gate is written for.

    `install` is the pinned kvmem its workflows install, or None for a repository that installs
    kvmem from its own checkout (kvmem's: the head's to measure, the default branch's to judge).
    `shards` runs the scenarios in that many parts, each on a runner of its own, merged before
    they are judged. `soak` adds the nightly's soak of `scenarios-nightly/`, and `site` the
    history site it publishes on GitHub Pages from the merged shards."""

    install: str | None
    prefix: str = "kvmem"  # of the workflows' files, names and artifacts
    shards: int = 1
    soak: bool = False
    site: bool = False
    origin: str = "Written by `kvmem init`."  # the first line of each workflow

    def __post_init__(self) -> None:
        if self.site and self.shards < 2:
            raise ValueError("the history site is published from the merged shards: shards >= 2")

    def flags(self) -> dict[str, bool]:
        return {"checkout": self.install is None, "sharded": self.shards > 1,
                "soak": self.soak, "site": self.site}

    def values(self) -> dict[str, str]:
        shards = [str(shard) for shard in range(1, self.shards + 1)]
        return {"PREFIX": self.prefix, "ORIGIN": self.origin,
                "KVMEM_INSTALL": json.dumps(self.install or ".[mlx]"),
                "JUDGE_INSTALL": json.dumps(self.install or "./judge"),
                # kvmem's own checkout runs the harness it holds, as its tests do.
                "KVMEM": "kvmem" if self.install else "python -m harness",
                "SHARDS": str(self.shards), "SHARD_LIST": ", ".join(shards),
                "SHARD_WORDS": " ".join(shards),
                "REPORTS": "merged-reports" if self.shards > 1 else "reports"}


def templates(folder: Traversable | None = None, prefix: str = "") -> dict[str, str]:
    """Each template's path under `templates/`, and its text, as shipped."""
    found: dict[str, str] = {}
    for entry in (folder or files(__package__) / "templates").iterdir():
        if entry.is_dir():
            found |= templates(entry, f"{prefix}{entry.name}/")
        else:
            found[prefix + entry.name] = entry.read_text()
    return found


def rendered(setup: Setup, under: str = "") -> dict[str, str]:
    """Each file's path in the repository and its text for `setup`, in order of path: those
    whose template lies under `under` (a folder ending in `/`), or every one."""
    flags, values = setup.flags(), setup.values()
    return {substitute(path, values): render(text, flags, values)
            for path, text in sorted(templates().items()) if path.startswith(under)}
