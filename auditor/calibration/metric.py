"""The model-level metric: how far a truncated model is from the dense one on the held-out batches.

Every metric declares its direction (``Metric.higher_is_better``) and what the tolerance means:
- ``output`` (the default for models that are not causal language models): the relative error of the model's
  outputs against the dense model's, ||y - y_dense||_F / ||y_dense||_F over every held-out output (logits for models
  that return them; positions with ``attention_mask`` 0 left out), with top-1 agreement shown beside it; lower is
  better, it holds when it is at most the tolerance;
- ``perplexity`` (the default for a causal LM): next-token cross-entropy on the held-out text, pads and masked
  positions (``attention_mask`` 0, ``labels`` -100) left out. The measured value is the relative increase of the
  perplexity over the dense model's (``reference``): lower is better, it holds when it is at most the tolerance
  (0.02 = +2%);
- ``masked`` (the default for a masked LM, a Hugging Face ``*ForMaskedLM``): the cross-entropy at the masked
  positions against their labels, read as the masked-token perplexity exp(mean cross-entropy). The masked positions
  are those whose ``labels`` are not -100 (the Hugging Face collator's convention) and whose ``attention_mask`` is not
  0; a batch without ``labels`` scores every real position against its own input id (what
  ``BertForMaskedLM(labels=input_ids)`` scores), with a warning on the calibration. The measured value is the
  relative increase over the dense model's masked-token perplexity: lower is better, it holds when it is at most the
  tolerance (0.02 = +2%), as for ``perplexity``;
- ``kl``: the mean next-token KL divergence KL(dense || model) in nats per real token, computed batch by batch (the
  dense model's logits of one batch at a time, never all of them): lower is better, it holds when it is at most the
  tolerance;
- a user metric ``fn(model, batches) -> float`` declares its direction: higher-is-better by default (accuracy,
  negative loss), holding when it is at least the dense model's value minus the tolerance; or
  ``Metric(fn, higher_is_better=False)`` (a loss), holding when it is at most the dense model's value plus the
  tolerance; either in the metric's own units. ``batches`` is a list of what the calibration source yielded: a
  tensor, a tuple of positional inputs, or a dict of keyword inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..errors import AuditError, first_line
from .inputs import IGNORE_INDEX as IGNORE
from .inputs import Batch, Calibration, _import_fn, model_device

UserMetric = Callable[[nn.Module, list[Any]], float]
DEFAULT_TOLERANCE = 0.01


def main_output(out: Any) -> torch.Tensor:
    """The tensor a metric compares: the output itself, ``.logits``, or the first tensor of a tuple or dict."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    raise AuditError(f"the model returned {type(out).__name__}, with no tensor to compare",
                     "Give --metric module:fn that scores the model")


KINDS = ("output", "perplexity", "kl", "masked", "user")
NAMES = {"output-error": "output", "output": "output", "perplexity": "perplexity", "ppl": "perplexity",
         "kl": "kl", "masked-ce": "masked", "masked-perplexity": "masked", "mlm": "masked"}  # --metric NAME
LABELS = {"output": "relative output error", "perplexity": "perplexity increase", "kl": "next-token KL",
          "masked": "masked-token perplexity increase"}
HIGHER_IS_BETTER = {"output": False, "perplexity": False, "kl": False, "masked": False}  # declared directions
NO_LABELS = ("masked-token metric: no held-out batch carries labels, so every real token is scored as its own "
             "target (nothing is masked, and a masked LM sees the token it predicts); give labels (-100 at the "
             "positions not masked) and input_ids with the mask token there to score masked positions")


def load_metric(spec: str) -> UserMetric:
    """``file.py:fn`` or ``module:fn`` for --metric."""
    if ":" not in spec:
        raise AuditError(f"--metric {spec!r} is neither a metric name nor a function",
                         "Use --metric perplexity, kl, masked-perplexity, output-error, or file.py:fn / module:fn")
    return _import_fn(spec)


@dataclass
class Measurement:
    """One metric value, whether it holds, top-1 agreement with the dense model (built-in metrics), and for
    perplexity the model's perplexity itself (``value`` is its relative increase)."""

    value: float
    ok: bool
    top1: float | None = None
    absolute: float | None = None


