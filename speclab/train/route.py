"""Train routing v2's learned router (`speclab train route`): an MLP that predicts every arm's accept length for the
coming round, from which `speclab.routing.routers.ArmRouter` picks the arm with the most predicted tokens per ms.

Data: counterfactual profiles over N arms (`speclab.routing.replay.profile_sequence` with `arms`: every arm at every
position of the target's own greedy continuation; a merged arm's accept length is its best member's) of prompts cut
from the training splits of the four zoo domains (`speclab.train.router.corpus_prompts`, the same prompts WhiFlash's
router learns from). The router sees the recent rounds and the arm last used, which depend on the policy, so the
training rows are the round starts of several policies replayed on each profile (`replay.walk`): each arm alone,
and random choices; every row's targets are all arms' counterfactual accept lengths there. Sequences are split
into train and held out before training. The loss (`objective`): by default the decision's own regret
(`decision_loss`: every arm's counterfactual tokens per ms is known at every row) with a little MSE; or the accept
lengths' MSE alone. AdamW, one-cycle schedule.

Costs: each arm's rounds are measured here, live, on a few of the prompts (every phase of its rounds, each arm
alone, `none` from AR's, and a random schedule over all arms for catch-ups after switches), a round-cost model
fitted to them (`routing.routers.fit_arm_costs`) and kept in the router's config with the machine's name: the
router divides the predicted tokens by each arm's modeled round time.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from speclab.progress import Progress
from speclab.train.threads import own_threads

DEFAULT_ARMS = "eagle3+dflash+pld+pld.eagle3+none"


@dataclass
class RouteTrainConfig:
    corpus_dir: str
    out_dir: str
    arms: str = DEFAULT_ARMS
    sequences: int = 160  # prompts profiled (train + held out)
    prompt_tokens: int = 48
    new_tokens: int = 96
    heldout: float = 0.2
    random_walks: int = 4  # random-choice policies replayed per profile (beside each arm alone)
    epochs: int = 40
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.01
    dropout: float = 0.1
    width: int = 64
    objective: str = "rate"  # rate: the decision's lost tokens per ms (`decision_loss`); mse: accept lengths alone
    decision_temp: float = 0.1  # the soft decision's temperature on log tokens per ms (0.1: 10% more, e times likelier)
    mse_weight: float = 0.05  # beside the decision loss: predictions stay accept lengths (the trace's signal)
    cost_prompts: int = 4  # prompts decoded live per arm to measure its round time
    seed: int = 0
    threads: int = 2
    domain_weights: dict = field(default_factory=lambda: {"code": 1.0, "stories": 1.0, "literature": 1.0, "math": 1.0})


def collect(target, models: dict, prompts, cfg: RouteTrainConfig, cache: Path, log=print) -> dict:
    """N-arm profiles of every prompt's greedy continuation, saved to `cache` every 10 sequences and resumed from
    it; a cache made with other settings is refused rather than mixed in."""
    from speclab.core.engine import decode
    from speclab.errors import SpeclabError
    from speclab.methods import build_method, method_params
    from speclab.routing.replay import profile_sequence

    spec = f"route:arms={cfg.arms}+router=rule"
    key = {"target": target.fingerprint, "dtype": target.precision["dtype"], "arms": cfg.arms,
           "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens, "seed": cfg.seed,
           "domain_weights": cfg.domain_weights}
    done = torch.load(cache, weights_only=False) if cache.exists() else {"profiles": [], "key": key}
    if done.get("key") != key:
        diff = sorted(k for k in key if (done.get("key") or {}).get(k) != key[k])
        raise SpeclabError(f"{cache} was collected with other settings ({', '.join(diff)}): use another --out, or "
                           "delete it to collect again")
    done["profiles"] = done["profiles"][: len(prompts)]
    start, t0, minutes0 = len(done["profiles"]), time.time(), done.get("minutes", 0.0)
    if start:
        log(f"route data: resuming after {start} sequences ({cache})")
    drafters, _ = build_method(spec, target, models, method_params(spec, {}, target))
    arms = tuple(cfg.arms.split("+"))
    prog = Progress(len(prompts), "profile sequences (every arm at every position)")
    prog.update(start)
    for i in range(start, len(prompts)):
        dom, ids = prompts[i]
        out = decode(target, ids, max_new_tokens=cfg.new_tokens, stop_on_eos=False).new_ids
        p = profile_sequence(target, drafters, ids, out, cfg.new_tokens, f"train-{i}", dom, arms=arms)
        p.hidden = p.hidden.to(torch.float16)
        done["profiles"].append(p)
        prog.update(i + 1)
        done["minutes"] = minutes0 + (time.time() - t0) / 60
        if (i + 1) % 10 == 0 or i + 1 == len(prompts):
            torch.save(done, str(cache) + ".tmp")
            Path(str(cache) + ".tmp").replace(cache)
    return done


def rows(profiles, cfg: RouteTrainConfig, costs=None) -> dict:
    """Training rows: the round starts of each arm alone and of `random_walks` random policies replayed on every
    profile; per row the hidden state, the extras (`routers.arm_extras`), every arm's accept length there, prompt
    lookup's match and the sequence it came from. With `costs` (`routers.ArmCosts` over the profiles' arms) also
    every arm's round time there: `ms`, what the router expects (`ArmCosts.expected_ms`: mean widths, prompt
    lookup's proposal), and `ms_true`, at the width the arm drafts there; both with the drafters' backlogs after
    the rounds before it (`routers.arm_backlogs` over the engine's `HISTORY` rounds, as live)."""
    from speclab.core.engine import HISTORY
    from speclab.routing.replay import walk
    from speclab.routing.routers import N_RECENT, NONE, arm_backlogs, arm_extras
    out: dict = {"hidden": [], "extras": [], "y": [], "seq": [], "match": [], "ms": [], "ms_true": []}
    rng = np.random.default_rng(cfg.seed)
    for s, p in enumerate(profiles):
        A, N = p.accepted.shape
        names = [None if a == NONE else a for a in p.arms]
        choice = np.concatenate([np.repeat(np.arange(A)[:, None], N, 1),
                                 rng.integers(0, A, size=(cfg.random_walks, N))])
        w = walk(p, choice)
        probe = p.probe
        match, tokens = probe.get("pld_match", np.zeros(N)), probe.get("pld_tokens", np.zeros(N))
        for k in range(choice.shape[0]):
            live = w.start[:, k] >= 0
            g, acc, arm = w.start[live, k], w.accepted[live, k], w.drafter[live, k]
            recent = [np.concatenate([np.full(i + 1, -1), acc[: len(acc) - i - 1]]) for i in range(N_RECENT)]
            last = np.concatenate([[-1], arm[:-1]])
            out["extras"].append(arm_extras(p.entropy[g], match[g], tokens[g], recent, last, g, A))
            out["hidden"].append(p.hidden[torch.from_numpy(g)].float())
            out["y"].append(torch.from_numpy(p.accepted[:, g].T.astype(np.float32)))
            out["seq"].append(torch.full((len(g),), s))
            out["match"].append(torch.from_numpy(np.nan_to_num(match[g]).astype(np.float32)))
            if costs is not None:
                back = np.array([arm_backlogs(p.arms, acc[max(0, r - HISTORY): r].tolist(),
                                              [names[x] for x in arm[max(0, r - HISTORY): r]]) for r in range(len(g))])
                out["ms"].append(torch.from_numpy(costs.expected_ms(tokens[g], back)).float())
                out["ms_true"].append(torch.from_numpy(costs.round_ms(np.arange(A), p.width[:, g].T, back)).float())
    return {k: torch.cat(v) for k, v in out.items() if v}


def decision_loss(pred, y, ms, ms_true, none, temp: float) -> torch.Tensor:
    """The router's decision as a soft choice (softmax over arms of log `routers.predicted_rates` / temp), and the
    share of the best arm's tokens per ms it loses in expectation: an arm's true rate is its accept length + 1 over
    its round time at the width it drafts there (`ms_true`). Every arm's counterfactual is known at every row, so
    this is the decision's own regret, not a proxy for it."""
    from speclab.routing.routers import predicted_rates
    rate = (y + 1) / ms_true
    lost = 1 - rate / rate.max(-1, keepdim=True).values
    return (torch.softmax(predicted_rates(pred, ms, none).log() / temp, -1) * lost).sum(-1).mean()


def captured(choice: torch.Tensor, y, ms_true) -> float:
    """The mean share of the best arm's tokens per ms that the arms chosen ([n] indices) get, row by row."""
    rate = (y + 1) / ms_true
    return float((rate.gather(-1, choice[:, None])[:, 0] / rate.max(-1).values).mean())


def fit(data: dict, cfg: RouteTrainConfig, hidden_size: int, arms: list[str], costs: dict):
    """Train the MLP on `cfg.objective` (rows with `ms` and `ms_true` for "rate"); -> (ArmRouterMLP, per-epoch
    records, held-out metrics: per arm the accept length's fit, and with round times the tokens per ms each policy
    captures of the row's best arm: the router, the rule (min_match `MIN_MATCH`) and each arm alone)."""
    import torch.nn.functional as F

    from speclab.core.protocol import Signals
    from speclab.routing.arms import rule_other
    from speclab.routing.routers import (
        LOOKUP,
        MIN_MATCH,
        NONE,
        ArmRouterConfig,
        ArmRouterMLP,
        RuleRouter,
        predicted_rates,
    )
    from speclab.train.router import fit_mse, heldout_split, pearson
    torch.manual_seed(cfg.seed)
    h, x, y, seq = data["hidden"], data["extras"], data["y"], data["seq"]
    val, held, n_seq = heldout_split(seq, cfg)
    m = ArmRouterMLP(ArmRouterConfig(hidden_size, list(arms), costs, cfg.width, cfg.dropout))
    m.standardise(h[~val], x[~val])
    hv, xv, yv = h[val], x[val], y[val]
    n = int((~val).sum())
    none = torch.tensor([a == NONE for a in arms])
    timed = "ms" in data
    if cfg.objective == "rate" and not timed:
        raise ValueError("the rate objective needs the rows' round times: rows(profiles, cfg, costs)")
    loss, more = None, None
    if timed:
        yt, mt, tt = y[~val], data["ms"][~val], data["ms_true"][~val]
        mv, tv = data["ms"][val], data["ms_true"][val]

        def more(pv):
            return {"val_captured": captured(predicted_rates(pv, mv, none).argmax(-1), yv, tv)}
        if cfg.objective == "rate":
            def loss(pred, idx):
                return (decision_loss(pred, yt[idx], mt[idx], tt[idx], none, cfg.decision_temp)
                        + cfg.mse_weight * F.mse_loss(pred, yt[idx]))
    records = fit_mse(m, (h[~val], x[~val]), y[~val], (hv, xv), yv, cfg, "train route router (epochs)", more=more,
                      loss=loss)
    with torch.no_grad():
        pv = m(hv, xv)
    pvn, yvn = pv.numpy(), yv.numpy()
    per_arm = {a: {"corr": pearson(pvn[:, i], yvn[:, i]), "mse": float(((pvn[:, i] - yvn[:, i]) ** 2).mean()),
                   "mean": float(yvn[:, i].mean())} for i, a in enumerate(arms) if yvn[:, i].std() > 0}
    heldout = {"rows_train": n, "rows_heldout": int(val.sum()), "sequences": n_seq, "sequences_heldout": len(held),
               "per_arm": per_arm}
    if timed:
        pick = {"router": predicted_rates(pv, mv, none).argmax(-1)}
        if LOOKUP in arms:  # the rule router itself on each row's match (its choice depends on nothing else)
            rule = RuleRouter(LOOKUP, rule_other(arms), MIN_MATCH)
            pick[f"rule (min_match {MIN_MATCH})"] = torch.tensor(
                [arms.index(rule.choose(Signals(0, probe={"pld_match": m})).choice or NONE)
                 for m in data["match"][val].tolist()])
        pick.update({a: torch.full((len(yv),), i) for i, a in enumerate(arms)})
        heldout["captured"] = {k: captured(c, yv, tv) for k, c in pick.items()}
    return m, records, heldout


def event_rows(events, routed: bool = False):
    """Live RoundEvents as the rows `routing.routers.fit_arm_costs` fits: arm, width, backlog and the phases."""
    import pandas as pd

    from speclab.routing.routers import NONE
    return pd.DataFrame([{"arm": ev.drafter or NONE, "width": len(ev.tree), "backlog": ev.backlog,
                          "draft_ms": ev.timings_ms["draft"], "catchup_ms": ev.timings_ms["catchup"],
                          "verify_ms": ev.timings_ms["verify"], "route_ms": ev.timings_ms["route"],
                          "other_ms": ev.timings_ms["route"] + ev.timings_ms["commit"] + ev.timings_ms["record"],
                          "routed": routed} for ev in events])


def measure_costs(target, models: dict, prompts, cfg: RouteTrainConfig):
    """The arms' round-cost model fitted to live rounds here (`routing.routers.fit_arm_costs`): `cost_prompts`
    prompts decoded with each arm alone (`none`: AR) and with a random schedule over every arm (switches: catch-up
    backlogs of every length). -> (ArmCosts, what it was fitted to)."""
    import pandas as pd

    from speclab.core.engine import decode
    from speclab.generate import generate
    from speclab.methods import build_method, method_params
    from speclab.routing.routers import NONE, ScheduleRouter, fit_arm_costs
    arms = cfg.arms.split("+")
    spec = f"route:arms={cfg.arms}+router=rule"
    prog = Progress((len(arms) + 1) * cfg.cost_prompts, "measure the arms' round costs")
    rows, rng = [], np.random.default_rng(cfg.seed)
    for i in range(cfg.cost_prompts):
        for a in arms:
            evs: list = []
            generate(target, prompts[i][1], "ar" if a == NONE else f"route:arms={a}", models=models,
                     max_new_tokens=cfg.new_tokens, on_round=evs.append)
            rows.append(event_rows(evs))
            prog.update(len(rows))
        drafters, _ = build_method(spec, target, models, method_params(spec, {}, target))
        sched = [None if a == NONE else a for a in rng.choice(arms, size=cfg.new_tokens)]
        evs = []
        decode(target, prompts[i][1], drafters, ScheduleRouter(sched), max_new_tokens=cfg.new_tokens,
               listeners=(evs.append,))
        rows.append(event_rows(evs))
        prog.update(len(rows))
    df = pd.concat(rows, ignore_index=True)
    costs = fit_arm_costs(df, arms)
    how = {"rounds": len(df), "prompts": cfg.cost_prompts, "runs": "each arm alone and a random schedule over all",
           "rounds_per_arm": df.arm.value_counts().to_dict()}
    return costs, how


def router_overhead(target, models: dict, prompts, cfg: RouteTrainConfig, mlp) -> float:
    """The learned router's own time a round (ms): its route phase (the features, the MLP and prompt lookup's probe)
    in live decodes of the cost prompts."""
    from speclab.generate import generate
    evs: list = []
    for i in range(cfg.cost_prompts):
        generate(target, prompts[i][1], f"route:arms={cfg.arms}+router=learned", models={**models, "route": mlp},
                 max_new_tokens=cfg.new_tokens, on_round=evs.append)
    return float(np.mean([ev.timings_ms["route"] for ev in evs]))


@own_threads
def train_route(cfg: RouteTrainConfig, target, models: dict, log=print) -> dict:
    from speclab.core.precision import cpu_label
    from speclab.train.router import setup

    out, prompts = setup(cfg, target)
    data = collect(target, models, prompts, cfg, out / "profiles.pt", log)
    arms = cfg.arms.split("+")
    costs, how = measure_costs(target, models, prompts, cfg)
    m, records, heldout = fit(rows(data["profiles"], cfg, costs), cfg, target.hidden_size, arms, asdict(costs))
    costs.router_ms = router_overhead(target, models, prompts, cfg, m.eval())
    al = np.mean([p.accepted.mean(1) + 1 for p in data["profiles"]], 0)
    m.config.costs = asdict(costs)
    m.config.target = target.fingerprint
    m.config.machine = f"{cpu_label()}, {target.precision['dtype']}"
    m.config.derivation = how
    summary = {"train_config": asdict(cfg), "collect_minutes": data.get("minutes", 0.0), "heldout": heldout,
               "al_profiled": dict(zip(arms, map(float, al))), "costs": asdict(costs),
               "machine": m.config.machine, "curve": records}
    m.save(out / "model")
    (out / "model" / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "model" / "README.md").write_text(card(summary))
    return summary


def card(s: dict) -> str:
    """The route router's model card from its training summary."""
    from speclab.routing.routers import n_extras
    cfg, h, c = s["train_config"], s["heldout"], s["costs"]
    arms = cfg["arms"].split("+")
    lines = ["# Routing v2 router (speclab zoo)", "",
             f"An MLP on the zoo target's final-norm hidden state and {n_extras(len(arms))} round features (the "
             "entropy of the target's last distribution, prompt lookup's match and proposal length, the last two "
             f"accept lengths, the position, the last arm one-hot over the {len(arms)} arms and 'none yet') -> "
             f"{cfg['width']} -> GELU -> one predicted accept length per arm: "
             f"{cfg['arms'].replace('+', ', ')}. `route:router=learned` takes the arm with the most predicted tokens "
             "(accepted + 1) per ms of its measured round time.", "",
             "## Data", "",
             f"- {h['sequences']} prompts of {cfg['prompt_tokens']} tokens from the training splits of the four zoo "
             f"domains, each continued greedily by the target ({cfg['new_tokens']} tokens), every arm profiled at "
             f"every position. Collecting took {s['collect_minutes']:.1f} min.",
             f"- Rows: the round starts of each arm alone and of {cfg['random_walks']} random policies on every "
             f"profile; {h['rows_train']} rows to train, {h['rows_heldout']} held out ({h['sequences_heldout']} "
             "sequences, split by sequence).", "",
             "## Round costs (fitted when trained)", "",
             f"On {s['machine']}: live rounds of {cfg['cost_prompts']} prompts decoded with each arm alone and with "
             "a random schedule over all arms (`speclab.routing.routers.fit_arm_costs`): a round of arm a costs "
             "draft + catch-up (c0 + c1 x backlog) + verify0 + verify1 x (width + 1) + other, and a routed round "
             f"the router's own {c['router_ms']:.2f} ms more. Verification: {c['verify0']:.2f} + {c['verify1']:.3f} "
             f"ms per row ({c['rounds_fitted']} rounds).", "",
             "| arm | profiled tokens per round | draft ms | catch-up ms (c0, c1 per token) | other ms | mean width |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {a} | {s['al_profiled'][a]:.2f} | {c['draft'][i]:.2f} | {c['catchup0'][i]:.2f}, "
              f"{c['catchup1'][i]:.3f} | {c['other'][i]:.2f} | {c['width'][i]:.2f} |" for i, a in enumerate(c["arms"])]
    lines += ["", "## Held-out quality (per arm: predicted vs true accept length)", "",
              "| arm | Pearson r | MSE | true mean |", "|---|---|---|---|"]
    lines += [f"| {a} | {v['corr']:.3f} | {v['mse']:.3f} | {v['mean']:.3f} |" for a, v in h["per_arm"].items()]
    if "captured" in h:
        lines += ["", "## Held-out decisions (tokens per ms captured of each row's best arm)", "",
                  "Every held-out row (a round start of one of the replayed policies) with every arm's true tokens "
                  "per ms there (accept length + 1 over its modeled round time at the width it drafts there, after "
                  "its backlog): the mean share of the best arm's that each policy's choice gets. Myopic (one round "
                  "at a time), so a guide to the live result, not the live result.", "",
                  "| policy | captured |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in h["captured"].items()]
    objective = cfg.get("objective", "mse")
    how = ("the decision's expected lost share of the best arm's tokens per ms (softmax temperature "
           f"{cfg['decision_temp']:g} on log tokens per ms) + {cfg['mse_weight']:g} x the accept lengths' MSE"
           if objective == "rate" else "the accept lengths' MSE")
    lines += ["", f"Command: `speclab train route --out runs/route --sequences {cfg['sequences']} --new-tokens "
              f"{cfg['new_tokens']} --objective {objective}`; loss: {how}; {cfg['epochs']} epochs, AdamW lr "
              f"{cfg['lr']:g}, seed {cfg['seed']}."]
    return "\n".join(lines) + "\n"
