"""The marks a template under `templates/` may carry, so that one text writes the gate's files
for every repository (those of `kvmem init` and kvmem's own) and still reads as the file it
writes. There are two, and nothing else: `__NAME__`, replaced by the value of NAME, in a path
or a line; and whole lines `#@if FLAG`, `#@else` and `#@end`, which keep the lines between
them where FLAG is set (or, after `#@else`, where it is not) and are themselves dropped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

MARK = "#@"
NAME = re.compile(r"__([A-Z][A-Z_]*[A-Z])__")


def render(text: str, flags: Mapping[str, bool], values: Mapping[str, str]) -> str:
    """`text` with its blocks kept or dropped by `flags` and its names replaced by `values`.
    A mark or a name the template gets wrong is kvmem's mistake, never the user's: ValueError."""
    kept: list[str] = []
    blocks: list[bool] = []  # for each open block, whether its lines are kept
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        mark = line.strip()
        if not mark.startswith(MARK):
            if all(blocks):
                kept.append(line)
            continue
        word, _, flag = mark[len(MARK):].partition(" ")
        if word == "if" and flag in flags:
            blocks.append(flags[flag])
        elif word == "else" and blocks and not flag:
            blocks[-1] = not blocks[-1]
        elif word == "end" and blocks and not flag:
            blocks.pop()
        else:
            raise ValueError(f"line {number}: {mark!r} is no mark of an open block or a known "
                             f"flag ({', '.join(sorted(flags))})")
    if blocks:
        raise ValueError(f"{len(blocks)} block(s) not closed by {MARK}end")
    return substitute("".join(kept), values)


def substitute(text: str, values: Mapping[str, str]) -> str:
    """`text` with each `__NAME__` replaced by its value."""
    def value(found: re.Match[str]) -> str:
        if found[1] not in values:
            raise ValueError(f"{found[0]}: no such value ({', '.join(sorted(values))})")
        return values[found[1]]
    return NAME.sub(value, text)
