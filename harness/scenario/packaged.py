"""The scenarios shipped inside kvmem, so that `kvmem list` and `kvmem run scenarios/...` work
outside a checkout of this repository.

`harness/bundled` is a link to the repository's `scenarios/` folder: an editable install reads
the folder through it, and a wheel holds a copy as package data (pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

FOLDER = "scenarios"
BUNDLED = Path(__file__).parent.parent / "bundled"


def fallback(paths: Sequence[str | Path]) -> tuple[list[Path], str | None]:
    """`paths`, each one under a `scenarios` folder that the current folder lacks read from the
    bundled copy instead, and a line saying so when one was (else None).

    Only a missing folder falls back: a file missing from a `scenarios/` that exists is the
    user's mistake and stays one.
    """
    given = list(map(Path, paths))
    under = [p.parts[:1] == (FOLDER,) for p in given]
    if not any(under) or Path(FOLDER).exists():
        return given, None
    return ([BUNDLED.joinpath(*p.parts[1:]) if inside else p for p, inside in zip(given, under, strict=True)],
            f"no {FOLDER}/ folder here: using the scenarios bundled with kvmem, in {BUNDLED}/")
