"""The base of every schema a user writes (a scenario, its expectations, a detector's settings):
an unknown key is an error, not ignored, and a validated value is frozen.

A schema whose fields come from a registry (a detector's thresholds under `detect:`, its
presence and a metric's budget under `expect:`) is validated against the registry as it stands
when a file is read (`registered`), not as it stood at import: an entry added later is known,
and a name not registered is an unknown field.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, create_model


class Strict(BaseModel):
    # defer_build: validators are built on first use; a variant's process only unpickles
    # scenarios, and building them all at import was 0.17 s of its 0.85 s start.
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True, defer_build=True)


Fields = tuple[tuple[str, tuple[Any, Any]], ...]  # (name, (type, default)) each


@functools.cache
def _closed(base: type[Strict], fields: Fields) -> type[Strict]:
    """`base` with `fields` (those it does not declare itself), closed to unknown keys."""
    added: dict[str, Any] = {name: spec for name, spec in fields if name not in base.model_fields}
    return create_model(base.__name__, __base__=base, __cls_kwargs__={"extra": "forbid"},
                        **added)


def registered(base: type[Strict], fields: Callable[[], dict[str, tuple[Any, Any]]]
               ) -> Callable[[Any], Any]:
    """A validator of `base` with the fields `fields()` gives when it runs. The value is a plain
    `base` (declared with `extra="allow"`) holding the registered fields as extras, so it
    pickles by value into a variant's process."""
    def validate(value: Any) -> Strict:
        checked = _closed(base, tuple(fields().items())).model_validate(value)
        return base.model_construct(checked.model_fields_set, **dict(checked))

    return validate


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
