"""The character-level sample GPT: exact size, real skill on held-out text, none on random ids, and a full trace."""

import math

import pytest
import torch
from torch import nn

import auditor
from auditor.results import Kind
from auditor.structure.trace import Method

# measured by sample_models/train_chargpt.py on the shipped held-out file (float16 weights)
HOLDOUT_LOSS = 1.7782  # nats per character
HOLDOUT_ACC = 0.5246  # next-character top-1


@pytest.fixture(scope="module")
def gpt():
    from chargpt import chargpt

    return chargpt()


@torch.no_grad()
def next_char(model: nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(cross-entropy in nats per character, top-1 accuracy) predicting ids[:, 1:] from each prefix."""
    logits = model(ids[:, :-1]).flatten(0, 1)
    target = ids[:, 1:].flatten().long()
    return nn.functional.cross_entropy(logits, target).item(), (logits.argmax(-1) == target).float().mean().item()


def test_parameter_count_closed_form(gpt):
    from chargpt import VOCAB, Config

    model, _ = gpt
    cfg = model.cfg
    assert cfg == Config() and cfg.vocab == len(VOCAB) == 98
    d, v, t = 192, 98, 128
    block = 4 * (d * d + d) + 2 * (4 * d * d) + 4 * d + d + 4 * d  # q k v proj, fc + out with biases, 2 LayerNorms
    assert cfg.param_count() == v * d + t * d + 4 * block + 2 * d + d * v + v == 1_842_146
    assert sum(p.numel() for p in model.parameters()) == 1_842_146


def test_shipped_files_hold_the_documented_shapes(gpt):
    from chargpt import CALIB, HOLDOUT, load_ids

    _, (example,) = gpt
    assert example.shape == (1, 128) and example.dtype == torch.long
    for path, n in ((CALIB, 64), (HOLDOUT, 256)):
        ids = load_ids(path)
        assert ids.shape == (n, 128) and ids.dtype == torch.uint8 and int(ids.max()) < 98


def test_encode_decode_round_trip_and_unknown_characters():
    from chargpt import decode, encode

    text = "def f(x):\n\treturn x  # ok\n"
    assert decode(encode(text)) == text
    assert encode("é→x").tolist() == [0, 0, encode("x").item()]


def test_held_out_text_is_predicted_and_random_ids_are_not(gpt):
    from chargpt import HOLDOUT, load_ids

    model, _ = gpt
    held = load_ids(HOLDOUT)
    loss, acc = next_char(model, held)
    assert acc == pytest.approx(HOLDOUT_ACC, abs=0.005)
    assert loss == pytest.approx(HOLDOUT_LOSS, abs=0.01)
    unigram = (held[:, 1:] == torch.bincount(held.flatten().long()).argmax()).float().mean().item()
    assert 0.25 < unigram < 0.32  # the space character
    assert acc > unigram + 0.2
    rand = torch.randint(0, 98, (256, 128), generator=torch.Generator().manual_seed(2))
    rloss, racc = next_char(model, rand)
    assert racc < 0.03  # chance is 1/98
    assert rloss > loss + 2.0 and rloss > math.log(98)  # worse than a uniform guess: random ids are not text


def test_audit_traces_symbolically_and_finds_every_linear_and_embedding(gpt):
    model, inputs = gpt
    a = auditor.audit(model, inputs, spectra=False)
    assert a.trace_method == Method.SYMBOLIC and not a.trace_failures
    expected = {name for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    assert len(expected) == 4 * 6 + 1 + 2
    assert {layer.name for layer in a.layers} == expected
    assert sum(layer.kind == Kind.EMBEDDING for layer in a.layers) == 2
    assert a.total_params == 1_842_146
    # MACs: 128 positions through every Linear (4 x (4 d^2 + 8 d^2) + d x vocab); embeddings are lookups
    assert a.total_macs == 128 * (4 * 12 * 192 * 192 + 192 * 98)
    assert a.layer("tok").lookups == 128 and a.layer("pos").lookups == 128
