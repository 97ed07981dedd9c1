"""Train a zoo language model (Qwen3 architecture) from scratch on CPU, or distil one from a teacher.

nanoGPT-style: one config dataclass, packed random windows of the tokenized corpus, AdamW with
warm-up + cosine decay, bf16 autocast, periodic per-domain validation, checkpoints that survive an
interrupted run (the newest checkpoint is always a loadable HF directory).
With `teacher` set, the loss is KL(teacher || student) on the teacher's next-token distributions
(the student learns the target's distribution, not just the corpus).
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from speclab.files import write_atomic
from speclab.progress import Progress
from speclab.train.corpus import DOMAINS, tokenize_corpus
from speclab.train.threads import own_threads

DOMAIN_WEIGHTS = {"code": 0.3, "stories": 0.15, "literature": 0.3, "math": 0.25}  # the training mix of every recipe


@dataclass
class ModelShape:
    hidden_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    max_position_embeddings: int = 1024


def option(default, help: str, *, lo=None, hi=None, flag: str = ""):
    """A training config field that is also an option of its `speclab train` command (the drafter trainings'
    options are generated from their configs' fields, `speclab.cli.train`, so the default lives here only): its
    help, the values allowed ([lo, hi]), and the option's name where it is not `--field-name` (a bool that is True
    by default is the switch `flag` that turns it off, e.g. `--no-shift`)."""
    return field(default=default, metadata={"help": help, "lo": lo, "hi": hi, "flag": flag})


def loss_tv_option(over: str = "over the target's --loss-topk tokens, or its full distribution"):
    """The `loss_tv` field of a training config: DSpark's L_tv, the expected acceptance of a sampled draft trained
    directly (`topk_acceptance`), computed `over` what the trainer knows of the target's distribution."""
    return option(0.0, f"weight of the acceptance term 1 - sum min(p, q) per step, added to the loss (DSpark's L_tv; "
                  f"{over}): trains for sampled decoding (0: off)", lo=0.0)


@dataclass(kw_only=True)
class Schedule:
    """The batches and the LR schedule (`lr_at`) of a training run: the fields every training config shares,
    keyword-only (the target's and the draft's recipe; the online drafter trainings use `OnlineSchedule`)."""
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    max_minutes: float = 60.0  # wall-clock budget: the LR schedule runs on elapsed time, so a busy machine
    # costs tokens, never the deadline


@dataclass(kw_only=True)
class OnlineSchedule(Schedule):
    """The online drafter trainings' schedule and run settings (EAGLE-3, DFlash, SpecBlock): shorter windows, a
    short warm-up, no decay."""
    seq_len: int = 256
    min_lr: float = 5e-5
    warmup_steps: int = 20
    weight_decay: float = 0.0
    precision: str = "fp32"  # PRECISIONS: the drafter in fp32, or in bf16 autocast with the target in bf16
    init_from: str | None = None  # a drafter directory to resume from (optimizer moments restart)
    eval_every_s: float = 600.0  # validation, checkpoint and snapshot this often
    eval_windows: int = 8  # validation windows per domain
    seed: int = 0
    threads: int = 2
    domain_weights: dict = field(default_factory=DOMAIN_WEIGHTS.copy)  # the training mix (one left out: --without)
    max_tokens: int = 0  # stop after this many training tokens as well (0: the wall clock only)


@dataclass
class TrainConfig(Schedule):
    corpus_dir: str
    tokenizer_dir: str
    out_dir: str
    shape: ModelShape = field(default_factory=ModelShape)
    teacher: str | None = None  # HF dir of the model to distil from
    init_from: str | None = None  # HF dir to start from (resume a cut-off run; optimizer moments restart)
    eval_every_s: float = 600.0
    eval_tokens: int = 16384  # per domain
    seed: int = 0
    threads: int = 2
    compile: bool = True  # torch.compile pays ~1.2x here for runs longer than a few minutes
    domain_weights: dict = field(default_factory=DOMAIN_WEIGHTS.copy)


def build_model(shape: ModelShape, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tokenizer), tie_word_embeddings=True, rope_theta=10000.0,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, attn_implementation="sdpa", **asdict(shape))
    return Qwen3ForCausalLM(config)


