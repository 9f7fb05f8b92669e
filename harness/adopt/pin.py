"""Which kvmem a repository's workflows install: one pip requirement pinned to a release, a
commit or a file, so that the gate judging a pull request cannot change under it, and always
with the `mlx` extra: the scenarios they run serve mlx-lm's caches in kvmem's own process.

The default is the running kvmem, from where pip recorded it came (PEP 610's direct_url.json):
a git commit, an archive at a URL, or, with no record, a release of an index. A local folder
or file is no default: a workflow runner cannot reach it.
"""

from __future__ import annotations

import json
import re
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from ..common.echo import echo
from ..common.errors import KvmemError

NAME = "kvmem"
EXTRA = "mlx"  # mlx-lm, which every in-process engine runs
EXAMPLE = f"--install '{NAME} @ git+https://github.com/OWNER/{NAME}@COMMIT'"
COMMIT = re.compile(r"@[0-9a-f]{40}$")
REACHABLE = ("https://", "http://")


class PinError(KvmemError, ValueError):
    """An install spec that is not a pinned kvmem, or no default to offer."""


def checked(spec: str) -> str:
    """`spec`, with the `mlx` extra, when it is a pip requirement for one kvmem a runner can
    install: `kvmem==X`, or `kvmem @ URL` of an archive, or of a VCS with a full commit."""
    try:
        requirement = Requirement(spec)
    except InvalidRequirement as exc:
        reason = str(exc).splitlines()[0]   # the lines after it draw the spec with a caret
        raise PinError(f"--install {echo(spec)}: not a pip requirement ({reason})") from None
    if canonicalize_name(requirement.name) != NAME:
        raise PinError(f"--install {echo(spec)}: names {echo(requirement.name)}, not {NAME}")
    url = requirement.url
    if url is None:
        pins = [s for s in requirement.specifier if s.operator in ("==", "===")]
        if len(pins) == 1 == len(requirement.specifier) and "*" not in pins[0].version:
            return _with_extra(requirement)
        raise PinError(f"--install {echo(spec)}: not pinned; name one version (kvmem==X), "
                       f"or a URL")
    scheme, _, _ = url.partition("://")
    if not scheme.split("+")[-1].startswith("http"):
        raise PinError(f"--install {echo(spec)}: a runner cannot reach {echo(url)}; name an "
                       "https URL")
    if "+" in scheme and not COMMIT.search(url.partition("#")[0]):
        raise PinError(f"--install {echo(spec)}: not pinned; end the URL with a full "
                       "40-character commit (@COMMIT), not a branch or a tag")
    return _with_extra(requirement)


def _with_extra(requirement: Requirement) -> str:
    requirement.extras.add(EXTRA)
    return str(requirement)


def default() -> str:
    """The requirement that installs the running kvmem again, from where pip recorded it came."""
    try:
        installed = distribution(NAME)
    except PackageNotFoundError:
        raise PinError(f"{NAME} is not installed, so there is nothing to pin: pass "
                       f"{EXAMPLE}") from None
    recorded = installed.read_text("direct_url.json")
    if recorded is None:
        return checked(f"{NAME}=={installed.version}")
    origin = json.loads(recorded)
    url = origin.get("url", "")
    vcs = origin.get("vcs_info", {})
    subdirectory = f"#subdirectory={origin['subdirectory']}" if "subdirectory" in origin else ""
    if vcs.get("vcs") == "git" and url.startswith(REACHABLE):
        return checked(f"{NAME} @ git+{url}@{vcs['commit_id']}{subdirectory}")
    if "archive_info" in origin and url.startswith(REACHABLE):
        return checked(f"{NAME} @ {url}")
    raise PinError(f"this {NAME} was installed from {url}, which a workflow runner cannot "
                   f"reach: pass the kvmem the workflows should install, pinned, e.g. {EXAMPLE}")
