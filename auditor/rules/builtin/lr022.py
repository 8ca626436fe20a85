"""The calibration rule LR022: at the rank plan's own size, quantization alone does less harm."""

from __future__ import annotations

from ...results import Severity
from ..context import Context
from ..registry import Emit, rule


@rule("LR022", "rank-plan-dominated-by-bits", Severity.WARNING)
def lr022(ctx: Context, emit: Emit) -> None:
    """The audit's rank plan takes as many bytes as a quantized plan that measures less harm.

    ## What it flags
    A calibrated audit with a byte budget (`--budget-bytes` or `--bits-per-weight`) whose suggested rank plan was
    verified, where the bits-only plan chosen at the rank plan's own size (int8 / int4 / int3 round to nearest,
    kept layers as they are) takes no more bytes and measures less harm on the same verification rows: the rank
    plan is dominated, more bytes and more error than another.

    ## Why it is bad
    Low rank is then the wrong tool for this model at this size: the same memory buys a more faithful model by
    quantization alone, with no recovery fine-tune to budget for the factorization. Per byte, quantization usually
    wins on language models (GPTQ 4-bit against SVD-LLM at 20% removed); this rule says when it does here, measured.

    ## Example
    ```
    lowrank-audit model/ --calibration text/ --budget 0.2 --bits-per-weight 4.5
    ```

    ## Do instead
    Quantize (the report's bits-only or joint plan at that size; `--write-bits DIR` writes the one that measured
    least harm at the budget), or factorize only where the report's joint plan keeps a rank; a rank plan remains worth it for latency, which bytes do not
    measure (`--measure-speed`).
    """
    cal = ctx.audit.calibration
    bits, b = (cal.bits, cal.budget) if cal is not None else (None, None)
    if bits is None or b is None or not b.plan or b.verification is None or bits.rank_plan_size is None:
        return
    rank_value = b.verification.value
    quant = next((p for p in bits.at(bits.rank_plan_size) if p.family == "bits" and p.reachable), None)
    if quant is None or quant.value is None or quant.nbytes > bits.rank_plan_size:
        return
    better = quant.value > rank_value if cal.higher_is_better else quant.value < rank_value
    if not better:
        return
    emit(f"at the rank plan's {bits.rank_plan_size:,} bytes, quantization alone measures {cal.metric} "
         f"{cal.value_text(quant.value)} against the rank plan's {cal.value_text(rank_value)} on the same "
         f"verification rows: the rank plan is dominated", [],
         "Quantize instead (the report's bits-only or joint plan at that size; --write-bits DIR writes the one "
         "that measured least harm at the budget), or keep the rank plan only for latency", size=bits.rank_plan_size, rank=rank_value,
         bits=quant.value, bits_bytes=quant.nbytes, choices=quant.counts)
