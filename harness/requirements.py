"""Version bounds that a component's package puts on mlx and mlx-lm, against what is installed.

A store written for mlx-lm 0.2x can run under 0.3x and measure something its authors never
shipped: a cache class renamed, a copy that became lazy. The run still goes on (the user may
know better), but its output says so, once per package and bound. Only installed packages
declare bounds; a component loaded from a folder (`examples.leaky_store:LeakyStore`) has none.
The check reads package metadata only, so no user code is imported in the parent.
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


def bound_warnings(import_paths: Iterable[str]) -> list[str]:
    """One line per package and violated bound among the packages providing `import_paths`
    (`package.module:factory`), naming the component, the bound and the installed version."""
    owners = metadata.packages_distributions()
    lines: dict[tuple[str, str], str] = {}
    for path in import_paths:
        top = path.partition(":")[0].split(".")[0]
        for dist in owners.get(top, []):
            for requirement, installed in _broken_bounds(dist):
                key = (canonicalize_name(dist), str(requirement))
                lines.setdefault(key, (
                    f"{path} comes from {dist} {metadata.version(dist)}, which requires "
                    f"{requirement.name}{requirement.specifier}; installed is {installed} "
                    "(the run goes on)"))
    return list(lines.values())