@contextlib.contextmanager
def checkpoint_on_interrupt(save, log, where):
    """Ctrl-C or SIGTERM (the CLI raises it as KeyboardInterrupt) in a training loop: the weights so far are saved
    (written whole, then renamed, like every checkpoint) before the interruption goes on, so a run resumed with
    --init-from loses nothing; the previous checkpoint stands if this save is interrupted too."""
    try:
        yield
    except KeyboardInterrupt:
        save()
        log(f"\ninterrupted: the weights so far are in {where} (resume with --init-from {where})")
        raise


def frozen_target_setup(cfg):
    """What online drafter training starts from (`cfg`: target_dir, corpus_dir, seed, threads, precision): seeds,
    the tokenizer, the token data (`corpus_dir`: one or more text corpora or regenerated folders, comma-separated;
    `speclab.train.regenerate.load_token_data`) and the target, frozen: in fp32, or in bf16 when the training
    runs in bf16 autocast (then the drafter learns from the features a bf16 decode gives it).
    -> (tokenizer, data, target, rng)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speclab.train.regenerate import load_token_data

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    tok = AutoTokenizer.from_pretrained(cfg.target_dir)
    data = load_token_data(cfg.corpus_dir, tok)
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(cfg.target_dir, dtype=dtype).eval().requires_grad_(False)
    return tok, data, target, np.random.default_rng(cfg.seed)


PRECISIONS = ("fp32", "bf16")  # an online drafter training: everything in fp32, or bf16 autocast (weights fp32)


def autocast(precision: str):
    """The drafter's forward (and so its backward) in bf16 autocast, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def target_features(target, ids: torch.Tensor, states, top: int) -> tuple[torch.Tensor, tuple]:
    """A frozen target's pass over ids, no grad: its hidden states `states` (indices into HF's hidden_states)
    concatenated (fp32), and its next-token distributions (`target_dist`)."""
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[j] for j in states], -1).float()
        return feats, target_dist(out.logits, top)


def target_dist(logits: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's next-token distributions as a loss reads them: its `top` most likely tokens (`top_tokens`:
    probabilities, ids; the mass left is the rest bucket of `topk_soft_ce`), or with `top` 0 (log-probs over the
    vocabulary, None)."""
    return top_tokens(logits, top) if top else (torch.log_softmax(logits.float(), -1), None)


def top_tokens(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A distribution by its `k` most likely tokens: (their probabilities under the full softmax, their ids). The
    mass left over is the rest bucket of `topk_soft_ce`."""
    vals, idx = torch.log_softmax(logits.float(), -1).topk(k, -1)
    return vals.exp(), idx


def topk_soft_ce(lg: torch.Tensor, p: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor | None = None):
    """Per-row cross-entropy of logits lg [..., V] against a distribution known by its top tokens (probabilities p
    [..., k] under the full distribution, ids idx into lg) plus one bucket for everything else:
    -sum_i p_i log q_i - p_rest log q_rest. The rest bucket keeps the drafter's tail mass calibrated: renormalising
    the top tokens instead teaches it that the tail is empty, which costs acceptance under sampling (measured:
    README "Training the drafters"). `keep` [..., k] drops top tokens lg cannot express (a reduced draft
    vocabulary); the rest is then renormalised over what is left. A gather and two logsumexps: no product over the
    vocabulary."""
    lse = lg.logsumexp(-1)
    top = lg.gather(-1, idx)
    p_rest = (1.0 - p.sum(-1)).clamp_min(0.0)
    if keep is not None:
        p = p * keep
        top = top.masked_fill(~keep, float("-inf"))
        total = p.sum(-1) + p_rest
        p, p_rest = p / total[..., None], p_rest / total
    log_rest = torch.log(-torch.expm1((top.logsumexp(-1) - lse).clamp(max=-1e-7)))  # log(1 - q(top))
    return -(p * (top - lse[..., None]).masked_fill(p == 0, 0.0)).sum(-1) - p_rest * log_rest


