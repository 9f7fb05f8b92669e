"""Scenario files: the schema (`schema`, with the server's part in `server` and the engines a
scenario names in `engines`), reading and merging them (`load`), the check of the components
they name before any run (`checks`), and the scenarios bundled with kvmem (`packaged`)."""

from .load import ScenarioError, Variant, check_unique, discover, load_variants
from .schema import ChatSpec, ComponentSpec, ScenarioSpec, WorkloadSpec

__all__ = ["ChatSpec", "ComponentSpec", "ScenarioError", "ScenarioSpec", "Variant",
           "WorkloadSpec", "check_unique", "discover", "load_variants"]
