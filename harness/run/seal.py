"""Bindings frozen when kvmem made them, and a check that the measured code left them so.

The probe reads MLX's memory through functions and objects it holds (`harness.run.probe`): its
bound counters, its methods, the rows it appends to. Code in the same process can reach them
(`sys.modules`, `gc`) and rebind one to a function that reads less. A seal keeps, out of that
code's sight in a closure, each binding's reader and the object it gave when sealed; `broken`
names the first that now gives another, and the run fails with it. It cannot stop code that
means to hide (that code could rebind anything), but a rebinding it checks never passes unseen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REBOUND = "the probe's counters were rebound by the measured code"


def _origin(thing: Any) -> str:
    """What a replacement is, as the failure names it: its module and qualified name."""
    module = getattr(thing, "__module__", None) or "?"
    name = getattr(thing, "__qualname__", None) or type(thing).__qualname__
    return f"{module}.{name}"


def seal(readers: dict[str, Callable[[], Any]]) -> Callable[[], str | None]:
    """A check of `readers` (a binding's name → a function reading it now): the check returns
    None while each reads the object it read at sealing, else the failure naming the first."""
    sealed = {name: (read, read()) for name, read in readers.items()}

    def broken() -> str | None:
        for name, (read, then) in sealed.items():
            try:
                now = read()
            except Exception:  # a binding deleted: a reader raises KeyError or the like
                return f"{REBOUND}: {name} was removed"
            if now is not then:
                return f"{REBOUND}: {name} is now {_origin(now)}"
        return None

    return broken
