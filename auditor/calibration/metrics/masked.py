"""``masked`` (the default for a masked LM, a Hugging Face ``*ForMaskedLM``): the cross-entropy at the masked
positions against their labels, read as the masked-token perplexity exp(mean cross-entropy). The masked positions
are those whose ``labels`` are not -100 (the Hugging Face collator's convention) and whose ``attention_mask`` is not
0; a batch without ``labels`` scores every real position against its own input id (what
``BertForMaskedLM(labels=input_ids)`` scores), with a warning. The measured value is the relative increase over the
dense model's masked-token perplexity: lower is better, it holds when it is at most the tolerance (0.02 = +2%), as
for :mod:`.perplexity`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .chunks import Scored
from .common import masked_scored, masked_targets
from .perplexity import Perplexity

if TYPE_CHECKING:
    from ..data.inputs import Batch

NO_LABELS = ("masked-token metric: no held-out batch carries labels, so every real token is scored as its own "
             "target (nothing is masked, and a masked LM sees the token it predicts); give labels (-100 at the "
             "positions not masked) and input_ids with the mask token there to score masked positions")


class MaskedPerplexity(Perplexity):
    kind = "masked"
    names = ("masked-ce", "masked-perplexity", "mlm")
    label = "masked-token perplexity increase"
    units = "a relative increase of the held-out masked-token perplexity"
    increase_of = "masked-token perplexity"
    what = "masked-token perplexity"
    scored = "masked-token"
    nothing_scored = ("the held-out batches hold no masked position to score (every label -100 or padding)",
                      "Give labels with the original id at the masked positions")

    def scored_positions(self, y: torch.Tensor, b: Batch) -> Scored:
        return masked_scored(y, b)

    def counted(self, b: Batch) -> torch.Tensor:
        """Which positions count, per row (rows, positions): the masked ones."""
        return masked_targets(b)[1]

    def warnings_for(self, batches: list[Batch]) -> list[str]:
        """The labels-less warning when no held-out batch carries labels."""
        return [NO_LABELS] if batches and not any(masked_targets(b)[2] for b in batches) else []


KIND = MaskedPerplexity()
