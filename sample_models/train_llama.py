"""Train the sample Llama (a Hugging Face ``LlamaForCausalLM``) and its byte-level BPE tokenizer on the Python standard
library's sources, and save both as a Hugging Face directory with a calibration text and a held-out text.

    python sample_models/train_llama.py

Architecture: Llama's (RMSNorm, rotary positions, SwiGLU MLP, no biases) with grouped-query attention: 4 query heads
and 2 key/value heads of width 32 (hidden 128), 4 decoder blocks, MLP width 344, 128 positions, untied output head;
1,250,432 parameters (the embedding and the head are 42% of them).

Text: the top-level ``*.py`` files of the running interpreter's standard library (``sysconfig``'s ``stdlib`` path),
in sorted order. Every 8th file (the 1st, 9th, ...) is held out; the rest is training text, which the tokenizer (BPE
over bytes, 2,048 ids, ``tokenizers``) and the model learn from. ``llama/holdout.txt`` is the held-out files' start
(whole lines, at most 128 KiB); ``llama/calib.txt`` is the same amount of training text taken from the files 5th,
13th, ... (never a held-out file). The shipped files were made with CPython 3.11.7's library; another version's
sources give slightly different numbers.

Writes ``llama/``: ``config.json``, ``model.safetensors`` (the weights rounded to bfloat16, to keep the sample small;
the config says float32, so the model is built and run in float32 with those rounded values), ``tokenizer.json``,
``tokenizer_config.json``, ``calib.txt`` and ``holdout.txt``. Deterministic (fixed seeds, one thread, a fixed
number of steps; one thread because two threads on a machine shared with other jobs ran 18x slower a step here).
Prints the held-out loss and perplexity with the float32 weights and with the bfloat16 weights as shipped.

Training: AdamW (betas 0.9, 0.95; weight decay 0.1 on matrices), batches of 16 windows of 129 tokens drawn at random
from the training text (1,319,430 tokens), gradients clipped to norm 1, the learning rate warmed up linearly to 3e-3
over 50 steps and then halved every 250 steps. The rate does not depend on the number of steps, so a run of N steps
(``--steps N``) is the first N steps of a longer run, and the curve below is what each step count would ship.
Held-out perplexity (128 windows of 129 tokens spread over the held-out files, float32), one run:

    steps          100     200    300    400    500    600    700    800    900   1000   1100   1200   1300   1400   1500
    perplexity  187.15  100.10  72.70  61.17  53.77  49.65  46.65  45.14  43.33  41.97  41.00  40.43  40.04  39.60  39.22

1,500 steps ship (2.3 passes over the training text; bfloat16 as shipped: 39.213). The last 500 steps gain 6.6%,
the last 200 2.0%: the rate is then below 1e-4. 1,053 s with one thread on the 2-core VM shared with other jobs (load
average 10-17); a step is about 0.24 s of CPU, so about 6 minutes on one idle core.
Not measured: whether twice the steps with a slower decay would go meaningfully lower.
"""

from __future__ import annotations

import json
import math
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
OUT = HERE / "llama"
CALIB = OUT / "calib.txt"
HOLDOUT = OUT / "holdout.txt"

VOCAB = 2048
EOS, PAD = "<|endoftext|>", "<pad>"  # ids 0 and 1
CONTEXT = 128
STEPS = 1500
BATCH = 16  # windows of CONTEXT + 1 tokens per step
PEAK_LR = 3e-3
WARMUP = 50
HALF_LIFE = 250  # steps
EVAL_EVERY = 100  # steps between held-out evaluations (all 128 windows)
HOLDOUT_EVERY = 8
CALIB_OFFSET = 4  # calibration text: the training files i % 8 == 4
TEXT_BYTES = 128 * 1024  # each of calib.txt and holdout.txt, cut at a line end


# The shipped sample, and the wider model the quality benchmark holds back from the repository (2,410,176 parameters:
# hidden 192, MLP 512, 6 query heads and 3 key/value heads of width 32; ``--shape wide``).
SHAPES = {
    "sample": {"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, "num_key_value_heads": 2},
    "wide": {"hidden_size": 192, "intermediate_size": 512, "num_attention_heads": 6, "num_key_value_heads": 3},
}


def config(shape: str = "sample") -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, **SHAPES[shape],
        "num_hidden_layers": 4, "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 1, "use_cache": False,
        "dtype": "float32",
    }


def sources() -> list[tuple[str, str]]:
    """(file name, text) of the stdlib's top-level sources, sorted by name."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return [(f.name, f.read_text(encoding="utf-8", errors="replace")) for f in files]


def cut(texts: list[str], limit: int) -> str:
    """The texts joined, cut to at most ``limit`` UTF-8 bytes at a line end."""
    joined = "".join(t if t.endswith("\n") else t + "\n" for t in texts)
    data = joined.encode("utf-8")[:limit]
    return data[:data.rfind(b"\n") + 1].decode("utf-8")


def train_tokenizer(train_texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_texts, trainer=trainer)
    return tok


def encode(tok, texts: list[str]) -> torch.Tensor:
    """All texts' ids, each file followed by the end-of-text id."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [0]
    return torch.tensor(ids, dtype=torch.long)


