"""Command line: `python -m harness` and the `kvmem` script are this one parser, assembled from
the modules that hold each group of commands with its arguments (`running`, `gating`,
`history`, `recording`, and `kvmem init` in harness.adopt).

Exit status: 0 every expectation held, 1 an expectation (or comparison) failed, 2 bad input or a
run that could not complete. Bad input is one line naming the file and the field, never a
traceback: every refusal is a `BadInput`. The runner (MLX, pandas, matplotlib) is imported by
the commands that run or merge, after their input has been read: `kvmem --help` and the
refusal of a bad file load neither.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

from .. import adopt
from ..common.echo import clip
from ..common.errors import BadInput
from . import gating, history, options, recording, running, schema


class _Parser(argparse.ArgumentParser):
    """argparse, reporting a mistake in the arguments as all bad input is reported: one line,
    the values it echoes cut to fit, exit 2 (`--help` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {clip(message, 300)}\n")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="kvmem",
                  description="Memory profiling and regression gate for KV-cache strategies on MLX.")
    sub = top.add_subparsers(dest="command", required=True)
    for group in (running, recording, gating, history, schema, adopt):
        group.add(sub)
    return top


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM ends a run as Ctrl-C does: the running child is killed, written reports stay."""
    raise KeyboardInterrupt


def _import_from_cwd() -> None:
    """Resolve import-path components from the current folder, as `python -m harness` does.

    `python -m` puts the current folder first on sys.path and a console script does not, so
    without this `kvmem run scenarios` could not find `examples.leaky_store` where
    `python -m harness run scenarios` does. Spawned children inherit the path.
    """
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _import_from_cwd()
    # Logs in CI are wide; a terminal keeps its own width.
    console = Console(width=None if sys.stdout.isatty() else 160)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        return int(args.handler(args, console))
    except BadInput as exc:
        options.errors().print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        return 2
    except KeyboardInterrupt:
        options.errors().print("[red]interrupted[/red]: what was running was stopped; "
                               "reports already written are kept", highlight=False)
        return 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
