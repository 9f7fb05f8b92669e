"""The runner's defaults that the command line shows, in a module that imports nothing.

`kvmem --help` and the refusal of a bad file build the whole parser; reading these from the
modules that use them would load MLX, pandas and matplotlib first.
"""

import os

DEFAULT_TIMEOUT = 1800.0  # seconds a variant may run; a scenario or `--timeout` says otherwise
DEFAULT_RUNS = 5  # `kvmem noise`: runs per variant
DEFAULT_OUT = "reports-noise"  # beside `kvmem run`'s reports, so a walk of one never finds both


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else all): `kvmem run
    --jobs auto`, its default."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1
