"""Train WhiFlash-Neural's router: an MLP on the target's final hidden state h_t predicting
Delta AL_t = AL_eagle3 - AL_dflash (WhiFlash 3.3.2).

Data: (h_t, Delta AL_t) pairs from counterfactual profiles (`speclab.routing.replay.profile_sequence`) of the target's
own greedy continuations of prompts cut from the training splits of all four zoo domains, mixed evenly (the
paper's task-agnostic corpus). Sequences are split into train and held-out before training, so the held-out
correlation is on sequences the router never saw. MSE, AdamW, one cosine schedule.

The default threshold is hardware-aware (`speclab.routing.replay.hardware_threshold`): from a cost model fitted to live
rounds of EAGLE-3, DFlash and a switching WhiFlash-Entropy run measured here on a few of the same prompts.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from speclab.progress import Progress
from speclab.train.threads import own_threads


@dataclass
class RouterTrainConfig:
    corpus_dir: str
    out_dir: str
    sequences: int = 240  # prompts profiled (train + held out)
    prompt_tokens: int = 48
    new_tokens: int = 96
    heldout: float = 0.2  # share of sequences held out
    epochs: int = 12  # the held-out MSE bottoms out near epoch 10 on the zoo's 23 k pairs (data/zoo/router)
    batch_size: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.01
    dropout: float = 0.1
    cost_prompts: int = 6  # prompts decoded live to fit the cost model behind the hardware-aware threshold
    seed: int = 0
    threads: int = 2
    domain_weights: dict = field(default_factory=lambda: {"code": 1.0, "stories": 1.0, "literature": 1.0, "math": 1.0})


def corpus_prompts(data: dict, cfg: RouterTrainConfig) -> list[tuple[str, torch.Tensor]]:
    """(domain, prompt ids) cut at random from the domains' training splits, domains drawn by their weights. Prompt i
    depends only on the seed and i, so a run with more --sequences extends (and resumes) a smaller one."""
    doms = list(cfg.domain_weights)
    p = np.array([cfg.domain_weights[d] for d in doms], float)
    out = []
    for i in range(cfg.sequences):
        rng = np.random.default_rng([cfg.seed, i])
        dom = doms[int(rng.choice(len(doms), p=p / p.sum()))]
        arr = data[dom]["train"]
        s = int(rng.integers(0, len(arr) - cfg.prompt_tokens))
        out.append((dom, torch.from_numpy(arr[s : s + cfg.prompt_tokens].astype(np.int64))))
    return out


def drafter_params(target) -> dict:
    """The drafters' settings the router learns to choose between: WhiFlash's defaults on this target's device."""
    from speclab.methods import method_params
    return method_params("whiflash-entropy", {}, target)


def profile_one(target, drafters, ids: torch.Tensor, domain: str, i: int, new_tokens: int) -> dict:
    """Corpus prompt i's greedy continuation profiled (`profile_sequence`): its pairs and per-position figures."""
    from speclab.core.engine import decode
    from speclab.routing.replay import profile_sequence
    out = decode(target, ids, max_new_tokens=new_tokens, stop_on_eos=False).new_ids
    p = profile_sequence(target, drafters, ids, out, new_tokens, f"train-{i}", domain)
    return {"hidden": p.hidden.to(torch.float16),
            "delta": torch.from_numpy((p.accepted[0] - p.accepted[1]).astype(np.float32)),
            "seq": torch.full((p.n,), i), "domain": domain, "al": torch.from_numpy(p.accepted.mean(1) + 1),
            "entropy": torch.from_numpy(p.entropy)}


