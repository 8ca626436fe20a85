"""Tie groups (``--tie``): layers whose ranks must be equal, so that a fused kernel can run the factorized model.

A tie is a set of layer patterns matched within each block: ``q_proj,k_proj,v_proj`` ties, in every block that holds
all three, the three layers whose names end in those components (a pattern of k dotted parts is matched with
``fnmatch.fnmatchcase`` against a name's last k parts; the rest of the name is the block). One block's members form
one :class:`~auditor.results.TieGroup`, and its members get one rank r: a fused kernel concatenates their outputs
(q/k/v read one input, so [A_q; A_k; A_v] stacks into one first factor), and it needs one r, whatever the members'
widths (k and v are narrower than q under grouped-query attention). A rank that saves nothing in one member (r at
or above that member's break-even) is no rank for the group: the group is factorized at a rank every member saves
at, or kept dense whole.

``--tie auto`` (:data:`~auditor.options.TIE_AUTO`) offers the groups that fused kernels fuse in the families the tool
knows (:data:`KNOWN`: the names vLLM's ``packed_modules_mapping`` packs, and the encoders' and T5's), each where every
block of the model holds all its members; a family whose layers are fused already (GPT-2's ``c_attn``, Phi-3's
``qkv_proj``) needs none.

Pure functions over names and plain data: no torch.

>>> from auditor.results import Kind, Layer
>>> def lin(name, m, n): return Layer(name, name + ".weight", Kind.LINEAR, "Linear", (m, n), m, n)
>>> layers = [lin(f"h.{i}.attn.{p}", 64 if p == "q" else 16, 64) for i in range(2) for p in "qkvo"]
>>> [(g.label, g.block, g.members) for g in resolve_ties(layers, [("q", "k", "v")])][1]
('q/k/v', 'h.1.attn', ('h.1.attn.q', 'h.1.attn.k', 'h.1.attn.v'))
>>> violations({"h.0.attn.q": 8, "h.0.attn.k": 8, "h.0.attn.v": 4}, resolve_ties(layers, [("q", "k", "v")]))[0][1]
{'h.0.attn.q': 8, 'h.0.attn.k': 8, 'h.0.attn.v': 4}
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import replace
from typing import Any, Iterable, Mapping, Sequence

from .. import lrmath
from ..errors import AuditError
from ..options import TIE_AUTO
from .groups import natural_key
from ..results import Layer, Spectrum, Suggestion, TieGroup, Verdict

__all__ = ["KNOWN", "broken_words", "keep_ties", "label_of", "resolve_ties", "tie_suggestions", "violations"]

# The tie groups --tie auto offers, by family: what fused kernels fuse (vLLM's packed_modules_mapping: qkv_proj,
# gate_up_proj) and the encoders' separate projections. Fused already, needing none: GPT-2's c_attn, Phi-3's
# qkv_proj and gate_up_proj, GPT-NeoX's query_key_value, Falcon's query_key_value.
KNOWN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Llama, Mistral, Qwen, Gemma: attention", ("q_proj", "k_proj", "v_proj")),
    ("Llama, Mistral, Qwen, Gemma: gated MLP", ("gate_proj", "up_proj")),
    ("BERT, RoBERTa: attention", ("query", "key", "value")),
    ("T5: attention", ("q", "k", "v")),
    ("T5 v1.1: gated MLP", ("wi_0", "wi_1")),
    ("Mixtral experts: gated MLP", ("w1", "w3")),
)


def label_of(patterns: Sequence[str]) -> str:
    """A tie's name in the reports: its patterns joined by '/' ("q_proj/k_proj/v_proj")."""
    return "/".join(patterns)


def _split(name: str, pattern: str) -> str | None:
    """The block of ``name`` when ``pattern`` matches its last parts (as many as the pattern has), else None."""
    k = pattern.count(".") + 1
    parts = name.split(".")
    if len(parts) < k or not fnmatch.fnmatchcase(".".join(parts[-k:]), pattern):
        return None
    return ".".join(parts[:-k])


