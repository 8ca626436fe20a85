"""Quality per parameter removed, on text the tool never read: the audit's plans against SVD-LLM's uniform whitened
truncation at the same share removed, and the default plan against uniform at the same perplexity (issue 38).

    python sample_models/train_llama.py --shape wide --out /tmp/wide    # the held-back 2.4M Llama (~13 min)
    PYTHONPATH=. python benchmarks/quality.py /tmp/wide [--shares 0.1 0.2 0.3] [--threads 2]

The model (a Hugging Face Llama directory that ``train_llama.py`` wrote) trained on the top-level standard-library
sources but every 8th file. Those held-out files, in name order, are cut in two: the first ones up to 300,000
characters are the calibration (a directory, one document per file, which the tool splits into fit, search and
verification rows on file boundaries); the files after them, and the subpackage sources (``*/*.py``, never trained
on nor read), are the unseen text: 96 windows of the model's 128 positions spread over it.

1. Fixed share removed (the field's framing): for each share, ``--budget SHARE --tolerance 0.05``; its plan written
   with ``auditor.factorize`` (the loss-aware fit the audit measured, the sequential fit ``lowrank-audit factorize
   --calibration`` writes by default, and the independent fit), and uniform whitened truncation of the decoder blocks' Linears (one kept share of every layer's
   break-even rank, bisected to the same parameters removed; the independent whitened fit, SVD-LLM's) on the same fit
   rows. Printed: the perplexity increase of each on the unseen windows and the plan's against uniform's, and the
   audit's verification intervals against the value on unseen text; and the sequential fit with ``refit_dense``
   (the layers the plan keeps dense refitted on their shifted inputs) against uniform on both texts.
2. The default audit (tolerance +1%): its share removed, its verification and unseen intervals, its unseen
   perplexity increase, its wall time against its tier-1 wall; and uniform truncation's share removed at the same
   unseen perplexity (the kept share bisected), with the ratio of the two removals.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import auditor  # noqa: E402
from auditor.calibration import load_calibration  # noqa: E402
from auditor.structure.layers import ParamTable, collect_layers  # noqa: E402
from auditor.surgery import count_params  # noqa: E402

CALIB_CHARS = 300_000
UNSEEN_WINDOWS = 96

FITS = ("loss-aware", "sequential", "independent")  # auditor.factorize's fits; "refit" and "closed": sequential


def texts() -> tuple[list[tuple[str, str]], str, str]:
    """(the calibration files: name, text), the unseen text and a second unseen text (the subpackage sources after
    the first's, a check that a ratio is not one text's)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held = [f for i, f in enumerate(sorted(stdlib.glob("*.py"))) if i % 8 == 0]
    calib, n = [], 0
    for f in held:
        if n >= CALIB_CHARS:
            break
        t = f.read_text(encoding="utf-8", errors="replace")
        calib.append((f.name + ".txt", t))
        n += len(t)
    rest = [f.read_text(encoding="utf-8", errors="replace") for f in held[len(calib):]]
    subs = [f for f in sorted(stdlib.glob("*/*.py")) if "site-packages" not in f.parts and "test" not in f.parts[-2]]
    used = 0
    for f in subs:
        rest.append(f.read_text(encoding="utf-8", errors="replace"))
        used += 1
        if sum(map(len, rest)) >= 600_000:
            break
    second = "".join(f.read_text(encoding="utf-8", errors="replace") for f in subs[used:used + 60])[:600_000]
    return calib, "".join(rest), second


def unseen_windows(model_dir: Path, text: str, length: int) -> torch.Tensor:
    from tokenizers import Tokenizer

    ids = torch.tensor(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids)
    starts = torch.linspace(0, len(ids) - length, UNSEEN_WINDOWS).long()
    return torch.stack([ids[s:s + length] for s in starts.tolist()])


