"""Which variants a command measures: every variant of the scenario files under its paths,
validated before any runs, read from the scenarios bundled with kvmem where the current folder
has no `scenarios/` (harness.scenario.packaged)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from ..components.registry import import_paths
from ..report import console as term
from ..scenario import ScenarioError, Variant, check_unique, discover, load_variants, packaged


def variants(paths: Sequence[str | Path], only: list[str] | None = None,
             console: Console | None = None) -> list[Variant]:
    """Every variant of the scenario files under `paths` (or those named), validated first;
    two that would write one report folder are bad input.

    With a console (the commands that run them), warns once about each version bound on mlx
    or mlx-lm that a component's package declares and the installed version violates.
    """
    paths, note = packaged.fallback(paths)
    if note and console is not None:
        console.print(note, highlight=False, soft_wrap=True)
    found = [v for path in discover(paths) for v in load_variants(path, only)]
    if not found:
        raise ScenarioError(f"{', '.join(map(str, paths))}: no scenario files (*.yaml) found")
    check_unique(found)
    if console is not None:
        from ..components.requirements import bound_warnings  # packaging: once files are read

        term.warn(console, bound_warnings((", ".join(_user_components(v)), v.packages)
                                          for v in found if v.packages))
    return found


def _user_components(variant: Variant) -> list[str]:
    cache = variant.spec.cache
    return import_paths(c for c in (cache.layer, cache.sliding, cache.recurrent, cache.store,
                                    cache.session)
                        if c is not None)