def _groups(layers: Sequence[Layer], patterns: Sequence[str], strict: bool) -> list[TieGroup] | None:
    """One tie's groups, a block each; with ``strict`` every defect is one AuditError line, else None (auto)."""
    text = ",".join(patterns)
    blocks: dict[str, dict[str, list[str]]] = {}
    for p in patterns:
        hits = [(l.name, b) for l in layers if (b := _split(l.name, p)) is not None]
        if not hits:
            if not strict:
                return None
            ends = list(dict.fromkeys(l.name.rpartition(".")[2] for l in layers))
            close = difflib.get_close_matches(p, ends, n=3, cutoff=0.5)
            raise AuditError(f"--tie {text}: pattern {p!r} matches no layer",
                             f"Closest layer names: {', '.join(close)}" if close
                             else "Patterns match a layer name's last parts, e.g. q_proj; list them with --format json")
        for name, block in hits:
            blocks.setdefault(block, {}).setdefault(p, []).append(name)
    out: list[TieGroup] = []
    kinds = {l.name: l.kind for l in layers}
    for block, found in blocks.items():
        problem = _block_problem(block, found, patterns, kinds)
        if problem is not None:
            if not strict:
                return None
            raise AuditError(f"--tie {text}: {problem[0]}", problem[1])
        out.append(TieGroup(label_of(patterns), block, tuple(found[p][0] for p in patterns)))
    return sorted(out, key=lambda g: natural_key(g.block))


def _block_problem(block: str, found: Mapping[str, list[str]], patterns: Sequence[str],
                   kinds: Mapping[str, Any]) -> tuple[str, str] | None:
    """What is wrong with one block's members (a pattern matching none or two there, mixed kinds), or None."""
    where = f"block {block or '(the model)'}"
    many = [p for p in patterns if len(found.get(p, [])) > 1]
    if many:
        p = many[0]
        return (f"pattern {p!r} matches {len(found[p])} layers in {where} ({', '.join(found[p][:3])})",
                "Give patterns that select one layer per block")
    missing = [p for p in patterns if p not in found]
    if missing:
        have = [found[p][0] for p in patterns if p in found]
        return (f"in {where} only {', '.join(have)} match{'es' if len(have) == 1 else ''}; "
                f"{', '.join(repr(p) for p in missing)} match{'es' if len(missing) == 1 else ''} none there",
                "Tie layers that every block holds, or narrow the patterns to the blocks that hold them all")
    kind_of = {p: str(kinds[found[p][0]]) for p in patterns}
    if len(set(kind_of.values())) > 1:
        return (f"members of different kinds in {where}: "
                + ", ".join(f"{found[p][0]} ({kind_of[p]})" for p in patterns),
                "Tie layers of one kind (a fused kernel concatenates one kind of product)")
    return None


def resolve_ties(layers: Sequence[Layer], specs: Iterable[Sequence[str]]) -> tuple[TieGroup, ...]:
    """The tie groups of ``specs`` (from :func:`auditor.options.tie_specs`) over ``layers``, in the order given,
    each tie's blocks in natural order (h.2 before h.10); ``TIE_AUTO`` adds :data:`KNOWN`'s ties that resolve
    whole. Bad input is one AuditError line: a pattern that matches no layer, a block holding only some members or one pattern's two layers,
    members of different kinds, a layer in two groups."""
    out: list[TieGroup] = []
    for spec in specs:
        if tuple(spec) == TIE_AUTO:
            for _, patterns in KNOWN:
                found = _groups(layers, patterns, strict=False)
                if found and not any(_owner(g, out) for g in found):
                    out.extend(found)
            continue
        for g in _groups(layers, tuple(spec), strict=True) or []:
            twice = _owner(g, out)
            if twice is not None:
                raise AuditError(f"--tie {','.join(g.label.split('/'))}: layer {twice[0]} is already in the tie "
                                 f"{twice[1].label} ({', '.join(twice[1].members)}): a layer takes one rank",
                                 "Put each layer in one --tie group (join the groups into one to tie them all)")
            out.append(g)
    return tuple(out)


def _owner(group: TieGroup, groups: Sequence[TieGroup]) -> tuple[str, TieGroup] | None:
    """(a member of ``group``, the group of ``groups`` that holds it already), or None."""
    for g in groups:
        for m in group.members:
            if m in g.members:
                return m, g
    return None


def violations(ranks: Mapping[str, int], groups: Sequence[TieGroup]) -> list[tuple[TieGroup, dict[str, int]]]:
    """The groups a plan (layer -> rank; a layer absent is dense) breaks: members at different ranks, or some
    factorized and some dense; each with its members' ranks (0: dense)."""
    out: list[tuple[TieGroup, dict[str, int]]] = []
    for g in groups:
        got = {m: int(ranks.get(m, 0)) for m in g.members}
        if len(set(got.values())) > 1:
            out.append((g, got))
    return out