@dataclass
class Metric:
    """What is measured, which way is better, and how much may be lost.

    ``kind``: "output", "perplexity", "kl" or "user"; empty: "user" with ``fn``, else "output". Every metric
    declares its direction in ``higher_is_better``: the built-in kinds are lower-is-better (``HIGHER_IS_BETTER``) and
    zero on the dense model (perplexity as its relative increase), and cannot be declared otherwise; a user metric
    is higher-is-better unless it says ``higher_is_better=False``."""

    fn: UserMetric | None = None  # a user metric; None: a built-in one
    tolerance: float = DEFAULT_TOLERANCE
    name: str = ""
    kind: str = ""
    higher_is_better: bool | None = None  # None: the kind's own (a user metric: True)

    def __post_init__(self) -> None:
        if not self.kind:
            self.kind = "user" if self.fn is not None else "output"
        if self.kind not in KINDS:
            raise ValueError(f"metric kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if (self.kind == "user") != (self.fn is not None):
            raise ValueError(f"a {self.kind!r} metric {'needs' if self.kind == 'user' else 'takes no'} function")
        own = HIGHER_IS_BETTER.get(self.kind)
        if self.higher_is_better is None:
            self.higher_is_better = True if own is None else own
        elif not isinstance(self.higher_is_better, bool):
            raise ValueError(f"higher_is_better must be True or False, not {self.higher_is_better!r}")
        elif own is not None and self.higher_is_better != own:
            raise ValueError(f"the {self.kind!r} metric is {'higher' if own else 'lower'}-is-better; it cannot be "
                             "declared otherwise")

    @property
    def output_error(self) -> bool:
        """The relative output error: the tier-1 layer-output errors predict it (in its units)."""
        return self.kind == "output"

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return getattr(self.fn, "__name__", "metric") if self.fn is not None else LABELS[self.kind]


def is_causal_lm(model: nn.Module, batch: "Batch | None" = None) -> bool:
    """A causal language model: a Hugging Face ``*ForCausalLM`` / ``*LMHeadModel``, or (not a Hugging Face model) one
    that takes ``input_ids`` and returns logits over its vocabulary (the rows of its largest embedding) at every
    position of ``batch``. Masked LMs and encoders are not."""
    name = type(model).__name__
    if name.endswith("ForCausalLM") or name.endswith("LMHeadModel"):
        return True
    if getattr(model, "config", None) is not None or batch is None:
        return False
    ids = batch.kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return False
    vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=None)
    if vocab is None:
        return False
    try:
        with torch.no_grad():
            y = main_output(model(*batch.args, **batch.kwargs))
    except Exception:  # noqa: BLE001 - no logits to read: not a language model this test recognises
        return False
    return tuple(y.shape) == (*ids.shape, vocab) and y.is_floating_point()


def is_masked_lm(model: nn.Module) -> bool:
    """A masked language model: a Hugging Face ``*ForMaskedLM`` (BERT, RoBERTa, DistilBERT, ...)."""
    return type(model).__name__.endswith("ForMaskedLM")


def _row_mask(b: Batch) -> torch.Tensor | None:
    """The real positions of a batch: ``attention_mask`` != 0 when it is 2-D (batch, positions); None when there is
    no such mask or it keeps every position."""
    m = b.kwargs.get("attention_mask")
    if not isinstance(m, torch.Tensor) or m.dim() != 2:
        return None
    keep = m != 0
    return None if bool(keep.all()) else keep


def _targets(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token targets, which of them count) of a batch: the ids (or ``labels``) shifted by one, counted where
    the target is real and not -100, and the position predicting it real too."""
    ids = b.kwargs.get("labels")
    if not isinstance(ids, torch.Tensor):
        ids = b.kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = next((a for a in b.args if isinstance(a, torch.Tensor)), None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise AuditError("a next-token metric needs 2-D integer token ids (input_ids) in every held-out batch",
                         "Give input_ids (batch, positions), or use --metric output-error")
    tgt = ids[:, 1:].long()
    keep = tgt != -100
    mask = b.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        keep = keep & (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
    return tgt.clamp_min(0), keep


def _next_token_logprobs(y: torch.Tensor, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 log-probabilities at the counted positions (rows, vocab) and their targets (rows,)."""
    tgt, keep = _targets(b)
    if y.dim() != 3 or y.shape[:2] != (tgt.shape[0], tgt.shape[1] + 1):
        raise AuditError(f"a next-token metric needs logits (batch, positions, vocab) for the input ids "
                         f"{tuple(tgt.shape[0:1]) + (tgt.shape[1] + 1,)}; the model returned {tuple(y.shape)}",
                         "Use --metric output-error, or a user metric, for this model")
    logits = y[:, :-1][keep]
    return torch.log_softmax(logits.float(), dim=-1), tgt[keep]


