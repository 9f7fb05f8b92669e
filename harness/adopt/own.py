"""kvmem's own gate workflows, written by kit.py from the templates `kvmem init` writes, with
this repository's settings: named `memory-*`, kvmem installed from the checkout (the head's to
measure, the default branch's to judge), the suite in two shards, and a nightly that also soaks
a real server and publishes the history site. After changing a template, write them again:

    python -m harness.adopt.own

tests/test_workflows.py fails while a file differs from what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..common.files import atomic_text
from .kit import Setup, rendered

SETUP = Setup(install=None, prefix="memory", shards=2, soak=True, site=True,
              origin="Written from harness/adopt/templates/ by `python -m harness.adopt.own`: "
                     "edit the template.")
WORKFLOWS = ".github/workflows/"
# The checkout this module lies in: its own workflows are this repository's.
ROOT = Path(__file__).resolve().parents[2]


def workflows() -> dict[str, str]:
    """This repository's gate workflows: each path in the repository, and its text."""
    return rendered(SETUP, WORKFLOWS)


def main() -> int:
    if not (ROOT / WORKFLOWS).is_dir():
        print(f"{ROOT}: not kvmem's checkout (no {WORKFLOWS}): run it from an editable install",
              file=sys.stderr)
        return 2
    for path, text in workflows().items():
        atomic_text(ROOT / path, text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
