"""The graph rule LR007: two linear maps chained with nothing nonlinear between. It needs a data-flow graph: the
module walk links layers in call order (q_proj -> k_proj), which says nothing about what feeds what."""

from __future__ import annotations

from ...results import Severity
from ..context import Context
from ..registry import Emit, Need, Scope, rule


@rule("LR007", "chained-linear-maps", Severity.INFO, scope=Scope.GRAPH, needs={Need.DATA_FLOW})
def lr007(ctx: Context, emit: Emit) -> None:
    """Two linear maps chained with nothing nonlinear between them.

    ## What it flags
    Two weight layers where the first feeds only the second and the second reads only the first, with no
    activation, norm or other nonlinear op between them (reshapes and dropout do not count).

    ## Why it is bad
    A B is one linear map of rank at most min(inner width): the pair adds no depth and cannot represent more than
    a single layer. It is already a low-rank factorization (possibly an accidental one); factorizing either factor
    again compounds the truncation.

    ## Example
    ```python
    nn.Sequential(nn.Linear(512, 64), nn.Linear(64, 512))   # one 512 x 512 map of rank <= 64
    ```

    ## Do instead
    Treat the pair as one factorized layer: leave it out of the plan, or merge it into one dense layer and
    factorize that once.
    """
    for a, b in ctx.chains:
        la, lb = ctx.layer_at(a), ctx.layer_at(b)
        inner = min(la.m, la.n, lb.m, lb.n)
        note = " and the plan factorizes it again" if {la.name, lb.name} & ctx.planned else ""
        emit(f"{a} ({la.m}x{la.n}) feeds {b} ({lb.m}x{lb.n}) with nothing nonlinear between: one linear map of "
             f"rank <= {inner}{note}",
             [la.name, lb.name], "Treat the pair as one factorized layer; do not factorize it again",
             inner_rank=inner)
