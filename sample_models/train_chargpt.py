"""Train the character-level sample GPT on the Python standard library's sources and save it with its token files.

    python sample_models/train_chargpt.py

Text: the top-level ``*.py`` files of the running interpreter's standard library (``sysconfig``'s ``stdlib`` path),
in sorted order; every 8th file (the 1st, 9th, ...) is held out for validation, the rest is training text. The
shipped files were made with CPython 3.11.7's library; another version's sources give slightly different numbers.

Writes, beside this file: ``chargpt.safetensors`` (float16 weights, config and vocabulary in the metadata),
``chargpt_calib.safetensors`` (64 windows of 128 training characters, uint8, key ``idx``) and
``chargpt_holdout.safetensors`` (256 windows of 128 held-out characters). Deterministic (fixed seeds, two
threads, a fixed number of steps); about 3 minutes on two idle CPU cores (30 with the cores shared). Prints the validation metrics with the float32
weights and with the float16 weights as shipped.
"""

from __future__ import annotations

import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chargpt import CALIB, HOLDOUT, WEIGHTS, CharGPT, Config, encode, metadata  # noqa: E402

STEPS = 400
BATCH = 32
PEAK_LR = 2e-3
WARMUP = 40
HOLDOUT_EVERY = 8


def corpus() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(training ids, held-out ids, held-out file names): the stdlib's top-level sources, one file in 8 held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train, held, names = [], [], []
    for i, f in enumerate(files):
        ids = encode(f.read_text(encoding="utf-8", errors="replace"))
        if i % HOLDOUT_EVERY == 0:
            held.append(ids)
            names.append(f.name)
        else:
            train.append(ids)
    return torch.cat(train), torch.cat(held), names


def windows(ids: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """``n`` windows of ``length`` ids at evenly spaced starts over the whole text (deterministic, no overlap while
    the text is long enough)."""
    starts = torch.linspace(0, len(ids) - length, n).long()
    return torch.stack([ids[s:s + length] for s in starts.tolist()])


def init_weights(model: CharGPT) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 layers)."""
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() > 1:
            std = 0.02 / math.sqrt(2 * model.cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
            nn.init.normal_(p, 0.0, std)


@torch.no_grad()
def evaluate(model: nn.Module, seqs: torch.Tensor, batch: int = 64) -> tuple[float, float]:
    """(mean cross-entropy in nats per character, top-1 accuracy) predicting each next id of ``seqs``."""
    model.eval()
    loss, correct, count = 0.0, 0, 0
    for chunk in seqs.split(batch):
        logits = model(chunk[:, :-1]).flatten(0, 1)
        target = chunk[:, 1:].flatten().long()
        loss += nn.functional.cross_entropy(logits, target, reduction="sum").item()
        correct += (logits.argmax(-1) == target).sum().item()
        count += target.numel()
    return loss / count, correct / count


def lr_at(step: int) -> float:
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, STEPS - WARMUP)
    return PEAK_LR * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: CharGPT, data: torch.Tensor, val: torch.Tensor) -> float:
    decay = [p for p in model.parameters() if p.dim() > 1]
    other = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    n = model.cfg.context + 1
    start = time.perf_counter()
    for step in range(STEPS):
        model.train()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = torch.randint(0, len(data) - n, (BATCH,), generator=g)
        chunk = torch.stack([data[s:s + n] for s in starts.tolist()]).long()
        loss = nn.functional.cross_entropy(model(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == STEPS - 1:
            vl, va = evaluate(model, val[:128])
            print(f"step {step:5d}  train {loss.item():.3f}  val {vl:.3f} nats/char  acc {va:.3f}  "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    return time.perf_counter() - start


def main() -> None:
    from safetensors.torch import save_file

    torch.set_num_threads(2)
    data, held, names = corpus()
    print(f"training text {len(data):,} chars; held out {len(held):,} chars in {len(names)} files "
          f"({', '.join(names[:4])}, ...)")
    val = windows(held, 512, 129)  # validation: 512 windows of 129 held-out characters
    cfg = Config()
    model = CharGPT(cfg)
    init_weights(model)
    seconds = train(model, data, val)

    loss32, acc32 = evaluate(model, val)
    half = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    save_file(half, str(WEIGHTS), metadata=metadata(cfg))
    model.load_state_dict({k: v.float() for k, v in half.items()})
    loss16, acc16 = evaluate(model, val)
    save_file({"idx": windows(data, 64, 128).contiguous()}, str(CALIB))
    hold = windows(held, 256, 128).contiguous()
    save_file({"idx": hold}, str(HOLDOUT))
    hl, ha = evaluate(model, hold)
    rand = torch.randint(0, cfg.vocab, (256, 128), generator=torch.Generator().manual_seed(2))
    rl, ra = evaluate(model, rand)
    unigram = (held == torch.bincount(data.long()).argmax()).float().mean().item()

    print(f"{cfg.param_count():,} params, {STEPS} steps x {BATCH} x {cfg.context} chars in {seconds:.0f} s")
    for label, (loss, acc) in (("fp32", (loss32, acc32)), ("fp16", (loss16, acc16))):
        print(f"validation ({label} weights, 512 windows): {loss:.4f} nats/char = {loss / math.log(2):.4f} "
              f"bits/char, top-1 {acc:.4f}")
    print(f"shipped holdout file (256 x 128): {hl:.4f} nats/char, top-1 {ha:.4f}; unigram baseline top-1 "
          f"{unigram:.4f}; uniform random ids: {rl:.4f} nats/char, top-1 {ra:.4f}")
    for path in (WEIGHTS, CALIB, HOLDOUT):
        print(f"{path.stat().st_size:,} bytes -> {path.name}")


if __name__ == "__main__":
    main()
