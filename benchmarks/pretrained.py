"""Pretrained models from the package index: the audit, the written plans and uniform truncation on unseen inputs.

    python benchmarks/pretrained.py                        # both models, budgets 0.2 and 0.3 (a few minutes)
    python benchmarks/pretrained.py --only iglm --budgets 0.3 --calib-rows 256 --unseen-rows 128

Weights trained elsewhere, shipped inside wheels on PyPI (no model hub at run time), fetched with
``pip download --no-deps`` into ``--cache`` (default ``benchmarks/.pretrained-cache``, git-ignored; never the venv)
and read from the unzipped wheel; without the index (offline, pip fails) the script says so and exits 0:

- ``iglm==0.1.0`` (IgLM, Shuai, Ruffolo & Gray 2023; JHU academic software licence, non-commercial): a causal
  language model of antibody variable domains, ``transformers.GPT2LMHeadModel`` (4 layers, width 512, MLP 2048,
  33 tokens: the amino acids, chain and species tags), 12.9M parameters, 12.6M of them in Linear (Conv1D) layers;
- ``rxnfp==0.1.0`` (rxnfp, Schwaller et al. 2021, MIT): a BERT masked LM pretrained on chemical reaction SMILES
  (``bert_pretrained``: 12 layers, width 256, MLP 512, 591 tokens), 6.7M parameters (its config has no
  ``model_type``: it is read as a ``BertConfig`` and saved with ``BertForMaskedLM.save_pretrained``, the weights
  unchanged; the MLM head is in the checkpoint, its pooler and next-sentence head, off the masked LM's path, are
  dropped).

Neither comes with data, so the inputs are made here and tokenized here (a ``.safetensors`` of ``input_ids``,
``attention_mask`` and, for the masked LM, ``labels``), one calibration set and one disjoint unseen set:

- IgLM: sequences sampled from the dense IgLM itself (``generate``, temperature 1, prompts heavy/light x
  human/mouse/rat/rabbit, a seed per set), each ``[CHAIN] [SPECIES] residues [SEP]``, padded to the longest. The
  unseen set is sampled with another seed (no sequence in both). Perplexity on the model's own samples is near its
  entropy: the dense baseline is low, and what is measured is how much the factorized models lose against it.
- rxnfp: reaction SMILES from 8 reaction templates (amide coupling, esterification, Suzuki coupling, ketone
  reduction, Boc removal, ester hydrolysis, nitro reduction, reductive amination) over lists of building blocks,
  in the USPTO style the model was trained on (reactants and reagents ``.``-separated, ``>>``, product), tokenized
  with rxnfp's SMILES regex and vocabulary, ``[CLS] ... [SEP]``, padded; 15% of the real tokens masked
  (``[MASK]``, labels there). The unseen set uses building blocks the calibration set never contains (a held-out
  part of each list), so its reactions are new molecules, not new pairings of seen ones.

Each model: the default calibrated audit (``lowrank-audit DIR --calibration calib.safetensors``, default flags:
the tolerance 0.01 of the default metric, perplexity for IgLM and masked-token perplexity for rxnfp), then
``--budget F --emit-plan plan.toml`` for each F, ``lowrank-audit factorize DIR --plan plan.toml --calibration ...``
(the default fit: sequential), and the uniform whitened truncation (SVD-LLM) at the same share: the ranks of the
audit's own baseline (``budget.uniform.ranks`` in its JSON) written as a plan and factorized with ``--fit
independent`` (each layer alone on whitened inputs: SVD-LLM's truncation). Each written model is loaded with
``auditor.folder.load_factorized`` and judged on the unseen set: perplexity increase (IgLM; next-token
cross-entropy on the real tokens after the prompt's first) and, for rxnfp, the masked-token perplexity increase
and 1 - cosine of the mean-pooled last hidden state (real tokens only) against the dense model's, mean over rows.
The audit's own numbers (its chosen plan's held-out value and the uniform baseline's on the same rows) are printed
beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # this checkout's auditor (load_factorized, lrmath), as the child processes get

PACKAGES = {"iglm": "iglm==0.1.0", "rxnfp": "rxnfp==0.1.0"}

SMI_REGEX = (r"(\%\([0-9]{3}\)|\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\||\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>>?|"
             r"\*|\$|\%[0-9]{2}|[0-9])")  # rxnfp.tokenization.SMI_REGEX_PATTERN


# ---------------------------------------------------------------------------------------------------- fetching
def fetch(name: str, cache: Path) -> Path | None:
    """The unzipped wheel of ``name`` under ``cache``: downloaded once with pip (no dependencies), None offline."""
    spec = PACKAGES[name]
    wheels = cache / "wheels"
    unzipped = cache / "unzipped" / name
    if (unzipped / ".done").exists():
        return unzipped
    wheels.mkdir(parents=True, exist_ok=True)
    have = [w for w in wheels.glob(f"{name}-*.whl")]
    if not have:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", str(wheels)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        have = [w for w in wheels.glob(f"{name}-*.whl")]
        if r.returncode != 0 or not have:
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"skip {name}: `pip download {spec}` failed (offline, or the index unreachable): {last}")
            return None
    if unzipped.exists():
        shutil.rmtree(unzipped)
    with zipfile.ZipFile(have[0]) as z:
        z.extractall(unzipped)
    (unzipped / ".done").write_text(have[0].name)
    return unzipped


def model_dir(name: str, unzipped: Path, cache: Path) -> Path:
    """A Hugging Face directory (config.json + model.safetensors) of the package's weights, made once."""
    import torch
    import transformers

    out = cache / "models" / name
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if name == "iglm":
        src = unzipped / "iglm" / "trained_models" / "IgLM"
        model = transformers.GPT2LMHeadModel.from_pretrained(src, output_loading_info=False)
    else:
        src = unzipped / "rxnfp" / "models" / "transformers" / "bert_pretrained"
        cfg = transformers.BertConfig.from_json_file(str(src / "config.json"))
        model = transformers.BertForMaskedLM(cfg)
        sd = torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids") and k != "cls.predictions.decoder.weight"
                   and k != "cls.predictions.decoder.bias"]
        # the checkpoint is BERT pretraining's (MLM and next-sentence heads): the pooler and the next-sentence head
        # are dropped, neither is on the masked LM's path
        unexpected = [k for k in unexpected if not k.endswith("position_ids") and not k.startswith("bert.pooler.")
                      and not k.startswith("cls.seq_relationship.")]
        if missing or unexpected:
            raise SystemExit(f"rxnfp checkpoint does not fit BertForMaskedLM: missing {missing}, unexpected "
                             f"{unexpected}")
        model.tie_weights()
        shutil.copy(src / "vocab.txt", out / "vocab.txt")
    model.eval().save_pretrained(out, safe_serialization=True)
    return out


