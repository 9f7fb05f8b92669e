"""The base of every pydantic model kvmem defines (a scenario, its expectations, a detector's
settings, a summary, the nightly record): an unknown key is an error, not ignored, and a
validated value is frozen. A model that needs otherwise overrides one setting, and says why.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class Strict(BaseModel):
    """Closed to unknown keys, frozen once validated."""

    # defer_build: validators are built on first use; a variant's process only unpickles
    # scenarios, and building them all at import was 0.17 s of its 0.85 s start.
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True, defer_build=True)


# A finite number; an int is a number, a bool or a string is not.
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]


def tagged(**members: Any) -> Any:
    """A union that validates against one member, chosen by the input's shape (`mapping`,
    `list` or `scalar`).

    Plain unions report every member's errors; a user who wrote a mapping wants to hear what
    is wrong with the mapping, not that it is not a string.
    """
    def choose(value: Any) -> str:
        # A model is a mapping too: what was validated from one is serialized as one.
        if isinstance(value, (dict, BaseModel)):
            return "mapping"
        return "list" if isinstance(value, list) else "scalar"

    choices = [Annotated[t, Tag(tag)] for tag, t in members.items()]
    # A union built at run time: only Union[...] takes its members as a tuple.
    return Annotated[Union[tuple(choices)], Discriminator(choose)]  # noqa: UP007
