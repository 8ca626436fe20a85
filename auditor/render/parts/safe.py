"""Escaping for names that come from a model: every renderer shows layer and model names through these.

A name is data, not markup: in Markdown it must not open a link, an image, a heading, raw HTML or break out of a
code span; on a terminal it must not move the cursor, change colours, start a new line or reorder the text
(bidirectional overrides). HTML is escaped by jinja2's autoescape; charts use
:func:`auditor.render.parts.layer_charts.safe_label`.

>>> md_code("evil`](http://x)")
'`` evil`](http://x) ``'
>>> md_text("# [a](http://x) <b> -> c")
'# \\\\[a\\\\](http://x) &lt;b> -> c'
>>> term("a\\x1b[31mred\\u202e")
'a\\\\x1b[31mred\\\\u202e'
>>> middle("encoder.block.0.layer.0.SelfAttention.relative_attention_bias", 40)
'encoder.block.0….relative_attention_bias'
"""

from __future__ import annotations

import re

__all__ = ["escape", "md_code", "md_text", "middle", "term", "visible"]

from ...errors import escape, visible  # the one escaping function (core: error lines use it too)


def term(text: str) -> str:
    """A name for the terminal: no escape sequence, control character or direction override reaches it."""
    return visible(text)


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def md_text(text: str) -> str:
    """A name in running Markdown text (mid-line, or a table cell): the characters that open code, emphasis,
    links and images, strike-through or a cell break are backslash-escaped and ``<`` ``&`` written as entities,
    so no link, image, emphasis, autolink or raw HTML can come from it (with ``[`` escaped, ``![`` and ``](``
    cannot form; a heading or a block quote needs the line start, which a name never has here). ``>`` stays as
    it is: without ``<`` it opens nothing mid-line, and "->" reads as written in the Markdown source too."""
    t = visible(text).replace("&", "&amp;").replace("<", "&lt;")
    return _MD_SPECIAL.sub(r"\\\1", t)


def md_code(text: str) -> str:
    """A name as a Markdown code span that holds it literally: the fence is one backtick longer than the longest
    backtick run inside (padded with spaces when the name touches a backtick); ``|`` is escaped for table cells
    (GitHub splits cells before parsing code spans)."""
    t = visible(text).replace("|", "\\|")
    longest = max((len(m) for m in re.findall(r"`+", t)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if t.startswith("`") or t.endswith("`") or longest else ""
    return f"{fence}{pad}{t}{pad}{fence}"


def middle(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters in the middle, keeping the start (encoder/decoder) and the last path
    component (the layer's own name), so two long names that differ at either end stay distinct."""
    if len(text) <= width:
        return text
    if width < 5:
        return text[: max(0, width - 1)] + "…"
    tail = min(len(text.rsplit(".", 1)[-1]) + 1, width * 2 // 3) if "." in text else width // 2
    head = width - 1 - tail
    return text[:head] + "…" + text[-tail:]
