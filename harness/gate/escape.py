"""What a pull request wrote, shown as data in every rendering: names, reasons, messages,
values and error text on one line, with nothing invisible, and in the comment with nothing
Markdown, HTML or GitHub acts on. A `|` would forge a table's cells, a backtick close a code span
early, a `<!--` hide the rest of the comment, `[x](y)` make a link, `@name` ping someone, `:x:`
draw an emoji; a line break would end a row, a bidi override reorder it.
"""

from __future__ import annotations

import re
import unicodedata

from ..common.echo import spelled

_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
_ESCAPED = frozenset("\\`<|[]*~&")  # `>` acts only after a `<` or at a line's start
# A `_` between two letters or digits opens and closes nothing; any other may.
_UNDERSCORE = re.compile(r"(?<![^\W_])_|_(?![^\W_])")
# After `@` or `#` before a word (a mention, a reference), the first `:` of `:name:` (an
# emoji) or of `://`, and `www` before its dot (a bare link).
_AUTOLINK = re.compile(r"(?<=[@#])(?=\w)|(?<=:)(?=//|[\w+-]+:)|(?<=www)(?=\.)", re.I)
_JOINER = "\u2060"  # WORD JOINER: invisible, and ends a mention, a reference or a link


def plain(text: object) -> str:
    """`text` on one line, as the terminal and JUnit show it: a line break reads as a space,
    any other control or format character (an escape sequence, a bidi override, a zero-width
    space) as its code point."""
    return "".join(" " if c in _BREAKS else f"⟨U+{ord(c):04X}⟩"
                   if unicodedata.category(c) in ("Cc", "Cf", "Co", "Cs") else c
                   for c in str(text))


def md(text: object) -> str:
    """`text` as literal Markdown, in a table cell or a line: nothing in it formats, links,
    mentions, comments out, or splits a cell or a row."""
    shown = "".join("\\" + c if c in _ESCAPED else c for c in plain(text))
    return _AUTOLINK.sub(_JOINER, _UNDERSCORE.sub(r"\\_", shown))


def verbatim(text: object) -> str:
    """`text` as inline code where a code span holds it as it is; escaped text where it would
    close the span (a backtick) or split a table cell (a `|`)."""
    shown = plain(text)
    if not shown.strip() or "`" in shown or "|" in shown:
        return md(shown)
    return f"`{shown}`"


def esc(text: object, markdown: str) -> str:
    """`text` for the comment (`markdown` is a backtick there), else for the terminal."""
    return md(text) if markdown else plain(text)


def as_name(text: object, markdown: str) -> str:
    """A name (a finding's kind, an expectation, a holder, a commit) as code in the comment, as
    is in the terminal."""
    return verbatim(text) if markdown else plain(text)


def named(label: str, markdown: str = "`") -> str:
    """A variant's label, as code in the comment, with the code points of any character outside
    ASCII after it, so two labels that look alike read apart."""
    rest = spelled(label)[len(label):]
    return f"{verbatim(label)}{md(rest)}" if markdown else plain(label) + rest
