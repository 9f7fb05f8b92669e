"""Children a test interrupts hear the interrupt, whatever signal dispositions the suite inherited.

A shell starts a background job of a non-interactive script (`.ci/run &`, `nohup`, some CI
runners) with SIGINT ignored, and an ignored signal stays ignored across fork and exec: Python
then installs no KeyboardInterrupt handler, and a child the test interrupts runs to its end. Such
a test starts its child with `preexec_fn=interruptible`, as a terminal would have started it.
"""

from __future__ import annotations

import signal


def interruptible() -> None:
    """Run in the child before exec: SIGINT and SIGTERM back to their defaults."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
