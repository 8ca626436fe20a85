"""Block grouping: layers whose qualified names differ only in integer path components form one group.

``model.layers.0.mlp.down_proj`` ... ``model.layers.31.mlp.down_proj`` are one group shown as
``model.layers.*.mlp.down_proj``; T5's ``encoder.block.*...`` and ``decoder.block.*...`` stay apart because a
non-integer component differs. Pure functions on names and integers: no torch, no audit object needed.

Plan globs follow :mod:`auditor.planning.plan`: a pattern selects a layer when ``fnmatch.fnmatchcase`` matches its name (or
its parameter's name). ``*`` there also matches dots, so every glob emitted here is checked against all names and
narrowed (``[0-9]`` per digit) where ``*`` would reach past its group. Literal ``[``, ``*`` and ``?`` in names are
escaped as ``[[]``, ``[*]`` and ``[?]`` so a plan reads back to exactly the ranks written.

>>> g = group_layers([LayerShape(f"h.{i}.mlp", 3072, 768) for i in range(12)])[0]
>>> g.pattern, len(g.members), g.params, g.same_shape
('h.*.mlp', 12, 28311552, True)
>>> plan_globs({"h.0.fc": 8, "h.1.fc": 8, "h.0.proj": 8, "h.1.proj": 4})
{'h.*.fc': 8, 'h.0.proj': 8, 'h.1.proj': 4}
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence

__all__ = ["Group", "LayerShape", "Members", "escape_glob", "glob_matches", "group_layers", "natural_key", "plan_globs",
           "toml_string"]


class _LayerLike(Protocol):
    name: str
    m: int
    n: int

    @property
    def params(self) -> int: ...


@dataclass(frozen=True)
class LayerShape:
    """The least a layer needs for grouping: its qualified name and matrix view m x n (params = m * n * groups)."""

    name: str
    m: int
    n: int
    groups: int = 1

    @property
    def params(self) -> int:
        return self.m * self.n * self.groups


class Members:
    """``size`` and ``is_group`` for anything with a ``members`` sequence: :class:`Group` (member names) and the
    reports' :class:`auditor.render.parts.pages.GroupRow` (member rows)."""

    members: Sequence[Any]

    @property
    def size(self) -> int:
        """How many members."""
        return len(self.members)

    @property
    def is_group(self) -> bool:
        """More than one member."""
        return len(self.members) > 1


@dataclass(frozen=True)
class Group(Members):
    """Layers whose names differ only in integer path components (a single layer is a group of one).

    ``label`` is the name with varying indices shown as ``*`` (for people); ``pattern`` is the same with the
    literal parts glob-escaped (for plans). ``shapes`` lists the distinct (m, n) in member order.
    """

    label: str
    pattern: str
    members: tuple[str, ...]  # natural order: h.2 before h.10
    params: int  # all members together
    share: float  # params / the total given to group_layers
    shapes: tuple[tuple[int, int], ...]
    member_params: tuple[int, ...]

    @property
    def same_shape(self) -> bool:
        """Every member has the same matrix view (m, n)."""
        return len(self.shapes) == 1

    @property
    def params_each(self) -> int | None:
        """The members' common parameter count, or None when they differ."""
        return self.member_params[0] if len(set(self.member_params)) == 1 else None


def _is_index(part: str) -> bool:
    return part.isascii() and part.isdigit()


