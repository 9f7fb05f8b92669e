"""Version bounds that a component's package puts on mlx and mlx-lm, against what is installed.

A store written for mlx-lm 0.2x can run under 0.3x and measure something its authors never
shipped: a cache class renamed, a copy that became lazy. The run still goes on (the user may
know better), but its output says so, once per package and bound. Only installed packages
declare bounds; a component loaded from a folder (`examples.leaky_store:LeakyStore`) has none,
but the packages it imports do. Which packages the components loaded comes from the pre-run
check (harness.components.check, in a child); this module reads package metadata only, so no
user code is imported in the parent.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

WATCHED = ("mlx", "mlx-lm")


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _broken_bounds(dist: str) -> list[tuple[Requirement, str]]:
    """The requirements of `dist` on a watched package that its installed version violates."""
    broken = []
    for line in metadata.requires(dist) or []:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue  # pip installed it; a bound it cannot parse is not ours to judge
        name = canonicalize_name(requirement.name)
        if name not in WATCHED:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # for another platform, or only with an extra
        installed = _installed(name)
        if installed is not None and not requirement.specifier.contains(installed, prereleases=True):
            broken.append((requirement, installed))
    return broken


def bound_warnings(loaded: Iterable[tuple[str, dict[str, str]]]) -> list[str]:
    """One line per package and violated bound among the packages each component set loaded
    (`loaded`: (what loaded them, {distribution: version})), naming the package, what loaded
    it, the bound and the installed version. A glue module's imports count: the packages are
    those the pre-run check saw loaded, not only the one owning the component's module."""
    lines: dict[tuple[str, str], str] = {}
    for who, packages in loaded:
        for dist, version in packages.items():
            for requirement, installed in _broken_bounds(dist):
                key = (canonicalize_name(dist), str(requirement))
                lines.setdefault(key, (
                    f"{who} loads {dist} {version}, which requires "
                    f"{requirement.name}{requirement.specifier}; installed is {installed} "
                    "(the run goes on)"))
    return list(lines.values())