# ---------------------------------------------------------------------------------------------------- inputs
IGLM_VOCAB = None


def sampled(model, rows: int, seed: int, cache: Path, torch):
    """:func:`_iglm_sample` once per (rows, seed), kept in ``cache/data``: sampling is most of a run's time."""
    from safetensors.torch import load_file, save_file

    f = cache / "data" / f"iglm_{rows}_{seed}.safetensors"
    if f.exists():
        t = load_file(str(f))
        return t["input_ids"], t["attention_mask"]
    ids, mask = _iglm_sample(model, rows, seed, 64, torch)
    f.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": ids, "attention_mask": mask}, str(f))
    return ids, mask


def _iglm_sample(model, rows, seed, batch, torch):
    """``rows`` distinct sequences sampled from IgLM (temperature 1, the tags and [PAD]/[UNK]/[CLS]/[MASK] never
    sampled after the prompt, stop at [SEP], at most 150 tokens): (input_ids, attention_mask) padded with [PAD]."""
    tokens = IGLM_VOCAB
    chain = [tokens["[HEAVY]"], tokens["[LIGHT]"]]
    species = [tokens[s] for s in ("[HUMAN]", "[MOUSE]", "[RAT]", "[RABBIT]")]
    bad = torch.zeros(len(tokens), dtype=torch.bool)
    for t, i in tokens.items():
        bad[i] = t.startswith("[") and t != "[SEP]"
    sep, pad = tokens["[SEP]"], tokens["[PAD]"]
    g = torch.Generator().manual_seed(seed)
    seen: set[tuple[int, ...]] = set()
    out: list[list[int]] = []
    while len(out) < rows:
        c = torch.tensor(chain)[torch.randint(len(chain), (batch,), generator=g)]
        s = torch.tensor(species)[torch.randint(len(species), (batch,), generator=g)]
        seqs = torch.stack([c, s], 1)
        done = torch.zeros(batch, dtype=torch.bool)
        with torch.no_grad():
            o = model(input_ids=seqs, use_cache=True)
            for _ in range(148):
                p = torch.softmax(o.logits[:, -1].float().masked_fill(bad, float("-inf")), -1)
                nxt = torch.multinomial(p, 1, generator=g).masked_fill(done[:, None], pad)
                seqs = torch.cat([seqs, nxt], 1)
                done |= nxt[:, 0] == sep
                if bool(done.all()):
                    break
                o = model(input_ids=nxt, past_key_values=o.past_key_values, use_cache=True)
        for row in seqs.tolist():
            if sep not in row[2:]:
                continue
            seq = tuple(row[:row.index(sep, 2) + 1])
            if len(seq) < 60 or seq in seen:
                continue
            seen.add(seq)
            out.append(list(seq))
    out = out[:rows]
    width = max(map(len, out))
    ids = torch.full((rows, width), pad, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for i, seq in enumerate(out):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
    return ids, mask


ACYL = ["c1ccccc1", "c1ccc(Cl)cc1", "c1ccc(OC)cc1", "c1ccc(F)cc1", "c1ccncc1", "C1CCCCC1", "CC", "CCC", "CC(C)C",
        "c1ccc2ccccc2c1", "c1ccc(C(F)(F)F)cc1", "c1ccsc1", "c1ccoc1", "C1CCOCC1", "c1cc(C)ccc1C", "c1ccc(Br)cc1",
        "C1CC1", "CCCCC", "c1cnc(C)nc1", "c1ccc([N+](=O)[O-])cc1"]
AMINE = ["c1ccccc1", "Cc1ccccc1", "CC", "CCCC", "C1CCCC1", "Cc1ccc(OC)cc1", "c1ccc(F)cc1", "CC(C)C", "CCOC",
         "c1cccnc1", "C1CCN(C)CC1", "CCc1ccccc1", "c1ccc(Cl)c(Cl)c1", "CC(C)(C)C", "C1CCC1", "CCCO"]
ALCOHOL = ["C", "CC", "CCC", "CC(C)C", "Cc1ccccc1", "CCCC", "CC(C)(C)C", "CCOC"]
ARYL_BR = ["c1ccc(C)cc1", "c1ccc(OC)cc1", "c1ccncc1", "c1ccc(C#N)cc1", "c1ccc(C(=O)OC)cc1", "c1cccs1",
           "c1ccc(F)c(F)c1", "c1ccc2[nH]ccc2c1", "c1cnc(N)nc1", "c1ccc(C(C)=O)cc1", "c1ccc(Cl)nc1", "c1ccccc1"]
BORONIC = ["c1ccccc1", "c1ccc(F)cc1", "c1ccc(OC)cc1", "c1ccoc1", "c1cccnc1", "c1ccc(C)cc1", "c1ccc(C(F)(F)F)cc1",
           "c1ccc2ccccc2c1", "c1cscc1", "c1ccc(Cl)cc1"]
KETONE_R = ["C", "CC", "c1ccccc1", "C1CC1", "CC(C)C", "c1ccc(F)cc1", "CCC", "c1ccncc1"]
NITRO_AR = ["c1ccccc1", "c1ccc(C)cc1", "c1ccc(Cl)cc1", "c1ccc(OC)cc1", "c1ccc(C(=O)O)cc1", "c1cccnc1",
            "c1ccc(F)cc1C", "c1ccc2ccccc2c1", "c1ccc(C#N)cc1", "c1cc(C)ccc1O"]
ALDEHYDE = ["c1ccccc1", "c1ccc(OC)cc1", "CC(C)", "c1ccoc1", "c1ccncc1", "CCCC", "c1ccc(Cl)cc1", "C1CCCCC1"]

TEMPLATES = [  # (name, lists, reaction): the lists' entries fill {0}, {1} in turn
    ("amide", (ACYL, AMINE), "{0}C(=O)O.N{1}.CCN(C(C)C)C(C)C.CN(C)C=O>>{0}C(=O)N{1}"),
    ("ester", (ACYL, ALCOHOL), "{0}C(=O)O.O{1}.O=S(=O)(O)O>>{0}C(=O)O{1}"),
    ("suzuki", (ARYL_BR, BORONIC), "Br{0}.OB(O){1}.O=C([O-])[O-].[K+].[K+].[Pd]>>{0}{1}"),
    ("reduction", (ACYL, KETONE_R), "{0}C(=O){1}.[BH4-].[Na+].CO>>{0}C(O){1}"),
    ("boc", (AMINE,), "CC(C)(C)OC(=O)N{0}.O=C(O)C(F)(F)F.ClCCl>>N{0}"),
    ("hydrolysis", (ACYL, ALCOHOL), "{0}C(=O)O{1}.[OH-].[Li+].C1CCOC1.O>>{0}C(=O)O"),
    ("nitro", (NITRO_AR,), "O=[N+]([O-]){0}.[H][H].[Pd].CCO>>N{0}"),
    ("amination", (ALDEHYDE, AMINE), "O=C{0}.N{1}.[BH3-]C#N.[Na+].CO>>{0}CN{1}"),
]


def reactions(part: str, seed: int) -> list[str]:
    """Every reaction of the templates over the building blocks of ``part``: 'calib' uses the first 3/4 of each
    list, 'unseen' only combinations with at least one block from the last quarter (new molecules)."""
    out = []
    for _, lists, rxn in TEMPLATES:
        cuts = [max(1, (3 * len(l)) // 4) for l in lists]
        def combos(i):
            if i == len(lists):
                yield ()
                return
            for j, x in enumerate(lists[i]):
                for rest in combos(i + 1):
                    yield ((j >= cuts[i], x),) + rest
        for c in combos(0):
            new = any(flag for flag, _ in c)
            if (part == "unseen") == new:
                out.append(rxn.format(*[x for _, x in c]))
    random.Random(seed).shuffle(out)
    return out


def rxnfp_inputs(vocab: dict[str, int], texts: list[str], seed: int, mask_share: float = 0.15):
    """(input_ids, attention_mask, labels, clean_ids): [CLS] tokens [SEP], padded; ``mask_share`` of the real
    tokens (not [CLS]/[SEP]) replaced by [MASK] in input_ids, their ids in labels (-100 elsewhere)."""
    import torch

    rx = re.compile(SMI_REGEX)
    rows, unk = [], 0
    for t in texts:
        toks = rx.findall(t)
        assert "".join(toks) == t, t
        ids = [vocab.get(x, vocab["[UNK]"]) for x in toks]
        unk += sum(i == vocab["[UNK]"] for i in ids)
        rows.append([vocab["[CLS]"], *ids, vocab["[SEP]"]])
    width = max(map(len, rows))
    n = len(rows)
    ids = torch.full((n, width), vocab["[PAD]"], dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    g = torch.Generator().manual_seed(seed)
    inner = mask.bool().clone()
    inner[:, 0] = False
    inner[torch.arange(n), mask.sum(1) - 1] = False
    chosen = (torch.rand(ids.shape, generator=g) < mask_share) & inner
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    masked = torch.where(chosen, torch.full_like(ids, vocab["[MASK]"]), ids)
    return masked, mask, labels, ids, unk


# ---------------------------------------------------------------------------------------------------- judging
def judge(kind: str, dense, model, data: dict) -> dict:
    """The unseen set's numbers for ``model`` against ``dense``: perplexity (causal LM) or masked-token perplexity
    and 1 - cosine of the mean-pooled last hidden state (masked LM)."""
    import torch
    import torch.nn.functional as F

    def ce_causal(m):
        tot, cnt = 0.0, 0
        for s in range(0, len(data["input_ids"]), 64):
            ids, am = data["input_ids"][s:s + 64], data["attention_mask"][s:s + 64]
            logits = m(input_ids=ids, attention_mask=am).logits[:, 1:-1]  # predict from the species tag on
            tgt, keep = ids[:, 2:], am[:, 2:].bool()
            ce = F.cross_entropy(logits.transpose(1, 2).float(), tgt, reduction="none")
            tot += float(ce[keep].sum())
            cnt += int(keep.sum())
        return tot / cnt

    def ce_masked(m):
        tot, cnt = 0.0, 0
        for s in range(0, len(data["input_ids"]), 128):
            ids, am, lab = (data[k][s:s + 128] for k in ("input_ids", "attention_mask", "labels"))
            logits = m(input_ids=ids, attention_mask=am).logits
            keep = lab != -100
            ce = F.cross_entropy(logits[keep].float(), lab[keep], reduction="sum")
            tot += float(ce)
            cnt += int(keep.sum())
        return tot / cnt

    def pooled(m):
        outs = []
        for s in range(0, len(data["clean_ids"]), 128):
            ids, am = data["clean_ids"][s:s + 128], data["attention_mask"][s:s + 128]
            h = m(input_ids=ids, attention_mask=am, output_hidden_states=True).hidden_states[-1].float()
            w = am.unsqueeze(-1).float()
            outs.append((h * w).sum(1) / w.sum(1))
        return torch.cat(outs)

    with torch.no_grad():
        if kind == "causal":
            base = data.setdefault("_base", ce_causal(dense))
            ce = ce_causal(model)
            return {"ppl": float(torch.tensor(ce).exp()), "ppl_dense": float(torch.tensor(base).exp()),
                    "ppl_increase": float(torch.tensor(ce - base).exp()) - 1}
        base = data.setdefault("_base", ce_masked(dense))
        ce = ce_masked(model)
        ref = data.setdefault("_pooled", pooled(dense))
        cos = F.cosine_similarity(pooled(model), ref, dim=1)
        return {"ppl": float(torch.tensor(ce).exp()), "ppl_dense": float(torch.tensor(base).exp()),
                "ppl_increase": float(torch.tensor(ce - base).exp()) - 1, "one_minus_cos": float((1 - cos).mean())}


# ---------------------------------------------------------------------------------------------------- the tool
def tool(args: list[str], log: Path, reuse: bool = False) -> tuple[int, float]:
    """``lowrank-audit ARGS`` in a child process (this checkout first on the path); its output to ``log``. With
    ``reuse`` (``--keep`` and the outputs there) the earlier run's exit status and time, read from ``log``."""
    if reuse and log.exists():
        last = log.read_text().splitlines()[-1]
        m = re.match(r"# exit (-?\d+) in ([0-9.]+) s", last)
        if m:
            return int(m.group(1)), float(m.group(2))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.perf_counter()
    with open(log, "w") as fh:
        fh.write("$ lowrank-audit " + " ".join(args) + "\n")
        fh.flush()
        r = subprocess.run([sys.executable, "-m", "auditor", *args], stdout=fh, stderr=subprocess.STDOUT, env=env,
                           cwd=str(ROOT))
    secs = time.perf_counter() - t
    with open(log, "a") as fh:
        fh.write(f"# exit {r.returncode} in {secs:.1f} s\n")
    return r.returncode, secs


def uniform_ranks(rep: dict, uni: dict) -> dict[str, int]:
    """The ranks of the audit's uniform baseline (``auditor/calibration/tiers/uniform.py``, ``ranks_at``): every
    layer of the kinds the chosen plan factorizes, not fixed, at ``kept`` of its break-even rank (half up, at least
    1), left dense where that saves nothing; checked against the parameters the report says it removes."""
    import math

    from auditor import lrmath

    budget = rep["calibration"]["budget"]
    layers = {l["name"]: l for l in rep["layers"]}
    fixed = budget.get("fixed") or {}
    kinds = {layers[k]["kind"] for k in (budget.get("plan") or {}) if k in layers and k not in fixed}
    ranks: dict[str, int] = {}
    for name, l in layers.items():
        if name in fixed or (kinds and l["kind"] not in kinds):
            continue
        r = max(1, math.floor(uni["kept"] * l["break_even"] + 0.5))
        if lrmath.saves(l["m"], l["n"], r):
            ranks[name] = r
    ranks.update(fixed)
    removed = sum(layers[k]["params"] - r * (layers[k]["m"] + layers[k]["n"]) * layers[k].get("groups", 1)
                  for k, r in ranks.items())
    if removed != uni.get("removed"):
        print(f"  note: uniform ranks rebuilt remove {removed:,}, the report says {uni.get('removed')}")
    return ranks


def report_json(outdir: Path) -> dict:
    files = sorted(outdir.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no JSON report in {outdir}")
    return json.loads(files[0].read_text())


def fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def tail(log: Path, n: int = 3) -> str:
    lines = [l for l in log.read_text().splitlines() if l.strip()]
    return " | ".join(lines[-n:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=HERE / ".pretrained-cache")
    ap.add_argument("--out", type=Path, default=None, help="work folder (default: CACHE/run)")
    ap.add_argument("--only", choices=sorted(PACKAGES), action="append")
    ap.add_argument("--budgets", default="0.2,0.3")
    ap.add_argument("--calib-rows", type=int, default=None,
                    help="calibration rows (default 128 IgLM sequences, 256 rxnfp reactions)")
    ap.add_argument("--unseen-rows", type=int, default=None, help="unseen rows (default 64 and 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", "-j", type=int, default=2)
    ap.add_argument("--keep", action="store_true",
                    help="keep the work folder and reuse the audits already there (their reports and plans); "
                         "factorize and the judging run again")
    a = ap.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(max(1, a.jobs))
    out_root = a.out or a.cache / "run"
    names = a.only or ["iglm", "rxnfp"]
    budgets = [float(b) for b in a.budgets.split(",") if b]
    results = []
    calib_rows, unseen_rows = a.calib_rows, a.unseen_rows
    t_all = time.perf_counter()
    for name in names:
        unzipped = fetch(name, a.cache)
        if unzipped is None:
            continue
        d = model_dir(name, unzipped, a.cache)
        work = out_root / name
        if work.exists() and not a.keep:
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        import transformers

        a.calib_rows = calib_rows or (128 if name == "iglm" else 256)
        a.unseen_rows = unseen_rows or (64 if name == "iglm" else 128)
        if name == "iglm":
            global IGLM_VOCAB
            vocab = [l.strip() for l in (unzipped / "iglm" / "trained_models" / "vocab.txt").read_text().splitlines()
                     if l.strip()]
            IGLM_VOCAB = {t: i for i, t in enumerate(vocab)}
            dense = transformers.GPT2LMHeadModel.from_pretrained(d).eval()
            t = time.perf_counter()
            ci, cm = sampled(dense, a.calib_rows, a.seed + 1, a.cache, torch)
            ui, um = sampled(dense, a.unseen_rows + max(4, a.unseen_rows // 10), a.seed + 2, a.cache, torch)
            calib_set = {tuple(r[m.bool()].tolist()) for r, m in zip(ci, cm)}
            keep = [i for i in range(len(ui)) if tuple(ui[i][um[i].bool()].tolist()) not in calib_set][:a.unseen_rows]
            ui, um = ui[keep], um[keep]
            w = int(um.sum(1).max())
            ui, um = ui[:, :w].contiguous(), um[:, :w].contiguous()
            print(f"iglm: {len(ci)} calibration and {len(ui)} unseen sequences sampled "
                  f"({int(cm.sum())} and {int(um.sum())} tokens; {time.perf_counter() - t:.0f} s)")
            save_file({"input_ids": ci, "attention_mask": cm}, str(work / "calib.safetensors"))
            unseen = {"input_ids": ui, "attention_mask": um}
            kind = "causal"
        else:
            vocab_l = [l.rstrip("\n") for l in (d / "vocab.txt").read_text().splitlines()]
            vocab = {t: i for i, t in enumerate(vocab_l)}
            cal = reactions("calib", a.seed + 1)[:a.calib_rows]
            uns = reactions("unseen", a.seed + 2)[:a.unseen_rows]
            assert not set(cal) & set(uns)
            ci, cm, cl, _, cu = rxnfp_inputs(vocab, cal, a.seed + 1)
            ui, um, ul, uc, uu = rxnfp_inputs(vocab, uns, a.seed + 2)
            print(f"rxnfp: {len(cal)} calibration and {len(uns)} unseen reactions ({int(cm.sum())} and "
                  f"{int(um.sum())} tokens, [UNK] {cu} and {uu}, width {ci.shape[1]} and {ui.shape[1]})")
            save_file({"input_ids": ci, "attention_mask": cm, "labels": cl}, str(work / "calib.safetensors"))
            unseen = {"input_ids": ui, "attention_mask": um, "labels": ul, "clean_ids": uc}
            dense = transformers.BertForMaskedLM.from_pretrained(d).eval()
            kind = "masked"
        params = sum(p.numel() for p in dense.parameters())
        calib = str(work / "calib.safetensors")
        common = ["--calibration", calib, "--no-cache"]

        rc, secs = tool([str(d), *common, "-j", str(a.jobs), "--format", "json,text", "-o", str(work / "default")],
                        work / "default.log", a.keep and (work / "default" / "lowrank-audit.json").exists())
        print(f"{name}: default audit exit {rc} in {secs:.0f} s: {tail(work / 'default.log', 2)}")
        results.append({"model": name, "params": params, "run": "default audit", "exit": rc, "seconds": secs})

        from auditor.folder import load_factorized

        for b in budgets:
            tag = f"b{int(round(b * 100))}"
            plan = work / f"plan_{tag}.toml"
            rc, secs = tool([str(d), *common, "-j", str(a.jobs), "--budget", str(b), "--emit-plan", str(plan),
                             "--format", "json,text", "-o", str(work / f"audit_{tag}")], work / f"audit_{tag}.log",
                            a.keep and plan.exists() and (work / f"audit_{tag}" / "lowrank-audit.json").exists())
            row = {"model": name, "params": params, "run": f"--budget {b}", "exit": rc, "seconds": secs}
            print(f"{name}: --budget {b} audit exit {rc} in {secs:.0f} s: {tail(work / f'audit_{tag}.log', 2)}")
            try:
                rep = report_json(work / f"audit_{tag}")
            except (FileNotFoundError, json.JSONDecodeError) as exc:
                row["error"] = str(exc)
                results.append(row)
                continue
            budget = (rep.get("calibration") or {}).get("budget") or {}
            uni = budget.get("uniform") or {}
            ver, uver = budget.get("verification") or {}, uni.get("verification") or {}
            row["audit"] = {"removed_share": budget.get("removed_fraction"), "search": budget.get("metric"),
                            "verified": ver.get("value"), "interval": [ver.get("low"), ver.get("high")],
                            "rows": ver.get("rows"), "ok": budget.get("ok")}
            row["audit_uniform"] = {"kept": uni.get("kept"), "removed_share": uni.get("removed_fraction"),
                                    "search": uni.get("metric"), "verified": uver.get("value"),
                                    "interval": [uver.get("low"), uver.get("high")]}
            results.append(row)
            variants = []
            if plan.exists():
                variants.append(("plan", plan, []))
            ranks = uniform_ranks(rep, uni) if uni.get("kept") is not None else {}
            if ranks:
                uplan = work / f"uniform_{tag}.toml"
                uplan.write_text("# uniform whitened truncation (SVD-LLM) at the audit's baseline share: "
                                 f"kept {uni['kept']:.6f} of every layer's break-even rank\n[ranks]\n"
                                 + "".join(f'"{k}" = {v}\n' for k, v in ranks.items()))
                variants.append(("uniform", uplan, ["--fit", "independent"]))
            for label, pfile, extra in variants:
                o = work / f"fact_{label}_{tag}"
                if o.exists():
                    shutil.rmtree(o)
                rc, secs = tool(["factorize", str(d), "--plan", str(pfile), *common, *extra, "--allow-miss",
                                 "-o", str(o)], work / f"fact_{label}_{tag}.log")
                r2 = {"model": name, "params": params, "run": f"factorize {label} {b}", "exit": rc,
                      "seconds": secs}
                if rc == 0 and (o / "model.safetensors").exists():
                    fact = load_factorized(dense, o).eval()
                    r2["params_after"] = sum(p.numel() for p in fact.parameters())
                    r2["removed_share"] = 1 - r2["params_after"] / params
                    r2["unseen"] = judge(kind, dense, fact, unseen)
                else:
                    r2["error"] = tail(o.parent / f"fact_{label}_{tag}.log", 3)
                print(f"{name}: factorize {label} {b}: exit {rc} in {secs:.0f} s "
                      f"{json.dumps({k: r2.get(k) for k in ('removed_share', 'unseen', 'error') if k in r2})}")
                results.append(r2)
    saved = out_root / f"results_{'_'.join(names)}.json"
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwall time {time.perf_counter() - t_all:.0f} s; results in {saved}")
    print(f"{'model':6} {'run':24} {'exit':>4} {'s':>5} {'removed':>8} {'unseen ppl +':>12} {'1-cos':>8}")
    for r in results:
        u = r.get("unseen", {})
        rem = r.get("removed_share", (r.get("audit") or {}).get("removed_share"))
        print(f"{r['model']:6} {r['run']:24} {r['exit']:>4} {r['seconds']:5.0f} "
              f"{fmt(rem, '.3f'):>8} "
              f"{fmt(u.get('ppl_increase'), '.4f'):>12} {fmt(u.get('one_minus_cos'), '.5f'):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