def _check_targets(b: Batch, width: int, what: str, i: int | None = None) -> None:
    """The ids (or ``labels``) a token metric scores must index the model's ``width`` logits
    (:func:`~auditor.calibration.inputs.token_value_problem`, the loader's own validator): one line naming the value
    and where, else."""
    from .inputs import token_value_problem

    labels = isinstance(b.kwargs.get("labels"), torch.Tensor)
    name = "labels" if labels else "input_ids"
    t = b.kwargs.get(name)
    if not isinstance(t, torch.Tensor):
        t = next((a for a in b.args if isinstance(a, torch.Tensor)), None)
        name = "input ids"
    if not isinstance(t, torch.Tensor):
        return
    mask = b.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == t.shape:  # padding is not scored
        t = torch.where(mask != 0, t, torch.full_like(t, IGNORE if labels else 0))
    problem = token_value_problem(t, width, labels=labels)
    if problem:
        batch = f"held-out batch {i}" if i is not None else "a held-out batch"
        raise AuditError(f"calibration {name} in {batch} {problem.replace('the vocabulary', 'the logits')}: the "
                         f"{what} metric scores them against the model's {width} logits",
                         "Give ids the model's output covers (tokenize with its own tokenizer), or use --metric "
                         "output-error")


def _masked_targets(b: Batch) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(targets, which of them count, whether they came from ``labels``) of a masked-LM batch: ``labels`` where
    they are not -100, else every input id; positions with ``attention_mask`` 0 never count."""
    ids = b.kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = next((a for a in b.args if isinstance(a, torch.Tensor)), None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise AuditError("a masked-token metric needs 2-D integer token ids (input_ids) in every held-out batch",
                         "Give input_ids (batch, positions), or use --metric output-error")
    labels = b.kwargs.get("labels")
    given = isinstance(labels, torch.Tensor)
    if given and (labels.shape != ids.shape or labels.is_floating_point()):
        raise AuditError(f"a masked-token metric needs integer labels shaped like input_ids {tuple(ids.shape)}; "
                         f"a held-out batch has {labels.dtype} labels {tuple(labels.shape)}",
                         "Give labels (batch, positions): the original id at masked positions, -100 elsewhere")
    tgt = (labels if given else ids).long()
    keep = tgt != -100
    mask = b.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        keep = keep & (mask != 0)
    return tgt.clamp_min(0), keep, given


def _masked_logprobs(y: torch.Tensor, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 log-probabilities at the masked positions (rows, vocab) and their targets (rows,)."""
    tgt, keep, _ = _masked_targets(b)
    if y.dim() != 3 or tuple(y.shape[:2]) != tuple(tgt.shape):
        raise AuditError(f"a masked-token metric needs logits (batch, positions, vocab) for the input ids "
                         f"{tuple(tgt.shape)}; the model returned {tuple(y.shape)}",
                         "Use --metric output-error, or a user metric, for this model")
    return torch.log_softmax(y[keep].float(), dim=-1), tgt[keep]


def _user_batch(b: Batch) -> Any:
    if b.kwargs and not b.args:
        return dict(b.kwargs)
    if len(b.args) == 1 and not b.kwargs:
        return b.args[0]
    return b.args


DETERMINISM = 1e-6  # two dense runs on one held-out batch may differ by this much (relative to the output's size)
_CHECKED: dict[tuple[Any, str, float, bool], str] = {}  # (fn, digest, tolerance, direction) -> warning ("" none)


