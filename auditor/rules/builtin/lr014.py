"""The calibration rule LR014: calibration data too small for a layer (fewer rows than its input width, or an
embedding whose rows it never looked up), or token ids that look drawn at random."""

from __future__ import annotations

from ...results import PlanVerdict, Severity
from ..context import Context
from ..registry import Emit, rule


@rule("LR014", "calibration-too-small-or-synthetic", Severity.WARNING)
def lr014(ctx: Context, emit: Emit) -> None:
    """Calibration data too small for a layer, or inputs that look synthetic.

    ## What it flags
    A layer the reviewed plan truncates that saw fewer calibration rows (tokens, positions, patches) than its input
    width, or whose inputs the calibration did not span (an embedding with rows never looked up, such as positions
    past the calibration's sequence length, or vocabulary ids that never occur: the finding says how many), and
    calibration token ids that look drawn uniformly at random (two positions agree less than 1.5x as often as chance
    and under 1% of trigrams repeat). A layer the plan keeps dense is not flagged: no rank is chosen for it, so
    nothing is truncated blind.

    ## Why it is bad
    With fewer rows than input width the layer's input statistics X^T X are singular: the auditor damps them, but
    the whitened spectrum then describes the few rows it saw, not the model's inputs. A data-aware rank there is
    blind to the rest: 16-character windows on the sample char transformer gave its 128-row position table rank
    16, which on 128-character inputs gave 0.144 output error. A calibrated suggestion keeps such layers dense (no
    plan the search measures includes them), and they are left out of the measured floors. Random token ids make
    the study meaningless: a masked LM scored 6% accuracy on such inputs against 89% on real text, so every floor
    measured on them is wrong.

    ## Example
    ```
    lowrank-audit gpt.py:build --calibration random_ids.safetensors   # torch.randint(0, vocab, (8, 128))
    ```

    ## Do instead
    Give real inputs from the task, at least as many rows per layer as its input width (a few hundred sequences for
    a transformer), text in which the embedding's ids occur; or keep the layer dense (delete its line from the
    plan).
    """
    cal = ctx.audit.calibration
    if cal is None:
        return
    truncated = {it.layer for it in ctx.items if it.verdict in (PlanVerdict.FACTORIZE, PlanVerdict.NARROW)}
    for name, lc in cal.layers.items():
        if name not in truncated:  # a layer the plan keeps dense loses nothing to blind statistics
            continue
        if lc.singular:
            emit(f"{name} saw {lc.rows} calibration rows, fewer than its input width {lc.width}: its statistics are "
                 "singular (damped), so its rank is the data-free one", [name],
                 f"Give at least {lc.width:,} calibration rows, or delete {name}'s line from the plan to keep it "
                 "dense", rows=lc.rows, width=lc.width)
        elif not lc.spans and ctx.layer(name).kind == "embedding":
            missing = lc.width - (lc.seen or 0)
            emit(f"{name}: {missing:,} of its {lc.width:,} ids never occur in the calibration data ({lc.seen:,} "
                 "looked up), so its rank is the data-free one and truncating it is blind to those rows", [name],
                 "Use calibration data in which those ids occur (text covering the vocabulary for a token "
                 f"embedding, sequences as long as the context for a position table), or delete {name}'s line "
                 "from the plan to keep it dense", seen=lc.seen, width=lc.width, missing=missing)
        elif not lc.spans:
            emit(f"{name}: the calibration spanned {lc.seen:,} of its {lc.width:,} input directions, so its rank "
                 "is the data-free one (directions never seen would be truncated blind)", [name],
                 f"Give calibration data that varies every input of {name}, or delete its line from the plan to "
                 "keep it dense", seen=lc.seen, width=lc.width)
    if cal.synthetic:
        emit("calibration inputs look like token ids drawn uniformly at random: floors measured on them are "
             "meaningless", [], "Use real inputs from the task", synthetic=True)
