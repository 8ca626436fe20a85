"""Log-probabilities over a vocabulary, a chunk of positions at a time.

A language model's output for one batch is (rows, positions, vocabulary) logits: 32 x 512 x 49,152 float32 values
are 3.2 GB. Taking ``log_softmax`` of the scored positions whole makes a second and third copy of that (the scored
positions gathered, then their log-probabilities), and a backward through it three more (the gradient of the
log-probabilities, of their logits, and scattered back). Here nothing the size of the batch's logits is made but the
model's own output (and, differentiating, its gradient): each chunk of at most :data:`CHUNK_VALUES` logits is
gathered, cast to float32 and normalised on its own, read, and dropped. ``log_softmax`` normalises each position on
its own, so the values are those of the whole-batch computation bit for bit (tested), and labels sampled a chunk at
a time draw the same numbers from the generator as one draw over every position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

CHUNK_VALUES = 1 << 22  # logits per chunk: 4,194,304 (16 MiB in float32)


def chunk_rows(vocab: int) -> int:
    """Positions per chunk for a ``vocab``-wide output: :data:`CHUNK_VALUES` logits, at least one position."""
    return max(1, CHUNK_VALUES // max(1, vocab))


@dataclass(frozen=True)
class Scored:
    """The scored positions of one batch's logits, read a chunk at a time.

    ``logits`` is the model's output (or a view of it: the positions that predict the next token), ``where`` the
    indices of the scored positions into its leading dimensions (``keep.nonzero()`` unbound: the row-major order of
    ``logits[keep]``), ``targets`` their labels, one per scored position."""

    logits: torch.Tensor
    where: tuple[torch.Tensor, ...]
    targets: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor) -> "Scored":
        """The positions ``keep`` selects of ``logits`` (its leading dimensions) and ``targets`` (shaped like
        ``keep``) at them."""
        return cls(logits, keep.nonzero(as_tuple=True), targets[keep])

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    @property
    def vocab(self) -> int:
        return int(self.logits.shape[-1])

    def spans(self) -> Iterator[slice]:
        step = chunk_rows(self.vocab)
        for start in range(0, len(self), step):
            yield slice(start, min(start + step, len(self)))

    def chunk_logits(self, s: slice) -> torch.Tensor:
        """(positions, vocab) logits of the scored positions in ``s``, as the model gave them."""
        return self.logits[tuple(w[s] for w in self.where)]

    def logprobs(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """(span, float32 log-probabilities of its positions), a chunk at a time."""
        for s in self.spans():
            yield s, torch.log_softmax(self.chunk_logits(s).float(), dim=-1)

    def picked(self, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 log-probability of each scored position's label (``targets`` unless given), no graph kept."""
        labels = self.targets if labels is None else labels
        out = torch.empty(len(self), dtype=torch.float32, device=self.logits.device)
        with torch.no_grad():
            for s, logp in self.logprobs():  # written in place: a small result kept per chunk between the chunks'
                out[s] = logp.gather(1, labels[s, None])[:, 0]  # large ones would keep the heap from reusing them
        return out

    def sample(self, gen: torch.Generator) -> torch.Tensor:
        """One label per scored position drawn from the model's own distribution there (on the CPU, from ``gen``):
        the draw ``torch.multinomial(probs, 1)`` over every position at once makes, a chunk at a time."""
        out = torch.empty(len(self), dtype=torch.long)
        with torch.no_grad():
            for s, logp in self.logprobs():
                out[s] = torch.multinomial(logp.exp().cpu(), 1, generator=gen)[:, 0]
        return out

    def nll(self, labels: torch.Tensor) -> torch.Tensor:
        """The summed negative log-likelihood of ``labels`` (one per scored position), differentiable in
        ``logits``: its backward writes the logits' gradient a chunk at a time (each chunk through autograd's own
        ``log_softmax`` backward, so the numbers of the whole-batch graph), no full-vocabulary copy beyond it."""
        return _NLL.apply(self.logits, labels, *self.where)


def kl_terms(p: Scored, q: Scored) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scored position (both over the same positions) KL(p || q) in float32 and whether the two agree on the
    most likely token, a chunk at a time."""
    kl = torch.empty(len(p), dtype=torch.float32, device=p.logits.device)
    agree = torch.empty(len(p), dtype=torch.bool, device=p.logits.device)
    with torch.no_grad():
        for (s, lp), (_, lq) in zip(p.logprobs(), q.logprobs()):
            kl[s] = (lp.exp() * (lp - lq)).sum(-1)
            agree[s] = lp.argmax(-1) == lq.argmax(-1)
    return kl, agree


class _NLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: torch.Tensor, labels: torch.Tensor,
                *where: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, labels, *where)
        sc = Scored(logits, tuple(where), labels)
        return -sc.picked().sum()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, labels, *where = ctx.saved_tensors  # type: ignore[attr-defined]
        sc = Scored(logits, tuple(where), labels)
        grad = torch.zeros_like(logits)
        for s in sc.spans():  # autograd's own log_softmax backward on each chunk: its numbers, bit for bit
            x = sc.chunk_logits(s).detach().requires_grad_(True)
            with torch.enable_grad():
                loss = -torch.log_softmax(x.float(), dim=-1).gather(1, labels[s, None]).sum()
                (gx,) = torch.autograd.grad(loss, [x], grad_outputs=g)
            grad[tuple(w[s] for w in where)] = gx
        return (grad, None, *([None] * len(where)))


__all__ = ["CHUNK_VALUES", "Scored", "chunk_rows", "kl_terms"]
