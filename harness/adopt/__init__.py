"""`kvmem init`: what a repository needs to gate its pull requests on memory with kvmem.

It writes the files under `templates/` into the root of the git repository it runs in, rendered
for a pinned kvmem (kit.py): a starter scenario that passes in seconds, a baselines folder
saying how baselines are recorded, and four GitHub workflows: a pull request's measurement, its
judge (the verdict as the commit status `CONTEXT`, and the comment), the withdrawal of an
acceptance on a push, and a nightly check; those that run kvmem install one pinned kvmem
(`pin.py`). kvmem's own workflows are written from the same templates (own.py). Files already
there are refused, not overwritten, unless asked: they may be the user's own.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from rich.console import Console

from ..common.echo import echo
from ..common.errors import BadInput, cannot_write
from ..common.files import atomic_text
from .kit import Setup, rendered
from .kit import templates as templates  # what a wheel ships (tests/test_packaging.py)
from .pin import PinError, checked, default

LABEL = "memory-accepted"
# The commit status the judge sets on a pull request's head: what branch protection requires.
CONTEXT = "kvmem/memory"
MAX_SHARDS = 256  # the most jobs a GitHub matrix makes


class AdoptError(BadInput):
    """`kvmem init` cannot write its files: one line naming the file or the option."""


def repository(folder: Path) -> Path:
    """The root of the git repository holding `folder`."""
    try:
        top = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True)
    except OSError as exc:
        raise AdoptError(f"git: cannot run it ({exc.strerror or exc}); kvmem init writes into "
                         "a git repository") from None
    if top.returncode != 0:
        raise AdoptError(f"{folder}: not in a git repository; run `git init` first, or pass "
                         "--dir with a folder of your repository")
    return Path(top.stdout.strip())


def write(root: Path, install: str, force: bool = False, shards: int = 1) -> list[str]:
    """Write every template under `root`, the workflows installing `install` and running the
    scenarios in `shards` parts; refuse (writing nothing) when one exists, unless `force`.
    Returns the paths written, relative to `root`."""
    texts = rendered(Setup(install, shards=shards))
    existing = [path for path in texts if (root / path).exists()]
    if existing and not force:
        raise AdoptError(f"{', '.join(existing)}: already in {root}; kvmem init overwrites "
                         "nothing without --force")
    for path, text in texts.items():
        try:
            atomic_text(root / path, text)
        except OSError as exc:
            raise cannot_write(root / path, exc) from None
    return list(texts)


def _init(args: argparse.Namespace, console: Console) -> int:
    try:
        install = checked(args.install) if args.install else default()
    except PinError as exc:
        raise AdoptError(str(exc)) from None
    root = repository(Path(args.dir))
    for path in write(root, install, args.force, args.shards):
        console.print(f"wrote {path}", highlight=False)
    console.print(f"into {root}; the workflows install {install}\n\nnext steps:\n"
                  "  1. kvmem run scenarios  (the starter passes in a few seconds)\n"
                  '  2. kvmem baseline update --runs 3 --reason "first baselines"  (on Linux, '
                  "the runners' backend: baselines/README.md)\n"
                  "  3. add reports/ and kvmem-gate/ to .gitignore; commit scenarios/, "
                  "baselines/ and .github/workflows/\n"
                  f"  4. create the label {LABEL}: a maintainer applies it to a pull request to "
                  "accept its memory change (a push takes it off again)\n"
                  f"  5. once the workflows are on the default branch, make the status {CONTEXT} "
                  "a required check of that branch (branch protection or a ruleset): the judge "
                  "sets it on each pull request's head commit",
                  highlight=False, markup=False, soft_wrap=True)
    return 0


def _shards(text: str) -> int:
    if text.isdecimal() and len(text) <= len(str(MAX_SHARDS)) and 1 <= int(text) <= MAX_SHARDS:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a whole number of shards from 1 to {MAX_SHARDS}, "
                                     f"got {echo(text)}")


def add(sub: argparse._SubParsersAction) -> None:
    """`kvmem init [--install SPEC] [--shards N] [--dir DIR] [--force]`."""
    init = sub.add_parser(
        "init", help="write a starter scenario, a baselines folder and the memory gate's GitHub "
                     "workflows into this git repository")
    init.add_argument(
        "--install", metavar="SPEC",
        help="the pinned kvmem the workflows install, as pip reads it: "
             "'kvmem @ git+https://github.com/OWNER/kvmem@COMMIT' (a full commit), "
             "'kvmem @ https://HOST/kvmem-X-py3-none-any.whl' or 'kvmem==X'. Default: this "
             "kvmem, where pip recorded it came from (a git commit, a URL, a release); "
             "required when it came from a local folder or file, which a runner cannot reach")
    init.add_argument("--shards", type=_shards, default=1, metavar="N",
                      help="run the scenarios, of a pull request and of the nightly check, in N "
                           "parts, each on a runner of its own, merged before they are judged "
                           "(default: 1)")
    init.add_argument("--dir", default=".",
                      help="a folder of the repository (default: the current one); the files "
                           "go to the repository's root")
    init.add_argument("--force", action="store_true", help="overwrite files that exist")
    init.set_defaults(handler=_init)