def soft_ce(lg: torch.Tensor, p: torch.Tensor, idx: torch.Tensor | None = None,
            keep: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row cross-entropy of logits lg [..., V] against the target's distribution: its full probabilities p
    [..., V] (`idx` None), or its top tokens and a rest bucket (`topk_soft_ce`)."""
    if idx is None:
        return lg.logsumexp(-1) - (p * lg).sum(-1)
    return topk_soft_ce(lg, p, idx, keep)


def acceptance(lg: torch.Tensor, p: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, sum min(p, q) of q = softmax(lg) and the target's distribution: its full probabilities p [..., V]
    (`idx` None: the acceptance of a token drawn from q), or its top tokens (`topk_acceptance`: a lower bound)."""
    if idx is None:
        return torch.minimum(p, torch.softmax(lg.float(), -1)).sum(-1)
    return topk_acceptance(lg, p, idx)


def topk_acceptance(lg: torch.Tensor, p: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor | None = None):
    """Per row, sum_i min(p_i, q_i) over a distribution's top tokens (probabilities p [..., k], ids idx into the
    logits lg [..., V]; `keep` [..., k] drops those lg cannot express): the part of the acceptance of a token drawn
    from q = softmax(lg) that the top tokens account for, a lower bound of the whole (DSpark's L_tv is one minus
    the whole)."""
    if keep is not None:
        p = p * keep
    return torch.minimum(p, torch.softmax(lg.float(), -1).gather(-1, idx)).sum(-1)


def snapshot(out: Path, tokens: int) -> None:
    """Keep a copy of the checkpoint just saved (out/model) as out/checkpoints/<tokens>, so every validation point
    of the curve can later be decoded on the zoo prompts (`speclab train curve`)."""
    import shutil

    dest = out / "checkpoints" / f"{tokens:012d}"
    if not dest.exists():
        shutil.copytree(out / "model", dest)


def online_run(m: torch.nn.Module, cfg):
    """The optimizer and the run directory of an online drafter training (`cfg`: lr, weight_decay, out_dir):
    -> (trainable params, AdamW, run dir, its train_log.jsonl opened for appending)."""
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return params, opt, out, open(out / "train_log.jsonl", "a")


def val_windows(data: dict, domain: str, n: int, seq_len: int) -> torch.Tensor:
    """[<= n, seq_len] windows spread evenly over a domain's validation split (so a split joined from several
    folders, greedy and sampled text, is validated on all of them)."""
    arr = data[domain]["val"]
    n = min(n, len(arr) // seq_len)
    starts = np.linspace(0, len(arr) - seq_len, n).astype(np.int64)
    return torch.from_numpy(np.stack([arr[s : s + seq_len] for s in starts]).astype(np.int64))


def sample_windows(data: dict, weights: dict, cfg, rng: np.random.Generator) -> torch.Tensor:
    """[batch_size, seq_len + 1] random training windows, the domain of each drawn by `weights`."""
    doms = list(weights)
    p = np.array([weights[d] for d in doms], dtype=float)
    picks = rng.choice(len(doms), size=cfg.batch_size, p=p / p.sum())
    rows = []
    for i in picks:
        arr = data[doms[i]]["train"]
        s = rng.integers(0, len(arr) - cfg.seq_len - 1)
        rows.append(arr[s : s + cfg.seq_len + 1].astype(np.int64))
    return torch.from_numpy(np.stack(rows))


@torch.no_grad()
def evaluate(model, data: dict, seq_len: int, eval_tokens: int, tokenizer=None) -> dict[str, dict[str, float]]:
    """Mean next-token loss (nats) per domain on the validation split, and bits per byte where a tokenizer is given."""
    model.eval()
    res = {}
    for d in DOMAINS:
        arr = data[d]["val"][: eval_tokens + 1].astype(np.int64)
        n = (len(arr) - 1) // seq_len
        x = torch.from_numpy(arr[: n * seq_len]).view(n, seq_len)
        y = torch.from_numpy(arr[1 : n * seq_len + 1]).view(n, seq_len)
        tot, cnt = 0.0, 0
        for i in range(0, n, 8):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=x[i : i + 8]).logits
            tot += F.cross_entropy(logits.float().flatten(0, 1), y[i : i + 8].flatten(), reduction="sum").item()
            cnt += y[i : i + 8].numel()
        r = {"loss": tot / cnt}
        if tokenizer is not None:
            nbytes = len(tokenizer.decode(arr[1 : n * seq_len + 1].tolist()).encode("utf-8"))
            r["bits_per_byte"] = tot / math.log(2) / nbytes
        res[d] = r
    model.train()
    return res


def lr_at(step: int, frac: float, cfg: Schedule) -> float:
    """Linear warm-up over steps, then cosine decay over the fraction of the time budget used."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, max(0.0, frac))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def save_hf(model, tokenizer, out_dir: Path, dtype=torch.bfloat16) -> None:
    """Save as a HF directory (safetensors in `dtype`); written to a temp dir then renamed, so a kill never leaves half
    a model."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    import copy
    model_copy = copy.deepcopy(model).to(dtype)
    model_copy.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                                    pad_token_id=tokenizer.pad_token_id, do_sample=False,
                                                    max_new_tokens=128)
    model_copy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


