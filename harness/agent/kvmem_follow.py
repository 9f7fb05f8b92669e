"""`kvmem record`'s agent: the agent of `kvmem_agent`, in every Python process of the command.

Started by `sitecustomize` where `KVMEM_AGENT_FOLLOW` is set. In the command's first process the
variables that say where kvmem listens stay in the environment, marked `child`, so every Python
process it starts runs an agent of its own; a child made by `os.fork` starts one as it is born.
Each connects to kvmem as the first did, saying its pid, its parent and whether it was forked.
A child's agent binds MLX's counters once the child has imported MLX (a child that never does
is sampled for RSS alone, at no cost of an MLX import), and reads no logical size, cap or
plugin: those are the first process's.

Standalone, as `kvmem_agent` is: the standard library only, imported beside it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import kvmem_agent  # type: ignore[import-not-found]  # beside this file, on PYTHONPATH

# What a followed command's children inherit: where kvmem listens and how often to sample.
INHERITED = ("KVMEM_AGENT", "KVMEM_AGENT_KEY", "KVMEM_AGENT_PERIOD", "KVMEM_AGENT_FOLLOW")
FOLLOW, CHILD = "1", "child"  # KVMEM_AGENT_FOLLOW in the command's first process, in a child


def start_from_environment() -> Any:
    """The agent of this process of a followed command, connected, following its forks."""
    inherited = {name: os.environ.get(name, "") for name in INHERITED}
    if inherited["KVMEM_AGENT_FOLLOW"] == CHILD:
        agent = kvmem_agent.Agent(float(inherited["KVMEM_AGENT_PERIOD"] or 0.1), None, lazy=True)
        kvmem_agent.connect(agent, inherited, [], None, forks)
        return agent
    agent = kvmem_agent.start_from_environment(forks)  # which clears the variables
    os.environ.update(inherited, KVMEM_AGENT_FOLLOW=CHILD)
    # The walker's one-time cost on the host (about 0.5 MiB: its first lists and caches) paid
    # before the command runs, so that the first walk kvmem asks for does not read as the
    # command's RSS drifting up.
    kvmem_agent.at_rest(False, True)
    return agent


def forks(agent: Any, address: tuple[str, int], key: bytes, hello: dict) -> None:
    """Start an agent of its own in every child this process forks: a fresh sampler and
    connection (the parent's threads do not survive the fork)."""
    forking: list[bool] = []

    def before() -> None:  # no sample is half taken when the fork copies the lock
        forking.append(agent.lock.acquire(timeout=1.0))

    def in_parent() -> None:
        if forking.pop():
            agent.lock.release()

    def in_child() -> None:
        forking.clear()
        agent.fresh()
        born = {**hello, "pid": os.getpid(), "parent": os.getppid(), "forked": True}
        threading.Thread(target=agent.serve, args=(address, key, born),
                         name="kvmem-agent", daemon=True).start()

    os.register_at_fork(before=before, after_in_parent=in_parent, after_in_child=in_child)