def collect(target, models: dict, prompts, cfg: RouterTrainConfig, cache: Path, log=print, profiles=None) -> dict:
    """Profiles of every prompt's greedy continuation -> pairs {hidden [n, d], delta [n], seq [n], domain [n]};
    saved to `cache` every 10 sequences and resumed from it. A cache made with other settings (target, dtype,
    drafters, prompts) is refused rather than mixed in. `profiles(todo, put)`: who profiles the prompts of `todo`,
    calling put(i, `profile_one`'s result) in any order (a Ray cluster: `speclab.cluster.router_profiles`; default:
    this process, one by one, with its progress line); they are kept in prompt order."""
    from speclab.errors import SpeclabError
    from speclab.methods import build_method

    params = drafter_params(target)
    key = {"target": target.fingerprint, "dtype": target.precision["dtype"], "drafters": params,
           "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens, "seed": cfg.seed,
           "domain_weights": cfg.domain_weights}
    fields = ("hidden", "delta", "seq", "domain", "al", "entropy")
    done = torch.load(cache) if cache.exists() else {**{k: [] for k in fields}, "key": key}
    if done.get("key") != key:
        diff = sorted(k for k in key if (done.get("key") or {}).get(k) != key[k])
        raise SpeclabError(f"{cache} was collected with other settings ({', '.join(diff)}): use another --out, or "
                           "delete it to collect again")
    for k in fields:  # a larger run's cache serves a smaller one
        done[k] = done[k][: len(prompts)]
    start, t0, minutes0 = len(done["al"]), time.time(), done.get("minutes", 0.0)
    if start:
        log(f"router data: resuming after {start} sequences ({cache})")
    prog = None
    if profiles is None:
        drafters, _ = build_method("whiflash-entropy", target, models, params)
        prog = Progress(len(prompts), "profile sequences")
        prog.update(start)

        def here(todo, put):
            for i in todo:
                put(i, profile_one(target, drafters, prompts[i][1], prompts[i][0], i, cfg.new_tokens))
        profiles = here
    waiting: dict = {}

    def put(i: int, item: dict) -> None:
        waiting[i] = item
        while len(done["al"]) in waiting:  # in prompt order, so a resumed run continues where this one stopped
            j = len(done["al"])
            item = waiting.pop(j)
            for k in fields:
                done[k].append(item[k])
            if prog is not None:
                prog.update(j + 1, pairs=sum(len(x) for x in done["delta"]))
            done["minutes"] = minutes0 + (time.time() - t0) / 60  # collecting time over every resumed run
            if (j + 1) % 10 == 0 or j + 1 == len(prompts):
                torch.save(done, str(cache) + ".tmp")
                Path(str(cache) + ".tmp").replace(cache)
    profiles(range(start, len(prompts)), put)
    return done


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / den) if den else math.nan


