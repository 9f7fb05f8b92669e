"""Byte sizes: parsed from what people write (`512 MiB`) and formatted for what they read, one
helper a form: `format_bytes` (`7.81 MiB`), `exact_bytes` (`8,192,000 B`), `mib` (a column in
MiB).

Sizes stay exact as floats (detectors and the gate compute with them), so none may pass 2**53
bytes (8 PiB).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema

from .errors import BadInput

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
_UNITS = {"": 1, "B": 1, "KIB": KiB, "MIB": MiB, "GIB": GiB, "TIB": TiB,
          "KB": 10**3, "MB": 10**6, "GB": 10**9}
_SIZE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$", re.ASCII)
MAX_SIZE = 2**53


def parse_size(value: Any) -> int:
    """Bytes from an integer or a string such as `512 MiB`; negative sizes are rejected."""
    if isinstance(value, bool):
        raise BadInput("expected a size in bytes, such as 4096 or '512 MiB'")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and len(value) <= 64 and (match := _SIZE.match(value)):
        unit = match.group(2).upper()
        if unit not in _UNITS:
            raise BadInput(f"unknown unit {match.group(2)!r}: expected B, KiB, MiB, GiB or TiB")
        # Exact arithmetic: a float would turn 40 digits into inf (OverflowError) or round.
        number = int(Fraction(match.group(1)) * _UNITS[unit])
    else:
        raise BadInput("expected a size in bytes, such as 4096 or '512 MiB'")
    if number < 0:
        raise BadInput("expected a size of zero or more bytes")
    if number > MAX_SIZE:
        raise BadInput("expected a size of at most 8 PiB (2**53 bytes)")
    return number


# How a number with a unit is written, for an editor checking a scenario (its JSON Schema).
NUMBER_TEXT = r"^\s*[0-9]+(\.[0-9]+)?\s*"
SIZE_TEXT = NUMBER_TEXT + r"([Bb]|[KkMmGg][Ii]?[Bb]|[Tt][Ii][Bb])?\s*"


def written_as(pattern: str, number: dict[str, Any], example: str) -> WithJsonSchema:
    """A value's JSON Schema: a number (`number`'s schema) or text matching `pattern`."""
    return WithJsonSchema({"anyOf": [number, {"type": "string", "pattern": pattern + "$"}],
                           "examples": [example]})


Size = Annotated[int, BeforeValidator(parse_size),
                 written_as(SIZE_TEXT, {"type": "integer", "minimum": 0}, "512 MiB")]

_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|)\s*$", re.ASCII)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600}
MAX_DURATION = 7 * 86_400.0  # a week
_PER = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*/\s*(s|m|h)\s*$", re.ASCII)
MAX_PER_SECOND = 10_000.0


def _scaled(value: Any, pattern: re.Pattern[str], scale: Callable[[float, str], float],
            expected: str, most: float) -> float:
    """A number, or a string `pattern` reads as a number and a unit, scaled by its unit: more
    than zero, `most` at most."""
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and len(value) <= 32 and (match := pattern.match(value)):
        number = scale(float(match.group(1)), match.group(2))
    if number is None or not 0 < number <= most:
        raise BadInput(f"{expected}, more than zero and at most {most:,g}")
    return number


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as `90s`, `30m` or `2h` (a week at most)."""
    return _scaled(value, _DURATION, lambda n, unit: n * _SECONDS[unit],
                   "expected a duration in seconds such as 90, '90s', '30m' or '2h'",
                   MAX_DURATION)


def parse_per_second(value: Any) -> float:
    """Events a second from `2/s`, `90/m`, `500/h` or a number (a second)."""
    return _scaled(value, _PER, lambda n, unit: n / _SECONDS[unit],
                   "expected an arrival rate such as 2/s, 90/m or 500/h (a second)",
                   MAX_PER_SECOND)


Duration = Annotated[float, BeforeValidator(parse_duration),
                     written_as(NUMBER_TEXT + r"[smh]?\s*", {"type": "number", "exclusiveMinimum": 0},
                                "30m")]
PerSecond = Annotated[float, BeforeValidator(parse_per_second),
                      written_as(NUMBER_TEXT + r"/\s*[smh]\s*",
                                 {"type": "number", "exclusiveMinimum": 0}, "2/s")]


BINARY_UNITS = (("B", 1), ("KiB", KiB), ("MiB", MiB), ("GiB", GiB))


def binary_unit(value: float) -> tuple[str, int]:
    """The unit `format_bytes` writes `value` in, and its size: the largest that `value` fills
    (GiB at most). A chart's axis takes the unit of its largest value."""
    return next(((name, size) for name, size in reversed(BINARY_UNITS) if abs(value) >= size),
                BINARY_UNITS[0])


def format_bytes(value: float, signed: bool = False) -> str:
    """`7.81 MiB`, `-512 B`; three significant digits above 1 KiB."""
    sign = ("+" if value > 0 else "-" if value < 0 else "±") if signed else ("-" if value < 0 else "")
    unit, divisor = binary_unit(value)
    size = abs(value) / divisor
    text = f"{size:.0f}" if unit == "B" else f"{size:.3g}" if size < 100 else f"{size:.0f}"
    return f"{sign}{text} {unit}"


def exact_bytes(value: float, signed: bool = False) -> str:
    """`573,440 B`, `+573,440 B`: every byte, where `format_bytes` would round a change away."""
    return f"{value:{'+' if signed else ''},.0f} B"


def mib(value: float | None, digits: int = 2) -> str:
    """`1,234.56`: bytes in MiB with a fixed number of decimals, for columns headed MiB and
    messages that name the unit; `-` for no value."""
    return "-" if value is None else f"{value / MiB:,.{digits}f}"