def windows(ids: torch.Tensor, n: int, length: int) -> torch.Tensor:
    starts = torch.linspace(0, len(ids) - length, n).long()
    return torch.stack([ids[s:s + length] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: nn.Module, seqs: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats per token) over ``seqs``."""
    model.eval()
    loss, count = 0.0, 0
    for chunk in seqs.split(batch):
        logits = model(input_ids=chunk[:, :-1]).logits.flatten(0, 1).float()
        target = chunk[:, 1:].flatten()
        loss += nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += target.numel()
    return loss / count


def lr_at(step: int) -> float:
    """Linear warm-up over WARMUP steps, then halving every HALF_LIFE steps. The rate at a step does not depend on the
    number of steps, so a run of N steps is the first N steps of a longer one (the loss curve below)."""
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    return PEAK_LR * 0.5 ** ((step - WARMUP) / HALF_LIFE)


def train(model: nn.Module, data: torch.Tensor, val: torch.Tensor, steps: int,
          checkpoints: Path | None = None, seed: int = 0) -> tuple[float, float]:
    decay = [p for p in model.parameters() if p.dim() > 1]
    other = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1 + seed)
    n = CONTEXT + 1
    start = time.perf_counter()
    for step in range(steps):
        model.train()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = torch.randint(0, len(data) - n, (BATCH,), generator=g)
        chunk = torch.stack([data[s:s + n] for s in starts.tolist()])
        logits = model(input_ids=chunk[:, :-1]).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 25 == 0:
            print(f"step {step + 1:5d}  train {loss.item():.3f}  {time.perf_counter() - start:.0f} s", flush=True)
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
            held = evaluate(model, val)
            if checkpoints is not None:
                save_bf16(model, checkpoints / f"step{step + 1:05d}.safetensors")
            print(f"step {step + 1:5d}  train {loss.item():.3f}  held-out {held:.4f} nats/token, perplexity "
                  f"{math.exp(held):.2f}  {time.perf_counter() - start:.0f} s", flush=True)
    return loss.item(), time.perf_counter() - start


def save_bf16(model: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The weights rounded to bfloat16, written to ``path``."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})
    return state


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS}, as shipped)")
    parser.add_argument("--out", type=Path, default=OUT, help="directory to write (default: sample_models/llama)")
    parser.add_argument("--checkpoints", type=Path, help=f"also write the bfloat16 weights every {EVAL_EVERY} steps here")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="sample",
                        help="sample (as shipped) or wide (the 2.4M model benchmarks/quality.py measures)")
    parser.add_argument("--seed", type=int, default=0,
                        help="initialisation and batch-order seed (default 0, as shipped); another seed trains another "
                             "realization of the same shape, for checking that a measured result is not one model's")
    args = parser.parse_args()
    save(*fit(args.steps, args.checkpoints, args.shape, args.seed), args.out, args.steps, args.shape)


def fit(steps: int, checkpoints: Path | None = None, shape: str = "sample", seed: int = 0):
    """The tokenizer, the trained model, the texts to ship and the training's summary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    files = sources()
    train_files = [t for i, (_, t) in enumerate(files) if i % HOLDOUT_EVERY]
    held_files = [t for i, (_, t) in enumerate(files) if i % HOLDOUT_EVERY == 0]
    calib_files = [t for i, (_, t) in enumerate(files) if i % HOLDOUT_EVERY == CALIB_OFFSET]
    tok = train_tokenizer(train_files)
    data, held = encode(tok, train_files), encode(tok, held_files)
    print(f"{len(files)} files; training {len(data):,} tokens, held out {len(held):,} tokens "
          f"({len(held_files)} files: {', '.join(n for i, (n, _) in enumerate(files) if i % 8 == 0)[:60]}...)")

    cfg = config(shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
    val = windows(held, 128, CONTEXT + 1)
    last, seconds = train(model, data, val, steps, checkpoints, seed)
    texts = {"calib.txt": cut(calib_files, TEXT_BYTES), "holdout.txt": cut(held_files, TEXT_BYTES)}
    return tok, model, val, texts, (last, seconds)


def save(tok, model: nn.Module, val: torch.Tensor, texts: dict[str, str], summary: tuple[float, float], out: Path,
         steps: int, shape: str = "sample") -> None:
    """Write the Hugging Face directory and print the held-out numbers with float32 and bfloat16 weights."""
    from transformers import PreTrainedTokenizerFast

    cfg, (last, seconds) = config(shape), summary
    loss32 = evaluate(model, val)
    state = save_bf16(model, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, model_max_length=CONTEXT)
    fast.save_pretrained(str(out))
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        (out / extra).unlink(missing_ok=True)
    for name, text in texts.items():
        (out / name).write_text(text, encoding="utf-8")

    model.load_state_dict({k: v.float() for k, v in state.items()})
    loss16 = evaluate(model, val)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params:,} params, {steps} steps x {BATCH} x {CONTEXT} tokens in {seconds:.0f} s; last train loss "
          f"{last:.4f}")
    for label, loss in (("fp32", loss32), ("bf16 as shipped", loss16)):
        print(f"held-out (128 windows of {CONTEXT + 1}, {label}): {loss:.4f} nats/token, perplexity "
              f"{math.exp(loss):.3f}")
    for path in sorted(out.iterdir()):
        print(f"{path.stat().st_size:,} bytes -> {path}")


if __name__ == "__main__":
    main()
