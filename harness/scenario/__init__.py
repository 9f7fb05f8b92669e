"""Scenario files: the schema (`schema`), reading and merging them (`load`), and the check of
the components they name before any run (`checks`)."""

from .load import ScenarioError, Variant, check_unique, discover, load_variants
from .schema import (
    ChatSpec,
    ComponentSpec,
    DetectSpec,
    ExpectSpec,
    ScenarioSpec,
    SpikeBound,
    WorkloadSpec,
)

__all__ = ["ChatSpec", "ComponentSpec", "DetectSpec", "ExpectSpec", "ScenarioError",
           "ScenarioSpec", "SpikeBound", "Variant", "WorkloadSpec", "check_unique", "discover",
           "load_variants"]
