"""Values a message echoes back, cut to fit one line.

Whatever a user wrote (a preset, a component, a key, a flag's value) may be 100,000 characters
long by mistake; the message that names it must still be one readable line.
"""

from __future__ import annotations

import unicodedata

MAX_ECHO = 40  # characters of a value shown; enough to recognise a name


def echo(value: object, limit: int = MAX_ECHO) -> str:
    """`value`'s repr, a string cut to `limit` characters and marked with '...'."""
    if isinstance(value, str):
        return repr(value if len(value) <= limit else value[:limit] + "...")
    if isinstance(value, int) and abs(value) >= 10**limit:
        return "a huge integer"  # repr refuses more than 4,300 digits
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def clip(text: str, limit: int = 200) -> str:
    """A message from elsewhere (an exception's), cut to `limit` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def spelled(name: str) -> str:
    """`name`, followed by the code points of its characters outside ASCII, so that two names
    that look alike (`leak` and `lеak`, a Cyrillic е) read apart."""
    odd = [c for c in name if not c.isascii() or not c.isprintable()]
    if not odd:
        return name
    points = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}"
                       for c in dict.fromkeys(odd))
    return f"{name} ({points})"
