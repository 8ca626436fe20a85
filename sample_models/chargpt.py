"""A small character-level GPT (decoder-only transformer) trained on the Python standard library's own sources by
``train_chargpt.py`` beside this file: a sample model whose weights and inputs are real, for demos and for studies that
need calibration data (a text model scores real text far better than uniform random token ids).

Written with plain ``nn.Embedding`` / ``nn.Linear`` / ``nn.LayerNorm`` and a causal mask held as a buffer, so
``torch.fx.symbolic_trace`` traces it. The vocabulary is fixed (tab, newline, printable ASCII, and one id for
everything else), stored in the weights file's metadata as well.

    lowrank-audit sample_models/chargpt.py:chargpt
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
WEIGHTS = HERE / "chargpt.safetensors"
CALIB = HERE / "chargpt_calib.safetensors"  # windows of training text, key "idx"
HOLDOUT = HERE / "chargpt_holdout.safetensors"  # windows of held-out files, key "idx"

UNK = "\x00"  # id 0: any character outside the vocabulary
VOCAB = UNK + "\t\n" + "".join(chr(c) for c in range(32, 127))  # 98 characters
_INDEX = {ch: i for i, ch in enumerate(VOCAB)}


class Config(NamedTuple):  # not a dataclass: the CLI imports this file without registering it in sys.modules
    vocab: int = len(VOCAB)
    context: int = 128
    d_model: int = 192
    layers: int = 4
    heads: int = 4
    mlp: int = 4  # hidden width = mlp * d_model

    def param_count(self) -> int:
        """Parameters in closed form: embeddings, per block 4 d x d projections + the 4x MLP + two LayerNorms,
        the final LayerNorm and the output head (all Linears with bias, no weight tying)."""
        d, h = self.d_model, self.mlp * self.d_model
        block = 4 * (d * d + d) + (d * h + h) + (h * d + d) + 2 * (2 * d)
        return self.vocab * d + self.context * d + self.layers * block + 2 * d + (d * self.vocab + self.vocab)


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp * d)
        self.out = nn.Linear(cfg.mlp * d, d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.size(0), x.size(1), x.size(2)  # not `x.shape` unpacked: fx cannot iterate a traced size
        hd = d // self.heads
        y = self.ln1(x)
        q = self.q(y).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k(y).view(b, t, self.heads, hd).transpose(1, 2)
        v = self.v(y).view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd)) + mask  # mask: 0 on and below the diagonal, -inf above
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(self.act(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    """Logits (batch, time, vocab) for the next character at every position of ``idx`` (batch, time <= context)."""

    def __init__(self, cfg: Config = Config()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        n = cfg.context
        mask = torch.full((n, n), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)
        self.register_buffer("positions", torch.arange(n), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        idx = idx.long()  # the shipped token files are uint8
        t = idx.size(1)
        # narrow, not [:t]: a traced length cannot index a tensor, but torch functions take it
        x = self.tok(idx) + self.pos(self.positions.narrow(0, 0, t))
        mask = self.mask.narrow(0, 0, t).narrow(1, 0, t)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def encode(text: str) -> torch.Tensor:
    """Token ids (uint8) of ``text``; characters outside the vocabulary map to id 0."""
    return torch.tensor([_INDEX.get(ch, 0) for ch in text], dtype=torch.uint8)


def decode(ids: torch.Tensor) -> str:
    return "".join(VOCAB[int(i)] for i in ids.reshape(-1))


def metadata(cfg: Config) -> dict[str, str]:
    """What the weights file records besides tensors: the config and the vocabulary."""
    return {"config": json.dumps(cfg._asdict()), "vocab": json.dumps(VOCAB)}


def load_ids(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path))["idx"]


def model() -> CharGPT:
    """The trained model (float32, eval mode); the file stores float16 weights."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(WEIGHTS), "pt") as f:
        meta = f.metadata()
    if json.loads(meta["vocab"]) != VOCAB:
        raise ValueError(f"{WEIGHTS.name} was trained with another vocabulary; re-run train_chargpt.py")
    net = CharGPT(Config(**json.loads(meta["config"])))
    net.load_state_dict({k: v.float() for k, v in load_file(str(WEIGHTS)).items()})
    return net.eval()


def chargpt() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """(model, example inputs): one window of 128 held-out characters as a (1, 128) LongTensor."""
    return model(), (load_ids(HOLDOUT)[:1].long(),)