def _rank1_(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut every Linear, convolution and transformers Conv1D weight of ``model`` to rank 1 in place (the leading
    singular pair by 30 power iterations, seeded); returns (parameter, original) pairs to restore exactly."""
    from ..kinds.hf_conv1d import hf_conv1d_type

    conv1d = hf_conv1d_type()
    kinds = (nn.Linear, nn.modules.conv._ConvNd) + ((conv1d,) if conv1d is not None else ())
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()  # a weight tied between modules is cut (and saved) once
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for mod in model.modules():
            w = getattr(mod, "weight", None)
            if not isinstance(mod, kinds) or not isinstance(w, torch.Tensor) or w.dim() < 2 \
                    or not w.is_floating_point() or w.numel() == 0 or id(w) in seen:
                continue
            seen.add(id(w))
            saved.append((w, w.detach().clone()))
            a = w.detach().reshape(w.shape[0], -1).double()
            v = torch.randn(a.shape[1], generator=g, dtype=torch.float64).to(a.device)
            u = a @ v
            for _ in range(30):
                u = a @ v
                u = u / u.norm().clamp_min(1e-300)
                v = a.T @ u
                v = v / v.norm().clamp_min(1e-300)
            sigma = u @ a @ v
            w.copy_((sigma * torch.outer(u, v)).reshape(w.shape).to(w.dtype))
    return saved


class Evaluator:
    """Scores models on the calibration's held-out batches against the dense model's reference.

    On construction the dense model is checked once: its forward must repeat (two runs on the first held-out batch
    within ``DETERMINISM`` relative: dropout left on, or noise, would make every measured floor meaningless), and a
    user metric must fall when the model is cut down (the dense model against every layer at rank 1: a metric that
    rises is lower-is-better, refused; one that stays within the tolerance is a warning on the calibration)."""

    def __init__(self, dense: nn.Module, calibration: Calibration, metric: Metric | None = None) -> None:
        self.metric = metric or Metric()
        if not calibration.holdout:
            raise AuditError(f"the calibration from {calibration.source} holds nothing out (--holdout 0): the "
                             f"measured numbers (tiers 2 and 3, the plan check) would come from the "
                             f"{calibration.fit_rows} rows the statistics were fitted on",
                             "Give a held-out share (--holdout 0.25) or a held-out file (--holdout FILE)")
        device = model_device(dense)
        self.batches = [b.to(device) for b in calibration.measure]
        self.user_batches = [_user_batch(b) for b in self.batches]
        self._ref: list[torch.Tensor] = []
        self._dense: nn.Module | None = None
        self.evaluations = 0
        kind = self.metric.kind
        if kind == "output":
            with torch.no_grad():
                self._ref = [main_output(self._forward(dense, b, i)).detach() for i, b in enumerate(self.batches)]
            for i, r in enumerate(self._ref):
                if r.is_floating_point() and not bool(torch.isfinite(r).all()):
                    raise AuditError(f"the dense model's output on held-out batch {i} holds NaN or infinite values, "
                                     "so the relative output error cannot be measured",
                                     "Check the model's weights and that batch's inputs, or give a metric of your "
                                     "own")
            self._ref_norm2 = sum(float(self._masked(r, b).double().pow(2).sum())
                                  for r, b in zip(self._ref, self.batches))
            self.reference = 0.0
        elif kind in ("perplexity", "masked"):
            if kind == "masked" and self.batches and not any(_masked_targets(b)[2] for b in self.batches) \
                    and NO_LABELS not in calibration.warnings:
                calibration.warnings.append(NO_LABELS)
            self.reference = self._perplexity(dense)[0]
            if not (math.isfinite(self.reference) and self.reference > 0):
                what = "masked-token perplexity" if kind == "masked" else "perplexity"
                raise AuditError(f"the dense model's held-out {what} is {self.reference}",
                                 "Check the held-out text and the model's weights (a NaN or infinite logit)")
        elif kind == "kl":
            # the dense logits of one batch at a time, recomputed by a frozen copy: never all of them at once
            # (128 x 2048 tokens over a 128k vocabulary would be 67 GB); the caller may change ``dense`` in place
            import copy

            self._dense = copy.deepcopy(dense).eval()
            for p in self._dense.parameters():
                p.requires_grad_(False)
            self.reference = 0.0
        else:
            self.reference = self._user(dense)
        self._check_repeats(dense)
        if self.metric.fn is not None:
            self._check_direction(dense, calibration)

    @staticmethod
    def _masked(y: torch.Tensor, b: Batch) -> torch.Tensor:
        """The output at the real positions only (rows with ``attention_mask`` 0 left out) when it is (batch,
        positions, features) under the mask; the whole output otherwise."""
        keep = _row_mask(b)
        if keep is None or y.dim() != 3 or tuple(y.shape[:2]) != tuple(keep.shape):
            return y
        return y[keep]

    def _perplexity(self, model: nn.Module) -> tuple[float, float | None]:
        """(held-out perplexity, top-1 agreement: None), streamed batch by batch in float64 sums: next-token for
        ``perplexity``, at the masked positions for ``masked``."""
        masked = self.metric.kind == "masked"
        scored = _masked_logprobs if masked else _next_token_logprobs
        nll = 0.0
        count = 0
        with torch.no_grad():
            for i, b in enumerate(self.batches):
                y = main_output(self._forward(model, b, i))
                if isinstance(y, torch.Tensor) and y.dim() == 3:
                    _check_targets(b, y.shape[-1], "masked-token" if masked else "next-token", i)
                logp, tgt = scored(y, b)
                nll -= float(logp.gather(1, tgt[:, None]).double().sum())
                count += int(tgt.numel())
        if count == 0 and masked:
            raise AuditError("the held-out batches hold no masked position to score (every label -100 or padding)",
                             "Give labels with the original id at the masked positions")
        if count == 0:
            raise AuditError("the held-out batches hold no next-token position to score (every target masked or "
                             "padding)", "Give held-out text of at least two real tokens per row")
        return math.exp(nll / count) if nll / count < 700 else math.inf, None

    def _kl(self, model: nn.Module) -> tuple[float, float | None]:
        """(mean next-token KL(dense || model) per counted position, top-1 agreement), batch by batch."""
        assert self._dense is not None
        total = 0.0
        count = agree = 0
        with torch.no_grad():
            for i, b in enumerate(self.batches):
                p, _ = _next_token_logprobs(main_output(self._forward(self._dense, b, i)), b)
                q, _ = _next_token_logprobs(main_output(self._forward(model, b, i)), b)
                kl = (p.exp() * (p - q)).sum(-1)
                total += float(kl.double().sum())
                count += int(kl.numel())
                agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        if count == 0:
            raise AuditError("the held-out batches hold no next-token position to score (every target masked or "
                             "padding)", "Give held-out text of at least two real tokens per row")
        return total / count, agree / count

    def _forward(self, model: nn.Module, b: Batch, i: int) -> Any:
        try:
            return model(*b.args, **b.kwargs)
        except Exception as exc:  # noqa: BLE001 - a batch the forward refuses: one line naming it
            raise AuditError(f"held-out batch {i} does not fit {type(model).__name__}.forward: {first_line(exc)}",
                             "Give every batch the inputs and width the model takes") from None

    def _check_repeats(self, dense: nn.Module) -> None:
        if self.batches:
            check_repeats(dense, self.batches[0], self._ref[0] if self._ref else None, self.metric.fn is not None)

    def _check_direction(self, dense: nn.Module, calibration: Calibration) -> None:
        fn: Any = self.metric.fn
        try:
            hash(fn)
        except TypeError:
            fn = id(fn)
        key = (fn, calibration.digest, float(self.metric.tolerance), bool(self.metric.higher_is_better))
        if key not in _CHECKED:
            saved = _rank1_(dense)
            if not saved:
                return
            try:
                cut = self._user(dense, finite=False)
            finally:
                with torch.no_grad():
                    for w, original in saved:
                        w.copy_(original)
            ref, tol, label = self.reference, self.metric.tolerance, self.metric.label
            up = bool(self.metric.higher_is_better)
            worse, wrong = (ref - cut, cut - ref) if up else (cut - ref, ref - cut)  # how far it moved each way
            if not math.isfinite(cut):  # e.g. a perplexity overflowing on the cut model: it fell, or says nothing
                _CHECKED[key] = ""
            elif wrong > tol and up:
                raise AuditError(f"metric {label} rises when the model is cut down ({cut:.6g} with every layer at "
                                 f"rank 1, {ref:.6g} dense): it looks lower-is-better (a loss or an error), and every "
                                 "floor would come out at the smallest rank",
                                 "--metric must be higher-is-better: return the negative (e.g. -loss), or declare "
                                 "Metric(fn, higher_is_better=False)")
            elif wrong > tol:
                raise AuditError(f"metric {label} falls when the model is cut down ({cut:.6g} with every layer at "
                                 f"rank 1, {ref:.6g} dense), but it is declared lower-is-better: every floor would "
                                 "come out at the smallest rank",
                                 "Declare it higher-is-better (Metric(fn), the default), or return a loss")
            else:
                _CHECKED[key] = ("" if worse > tol else
                                 f"metric {label} barely moves when the model is cut down ({cut:.6g} with every layer at "
                                 f"rank 1, {ref:.6g} dense, tolerance {tol:g}): floors measured with it come out at "
                                 "the smallest ranks; use a metric that sees the model's quality, or a smaller "
                                 "--tolerance")
        if _CHECKED[key] and _CHECKED[key] not in calibration.warnings:
            calibration.warnings.append(_CHECKED[key])

    def _user(self, model: nn.Module, finite: bool = True) -> float:
        from ..sources.factory import _run_user_code

        label = self.metric.label

        def call() -> Any:
            with torch.no_grad():
                return self.metric.fn(model, self.user_batches)  # type: ignore[misc]

        out = _run_user_code(call, f"metric {label}", "raised", "Fix the metric function",
                             "Return a float from the metric instead of exiting")
        try:
            v = float(out)
        except (TypeError, ValueError, OverflowError):
            raise AuditError(f"metric {label} returned {type(out).__name__}, not a number",
                             "Return a float, higher is better") from None
        if finite and not math.isfinite(v):
            raise AuditError(f"metric {label} returned {v}", "Return a finite float, higher is better")
        return v

    def holds(self, value: float) -> bool:
        """Within the tolerance, in the metric's declared direction: a built-in metric (zero on the dense model) at
        most the tolerance; a user metric at most the tolerance worse than the dense model's value."""
        tol = self.metric.tolerance
        if self.metric.kind != "user":
            return value <= tol
        if self.metric.higher_is_better:
            return value >= self.reference - tol
        return value <= self.reference + tol

    def cost(self, value: float) -> float:
        """What a planner adds up: squared relative error (errors combine roughly in quadrature; the perplexity
        increase and the KL alike), or how far a user metric moved the wrong way from the dense value."""
        if self.metric.kind != "user":
            return value * value
        if self.metric.higher_is_better:
            return max(0.0, self.reference - value)
        return max(0.0, value - self.reference)

    def measure(self, model: nn.Module) -> Measurement:
        self.evaluations += 1
        kind = self.metric.kind
        if kind == "user":
            v = self._user(model)
            return Measurement(v, self.holds(v))
        if kind in ("perplexity", "masked"):
            ppl, _ = self._perplexity(model)
            v = ppl / self.reference - 1.0 if math.isfinite(ppl) else math.inf
            return Measurement(v, self.holds(v), None, ppl)
        if kind == "kl":
            v, top1 = self._kl(model)
            return Measurement(v, self.holds(v), top1)
        err2 = 0.0
        agree = rows = 0
        with torch.no_grad():
            for i, (b, ref) in enumerate(zip(self.batches, self._ref)):
                y = main_output(self._forward(model, b, i))
                if y.shape != ref.shape:
                    raise AuditError(f"the model's output on held-out batch {i} is {tuple(y.shape)}, the dense "
                                     f"model's {tuple(ref.shape)}", "Measure a model made from the dense one")
                y, r = self._masked(y, b), self._masked(ref, b)
                err2 += float((y.double() - r.double()).pow(2).sum())
                if r.dim() >= 1 and r.shape[-1] >= 2:
                    agree += int((y.argmax(-1) == r.argmax(-1)).sum())
                    rows += r[..., 0].numel()
        value = math.sqrt(err2 / self._ref_norm2) if self._ref_norm2 > 0 else math.sqrt(err2)
        return Measurement(value, self.holds(value), agree / rows if rows else None)


def check_repeats(dense: nn.Module, b: Batch, first: torch.Tensor | None = None, user_fn: bool = False) -> None:
    """Refuse a dense model whose forward does not repeat: two runs on held-out batch ``b`` (``first``: the dense
    output already computed on it) within ``DETERMINISM`` relative. ``user_fn``: a user metric scores the model, so
    a forward that returns no tensor is not an error."""
    forward = Evaluator._forward
    with torch.no_grad():
        try:
            if first is None:
                first = main_output(forward(None, dense, b, 0)).detach()  # type: ignore[arg-type]
            again = main_output(forward(None, dense, b, 0)).detach()  # type: ignore[arg-type]
        except AuditError:
            if user_fn:
                return  # the model returns no tensor: the user's metric scores it, as it will every time
            raise
    if first.shape != again.shape:
        diff = math.inf
    else:
        x, y = first.double(), again.double()
        both_nan = torch.isnan(x) & torch.isnan(y)
        d = torch.where(both_nan | (x == y), torch.zeros_like(x), (x - y).abs())  # the same infinity: equal
        scale = float(torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).max()) if x.numel() else 0.0
        worst = float(d.max()) if d.numel() else 0.0
        diff = worst / scale if scale > 0 else worst
    if not diff <= DETERMINISM:
        mode = "it is in training mode (dropout on)" if dense.training or any(
            m.training for m in dense.modules()) else "noise in the forward, or a nondeterministic kernel"
        raise AuditError(f"the model's forward does not repeat: two runs on held-out batch 0 differ by {diff:.3g} "
                         f"relative (at most {DETERMINISM:g} allowed), so no measured floor would mean anything; "
                         f"likely {mode}", "Put the model in eval mode (model.eval()) and take random noise out "
                         "of the forward before measuring")
