"""Processes a test started, told apart from those of anything else running on the machine.

A check that no server outlives a run cannot look for every server process: a second suite, or
any other user of the machine, may run servers of its own at the same time. Every process kvmem
starts inherits its environment, so a test tags its own environment with a token and looks for
the token in each process's environment, whether the process is still a descendant or was
orphaned.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

TAG = "KVMEM_TEST_RUN"


@contextmanager
def tagged() -> Iterator[str]:
    """Tag this process's environment (and so its children's) for the block; the token."""
    token, previous = uuid.uuid4().hex, os.environ.get(TAG)
    os.environ[TAG] = token
    try:
        yield token
    finally:
        if previous is None:
            del os.environ[TAG]
        else:
            os.environ[TAG] = previous


def started_under(token: str, *commands: str) -> list[psutil.Process]:
    """The live processes tagged with `token` whose command line contains one of `commands`."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(TAG) != token or process.status() == psutil.STATUS_ZOMBIE:
                continue
            line = " ".join(process.cmdline())
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
        if any(command in line for command in commands):
            found.append(process)
    return found