def natural_key(name: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that orders integer path components by value: ``h.2`` < ``h.10``.

    >>> sorted(["h.10.a", "h.2.a", "h.1.b"], key=natural_key)
    ['h.1.b', 'h.2.a', 'h.10.a']
    """
    return tuple((0, int(p), p) if _is_index(p) else (1, 0, p) for p in name.split("."))


def _key(name: str) -> tuple[str | None, ...]:
    return tuple(None if _is_index(p) else p for p in name.split("."))


def escape_glob(text: str) -> str:
    """``text`` as an fnmatch pattern that matches only itself: ``[``, ``*`` and ``?`` become ``[[]``, ``[*]``, ``[?]``.

    >>> escape_glob("w[0]*?")
    'w[[]0][*][?]'
    """
    return "".join(f"[{c}]" if c in "[*?" else c for c in text)


def glob_matches(pattern: str, names: Iterable[str]) -> list[str]:
    """The names a plan pattern selects, by :func:`auditor.planning.plan.resolve`'s rule (``fnmatch.fnmatchcase``)."""
    return [n for n in names if fnmatch.fnmatchcase(n, pattern)]


def _patterns(members: Sequence[str]) -> tuple[str, str]:
    """(label, glob) for the members of one group: '*' where the index varies among members, literal elsewhere."""
    parts = [m.split(".") for m in members]
    label, glob = [], []
    for column in zip(*parts):
        if len(set(column)) > 1:
            label.append("*")
            glob.append("*")
        else:
            label.append(column[0])
            glob.append(escape_glob(column[0]))
    return ".".join(label), ".".join(glob)


def _buckets(names: Iterable[str]) -> dict[tuple[str | None, ...], list[str]]:
    buckets: dict[tuple[str | None, ...], list[str]] = {}
    for name in names:
        buckets.setdefault(_key(name), []).append(name)
    return buckets


def group_layers(layers: Iterable[_LayerLike], total_params: int | None = None) -> list[Group]:
    """Group layers (anything with ``.name``, ``.m``, ``.n``, ``.params``: :class:`auditor.results.Layer` or
    :class:`LayerShape`) by name with integer components masked.

    Groups come largest first (ties: the group seen first). ``share`` is relative to ``total_params`` (the model's
    unique parameters; default: the sum over ``layers``). Every layer is in exactly one group.
    """
    items = list(layers)
    by_name: dict[str, Any] = {}
    for layer in items:
        if layer.name in by_name:
            raise ValueError(f"layer name {layer.name!r} appears twice")
        by_name[layer.name] = layer
    total = sum(int(l.params) for l in items) if total_params is None else total_params
    out: list[tuple[int, int, Group]] = []
    for first, (_, names) in enumerate(_buckets(by_name).items()):
        members = sorted(names, key=natural_key)
        label, glob = _patterns(members) if len(members) > 1 else (members[0], escape_glob(members[0]))
        member_params = tuple(int(by_name[n].params) for n in members)
        shapes: list[tuple[int, int]] = []
        for n in members:
            mn = (int(by_name[n].m), int(by_name[n].n))
            if mn not in shapes:
                shapes.append(mn)
        params = sum(member_params)
        out.append((params, first, Group(label, glob, tuple(members), params, params / total if total else 0.0,
                                         tuple(shapes), member_params)))
    out.sort(key=lambda t: (-t[0], t[1]))
    return [g for _, _, g in out]


def _digit_globs(members: Sequence[str]) -> list[str]:
    """Patterns with ``[0-9]`` per digit at the varying components, one per digit-length signature: each selects
    only names of this group's shape, so it cannot reach another group."""
    parts = [m.split(".") for m in members]
    varying = {i for i, column in enumerate(zip(*parts)) if len(set(column)) > 1}
    globs: list[str] = []
    for p in parts:
        g = ".".join("[0-9]" * len(c) if i in varying else escape_glob(c) for i, c in enumerate(p))
        if g not in globs:
            globs.append(g)
    return globs


def plan_globs(ranks: Mapping[str, int], names: Iterable[str] | None = None,
               also_matched: Mapping[str, str] | None = None) -> dict[str, int]:
    """Collapse a plan's per-layer ranks to group globs where every member of a group has the same rank.

    ``names``: every layer name a plan pattern could select (default: the keys of ``ranks``); a glob is emitted for
    a group only when all its members among ``names`` are planned with one rank. ``also_matched``: the other strings
    :func:`auditor.planning.plan.resolve` matches patterns against, each mapped to its layer's name (``{layer.param:
    layer.name}``); a glob selecting one of them selects that layer. Every pattern returned selects exactly the
    layers it stands for, and names
    with glob metacharacters are escaped, so resolving the result gives back ``ranks`` exactly. Order: the groups in
    natural order of their first member.
    """
    universe = list(dict.fromkeys([*(ranks if names is None else names), *ranks]))
    keys = {n: n for n in universe} | {k: v for k, v in (also_matched or {}).items() if k not in universe}

    def selects(globs: Sequence[str]) -> set[str]:
        return {keys[k] for g in globs for k in glob_matches(g, keys)}

    out: dict[str, int] = {}
    for _, members_any in sorted(_buckets(universe).items(), key=lambda kv: natural_key(min(kv[1], key=natural_key))):
        members = sorted(members_any, key=natural_key)
        planned = [m for m in members if m in ranks]
        if not planned:
            continue
        rank_set = {ranks[m] for m in planned}
        if len(members) > 1 and len(planned) == len(members) and len(rank_set) == 1:
            r = rank_set.pop()
            want = set(members)
            glob = _patterns(members)[1]
            if selects([glob]) == want:
                out[glob] = r
                continue
            narrow = _digit_globs(members)
            if selects(narrow) == want:
                out.update((g, r) for g in narrow)
                continue
        for m in planned:
            out[escape_glob(m)] = ranks[m]
    return out


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string that reads back to the same text and shows no raw control, C1 or
    bidirectional-override character (a name cannot start a new TOML line or reorder what a reader sees).

    >>> toml_string('a"b\\n[x]\\u202e')
    '"a\\\\"b\\\\n[x]\\\\u202E"'
    """
    out = ['"']
    for c in text:
        o = ord(c)
        if c in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[c])
        elif o < 0x20 or 0x7F <= o <= 0x9F or 0x202A <= o <= 0x202E or 0x2066 <= o <= 0x2069 or c in "\u2028\u2029":
            out.append(f"\\u{o:04X}")
        elif 0xD800 <= o <= 0xDFFF:
            raise ValueError(f"name {text!r} holds a lone surrogate, which no TOML or UTF-8 file can carry")
        else:
            out.append(c)
    out.append('"')
    return "".join(out)
