"""`python -m harness` and the `kvmem` script: the command line, Ctrl-C handled from the start.

`harness.cli.main` turns an interrupt of a command into exit 130 and one line. One can also come
while the command line's own modules import (about 0.3 s) or while main is printing an error;
`run` imports the command line inside the same handling, so that too is one line, never a
traceback. mlx-lm's package `__init__` is deferred in kvmem's processes
(`harness.common.mlx_lm_import`): it imports transformers, which a run on mlx-lm's caches never uses.
"""

from __future__ import annotations

import signal
import sys


def run() -> None:
    try:
        from .common.mlx_lm_import import defer_init

        defer_init()
        from .cli import main

        code = main()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C cannot cut this line
        sys.stderr.write("interrupted: reports already written are kept\n")
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    run()