def fit(data: dict, cfg: RouterTrainConfig, hidden_size: int, log=print):
    """Train the MLP on the pairs; -> (RouterMLP, per-epoch records, held-out metrics)."""
    from speclab.routing.routers import RouterConfig, RouterMLP

    torch.manual_seed(cfg.seed)
    h = torch.cat(data["hidden"]).float()
    y = torch.cat(data["delta"])
    seq = torch.cat(data["seq"])
    val, held, n_seq = heldout_split(seq, cfg)
    ht, yt, hv, yv = h[~val], y[~val], h[val], y[val]
    m = RouterMLP(RouterConfig(hidden_size, max(hidden_size // 8, 1), cfg.dropout))
    records = fit_mse(m, (ht,), yt, (hv,), yv, cfg, "train router (epochs)",
                      lambda pv: {"val_corr": pearson(pv.numpy(), yv.numpy())})
    with torch.no_grad():
        pv = m(hv).numpy()
    yvn = yv.numpy()
    heldout = {"pairs_train": int(len(yt)), "pairs_heldout": int(len(yv)), "sequences": n_seq,
               "sequences_heldout": int(len(held)), "mse": float(((pv - yvn) ** 2).mean()),
               "mse_predict_mean": float(((yt.mean().item() - yvn) ** 2).mean()), "corr": pearson(pv, yvn),
               "sign_agreement": float(((pv > 0) == (yvn > 0)).mean()), "delta_mean": float(yvn.mean()),
               "delta_std": float(yvn.std())}
    return m, records, heldout


def heldout_split(seq: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the rows held out [n] bool, the sequences held out, how many sequences): a share `cfg.heldout` of the
    sequences drawn by `cfg.seed`, so no held-out row shares a sequence with a training row."""
    n_seq = int(seq.max()) + 1
    held = torch.from_numpy(np.random.default_rng(cfg.seed).permutation(n_seq)[: max(1, int(n_seq * cfg.heldout))])
    return torch.isin(seq, held), held, n_seq


def fit_mse(m: torch.nn.Module, xt: tuple, yt: torch.Tensor, xv: tuple, yv: torch.Tensor, cfg, label: str,
            more=None, loss=None) -> list[dict]:
    """A router's training loop (WhiFlash's and routing v2's): MSE of `m(*inputs)` against y (or `loss(predictions,
    the batch's row indices)`), AdamW, one one-cycle schedule over `cfg.epochs` passes in batches of
    `cfg.batch_size`, the held-out MSE (and `more(predictions)`'s figures) after each epoch, with progress. Returns
    the per-epoch records; `m` ends in eval mode."""
    n = len(yt)
    opt = torch.optim.AdamW(m.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * math.ceil(n / cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=steps, pct_start=0.05)
    prog = Progress(cfg.epochs, label)
    records = []
    for ep in range(cfg.epochs):
        m.train()
        perm = torch.randperm(n)
        tot = 0.0
        for b in range(0, n, cfg.batch_size):
            idx = perm[b : b + cfg.batch_size]
            pred = m(*(x[idx] for x in xt))
            step = torch.nn.functional.mse_loss(pred, yt[idx]) if loss is None else loss(pred, idx)
            opt.zero_grad()
            step.backward()
            opt.step()
            sched.step()
            tot += step.item() * len(idx)
        m.eval()
        with torch.no_grad():
            pv = m(*xv)
        rec = {"epoch": ep + 1, "train_mse" if loss is None else "train_loss": tot / n,
               "val_mse": float(((pv - yv) ** 2).mean()),
               **(more(pv) if more else {})}
        records.append(rec)
        prog.update(ep + 1, **{k: f"{v:.3f}" for k, v in rec.items() if k != "epoch"})
    return records


def measure_costs(target, models: dict, prompts, cfg: RouterTrainConfig, data: dict, log=print):
    """A cost model fitted to live rounds here: EAGLE-3, DFlash and WhiFlash-Entropy at the median training entropy
    (so it switches) on `cost_prompts` prompts, traced to an in-memory store. -> (CostModel, mean switch backlog,
    mean tree width per drafter, mean catch-up backlog per drafter when it stays)."""
    from speclab.generate import generate
    from speclab.routing.replay import DRAFTERS, fit_costs
    from speclab.trace import TraceStore

    store = TraceStore(":memory:")
    thr = float(torch.cat(data["entropy"]).nanmedian())
    prog = Progress(cfg.cost_prompts * 3, "measure round costs")
    done = 0
    for i in range(cfg.cost_prompts):
        ids = prompts[i][1]
        for spec in ("eagle3", "dflash", f"whiflash-entropy:threshold={thr}"):
            generate(target, ids, spec, models=models, max_new_tokens=cfg.new_tokens, trace=store,
                     bench_id="router-costs")
            done += 1
            prog.update(done)
    cost = fit_costs(store, "router-costs")
    r = store.query("""SELECT drafter, backlog, n_drafted,
                              lag(drafter) OVER (PARTITION BY run_id ORDER BY round) AS prev
                       FROM rounds""")
    store.close()
    switch = r[r.prev.notna() & (r.prev != r.drafter)].backlog
    stay = r[r.prev == r.drafter]
    widths = tuple(float(r[r.drafter == d].n_drafted.mean()) for d in DRAFTERS)
    stays = tuple(float(stay[stay.drafter == d].backlog.mean()) for d in DRAFTERS)
    return cost, float(switch.mean()) if len(switch) else 16.0, widths, stays


def setup(cfg, target) -> tuple[Path, list]:
    """A router training's start (WhiFlash's and routing v2's): its threads, its run directory (made) and the corpus
    prompts it profiles (`corpus_prompts`)."""
    from speclab.train.corpus import tokenize_corpus
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data_c = tokenize_corpus(Path(cfg.corpus_dir), target.tokenizer, Path(cfg.corpus_dir) / ".tokens")
    return out, corpus_prompts(data_c, cfg)


@own_threads
def train_router(cfg: RouterTrainConfig, target, models: dict, log=print, profiles=None) -> dict:
    """Collect the pairs (`collect`; `profiles`: on a Ray cluster, `speclab.cluster.router_profiles`), fit the MLP,
    measure the round costs here and save the router with its card."""
    from speclab.routing.replay import DRAFTERS, hardware_threshold

    out, prompts = setup(cfg, target)
    pairs = collect(target, models, prompts, cfg, out / "pairs.pt", log, profiles)
    collect_min = pairs.get("minutes", 0.0)
    m, records, heldout = fit(pairs, cfg, target.hidden_size, log)
    al = torch.stack(pairs["al"]).mean(0).numpy()
    cost, switch_backlog, widths, stays = measure_costs(target, models, prompts, cfg, pairs, log)
    hw = hardware_threshold(cost, float(al[DRAFTERS.index("dflash")]), switch_backlog, widths, stays)
    m.config.target, m.config.hardware_threshold, m.config.derivation = target.fingerprint, hw["threshold"], hw
    summary = {"train_config": asdict(cfg), "collect_minutes": collect_min, "heldout": heldout,
               "al_profiled": dict(zip(DRAFTERS, map(float, al))), "dtype": pairs["key"]["dtype"],
               "drafter_params": pairs["key"]["drafters"], "hardware_threshold": hw,
               "cost_model": asdict(cost), "curve": records}
    m.save(out / "model", extra={})
    (out / "model" / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    with open(out / "model" / "train_log.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    (out / "model" / "README.md").write_text(card(out))
    return summary


def eagle3_shape(p: dict) -> str:
    """EAGLE-3's draft shape in words: 'a chain of depth 4' or 'depth 3, top-2, 8 nodes'."""
    if p.get("tree_topk") == 1:
        return f"a chain of depth {p.get('depth', '?')}"
    return f"depth {p.get('depth', '?')}, top-{p.get('tree_topk', '?')}, {p.get('total_tokens', '?')} nodes"


def curve_table(records: list[dict], every: int = 5) -> str:
    lines = ["| epoch | train MSE | held-out MSE | held-out corr |", "|---|---|---|---|"]
    for r in records:
        if r["epoch"] % every == 0 or r["epoch"] == 1:
            lines.append(f"| {r['epoch']} | {r['train_mse']:.3f} | {r['val_mse']:.3f} | {r['val_corr']:.3f} |")
    return "\n".join(lines)


def card(run_dir: str | Path, calibration: dict | None = None) -> str:
    """The router's model card (README.md) from a finished run: data, recipe, curve, held-out quality (and, for
    comparison, how well the target's entropy alone tracks Delta AL on the same held-out pairs), the
    hardware-aware threshold with its derivation."""
    run = Path(run_dir)
    s = json.loads((run / "model" / "train_summary.json").read_text())
    cfg, h, hw = s["train_config"], s["heldout"], s["hardware_threshold"]
    pairs = torch.load(run / "pairs.pt")
    seq = torch.cat(pairs["seq"])
    n_seq = int(seq.max()) + 1
    held = torch.from_numpy(
        np.random.default_rng(cfg["seed"]).permutation(n_seq)[: max(1, int(n_seq * cfg["heldout"]))])
    val = torch.isin(seq, held)
    ent, y = torch.cat(pairs["entropy"]).numpy(), torch.cat(pairs["delta"]).numpy()
    ok = val.numpy() & np.isfinite(ent)
    ent_corr = pearson(ent[ok], y[ok])
    doms = {d: pairs["domain"].count(d) for d in sorted(set(pairs["domain"]))}
    al, dp = s["al_profiled"], s.get("drafter_params", {})
    lines = [
        "# WhiFlash-Neural router (speclab zoo)", "",
        "An MLP on the zoo target's final-norm hidden state h_t (512 -> 64 -> GELU -> dropout 0.1 -> 1) predicting "
        f"Delta AL_t = AL_eagle3 - AL_dflash: how many more draft tokens the zoo's EAGLE-3 drafter "
        f"({eagle3_shape(dp)}) would get accepted than its DFlash drafter (block {dp.get('block_size', '?')}"
        f"{', Markov head' if dp.get('markov', 1) else ''}) in a round starting at position t, the target in "
        f"{s.get('dtype', 'float32')}. `whiflash-neural` routes to EAGLE-3 when the prediction exceeds its "
        "threshold.", "",
        "## Data", "",
        f"- {n_seq} prompts of {cfg['prompt_tokens']} tokens cut at random from the training splits of the four zoo "
        f"domains, mixed evenly (task-agnostic, like the paper's corpus): {doms}.",
        f"- Each prompt's greedy continuation by the target ({cfg['new_tokens']} tokens), both drafters profiled at "
        "every position (`speclab.routing.replay.profile_sequence`): one (h_t, Delta AL_t) pair per position, "
        f"{h['pairs_train'] + h['pairs_heldout']} pairs; {h['sequences_heldout']} sequences "
        f"({h['pairs_heldout']} pairs) held out, split by sequence. Collecting took {s['collect_minutes']:.1f} min.",
        f"- Profiled AL (tokens per round if that drafter drafted every round): EAGLE-3 {al['eagle3']:.3f}, "
        f"DFlash {al['dflash']:.3f}.", "",
        "## Training", "",
        f"MSE, AdamW (lr {cfg['lr']:g}, weight decay {cfg['weight_decay']:g}, one-cycle schedule), batch "
        f"{cfg['batch_size']}, {cfg['epochs']} epochs, seed {cfg['seed']}. Command: `speclab train router --out "
        f"runs/router --sequences {cfg['sequences']} --new-tokens {cfg['new_tokens']}`.", "",
        curve_table(s["curve"]), "",
        "## Held-out quality", "",
        "| | value |", "|---|---|",
        f"| MSE | {h['mse']:.3f} |", f"| MSE of predicting the training mean | {h['mse_predict_mean']:.3f} |",
        f"| Pearson correlation, predicted vs true Delta AL | {h['corr']:.3f} |",
        f"| sign agreement | {h['sign_agreement']:.3f} |",
        "| Pearson correlation of the target's entropy H_t with Delta AL (the entropy router's signal) | "
        f"{ent_corr:.3f} |",
        f"| true Delta AL: mean, std | {h['delta_mean']:.3f}, {h['delta_std']:.3f} |", "",
        "## Hardware-aware threshold", "",
        "EAGLE-3's round pays off when (AL_dflash + Delta) / T_eagle3 > AL_dflash / T_dflash; a switch adds EAGLE-3's "
        "catch-up of the typical switch backlog to T_eagle3. So tau_neural = AL_dflash x (T_eagle3 + switch - "
        "T_dflash) / T_dflash, with round times from a cost model fitted to live rounds measured on this machine "
        f"({cfg['cost_prompts']} prompts each of EAGLE-3, DFlash and a switching WhiFlash-Entropy):", "",
        "| quantity | value |", "|---|---|",
        f"| AL_dflash (profiled) | {hw['al_dflash']:.3f} |", f"| T_eagle3 (ms per round) | {hw['t_eagle3_ms']:.2f} |",
        f"| T_dflash (ms per round) | {hw['t_dflash_ms']:.2f} |",
        f"| mean tree width: EAGLE-3, DFlash | {hw['width_eagle3']:.2f}, {hw['width_dflash']:.2f} |",
        f"| switch: EAGLE-3's extra catch-up for a {hw['switch_backlog']:.1f}-token backlog (ms) | "
        f"{hw['switch_ms']:.2f} |",
        f"| **tau_neural** | **{hw['threshold']:.3f}** |", "",
        "It is the router's default when nothing is calibrated for the target; `speclab calibrate` replaces it per "
        "category (`data/zoo/calibration.json`)."]
    if calibration:
        lines += ["", "## Calibration (data/zoo/calibration.json)", "", "```json",
                  json.dumps({k: calibration[k] for k in ("thresholds",)}, indent=1), "```",
                  f"Made by `{calibration.get('info', {}).get('command', 'speclab calibrate')}` on bench "
                  f"`{calibration.get('info', {}).get('bench', '?')}` (suite zoo-calibration, held out from the zoo "
                  "suite)."]
    return "\n".join(lines) + "\n"
