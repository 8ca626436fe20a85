"""The flags the audit (``lowrank-audit MODEL``) and ``lowrank-audit factorize`` both take, defined once: the model
and its inputs, the plan, the calibration data and how it is split, the metric and its tolerance, the statistics'
dtype and the caches. Each command adds the ones it takes with :func:`add_shared` (``factorize`` makes ``--plan``
required); the recovery flags are :mod:`.recovery_flags`, shared the same way.

``-o`` and ``--measure-speed`` are not here: they mean different things in the two commands (the audit's report
folder and per-layer timing; the factorized model's folder and end-to-end timing).

``--metric``'s and ``--tolerance``'s help list the registered metrics (:mod:`auditor.calibration.metrics`): written
out here, because ``lowrank-audit --help`` imports no torch (the metric modules do), and held equal to what the
registry says by a test (:func:`metric_help`, :func:`tolerance_help`), so a metric added without its words here fails
it."""

from __future__ import annotations

from typing import Any

METRIC_DEFAULT = ("pooled-cosine for a sentence-transformers directory, with its pooling; perplexity for a causal LM, "
                  "masked-perplexity for a masked LM, else output-error")
METRIC_HELP = ("output-error (alias output): the relative output error, lower is better; perplexity (alias ppl): the "
               "perplexity increase, lower is better; kl: the next-token KL, lower is better; masked-ce (alias "
               "masked-perplexity, mlm): the masked-token perplexity increase, lower is better; pooled-cosine (alias "
               "pooled, sentence-cosine): the pooled-embedding cosine distance, lower is better; or fn(model, "
               f"batches) -> float, higher is better (default: {METRIC_DEFAULT})")
TOLERANCE_HELP = ("allowed loss in the metric's units (default 0.01), e.g. 0.02: output-error: a share of the dense "
                  "output's norm; perplexity: a relative increase of the held-out perplexity; kl: nats per real "
                  "token; masked-ce: a relative increase of the held-out masked-token perplexity; pooled-cosine: 1 - "
                  "the mean cosine of the pooled embeddings; user: the function's own")