def broken_words(broken: Sequence[tuple[TieGroup, Mapping[str, int]]]) -> tuple[str, str]:
    """(what, fix) for the groups a plan breaks (:func:`violations`), the first named, the rest counted.

    >>> g = TieGroup("q/k/v", "h.0.attn", ("h.0.attn.q", "h.0.attn.k", "h.0.attn.v"))
    >>> broken_words([(g, {"h.0.attn.q": 16, "h.0.attn.k": 8, "h.0.attn.v": 0})])[0]
    'breaks the tie q/k/v in h.0.attn: h.0.attn.q at rank 16, h.0.attn.k at rank 8, h.0.attn.v dense'
    """
    g, got = broken[0]
    ranks = ", ".join(f"{m} at rank {r}" if r else f"{m} dense" for m, r in got.items())
    more = f" (and {len(broken) - 1} more group{'s' if len(broken) > 2 else ''})" if len(broken) > 1 else ""
    return (f"breaks the tie {g.label} in {g.block or '(the model)'}: {ranks}{more}",
            "Give every member of a tie group one rank (or keep them all dense), or drop the tie (--tie, the plan's "
            "ties)")


def tie_suggestions(layers: Sequence[Layer], spectra: Mapping[str, Spectrum], suggestions: Mapping[str, Suggestion],
                    groups: Sequence[TieGroup]) -> dict[str, Suggestion]:
    """The data-free suggestions with each tie group at one rank: the largest of its members' suggested ranks (each
    member keeps at least its energy target), when every member is suggested for factorization and that rank saves
    in every member; else every member kept dense, said in its reason."""
    named = {l.name: l for l in layers}
    out = dict(suggestions)
    for g in groups:
        sgs = [suggestions.get(m) for m in g.members]
        ranks = [s.rank for s in sgs if s is not None and s.verdict is Verdict.FACTORIZE and s.rank]
        short = {m: m[len(g.block) + 1:] if g.block else m for m in g.members}
        if len(ranks) < len(g.members):
            dense = [short[m] for m, s in zip(g.members, sgs) if s is None or s.verdict is not Verdict.FACTORIZE]
            for m, s in zip(g.members, sgs):
                if s is not None:
                    out[m] = _dense(s, f"tied (--tie {g.label}), and {', '.join(dense)} "
                                       f"{'is' if len(dense) == 1 else 'are'} not factorized")
            continue
        r = max(ranks)
        worthless = [m for m in g.members if not (lrmath.saves(named[m].m, named[m].n, r) and r <= named[m].max_rank)]
        for m, s in zip(g.members, sgs):
            assert s is not None
            if worthless:
                out[m] = _dense(s, f"tied (--tie {g.label}): the group's rank {r} saves nothing in "
                                   f"{', '.join(short[w] for w in worthless)}")
            elif s.rank != r:
                layer, spec = named[m], spectra.get(m)
                kept = spec.energy_at(r) if spec is not None and spec.sigma is not None else None
                out[m] = replace(s, rank=r, reason=f"rank {r}, tied (--tie {g.label}); alone: {s.reason}",
                                 params_after=layer.params_at(r), macs_after=layer.macs_at(r),
                                 compression=layer.compression(r), energy_at_rank=kept,
                                 error_bound=lrmath.relative_error(kept) if kept is not None else None)
    return out


def keep_ties(suggestions: Mapping[str, Suggestion], groups: Sequence[TieGroup]) -> dict[str, Suggestion]:
    """The final suggestions with every group they would break kept dense whole (a safety net: the search and
    :func:`tie_suggestions` keep ties)."""
    out = dict(suggestions)
    ranks = {k: s.rank for k, s in suggestions.items() if s.verdict is Verdict.FACTORIZE and s.rank}
    for g, got in violations(ranks, groups):
        shown = ", ".join(f"{m} {r or 'dense'}" for m, r in got.items())
        for m in g.members:
            if m in out:
                out[m] = _dense(out[m], f"tied (--tie {g.label}), and the members' ranks differ ({shown})")
    return out


def _dense(s: Suggestion, reason: str) -> Suggestion:
    return replace(s, verdict=Verdict.KEEP_DENSE, rank=None, reason=f"{reason}; alone: {s.reason}", energy_at_rank=None,
                   error_bound=None, params_after=None, macs_after=None, compression=None)
