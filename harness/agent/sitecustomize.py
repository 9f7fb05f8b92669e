"""Started by Python in every interpreter whose `PYTHONPATH` holds this folder: kvmem puts it
there for a server it starts. The agent starts only where `KVMEM_AGENT` is set: in the first
process of the command alone (it removes the variable from its own environment, so the
server's own children run without it), or, where `kvmem record` follows the command's children
(`KVMEM_AGENT_FOLLOW`), in every Python process it starts. Another `sitecustomize` further along `sys.path` (a
distribution's own) still runs after it."""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain() -> None:
    """Run the next `sitecustomize.py` on sys.path, which this one shadows."""
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != _HERE and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_sitecustomize_next", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get("KVMEM_AGENT_FOLLOW"):
    import kvmem_follow  # type: ignore[import-not-found]  # beside this file, on PYTHONPATH

    kvmem_follow.start_from_environment()
elif os.environ.get("KVMEM_AGENT"):
    import kvmem_agent  # type: ignore[import-not-found]  # beside this file, on PYTHONPATH

    kvmem_agent.start_from_environment()
_chain()