@own_threads
def train_lm(cfg: TrainConfig) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer_dir)
    data = tokenize_corpus(Path(cfg.corpus_dir), tok, Path(cfg.corpus_dir) / ".tokens")
    if cfg.init_from:
        model = AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
    else:
        model = build_model(cfg.shape, tok)
    teacher = None
    if cfg.teacher:
        teacher = AutoModelForCausalLM.from_pretrained(cfg.teacher, dtype=torch.bfloat16).eval()
        teacher = torch.compile(teacher) if cfg.compile else teacher
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), fused=False)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_f = open(out / "train_log.jsonl", "a")  # noqa: SIM115  (the run's log: appended to all through the loop below)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    budget_s = cfg.max_minutes * 60
    print(f"params {n_params/1e6:.2f} M, budget {cfg.max_minutes:.0f} min", flush=True)
    step_fn = torch.compile(model) if cfg.compile else model
    prog = Progress(int(budget_s), "train (seconds)")
    t0 = time.time()
    last_eval = t0
    step = 0
    model.train()
    with checkpoint_on_interrupt(lambda: save_hf(model, tok, out / "model"), print, out / "model"):
        while True:
            elapsed = time.time() - t0
            last = elapsed >= budget_s
            if last:
                break
            lr = lr_at(step, elapsed / budget_s, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            xy = sample_windows(data, cfg.domain_weights, cfg, rng)
            x, y = xy[:, :-1], xy[:, 1:]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = step_fn(input_ids=x).logits
                if teacher is not None:
                    with torch.no_grad():
                        t_logp = F.log_softmax(teacher(input_ids=x).logits.float(), -1)
                    loss = F.kl_div(F.log_softmax(logits.float(), -1).flatten(0, 1), t_logp.flatten(0, 1),
                                    log_target=True, reduction="batchmean")
                else:
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            prog.update(min(int(time.time() - t0), int(budget_s)), step=step, loss=f"{loss.item():.3f}", lr=f"{lr:.2e}",
                        tok_s=f"{step * tokens_per_step / (time.time() - t0):.0f}")
            rec = {"step": step, "tokens": step * tokens_per_step, "loss": loss.item(), "lr": lr,
                   "time_s": time.time() - t0}
            if time.time() - last_eval > cfg.eval_every_s:
                rec["val"] = evaluate(model, data, cfg.seq_len, cfg.eval_tokens, tok)
                print(f"\nstep {step} val " + " ".join(f"{d}={v['loss']:.3f}" for d, v in rec["val"].items()),
                      flush=True)
                save_hf(model, tok, out / "model")
                last_eval = time.time()
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
    rec = {"step": step, "tokens": step * tokens_per_step, "time_s": time.time() - t0,
           "val": evaluate(model, data, cfg.seq_len, cfg.eval_tokens, tok)}
    log_f.write(json.dumps(rec) + "\n")
    save_hf(model, tok, out / "model")
    summary = {"params": n_params, "steps": step, "tokens": step * tokens_per_step, "minutes": (time.time() - t0) / 60,
               "val": rec.get("val"), "config": asdict(cfg)}
    write_atomic(out / "summary.json", json.dumps(summary, indent=2, default=str))
    return summary


def training_curve(logs: list[Path], every: int = 100) -> list[dict]:
    """Records of one or more train logs in order (a resumed run continues the token count and the clock);
    every `every`-th step and every validation record are kept."""
    out, tok0, t0 = [], 0, 0.0
    for path in logs:
        recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        for r in recs:
            if "val" in r or r["step"] % every == 0 or r is recs[-1]:
                out.append({**r, "tokens": r["tokens"] + tok0, "time_s": r["time_s"] + t0})
        if recs:
            tok0, t0 = tok0 + recs[-1]["tokens"], t0 + recs[-1]["time_s"]
    return out


def val_curve(records: list[dict], column, cell) -> str:
    """Markdown: tokens seen, minutes, then per domain `cell(val of that domain)` at each validation record of a
    (joined) training log; `column(domain)` heads the domain's column."""
    rows, head = [], None
    for r in records:
        if "val" not in r:
            continue
        if head is None:
            head = list(r["val"])
            rows = ["| tokens (M) | minutes | " + " | ".join(column(d) for d in head) + " |",
                    "|---|---|" + "---|" * len(head)]
        rows.append(f"| {r['tokens'] / 1e6:.2f} | {r['time_s'] / 60:.0f} | "
                    + " | ".join(cell(r["val"][d]) for d in head) + " |")
    return "\n".join(rows)


def curve_table(records: list[dict]) -> str:
    """Markdown: tokens seen, minutes, train loss and per-domain validation loss at each validation."""
    rows = ["| tokens (M) | minutes | train loss | " + " | ".join(f"val {d}" for d in DOMAINS) + " |",
            "|---|---|---|" + "---|" * len(DOMAINS)]
    for r in records:
        if "val" in r:
            loss = f"{r['loss']:.3f}" if "loss" in r else ""
            rows.append(f"| {r['tokens'] / 1e6:.2f} | {r['time_s'] / 60:.0f} | {loss} | "
                        + " | ".join(f"{r['val'][d]['loss']:.3f}" for d in DOMAINS) + " |")
    return "\n".join(rows)


@dataclass
class Step:
    """One training step's results for `online_loop`: the loss (the loop runs its backward), the tokens it trained
    on, what goes into the step's log record and what the progress line shows."""
    loss: torch.Tensor
    tokens: int
    record: dict
    shown: dict


def online_loop(name: str, m: torch.nn.Module, cfg, step_fn, evaluate_fn, val_line, log=print,
                about: str = "") -> dict:
    """The loop every online drafter training runs: for `cfg.max_minutes` of wall clock, `step_fn(step)` -> Step,
    backward, gradient clip 1.0, AdamW at `lr_at`; a progress line with ETA; every `cfg.eval_every_s` a
    validation (`evaluate_fn()` -> per-domain dict; `val_line(val)` says it in one line), a checkpoint and a
    snapshot; Ctrl-C or SIGTERM saves before it stops (resume with --init-from). The checkpoint's
    train_config.json is the run's card (config, steps, tokens); summary.json closes the run. -> the summary."""
    params, opt, out, log_f = online_run(m, cfg)
    n_params = sum(p.numel() for p in params)
    budget = cfg.max_minutes * 60
    log(f"{name}: {n_params / 1e6:.2f} M trainable params{about}, budget {cfg.max_minutes:.0f} min")
    # progress toward whichever budget ends the run first: seconds, or tokens when --max-tokens is set (the wall
    # clock then counts as its share of the tokens, so the ETA is the nearer of the two ends)
    total = cfg.max_tokens or int(budget)
    prog = Progress(total, f"train {name} ({'tokens' if cfg.max_tokens else 'seconds'})")
    t0 = last_eval = time.time()
    step = tokens = 0

    def save():
        card = json.dumps({"train_config": asdict(cfg), "steps": step, "tokens": tokens}, indent=1, default=str)
        m.save(out / "model", extra_files={"train_config.json": card + "\n"})

    with checkpoint_on_interrupt(save, log, out / "model"):
        while time.time() - t0 < budget and not (cfg.max_tokens and tokens >= cfg.max_tokens):
            lr = lr_at(step, (time.time() - t0) / budget, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            s = step_fn(step)
            s.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += s.tokens
            rec = {"step": step, "tokens": tokens, "loss": float(s.loss.detach()), **s.record, "lr": lr,
                   "time_s": time.time() - t0}
            prog.update(min(total, max(tokens if cfg.max_tokens else 0, int(total * (time.time() - t0) / budget))),
                        step=step, loss=f"{rec['loss']:.3f}", **s.shown,
                        tok_s=f"{tokens / rec['time_s']:.0f}")
            if time.time() - last_eval > cfg.eval_every_s:
                rec["val"] = evaluate_fn()
                log(f"\nstep {step} {val_line(rec['val'])}")
                save()
                snapshot(out, tokens)
                last_eval = time.time()
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
    rec = {"step": step, "tokens": tokens, "time_s": time.time() - t0, "val": evaluate_fn()}
    log_f.write(json.dumps(rec) + "\n")
    log_f.close()
    save()
    summary = {"params": n_params, "steps": step, "tokens": tokens, "minutes": (time.time() - t0) / 60,
               "val": rec["val"], "config": asdict(cfg)}
    write_atomic(out / "summary.json", json.dumps(summary, indent=2, default=str))
    return summary
