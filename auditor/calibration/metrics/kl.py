"""``kl``: the mean next-token KL divergence KL(dense || model) in nats per real token, computed batch by batch (the
dense model's logits of one batch at a time, never all of them): zero on the dense model, lower is better, it holds
when it is at most the tolerance."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ...errors import AuditError
from .base import Evaluating, Measurement, MetricKind, RowScorer, Scorer
from .chunks import Scored, kl_terms
from .common import kept_row_sums, next_token_scored, next_token_targets, main_output

if TYPE_CHECKING:
    from ..data.inputs import Batch


def frozen(dense: nn.Module) -> nn.Module:
    """A frozen copy of the dense model: its logits are recomputed one batch at a time (128 x 2048 tokens over a
    128k vocabulary would be 67 GB at once), and the caller may change ``dense`` in place."""
    out = copy.deepcopy(dense).eval()
    for p in out.parameters():
        p.requires_grad_(False)
    return out


class _Scorer(Scorer):
    def __init__(self, ev: Evaluating, dense: nn.Module) -> None:
        super().__init__(ev)
        self._dense = frozen(dense)
        self.reference = 0.0

    def measure(self, model: nn.Module) -> Measurement:
        """Mean next-token KL(dense || model) per counted position, with top-1 agreement."""
        total = 0.0
        count = agree = 0
        with torch.no_grad():
            for i, b in enumerate(self.ev.batches):
                p = next_token_scored(main_output(self.ev.forward(self._dense, b, i)), b)
                q = next_token_scored(main_output(self.ev.forward(model, b, i)), b)
                kl, same = kl_terms(p, q)
                total += float(kl.double().sum())
                count += int(kl.numel())
                agree += int(same.sum())
        if count == 0:
            raise AuditError("the held-out batches hold no next-token position to score (every target masked or "
                             "padding)", "Give held-out text of at least two real tokens per row")
        return self.judged(total / count, agree / count)


class _Rows(RowScorer):
    """Per row: the summed KL and the positions scored."""

    def __init__(self, dense: nn.Module, batches: list[Batch], like: RowScorer | None = None) -> None:
        self.batches = batches
        self._dense = like._dense if isinstance(like, _Rows) else frozen(dense)  # one frozen copy, shared

    def sums(self, model: nn.Module) -> tuple[np.ndarray, ...]:
        kl, cnt, agree = [], [], []
        for b in self.batches:
            _, keep = next_token_targets(b)
            p = next_token_scored(main_output(self._dense(*b.args, **b.kwargs)), b)  # its shape checked
            q = next_token_scored(main_output(model(*b.args, **b.kwargs)), b)
            k, same = kl_terms(p, q)
            kl.append(kept_row_sums(k, keep))
            cnt.append(keep.sum(1).double().cpu().numpy())
            agree.append(kept_row_sums(same, keep))
        self.last_top1 = np.concatenate(agree), np.concatenate(cnt)
        return np.concatenate(kl), np.concatenate(cnt)

    def value(self, sums: tuple[np.ndarray, ...], idx: "slice | np.ndarray" = slice(None)) -> float:
        kl, cnt = sums
        c = float(cnt[idx].sum())
        return float(kl[idx].sum()) / c if c > 0 else float("nan")


class KL(MetricKind):
    kind = "kl"
    names = ("kl",)
    label = "next-token KL"
    units = "nats per real token"
    gradient = "likelihood"
    predicted_words = "cross-entropy increases"
    verified_by_rows = True

    def scorer(self, ev: Evaluating, dense: nn.Module) -> Scorer:
        return _Scorer(ev, dense)

    def row_scorer(self, dense: nn.Module, batches: list[Batch], like: RowScorer | None = None) -> RowScorer:
        return _Rows(dense, batches, like)

    def scored_positions(self, y: torch.Tensor, b: Batch) -> Scored:
        return next_token_scored(y, b)


KIND = KL()
