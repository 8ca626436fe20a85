"""Markdown under a hard length cap, for a pull-request comment (GitHub refuses comments over 65,536 characters).

The summary always comes first; then sections, row by row, while they fit; then one line saying exactly what was
left out ("… 9,871 more layers and 2 more sections (Findings, Plan) in the attached report"). A section is started
only when its heading, its table header and at least one row fit; a table is never cut inside a row.

A section with a ``fold`` puts its intro and rows inside ``<details><summary>fold</summary>`` (blank lines around the
table, so GitHub renders it), closed by ``</details>`` even when the cap cuts its rows; the closing line goes after it.

Lengths are counted in UTF-16 code units, as GitHub (JavaScript) counts them: an emoji counts 2, so the cap holds
however the length is measured (code points, or UTF-16 units).

>>> s = Section("### Layers", ["| layer |", "|---|"], [f"| l{i} |" for i in range(1000)], noun="layers")
>>> md = fit_markdown("## Audit: PASS", [s], cap=200)
>>> md.shown_rows, md.omitted_rows, measure(md.text) <= 200
(15, 985, True)
>>> md.text.splitlines()[-1]
'_… 985 more layers in the attached report._'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["DEFAULT_CAP", "GITHUB_COMMENT_LIMIT", "OPEN_LIMIT", "Fitted", "Section", "fit_markdown", "measure",
           "open_part", "percent"]

GITHUB_COMMENT_LIMIT = 65_536
DEFAULT_CAP = 60_000  # leaves room for a bot's own header or an edit marker under GitHub's limit
OPEN_LIMIT = 10_000  # UTF-8 bytes shown before any <details> is opened: what a reviewer reads first

_FOLDED = re.compile(r"^<details>.*?^</details>$", re.S | re.M)


def percent(x: float | None) -> str:
    """A share or an error (a fraction) as the Markdown writes every one: a percentage with one decimal from 1% up,
    two significant digits below it, ``<0.01%`` below that; ``–`` for None or NaN.

    >>> [percent(x) for x in (0.60994, 1.0, 0.01, 0.005805, 0.0004, 0.0, -0.02, 3e-7, None)]
    ['61.0%', '100.0%', '1.0%', '0.58%', '0.04%', '0%', '-2.0%', '<0.01%', '–']
    """
    if x is None or x != x:
        return "\u2013"
    v = 100 * x
    if v == 0:
        return "0%"
    if abs(v) >= 0.995:
        return f"{v:.1f}%"
    if abs(v) >= 0.01:
        return f"{v:.2g}%"
    return "<0.01%" if v > 0 else ">-0.01%"


def open_part(text: str) -> str:
    """``text`` without its folded blocks (``<details>`` ... ``</details>`` lines): what shows unexpanded.

    >>> open_part("a\\n<details><summary>s</summary>\\n\\n| t |\\n\\n</details>\\nb\\n")
    'a\\n\\nb\\n'
    """
    return _FOLDED.sub("", text)


def measure(text: str) -> int:
    """Length in UTF-16 code units (what GitHub's limit counts); never less than ``len(text)``."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


@dataclass
class Section:
    """A heading, lines that always go with it (a table header, an intro sentence), then rows that may be cut.

    ``noun`` names the rows in the "N more" line ("layers", "findings", "rank changes"). Rows must be single
    lines (a row with a newline is refused: it could not be cut cleanly). ``fold``, when set, is the plain text
    (no markup, no names: it goes into raw HTML) of a ``<summary>`` that folds the intro and the rows.
    """

    heading: str
    intro: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    noun: str = "rows"
    title: str = ""  # short name for the omitted-sections list; default: the heading without leading '#'
    fold: str = ""  # the <details> summary that folds intro and rows; empty: shown open

    def opening(self) -> list[str]:
        """The lines before the rows: heading, the <details> opening, the intro."""
        out = [self.heading, ""] if self.heading else []
        if self.fold:
            out += [f"<details><summary>{self.fold}</summary>", ""]
        return out + list(self.intro)

    def closing(self) -> list[str]:
        """The lines after the rows (the end of the fold), before any note."""
        return ["", "</details>"] if self.fold else []

    @property
    def name(self) -> str:
        return self.title or self.heading.lstrip("#").strip() or self.noun


@dataclass
class Fitted:
    """The Markdown that fits, and what was left out (for logs and tests)."""

    text: str
    cap: int
    shown_rows: int
    omitted_rows: int  # rows of the section that was cut
    omitted_sections: list[str]  # names of the sections not shown at all
    omitted_section_rows: int  # rows in those sections

    @property
    def complete(self) -> bool:
        return not self.omitted_rows and not self.omitted_sections

    def __str__(self) -> str:
        return self.text


def _plural(n: int, noun: str) -> str:
    return f"{n:,} more {noun}"


def _closing(rows_left: int, noun: str, later: list[Section], where: str) -> str:
    parts = []
    if rows_left:
        parts.append(_plural(rows_left, noun))
    if later:
        names = ", ".join(s.name for s in later)
        parts.append(f"{len(later)} more section{'s' if len(later) > 1 else ''} ({names})")
    return "_… " + " and ".join(parts) + f" in {where}._"


def _note(closing: str) -> list[str]:
    """The closing line as its own paragraph: a blank line ends the table above, another separates the tail."""
    return ["", closing, ""]


def _lines_len(lines: Sequence[str]) -> int:
    return sum(measure(l) + 1 for l in lines)  # each line plus its newline


def fit_markdown(summary: str, sections: Sequence[Section], *, cap: int = DEFAULT_CAP, tail: str = "",
                 where: str = "the attached report") -> Fitted:
    """Assemble ``summary`` (always, first), ``sections`` in order while they fit, and ``tail`` (always, last, e.g.
    the version line) into at most ``cap`` UTF-16 units; the cut is announced in one line naming exactly how
    many rows and which sections are left out. ``cap`` must not exceed GitHub's 65,536 and must hold the summary,
    the tail and the closing line, else ValueError.
    """
    if not 0 < cap <= GITHUB_COMMENT_LIMIT:
        raise ValueError(f"cap {cap} must be between 1 and {GITHUB_COMMENT_LIMIT:,} (GitHub's comment limit)")
    for s in sections:
        if any("\n" in r or "\r" in r for r in [s.heading, s.fold, *s.intro, *s.rows]):
            raise ValueError(f"section {s.name!r}: a row or heading holds a line break")
    head = summary.rstrip("\n").split("\n") + [""]
    foot = tail.rstrip("\n").split("\n") if tail else []
    fixed = _lines_len(head) + _lines_len(foot)
    out: list[str] = list(head)
    used = fixed
    shown = 0
    for i, s in enumerate(sections):
        later = list(sections[i + 1:])
        block, end = s.opening(), s.closing()
        full = block + s.rows + end + [""]
        closing_none = _closing(0, s.noun, later, where)
        if used + _lines_len(full) + (_lines_len(_note(closing_none)) if later else 0) <= cap:
            out += full  # the whole section fits, with room to announce any later cut
            used += _lines_len(full)
            shown += len(s.rows)
            continue
        # cut inside this section: as many rows as fit with the closing line after them
        if used + _lines_len(full) <= cap and not later:
            out += full
            used += _lines_len(full)
            shown += len(s.rows)
            continue
        k, size = 0, used + _lines_len(block)
        while k < len(s.rows):
            closing = _closing(len(s.rows) - k - 1, s.noun, later, where)
            if size + measure(s.rows[k]) + 1 + _lines_len(end) + _lines_len(_note(closing)) > cap:
                break
            size += measure(s.rows[k]) + 1
            k += 1
        if k == 0:  # not even one row: leave the whole section out
            rest = [s, *later]
            closing = _closing(0, s.noun, rest, where)
            if used + _lines_len(_note(closing)) > cap:
                raise ValueError(f"cap {cap} cannot hold the summary, the tail and the closing line")
            out += _note(closing)[1:] if out[-1] == "" else _note(closing)
            return _done(out, foot, cap, shown, 0, rest)
        out += block + s.rows[:k] + end + _note(_closing(len(s.rows) - k, s.noun, later, where))
        return _done(out, foot, cap, shown + k, len(s.rows) - k, later)
    if used > cap:
        raise ValueError(f"cap {cap} cannot hold the summary and the tail ({used:,} characters)")
    return _done(out, foot, cap, shown, 0, [])


def _done(out: list[str], foot: list[str], cap: int, shown: int, cut_rows: int, later: list[Section]) -> Fitted:
    lines = out + foot
    while len(lines) > 1 and lines[-1] == "" and lines[-2] == "":
        lines.pop()
    text = "\n".join(lines).rstrip("\n") + "\n"
    assert measure(text) <= cap, (measure(text), cap)  # the arithmetic above guarantees it
    return Fitted(text, cap, shown, cut_rows, [s.name for s in later], sum(len(s.rows) for s in later))


ROWS_OPEN = 8  # a longer table (or list of findings) is folded
COLS_OPEN = 7  # a wider table is folded (GitHub's comment column is about 880 px)


class Room:
    """What is left of the open part, in UTF-8 bytes; each block asks before it is shown open."""

    def __init__(self, total: int) -> None:
        self.left = total

    def take(self, lines: list[str], limit: int | None = None) -> bool:
        size = sum(len(x.encode("utf-8")) + 1 for x in lines)
        if size > self.left or (limit is not None and size > limit):
            return False
        self.left -= size
        return True


def fold_if(section: Section, room: Room, fold: str, *, columns: int = 0, limit: int | None = None) -> Section:
    """``section`` open when its rows are few, its table narrow and it fits the room left; else folded."""
    lines = [*section.intro, *section.rows]
    if len(section.rows) <= ROWS_OPEN and columns <= COLS_OPEN and room.take(lines, limit):
        return section
    section.fold = fold
    return section
