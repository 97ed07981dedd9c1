"""The target's own continuations as drafter training data (`speclab data regenerate`; SpecForge's
`regenerate_train_data`).

Greedy verification accepts exactly what the target emits, so a drafter should learn from that, not from corpus
text. Prompts of `prompt_len` tokens are cut from each domain's corpus split (half of them document openings,
like the zoo prompts, half random windows), and the frozen target continues each for `new_tokens` tokens:

- batched: `batch` sequences of equal length in one forward (no padding), in the default dtype (`--dtype auto`),
  with the final norm and the head in fp32 as in speclab's decodes (`speclab.core.precision`);
- greedy, or sampled at temperature 1 (a seeded generator per shard, so a resumed run draws the same tokens);
  `mix` samples every other row of a batch and decodes the rest greedily;
- resumable: each batch is a shard file written whole; a rerun with the same settings skips the shards there (and
  does nothing once the run is complete);
- stored as token ids with their provenance: `<domain>.<split>.npz` holds `ids` [n, prompt_len + new_tokens]
  (uint16), `offset` (the prompt's first token in the tokenized split), `opening` (the prompt starts a document)
  and `sampled` (which decoding made the row); `provenance.json` holds the settings, the target and the counts.

The continuation is not cut at EOS: what the target writes after one (a new document) is its own output too.
`load_token_data` reads such a folder (or a text corpus) as the trainers' token arrays: the rows of a split joined
by EOS, like the documents of a corpus.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from speclab.files import write_atomic
from speclab.progress import Progress
from speclab.train.corpus import DOMAINS
from speclab.train.threads import own_threads

MODES = ("greedy", "sample", "mix")
PROVENANCE = "provenance.json"


@dataclass
class RegenConfig:
    target_dir: str
    corpus_dir: str
    out_dir: str
    mode: str = "greedy"  # greedy | sample (temperature 1) | mix (every other row sampled)
    train_sequences: int = 1024  # per domain
    val_sequences: int = 32  # per domain, from the validation split (held out)
    prompt_len: int = 64
    new_tokens: int = 192
    batch: int = 64
    dtype: str = "auto"
    seed: int = 0
    threads: int = 2

    def shards(self) -> list[tuple[str, str, int, int]]:
        """(domain, split, shard index, rows) of every batch, in the order generated."""
        out = []
        for split, n in (("val", self.val_sequences), ("train", self.train_sequences)):
            for d in DOMAINS:
                for i, start in enumerate(range(0, n, self.batch)):
                    out.append((d, split, i, min(self.batch, n - start)))
        return out


def pick_prompts(arr: np.ndarray, eos: int, n: int, length: int, rng: np.random.Generator):
    """(offsets [n], opening [n]): prompt starts in a tokenized split, half at document openings (the token after
    an EOS, or 0), half anywhere; each leaves room for `length` tokens."""
    last = len(arr) - length
    starts = np.concatenate([[0], np.flatnonzero(arr[:last] == eos) + 1])
    starts = starts[starts < last]
    opening = rng.random(n) < 0.5
    offsets = rng.integers(0, last, size=n)
    if len(starts):
        offsets[opening] = rng.choice(starts, size=int(opening.sum()))
    else:
        opening[:] = False
    return offsets, opening


class _Continuer:
    """The frozen target, batched: prefill [B, P], then one row per sequence per step; logits in fp32 from an fp32
    final norm on the model-dtype hidden state (what speclab's decodes compare)."""

    def __init__(self, model):
        self.model = model
        inner = model.get_decoder()
        self.norm_w, self.eps = inner.norm.weight.float(), inner.norm.variance_epsilon
        inner.norm = torch.nn.Identity()  # this copy of the model is ours: the norm runs below, in fp32
        self.head_w = model.get_output_embeddings().weight.float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(h.float(), h.shape[-1:], self.norm_w, self.eps) @ self.head_w.T

    @torch.inference_mode()
    def continue_(self, prompts: torch.Tensor, new_tokens: int, sampled: torch.Tensor,
                  gen: torch.Generator) -> torch.Tensor:
        """prompts [B, P] -> [B, P + new_tokens]; rows where `sampled` [B] draw at temperature 1, the rest argmax."""
        from transformers import DynamicCache

        from speclab.core.sampling import sample

        cache = DynamicCache(config=self.model.config)
        out = self.model.get_decoder()(input_ids=prompts, past_key_values=cache, use_cache=True)
        toks = []
        for _ in range(new_tokens):
            lg = self.logits(out.last_hidden_state[:, -1])
            nxt = lg.argmax(-1, True)
            if sampled.any():
                nxt = torch.where(sampled[:, None], sample(torch.softmax(lg, -1), gen)[:, None], nxt)
            toks.append(nxt)
            out = self.model.get_decoder()(input_ids=nxt, past_key_values=cache, use_cache=True)
        return torch.cat([prompts, *toks], 1)


@own_threads
def regenerate(cfg: RegenConfig, log=print) -> dict:
    """Generate every shard not yet on disk, then assemble the per-domain files and the provenance."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speclab.core.precision import pick_dtype
    from speclab.train.corpus import EOS_TEXT, tokenize_corpus

    out = Path(cfg.out_dir)
    shard_dir = out / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    settings = asdict(cfg)
    settings.pop("out_dir")
    settings.pop("threads")
    saved = out / "settings.json"
    if saved.exists() and json.loads(saved.read_text()) != settings:
        raise ValueError(f"{out} holds a regeneration with other settings ({saved}); give another --out or the same "
                         "settings to resume it")
    write_atomic(saved, json.dumps(settings, indent=1))
    if (out / PROVENANCE).exists():  # a finished run with these settings: nothing to do
        log(f"regenerate: {out} is complete (provenance.json); nothing to generate")
        return json.loads((out / PROVENANCE).read_text())
    torch.set_num_threads(cfg.threads)
    tok = AutoTokenizer.from_pretrained(cfg.target_dir)
    eos = tok.convert_tokens_to_ids(EOS_TEXT)
    data = tokenize_corpus(Path(cfg.corpus_dir), tok, Path(cfg.corpus_dir) / ".tokens")
    # the command resolves --dtype auto to this machine's decision (`speclab.models.resolve_dtype`); a library
    # call that passes auto gets `pick_dtype`'s answer without a measurement: fp32 unless cached
    dtype, why = pick_dtype(torch.device("cpu"), cfg.dtype), f"--dtype {cfg.dtype}"
    model = AutoModelForCausalLM.from_pretrained(cfg.target_dir, dtype=dtype).eval()
    cont = _Continuer(model)
    plan = cfg.shards()
    todo = [s for s in plan if not (shard_dir / _shard_name(*s[:3])).exists()]
    total = sum(r for *_, r in todo) * cfg.new_tokens
    log(f"regenerate ({cfg.mode}): {len(plan)} shards of up to {cfg.batch} sequences, {len(plan) - len(todo)} done; "
        f"{cfg.prompt_len} prompt + {cfg.new_tokens} new tokens each, {dtype} ({why})")
    prog = Progress(total, "regenerate (tokens)")
    done, t0 = 0, time.time()
    for shard_no, (d, split, i, rows) in enumerate(plan):
        name = _shard_name(d, split, i)
        if (shard_dir / name).exists():
            continue
        rng = np.random.default_rng([cfg.seed, shard_no])
        offsets, opening = pick_prompts(data[d][split], eos, rows, cfg.prompt_len, rng)
        prompts = torch.from_numpy(np.stack([data[d][split][o : o + cfg.prompt_len] for o in offsets]).astype(np.int64))
        sampled = torch.full((rows,), cfg.mode == "sample")
        if cfg.mode == "mix":
            sampled[1::2] = True
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + shard_no)
        ids = cont.continue_(prompts, cfg.new_tokens, sampled, gen)
        _save_npz(shard_dir / name, ids=ids.numpy().astype(np.uint16), offset=offsets, opening=opening,
                  sampled=sampled.numpy())
        done += rows * cfg.new_tokens
        prog.update(done, shard=f"{shard_no + 1}/{len(plan)}", tok_s=f"{done / (time.time() - t0):.0f}")
    summary = _assemble(cfg, out, plan, dtype, time.time() - t0, total)
    log(f"regenerate: {summary['new_tokens']} new tokens in {out}")
    return summary


def _shard_name(domain: str, split: str, i: int) -> str:
    return f"{domain}.{split}.{i:04d}.npz"


def _save_npz(path: Path, **arrays) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def _assemble(cfg: RegenConfig, out: Path, plan, dtype, seconds: float, generated: int) -> dict:
    """The shards of each domain and split in one file; the provenance; the shards go."""
    counts: dict = {}
    for d in DOMAINS:
        for split in ("train", "val"):
            parts = [np.load(out / "shards" / _shard_name(d, split, i))
                     for dd, s, i, _ in plan if (dd, s) == (d, split)]
            if not parts:
                continue
            merged = {k: np.concatenate([p[k] for p in parts]) for k in ("ids", "offset", "opening", "sampled")}
            _save_npz(out / f"{d}.{split}.npz", **merged)
            counts[f"{d}.{split}"] = {"sequences": len(merged["ids"]), "sampled": int(merged["sampled"].sum()),
                                      "openings": int(merged["opening"].sum())}
    from speclab.core.target import check_model_dir
    fingerprint = (check_model_dir(cfg.target_dir) / "model.safetensors")
    prov = {"what": "the target's own continuations of prompts cut from the corpus splits (speclab data regenerate)",
            "target": str(cfg.target_dir), "target_bytes": fingerprint.stat().st_size if fingerprint.exists() else None,
            "corpus": str(cfg.corpus_dir), "dtype": str(dtype).replace("torch.", ""),
            "logits": "fp32 (final norm and head in fp32 on the model-dtype hidden state)",
            "sampling": {"greedy": "argmax", "sample": "temperature 1, full vocabulary",
                         "mix": "rows alternate: even greedy, odd sampled at temperature 1"}[cfg.mode],
            "settings": {k: v for k, v in asdict(cfg).items() if k not in ("out_dir", "threads")},
            "counts": counts, "new_tokens": sum(c["sequences"] for c in counts.values()) * cfg.new_tokens,
            "seconds_this_run": round(seconds, 1), "generated_this_run": generated,
            "torch": torch.__version__}
    write_atomic(out / PROVENANCE, json.dumps(prov, indent=1) + "\n")
    for p in (out / "shards").glob("*.npz"):
        p.unlink()
    (out / "shards").rmdir()
    return prov


def is_regenerated(folder: str | Path) -> bool:
    return (Path(folder) / PROVENANCE).is_file()


def load_regenerated(folder: str | Path, eos: int) -> dict[str, dict[str, np.ndarray]]:
    """Per domain and split, the rows of a regenerated folder joined by EOS (the trainers' token arrays)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for d in DOMAINS:
        out[d] = {}
        for split in ("train", "val"):
            ids = np.load(Path(folder) / f"{d}.{split}.npz")["ids"]
            rows = np.concatenate([ids, np.full((len(ids), 1), eos, dtype=ids.dtype)], 1)
            out[d][split] = rows.reshape(-1)
    return out


def load_token_data(folders: str, tokenizer) -> dict[str, dict[str, np.ndarray]]:
    """The trainers' data: one or more folders (comma-separated), each a text corpus (<domain>.<split>.txt,
    tokenized and cached) or a regenerated one; several are concatenated per domain and split."""
    from speclab.train.corpus import EOS_TEXT, tokenize_corpus

    eos = tokenizer.convert_tokens_to_ids(EOS_TEXT)
    parts = []
    for f in [p for p in str(folders).split(",") if p]:
        parts.append(load_regenerated(f, eos) if is_regenerated(f) else tokenize_corpus(Path(f), tokenizer,
                                                                                       Path(f) / ".tokens"))
    if len(parts) == 1:
        return parts[0]
    return {d: {s: np.concatenate([p[d][s] for p in parts]) for s in ("train", "val")} for d in DOMAINS}