@torch.no_grad()
def perplexity(model: torch.nn.Module, seqs: torch.Tensor) -> float:
    nll, count = 0.0, 0
    for chunk in seqs.split(16):
        logits = model(input_ids=chunk).logits[:, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
        count += chunk[:, 1:].numel()
    return math.exp(nll / count)


class Uniform:
    """SVD-LLM's allocation: every decoder-block Linear at one kept share of its break-even rank (a layer that would
    save nothing stays dense)."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [l for l in collect_layers(model, ParamTable.of(model)).values()
                       if ".layers." in l.name and l.kind == "linear"]
        self.total = count_params(model)

    def plan(self, kept: float) -> dict[str, int]:
        out = {}
        for l in self.layers:
            r = max(1, math.floor(kept * l.m * l.n / (l.m + l.n)))
            if r * (l.m + l.n) < l.m * l.n:
                out[l.name] = r
        return out

    def removed(self, kept: float) -> float:
        by = {l.name: l for l in self.layers}
        return sum(by[n].m * by[n].n - r * (by[n].m + by[n].n) for n, r in self.plan(kept).items()) / self.total

    def at_share(self, target: float) -> dict[str, int]:
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.removed(mid) > target else (lo, mid)
        return self.plan(lo if abs(self.removed(lo) - target) <= abs(self.removed(hi) - target) else hi)


def audit(model_dir: Path, calib_dir: Path, **opts) -> tuple:
    options = auditor.AuditOptions(calibration=str(calib_dir), tokenizer=str(model_dir), cache=False, progress=False,
                                   **opts)
    t = time.perf_counter()
    a = auditor.audit_source(str(model_dir), options=options)
    return a, time.perf_counter() - t


def removed_by(model: torch.nn.Module, plan: dict[str, int]) -> float:
    by = {l.name: l for l in collect_layers(model, ParamTable.of(model)).values()}
    return sum(by[n].m * by[n].n - r * (by[n].m + by[n].n) for n, r in plan.items()) / count_params(model)


def fixed_shares(model, model_dir, calib_dir, fit, unseen, dense, shares) -> None:
    """``unseen`` and ``dense``: (windows, dense perplexity) of each unseen text; the first is the one judged."""
    uni = Uniform(model)
    print("share | plan: loss-aware, sequential, independent fit | uniform (independent) | plan / uniform | audit s"
          " | plan / uniform on the second unseen text | sequential with --refit-dense / uniform, on both texts"
          " | sequential without the block refinement (--no-refine) / uniform, on both texts")
    for share in shares:
        a, wall = audit(model_dir, calib_dir, budget=share, tolerance=0.05)
        plan = dict(a.calibration.budget.plan)
        got = removed_by(model, plan)
        row, two = {}, {}
        for label, ranks, how in (("la", plan, "loss-aware"), ("seq", plan, "sequential"), ("ref", plan, "refit"),
                                  ("cf", plan, "closed"), ("ind", plan, "independent"),
                                  ("uni", uni.at_share(got), "independent")):
            made = auditor.factorize(model, ranks, calibration=fit, fit=how if how in FITS else "sequential",
                                     refit_dense=how == "refit", refine=how != "closed")
            row[label], two[label] = (perplexity(made, w) / d - 1 for w, d in zip(unseen, dense))
        print(f"{100 * got:.1f}% (uniform {100 * removed_by(model, uni.at_share(got)):.1f}%) | "
              f"{100 * row['la']:+.2f}%, {100 * row['seq']:+.2f}%, {100 * row['ind']:+.2f}% | "
              f"{100 * row['uni']:+.2f}% | {row['la'] / row['uni']:.2f}x ({row['seq'] / row['uni']:.2f}x, "
              f"{row['ind'] / row['uni']:.2f}x) | {wall:.0f} | {two['la'] / two['uni']:.2f}x "
              f"({two['seq'] / two['uni']:.2f}x, {two['ind'] / two['uni']:.2f}x; uniform {100 * two['uni']:+.2f}%) | "
              f"{100 * row['ref']:+.2f}%: {row['ref'] / row['uni']:.2f}x, {two['ref'] / two['uni']:.2f}x | "
              f"{100 * row['cf']:+.2f}%: {row['cf'] / row['uni']:.2f}x, {two['cf'] / two['uni']:.2f}x", flush=True)
        print(f"    {reach(a.calibration.budget.verification, row['la'])}", flush=True)


def reach(v, value: float) -> str:
    """The audit's intervals against the value measured on unseen text (the model the audit measured)."""
    if v is None or v.low is None:
        return "no verification interval"
    u = v.unseen
    rows = f"rows [{100 * v.low:+.3f}%, {100 * v.high:+.3f}%]"
    doc = f"unseen-document ({u.label}) [{100 * u.low:+.3f}%, {100 * u.high:+.3f}%]" if u is not None else "none"
    top = u.high if u is not None else v.high
    return (f"verified {100 * v.value:+.3f}%, {rows}, {doc}; on unseen text {100 * value:+.3f}%: "
            f"{'within' if value <= top else 'BEYOND'} the upper end the plan is judged by")


def default_plan(model, model_dir, calib_dir, fit, unseen, dense) -> None:
    a, wall = audit(model_dir, calib_dir)
    c = a.calibration
    b = c.budget
    t1 = wall - sum(v for k, v in c.seconds.items() if k != "tier1")
    plan = dict(b.plan)
    got = removed_by(model, plan)
    inc = perplexity(auditor.factorize(model, plan, calibration=fit, fit="loss-aware"), unseen) / dense - 1
    seq = perplexity(auditor.factorize(model, plan, calibration=fit, fit="sequential"), unseen) / dense - 1
    closed = perplexity(auditor.factorize(model, plan, calibration=fit, fit="sequential", refine=False),
                        unseen) / dense - 1
    v = b.verification
    print(f"default plan: {100 * got:.1f}% removed ({len(plan)} layers); {reach(v, inc)}")
    print(f"  on unseen text: {100 * inc:+.3f}% as measured (loss-aware), {100 * seq:+.3f}% sequential "
          f"({100 * closed:+.3f}% without the block refinement); audit "
          f"{wall:.0f} s = {wall / t1:.2f}x its tier-1 wall ({t1:.0f} s)")
    uni = Uniform(model)
    least = perplexity(auditor.factorize(model, uni.plan(1.0), calibration=fit, fit="independent"), unseen) / dense - 1
    if least > inc:  # every layer at its break-even rank saves almost nothing and already measures worse
        print(f"  uniform truncation cannot reach that unseen perplexity at any share: at the break-even ranks "
              f"({100 * uni.removed(1.0):.2f}% removed) it measures {100 * least:+.3f}%")
        return
    lo, hi = 0.0, 1.0  # the kept share at which uniform's unseen perplexity increase equals the plan's
    for _ in range(14):
        mid = (lo + hi) / 2
        u = perplexity(auditor.factorize(model, uni.plan(mid), calibration=fit, fit="independent"), unseen) / dense - 1
        lo, hi = (lo, mid) if u <= inc else (mid, hi)
    share = uni.removed(hi)
    print(f"  uniform truncation at the same unseen perplexity: kept {hi:.3f} of break-even, {100 * share:.2f}% "
          f"removed; the plan removes {got / share if share else math.inf:.1f}x as much")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="the Llama directory train_llama.py --shape wide wrote")
    ap.add_argument("--shares", type=float, nargs="*", default=[0.1, 0.2, 0.3])
    ap.add_argument("--no-default", action="store_true", help="skip the default audit")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(args.model)).eval()
    calib, rest, second = texts()
    with tempfile.TemporaryDirectory() as tmp:
        calib_dir = Path(tmp)
        for name, t in calib:
            (calib_dir / name).write_text(t, encoding="utf-8")
        fit = load_calibration(str(calib_dir), model, tokenizer=str(args.model))
        unseen = unseen_windows(args.model, rest, model.config.max_position_embeddings)
        other = unseen_windows(args.model, second, model.config.max_position_embeddings)
        dense, dense2 = perplexity(model, unseen), perplexity(model, other)
        print(f"{count_params(model):,} parameters; calibration {len(calib)} files "
              f"({sum(len(t) for _, t in calib):,} characters); unseen {len(unseen)} windows, dense perplexity "
              f"{dense:.3f} (second unseen text: {len(other)} windows, {dense2:.3f})", flush=True)
        if args.shares:
            fixed_shares(model, args.model, calib_dir, fit, (unseen, other), (dense, dense2), args.shares)
        if not args.no_default:
            default_plan(model, args.model, calib_dir, fit, unseen, dense)


if __name__ == "__main__":
    main()