# flag -> (option strings, add_argument keywords)
FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "model": (("model",), {"help": "the model source (file.py:factory, module:factory, a Hugging Face directory, ...)"}),
    "input-shape": (("--input-shape",), {
        "action": "append", "metavar": "1,3,224,224",
        "help": "a float input of this shape (repeat for several positional inputs)"}),
    "input-ids": (("--input-ids",), {"metavar": "1,128",
                                     "help": "token ids of this shape, within the config's vocabulary"}),
    "weights": (("--weights",), {
        "metavar": "PATH", "help": "a state dict (safetensors, or .pt/.bin loaded weights_only), or a folder of them; "
                                   "also accepted with a config.json"}),
    "plan": (("--plan",), {"metavar": "FILE", "help": "a compression plan (TOML or JSON): the audit reviews it, "
                                                      "factorize applies it after the same review"}),
    "tie": (("--tie",), {
        "action": "append", "metavar": "GROUP",
        "help": "layers whose ranks must be equal, so that fused kernels can run the factorized model: "
                "comma-separated layer-name patterns matched within each block, e.g. --tie q_proj,k_proj,v_proj "
                "--tie gate_proj,up_proj (repeat for several groups), or --tie auto for the known families' groups (q/k/v and gate/up of "
                "Llama, Mistral, Qwen; BERT's query/key/value; T5's). The audit's search gives each group one rank; "
                "a plan that breaks a tie is LR021, which factorize refuses (default: the plan's own ties)"}),
    "calibration": (("--calibration",), {
        "metavar": "FILE|module:fn",
        "help": "inputs to measure with: a safetensors/.pt file of tensors named after the forward's inputs, batched "
                "along dim 0, file.py:fn / module:fn returning batches, or (for a Hugging Face directory with its "
                "tokenizer) a text file: .txt/.md/.rst/.py, or any UTF-8 file. factorize initialises the factors "
                "whitened by it and measures the plan on its held-out part"}),
    "calibration-length": (("--calibration-length",), {
        "type": int, "metavar": "N",
        "help": "tokens per window of a text calibration file (default: the model's positions, at most 512)"}),
    "document-separator": (("--document-separator",), {
        "metavar": "TEXT",
        "help": "the text between documents in a text calibration file (\\n, \\t, \\r and \\\\ are read as escapes, "
                "e.g. '\\n\\n\\n'): each piece is one document, held out and resampled whole by the verification; "
                "a directory of text files is one document per file without it"}),
    "holdout": (("--holdout",), {"metavar": "SHARE|FILE", "help": "share of the rows held out to measure (default "
                                                                  "0.25), or a second file held out whole"}),
    "metric": (("--metric",), {"metavar": "NAME|module:fn", "help": METRIC_HELP}),
    "tolerance": (("--tolerance",), {"type": float, "metavar": "X", "help": TOLERANCE_HELP.replace("%", "%%")}),
    "compute-dtype": (("--compute-dtype",), {
        "choices": ["model", "float32"],
        "help": "the dtype the calibrated audit computes in: model (its own, the default) or float32 (bf16/fp16 "
                "weights upcast while they run, the statistics one block at a time, every other forward a module at "
                "a time: on a CPU without bf16 matrix units bf16 is hundreds of times slower). factorize defaults to the plan's compute_dtype: give what the audit used, so the factors "
                "are the ones it measured"}),
    "confidence": (("--confidence",), {
        "type": float, "metavar": "LEVEL",
        "help": "the verification interval's level (default 0.9): the suggested plan's interval over the held-out "
                "rows the search never read must end within the tolerance"}),
    "no-split": (("--no-split",), {
        "action": "store_true", "help": "search and check the plan on every held-out row, without a verification "
                                        "part or interval (the behaviour before the split)"}),
    "no-cache": (("--no-cache",), {"action": "store_true",
                                   "help": "do not read or write the caches"}),
}


def unescape(text: str | None) -> str | None:
    r"""A separator typed on the command line with its escapes read: \n, \t, \r, \\.

    >>> unescape(r"\n\n--\t\\")
    '\n\n--\t\\'
    """
    if text is None:
        return None
    out, i = [], 0
    table = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in table:
            out.append(table[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def add_shared(group: Any, *names: str, **changed: dict[str, Any]) -> None:
    """Add the shared flags ``names`` (keys of :data:`FLAGS`) to an argparse parser or group, in that order;
    ``changed[name]`` updates a flag's keywords for this command (``plan={"required": True}``)."""
    for name in names:
        strings, keywords = FLAGS[name]
        group.add_argument(*strings, **{**keywords, **changed.get(name.replace("-", "_"), {})})


def metric_help() -> str:
    """--metric's help as the registry says it (:data:`METRIC_HELP` must equal it): every registered metric by its
    names and label, then a user function."""
    from ..calibration import metrics

    built_in = [metrics.for_kind(k) for k in metrics.kinds() if not metrics.for_kind(k).takes_function]
    listed = "; ".join(f"{k.names[0]}{' (alias ' + ', '.join(k.names[1:]) + ')' if k.names[1:] else ''}: the "
                       f"{k.label}, {'higher' if k.higher_is_better else 'lower'} is better" for k in built_in)
    return f"{listed}; or fn(model, batches) -> float, higher is better (default: {METRIC_DEFAULT})"


def tolerance_help() -> str:
    """--tolerance's help as the registry says it (:data:`TOLERANCE_HELP` must equal it): the default and what it is
    in each registered metric's units."""
    from ..calibration import metrics
    from ..calibration.measure.metric import DEFAULT_TOLERANCE

    units = "; ".join(f"{k.names[0] if k.names else k.kind}: {k.units or 'its own units'}"
                      for k in map(metrics.for_kind, metrics.kinds()))
    return f"allowed loss in the metric's units (default {DEFAULT_TOLERANCE:g}), e.g. 0.02: {units}"
