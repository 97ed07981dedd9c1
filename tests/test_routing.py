"""WhiFlash routing: routed greedy output equals AR for every policy (lazy and eager), replay equals live, lazy and
eager catch-up draft alike, the oracles are ordered, routed sampling keeps the target distribution, calibration is
used by default, and the cost model recovers known costs."""
import re

import numpy as np
import pytest
import torch

from helpers import PROMPTS, error_lines
from speclab.bench.routing import oracles
from speclab.core.engine import decode
from speclab.core.sampling import Sampling
from speclab.errors import InvalidInput
from speclab.generate import generate
from speclab.methods import build_method, method_params
from speclab.routing import replay
from speclab.routing.routers import (
    ArmCosts,
    Calibration,
    EntropyRouter,
    NeuralRouter,
    RouterConfig,
    RouterMLP,
    ScheduleRouter,
    load_router,
    threshold_bound,
)


@pytest.fixture(scope="module")
def models(deep, trained_eagle3, trained_dflash):
    """Trained tiny EAGLE-3 and DFlash drafters (they agree with the target often, so rounds accept drafts) and a
    random neural router."""
    torch.manual_seed(3)
    mlp = RouterMLP(RouterConfig(deep.hidden_size, max(deep.hidden_size // 8, 1), 0.0)).eval().to(deep.device)
    return {"eagle3": trained_eagle3, "dflash": trained_dflash, "router": mlp}


def entropies(target, prompt: str, n: int = 40) -> np.ndarray:
    """The target's next-token entropies along its greedy continuation of `prompt`."""
    ids = _ids(target, prompt)
    seq = torch.cat([ids, torch.tensor(generate(target, ids, "ar", max_new_tokens=n).token_ids)])
    logp = torch.log_softmax(target.forward(seq, target.new_cache()).logits, -1)
    return (-(logp.exp() * logp).sum(-1)).cpu().numpy()


def profile(target, models, ids, out, n):
    drafters, _ = build_method("whiflash-entropy", target, models, method_params("whiflash-entropy", {}, target))
    return replay.profile_sequence(target, drafters, ids, torch.tensor(out.token_ids), n)


def _ids(target, prompt):
    return torch.tensor(target.tokenizer(prompt, add_special_tokens=False)["input_ids"])


def policies(deep):
    """Thresholds that route both ways on these prompts: near the quartiles of the target's entropies, each midway
    between two neighbouring ones, so that no position's entropy sits on a threshold (a quartile can be one of
    them, and there the last bits of a live verification forward and of the profile's forward decide differently)."""
    e = np.unique(np.concatenate([entropies(deep, p) for p in PROMPTS[:3]]))
    at = (np.array([0.25, 0.5, 0.75]) * (len(e) - 2)).astype(int)
    return [float((e[i] + e[i + 1]) / 2) for i in at]


@pytest.fixture(scope="module")
def thresholds(deep):
    return policies(deep)


@pytest.mark.parametrize("eager", [0, 1], ids=["lazy", "eager"])
@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "not-deferred"])
def test_routed_greedy_equals_ar(deep, models, thresholds, eager, deferred):
    switched = 0
    for p in PROMPTS[:3]:
        ar = generate(deep, p, "ar", max_new_tokens=40)
        # and the ends of the entropy range: 0 (EAGLE-3 whenever the target is unsure at all), ln V (always DFlash)
        ends = [threshold_bound("entropy", deep.vocab_size).lo, threshold_bound("entropy", deep.vocab_size).hi]
        runs = [("whiflash-entropy", t) for t in thresholds + ends] + [("whiflash-neural", t) for t in (-0.5, 0.0, 0.5)]
        for method, t in runs:
            evs = []
            res = generate(deep, p, method, models=models, threshold=t, eager=eager, deferred=deferred,
                           max_new_tokens=40, on_round=evs.append)
            assert res.token_ids == ar.token_ids, (p, method, t)
            switched += sum(a.drafter != b.drafter for a, b in zip(evs, evs[1:]))
        sched = ScheduleRouter(["eagle3", "dflash", "dflash", "eagle3"] * 20, eager=bool(eager))
        drafters, _ = build_method("whiflash-entropy", deep, models, method_params("whiflash-entropy", {}, deep))
        res = decode(deep, _ids(deep, p), drafters, sched, max_new_tokens=40, deferred=deferred)
        assert res.new_ids.tolist() == ar.token_ids
    assert switched > 20  # the routers really switch


def _live_rounds(target, models, ids, spec, n):
    evs = []
    res = generate(target, ids, spec, models=models, max_new_tokens=n, on_round=evs.append)
    return res, [(e.drafter, e.n_accepted, len(e.committed), e.backlog) for e in evs]


def test_replay_equals_live(deep, models, thresholds):
    """Every round's drafter, accept length, committed tokens and catch-up backlog, at several thresholds of both
    policies (lazy and eager) on several prompts, equal the replay of the prompt's profile."""
    n, checked, accepted = 40, 0, 0
    for p in PROMPTS[:3]:
        ids = _ids(deep, p)
        ar = generate(deep, ids, "ar", max_new_tokens=n)
        prof = profile(deep, models, ids, ar, n)
        pred = replay.neural_signal(prof, models["router"])
        for spec, choice, eager in (
                [(f"whiflash-entropy:threshold={t}", replay.entropy_choice(prof, [t]), False) for t in thresholds]
                + [(f"whiflash-entropy:threshold={thresholds[1]}+eager=1", replay.entropy_choice(prof, [thresholds[1]]),
                    True)]
                + [(f"whiflash-neural:threshold={t}", replay.signal_choice(pred, [t]), False)
                   for t in np.quantile(pred, [0.3, 0.7])]):
            res, live = _live_rounds(deep, models, ids, spec, n)
            w = replay.walk(prof, choice, eager).one(0)
            rep = [(d, int(a), int(c), int(b)) for d, a, c, b in zip(w.drafter, w.n_accepted, w.committed, w.backlog)]
            assert rep == live, (p, spec)
            assert res.token_ids == prof.tokens.tolist()
            checked += 1
            accepted += int(w.n_accepted.sum())
    assert checked == 18 and accepted > 50


def test_lazy_and_eager_catch_up_draft_alike(deep, models, thresholds):
    for p in PROMPTS[:3]:
        trees = {}
        for eager in (0, 1):
            evs = []
            generate(deep, p, "whiflash-entropy", models=models, threshold=thresholds[1], eager=eager,
                     max_new_tokens=40, on_round=evs.append)
            trees[eager] = [(e.drafter, e.tree.tokens.tolist(), e.tree.parents.tolist(), e.backlog) for e in evs]
        assert [t[:3] for t in trees[0]] == [t[:3] for t in trees[1]]
        assert sum(t[3] for t in trees[0]) > sum(t[3] for t in trees[1])  # lazy digests more at once, less often


def test_oracles_are_ordered(deep, models, tmp_path):
    """On the same profiles: Oracle-Token (max AL) >= Oracle-Prompt >= Oracle-Task >= each drafter alone, per
    category and overall; Oracle-Token beats every threshold policy too."""
    profs = []
    for i, p in enumerate(PROMPTS):
        ids = _ids(deep, p)
        ar = generate(deep, ids, "ar", max_new_tokens=40)
        pr = profile(deep, models, ids, ar, 40)
        pr.prompt_id, pr.category = str(i), "a" if i < 2 else "b"
        profs.append(pr)
    from speclab.trace import TraceStore
    with TraceStore(tmp_path / "p.duckdb") as store:  # profiles survive the trace: the same arrays come back
        replay.save_profiles(store, "b", profs, {"x": 1})
        back, params = replay.load_profiles(store, "b")
    assert params == {"x": 1} and [b.prompt_id for b in back] == [p.prompt_id for p in profs]
    for a, b in zip(profs, back):
        assert (a.accepted == b.accepted).all() and (a.width == b.width).all() and (a.tokens == b.tokens).all()
        assert torch.equal(a.hidden, b.hidden) and np.allclose(a.entropy, b.entropy) and a.category == b.category
    t = oracles(profs).set_index(["policy", "category"]).tau
    for c in ("a", "b", "all"):
        best_drafter = max(t["eagle3", c], t["dflash", c])
        assert t["oracle-token", c] >= t["oracle-prompt", c] >= t["oracle-task", c] >= best_drafter
    assert t["oracle-token", "all"] > max(t["eagle3", "all"], t["dflash", "all"])  # strictly: the drafters differ
    sw = replay.summarize_walks(replay.replay_table(profs, {"e": (lambda p: replay.entropy_choice(
        p, np.linspace(0, 6, 25)), list(np.linspace(0, 6, 25)))}), by=("value",))
    assert t["oracle-token", "all"] >= sw.tau.max()


@pytest.mark.slow
def test_routed_sampling_keeps_target_distribution(tiny_v8):
    """Routed decoding under sampling (entropy and neural routers that switch between an EAGLE-3 and a DFlash
    drafter within a decode): the first two sampled tokens follow the target's exact joint distribution. Power:
    a sample of the joint at temperature 0.7 is told apart by the same test."""
    from helpers import random_dflash, random_eagle3
    from speclab.drafters.dflash import DFlashDrafter
    from speclab.drafters.eagle3 import Eagle3Drafter
    from test_sampling import N_RUNS, PROMPT, V, chi2_p, exact_joint, told_apart

    target = tiny_v8
    want = exact_joint(target, PROMPT, Sampling(1.0))
    torch.manual_seed(0)
    mlp = RouterMLP(RouterConfig(target.hidden_size, 4, 0.0)).eval().to(target.device)
    # thresholds that split the signals of the positions after the prompt and one more token (any next token)
    after = torch.stack([torch.cat([PROMPT, torch.tensor([v])]) for v in range(V)])
    outs = [target.forward(x, target.new_cache(), hidden=True) for x in after]
    logp = torch.log_softmax(torch.stack([o.logits[-1] for o in outs]), -1)
    ent = -(logp.exp() * logp).sum(-1)
    with torch.no_grad():
        pred = mlp(torch.stack([o.hidden[-1] for o in outs]))
    for router in (EntropyRouter(float(ent.median())), NeuralRouter(mlp, float(pred.median()))):
        drafters = {"eagle3": Eagle3Drafter(random_eagle3(target, 2), target, depth=2, tree_topk=1, total_tokens=8),
                    "dflash": DFlashDrafter(random_dflash(target, 4, mask_id=V - 1), target, block_size=3,
                                            markov=False, tree_topk=1, total_tokens=16)}
        counts, used = np.zeros(V * V), set()
        for seed in range(N_RUNS):
            res = decode(target, PROMPT, drafters, router, max_new_tokens=3,
                         listeners=(lambda ev, used=used: used.add(ev.drafter),), sampling=Sampling(1.0, seed=seed))
            a, b = res.new_ids.tolist()[:2]
            counts[a * V + b] += 1
        assert used == {"eagle3", "dflash"}
        assert chi2_p(counts, want) > 1e-3, router.policy
    assert told_apart(exact_joint(target, PROMPT, Sampling(0.7)), want)


def test_replay_is_greedy_only():
    with pytest.raises(InvalidInput, match="greedy-only"):
        replay.check_greedy(0.7)
    replay.check_greedy(0.0)


def test_calibrated_threshold_by_category(deep, models, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLAB_ZOO", str(tmp_path))
    Calibration({"entropy": {"code": 0.25, "*": 2.5}, "neural": {"*": -0.75}}, deep.fingerprint).save(
        tmp_path / "calibration.json")

    def thr(method, category, **kw):
        evs = []
        generate(deep, PROMPTS[0], method, models=models, category=category, max_new_tokens=4, on_round=evs.append,
                 **kw)
        return evs[0].decision.threshold

    assert thr("whiflash-entropy", "code") == 0.25
    assert thr("whiflash-entropy", "stories") == 2.5  # not calibrated: the global one
    assert thr("whiflash-entropy", None) == 2.5
    assert thr("whiflash-entropy", "code", threshold=1.5) == 1.5  # a given threshold wins
    assert thr("whiflash-neural", "code") == -0.75
    Calibration({"entropy": {"*": 9.0}}, "another-target").save(tmp_path / "calibration.json")
    from speclab.routing.routers import ENTROPY_FALLBACK
    assert thr("whiflash-entropy", "code") == ENTROPY_FALLBACK  # calibrated for another target: not used
    (tmp_path / "calibration.json").write_text("{oops")
    with pytest.raises(InvalidInput, match="not a speclab calibration file"):
        thr("whiflash-entropy", "code")
    # a user's file (the app's, $SPECLAB_CALIBRATION) is read first; the zoo's shipped file is the fallback for
    # what the user's file does not calibrate
    Calibration({"entropy": {"code": 0.25, "*": 2.5}, "neural": {"*": -0.75}}, deep.fingerprint).save(
        tmp_path / "calibration.json")
    Calibration({"entropy": {"*": 1.75}}, deep.fingerprint).save(tmp_path / "mine.json")
    monkeypatch.setenv("SPECLAB_CALIBRATION", str(tmp_path / "mine.json"))
    assert thr("whiflash-entropy", "code") == 1.75 and thr("whiflash-neural", "code") == -0.75
    monkeypatch.setenv("SPECLAB_CALIBRATION", str(tmp_path / "none-yet.json"))  # not saved yet: the zoo's
    assert thr("whiflash-entropy", "code") == 0.25


def test_router_checkpoint_round_trip(deep, tmp_path):
    torch.manual_seed(0)
    m = RouterMLP(RouterConfig(deep.hidden_size, 8, 0.1, hardware_threshold=0.4)).eval()
    m.save(tmp_path / "r")
    back = load_router(tmp_path / "r", deep)  # on the target's device
    h = torch.randn(5, deep.hidden_size)
    assert torch.allclose(m(h), back(h.to(deep.device)).cpu()) and back.config.hardware_threshold == 0.4
    small = RouterMLP(RouterConfig(deep.hidden_size + 1, 8))
    small.save(tmp_path / "s")
    with pytest.raises(InvalidInput, match="hidden states of size"):
        load_router(tmp_path / "s", deep)


def test_cost_model_recovers_known_costs(tmp_path):
    """Rounds whose phases follow known linear costs (plus noise) give back those costs."""
    import pyarrow as pa

    from speclab.trace import TraceStore

    rng = np.random.default_rng(0)
    truth = dict(draft=[3.0, 7.0], v0=5.0, v1=0.5, c0=[0.4, 0.2], c1=[0.05, 0.02], other=[0.3, 0.3], p0=4.0, p1=0.8)
    with TraceStore(tmp_path / "c.duckdb") as s:
        s.append_row("benches", bench_id="b", suite="x", methods="x", config_json="{}", device="cpu", status="done")
        for run in range(40):
            P = int(rng.integers(5, 60))
            rid = s.start_run(method="m", bench_id="b", prompt_tokens=P, prompt_id=str(run))
            n = 30
            d = rng.integers(0, 2, n)
            w = np.where(d == 0, rng.integers(1, 9, n), rng.integers(3, 7, n))
            back = rng.integers(1, 80, n)

            def noise(n=n):
                return rng.normal(0, 0.01, n)
            s.append({"rounds": pa.table({
                "run_id": np.full(n, rid), "round": np.arange(n, dtype=np.int32),
                "drafter": np.array(replay.DRAFTERS)[d], "n_drafted": w.astype(np.int32),
                "n_accepted": np.zeros(n, np.int32), "committed": np.ones(n, np.int32),
                "t_draft_ms": np.take(truth["draft"], d) + noise(),
                "t_verify_ms": truth["v0"] + truth["v1"] * (w + 1) + noise(),
                "t_catchup_ms": np.take(truth["c0"], d) + np.take(truth["c1"], d) * back + noise(),
                "t_route_ms": np.take(truth["other"], d) + noise(), "t_commit_ms": np.zeros(n),
                "t_record_ms": np.zeros(n),
                "backlog": back.astype(np.int32)})})
            s.finish_run(rid, "done", prefill_ms=truth["p0"] + truth["p1"] * P, elapsed_s=1.0, new_tokens=n, rounds=n)
        s.drain()
        c = replay.fit_costs(s, "b")
    assert np.allclose(c.draft, truth["draft"], atol=0.02) and abs(c.verify1 - truth["v1"]) < 0.01
    assert np.allclose(c.catchup1, truth["c1"], atol=0.002) and np.allclose(c.catchup0, truth["c0"], atol=0.05)
    assert abs(c.prefill1 - truth["p1"]) < 1e-6 and abs(c.prefill0 - truth["p0"]) < 1e-4


ROUTING_BAD = [  # (case, argv after the command, what the one line must say)
    ("sweep-router", ["sweep", "--router", "bogus"], "--router must be entropy or neural"),
    ("sweep-grid", ["sweep", "--router", "entropy", "--grid", "a:b"], "--grid must be thresholds"),
    ("sweep-grid-step", ["sweep", "--router", "entropy", "--grid", "0:1:0"], "--grid must be thresholds"),
    ("sweep-live", ["sweep", "--router", "entropy", "--live", "x"], "--grid must be thresholds"),
    ("sweep-no-db", ["sweep", "--router", "entropy", "--db", "{tmp}/nope.duckdb"], "no trace database at"),
    ("calibrate-router", ["calibrate", "--router", "entropy,foo"], "--router must be among entropy, neural, rule"),
    ("calibrate-rule-grid", ["calibrate", "--router", "rule", "--rule-grid", "1,2.5"],
     "min_match must be an integer from 1 to 32 (got 2.5)"),
    ("calibrate-rule-costs", ["calibrate", "--router", "entropy,rule", "--costs", "data/costs/cpu-fp32.json"],
     "--costs with --router rule"),
    ("routing-no-bench", ["routing", "--bench", "nope"], "no bench 'nope'"),
    ("routing-no-rounds", ["routing"], "has no traced rounds of both eagle3 and dflash"),
    ("profile-no-ar", ["profile"], "has no finished traced AR run"),
]


@pytest.mark.parametrize("case,argv,says", ROUTING_BAD, ids=[c[0] for c in ROUTING_BAD])
def test_routing_cli_refuses_bad_input_in_one_line(case, argv, says, tmp_path, capsys):
    """Before any model loads: one line naming what is wrong; the trace keeps its rows."""
    from speclab.cli import main
    from speclab.trace import TraceStore
    db = tmp_path / "t.duckdb"
    with TraceStore(db) as s:
        s.append_row("benches", bench_id="b1", suite="zoo", methods="ar", config_json="{}", device="cpu", status="done")
    argv = [x.format(tmp=tmp_path) for x in argv]
    rc = main(argv + ([] if "--db" in argv else ["--db", str(db)]))
    out, err = capsys.readouterr()
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1 and says in lines[0], (rc, err)
    assert "loading" not in err and out == ""
    with TraceStore(db, read_only=True) as s:
        assert len(s.query("SELECT * FROM benches")) == 1


def test_bench_pipeline_profiles_replays_calibrates(deep, models, thresholds, tmp_path):
    """A real bench (tiny models, zoo prompts) through the whole routing path: profiles into the trace and back,
    the cost model, every live run replayed identically, Table 1, a sweep with its best thresholds, switch costs
    and lazy vs eager."""
    from speclab.bench.calibration import grid
    from speclab.bench.routing import (
        best_thresholds,
        get_profiles,
        lazy_vs_eager,
        modeled_table,
        profile_bench,
        replay_agreement,
        replayed_runs,
        routing_table,
        sweep,
        switch_table,
        wide,
    )
    from speclab.bench.run import BenchConfig, run_bench
    from speclab.trace import TraceStore

    t = thresholds[1]
    specs = ["ar", "eagle3", "dflash", f"whiflash-entropy:threshold={t}", f"whiflash-entropy:threshold={t}+eager=1",
             "whiflash-neural:threshold=0"]
    with TraceStore(tmp_path / "b.duckdb") as store:
        bench = run_bench(BenchConfig(suite="zoo", methods=specs, limit=1, max_new_tokens=24, peers=False,
                                      untraced=False), deep, models, store, log=lambda s: None)
        made = profile_bench(store, bench, deep, models)
        profs = get_profiles(store, bench)  # read back from the trace
        assert [p.prompt_id for p in profs] == sorted(p.prompt_id for p in made) and len(profs) == 4
        cost = replay.fit_costs(store, bench)
        rep = replayed_runs(store, bench, profs, cost, models["router"])
        assert len(rep) == 4 * 5 and rep.identical.all() and (rep.modeled_s > 0).all()
        orc = oracles(profs, cost)
        table = routing_table(store, bench, orc)
        assert {"eagle3", "dflash", "oracle-token", specs[3]} <= set(table.method)
        assert len(wide(table)) == table.method.nunique()
        mt = modeled_table(rep, orc)
        assert set(mt.category) == {"code", "stories", "literature", "math", "all"}
        sw = sweep(profs, cost, "entropy", [0.0, t, 99.0])
        best = best_thresholds(sw)
        assert set(best) == {"*", "code", "stories", "literature", "math"}
        eager = store.query("SELECT method, bool_and(eager) AS eager FROM runs WHERE bench_id = ? GROUP BY method",
                            [bench]).set_index("method").eager
        assert eager.to_dict() == {s: s == specs[4] for s in specs}  # runs.eager, written by each run
        le = lazy_vs_eager(store, bench)
        assert set(le.lazy) == {specs[3]} and set(le.eager) == {specs[4]} and (le.tau_lazy == le.tau_eager).all()
        assert set(le.category) == {"code", "stories", "literature", "math", "all"}
        # the live switch table counts every drafter change of the lazy routed runs, from their rounds
        switches = 0
        for m in (specs[3], specs[5]):
            for rid in store.query("SELECT run_id FROM runs WHERE method = ?", [m]).run_id:
                d = store.rounds(int(rid)).drafter.tolist()
                switches += sum(a != b for a, b in zip(d, d[1:]))
        st = switch_table(store, bench)
        assert switches > 0 and st.switches.sum() == switches
        assert set(st.drafter) <= {"eagle3", "dflash"} and st.share_of_round.between(0, 1).all()
        # the cost model's error on the live runs: modeled / measured tokens/s - 1, the modeled time being the
        # replayed runs' (identical rounds), the measured the runs' own
        err = replay.model_error_table(cost, store, bench).set_index("method")
        runs = store.query("SELECT method, sum(new_tokens) AS t, sum(elapsed_s) AS s FROM runs WHERE bench_id = ? "
                           "GROUP BY method", [bench]).set_index("method")
        lazy = rep[rep.method != specs[4]].groupby("method")[["tokens", "modeled_s"]].sum()
        assert set(err.index) == set(specs[1:4]) | {specs[5]}  # eager runs left out: their catch-up holds two drafters
        for m, x in err.iterrows():
            assert x.tokens_per_s_live == pytest.approx(runs.t[m] / runs.s[m])
            assert x.tokens_per_s_modeled == pytest.approx(lazy.tokens[m] / lazy.modeled_s[m])
            assert x.model_error == pytest.approx(x.tokens_per_s_modeled / x.tokens_per_s_live - 1)
        from speclab import viz
        from speclab.bench.routing import router_rounds
        run = store.query("SELECT run_id, prompt_id FROM runs WHERE method = ?", [specs[5]]).iloc[0]
        rr = router_rounds(store, int(run.run_id), next(p for p in profs if p.prompt_id == run.prompt_id))
        # greedy: what the chosen drafter "would" have had accepted is what it had accepted, every round
        chosen = [r[f"{r.choice}_would_accept"] for _, r in rr.iterrows()]
        assert chosen == rr.n_accepted.tolist() and rr.pos.iloc[0] == 0 and not rr.switch.iloc[0]
        fig = viz.router_figure(rr)
        assert {t.name for t in fig.data} >= {"signal", "threshold", "eagle3 would accept", "dflash would accept"}
        would = {t.name: t.line for t in fig.data if t.name.endswith("would accept")}  # equal values stay visible:
        assert would["dflash would accept"].dash == "dash" and would["eagle3 would accept"].dash is None  # dashes on
        assert would["eagle3 would accept"].width > would["dflash would accept"].width  # a wider line (v4, 14)
        # the reports `speclab routing`, `sweep` and `calibrate` write, built by the library
        from speclab.bench.calibration import Calibrator, calibrate
        from speclab.bench.routing import live_specs, routing_report, run_live, sweep_report
        from speclab.cli.common import write_report
        report = routing_report(store, bench, profs, cost, models["router"])
        assert "Lazy vs eager" in report.text and "model error" in report.text and len(report.figs) == 4
        # the volatility figure in numbers: shares of positions, leader changes counted from the signals table
        from speclab.bench.routing import signals_table, volatility_table
        vt = volatility_table(profs, models["router"]).set_index("category")
        assert "Intra-sequence volatility" in report.text and set(vt.index) == {"code", "stories", "literature",
                                                                                  "math", "all"}
        assert np.allclose(vt[["eagle3_better", "dflash_better", "tie"]].sum(axis=1), 1.0)
        sig = signals_table(profs, models["router"])
        changes = 0
        for _, q in sig.groupby("prompt_id"):
            w = [x for x in q.winner if x != "tie"]
            changes += sum(a != b for a, b in zip(w, w[1:]))
        assert vt.leader_changes_per_100["all"] == pytest.approx(100 * changes / len(sig))
        assert vt.r_neural["all"] == pytest.approx(np.corrcoef(sig.predicted, sig.delta_tau)[0, 1])
        run_live(store, bench, deep, models, live_specs("entropy", [1.25]), log=lambda s: None)
        report = sweep_report(store, bench, profs, cost, "entropy", [0.0, 1.25, 99.0], live_thresholds=[1.25])
        live = report.figs[0].data[-1]  # a live point per category, over the replayed lines
        assert "Live runs at chosen thresholds" in report.text and live.name.endswith("(live)")
        paths = write_report(report, tmp_path / "r" / "sweep.md")
        assert [x.suffix for x in paths] == [".md", ".html"] and "model_error" in paths[0].read_text()
        best, report = calibrate(Calibrator(store, bench, profs, cost, models["router"]), ["entropy", "neural"])
        assert best["entropy"] == best_thresholds(sweep(profs, cost, "entropy", grid("entropy")))
        assert set(best["neural"]) == set(best["entropy"]) and len(report.figs) == 2
        # profiles replay the bench's runs in its dtype: `speclab routing` loads the models in it, another is refused,
        # and profiles made in another dtype are made again (or refused where nothing can load models)
        from speclab.cli.main import parser
        from speclab.cli.routing import _bench_paths
        from speclab.errors import SpeclabError
        argv = ["routing", "--db", str(tmp_path / "b.duckdb")]
        assert _bench_paths(parser().parse_args(argv), store, bench).dtype == "float32"
        with pytest.raises(SpeclabError, match="ran in float32"):
            _bench_paths(parser().parse_args(argv + ["--dtype", "bf16"]), store, bench)
        store.execute("UPDATE runs SET dtype = 'bfloat16' WHERE bench_id = ?", [bench])
        with pytest.raises(InvalidInput, match="were made in float32, its runs in bfloat16"):
            get_profiles(store, bench)
        with pytest.raises(InvalidInput, match="ran in bfloat16, the target is loaded in float32"):
            get_profiles(store, bench, lambda: (deep, models))
        assert "in bfloat16 a profile's target features" in replay_agreement(
            store, bench, rep.assign(identical=False, routed=True))


def test_calibrator_replays_saves_and_confirms_live(deep, route_models, thresholds, tmp_path, monkeypatch):
    """The app's calibration path on a real tiny bench: the bench and profiles made once and then reused, the
    replay at any threshold equal to the sweep's, the figure, save (what routers then use) and a live
    confirmation whose AL equals the replayed one (greedy). The same for route's rule (its min_match), over every
    arm profiled on the bench's AR outputs."""
    from speclab import viz
    from speclab.bench.calibration import VIEWS, Calibrator, check_threshold, grid, save_thresholds
    from speclab.routing.routers import default_threshold
    from speclab.trace import TraceStore

    monkeypatch.setenv("SPECLAB_CALIBRATION", str(tmp_path / "cal.json"))
    with TraceStore(tmp_path / "c.duckdb") as store:
        with pytest.raises(InvalidInput, match="prompts per category must be"):  # checked before any model work
            Calibrator.prepare(store, deep, route_models, "zoo", 0, 16)
        with pytest.raises(InvalidInput, match="unknown suite"):
            Calibrator.prepare(store, deep, route_models, "nope", 1, 16)
        assert store.query("SELECT count(*) AS n FROM benches").n[0] == 0
        cal = Calibrator.prepare(store, deep, route_models, "zoo", 1, 16, log=lambda s: None)
        again = Calibrator.prepare(store, deep, route_models, "zoo", 1, 16, log=lambda s: None)
        assert not cal.reused and again.reused and again.bench_id == cal.bench_id and len(again.profiles) == 4
        assert cal.categories == ["code", "literature", "math", "stories", "all"]
        t = thresholds[1]
        point = cal.at("entropy", t, "code")
        from speclab.bench.routing import sweep
        same = sweep(cal.profiles, cal.cost, "entropy", [t])
        assert point["tau"] == same[same.category == "code"].tau.iloc[0]
        best = cal.best("entropy", "all")
        assert best["tokens_per_s"] == cal.curve("entropy").query("category == 'all'").tokens_per_s.max()
        refs = cal.references()
        assert {"eagle3", "dflash", "oracle-token", "oracle-prompt", "ar"} <= set(refs.policy)
        ar = refs[refs.policy == "ar"].set_index("category")  # AR: AL 1, tokens/s as its bench runs measured
        from speclab.metrics import run_summary
        ids = store.query(f"SELECT run_id FROM runs WHERE bench_id = '{cal.bench_id}' AND method = 'ar'").run_id
        assert (ar.tau == 1).all() and set(ar.index) == set(cal.categories)
        assert ar.tokens_per_s["all"] == pytest.approx(run_summary(store, ids.tolist()).tokens_per_s[0])
        for c in cal.categories:  # AR named as faster exactly where it beats the router's optimum (app v4, 17)
            faster = ar.tokens_per_s[c] > cal.best("entropy", c)["tokens_per_s"]
            assert cal.ar_faster("entropy", c) == (pytest.approx(ar.tokens_per_s[c]) if faster else None)
        fig = viz.calibration_figure(cal.curve("entropy"), refs, t, point, best, VIEWS["entropy"], "code")
        assert {"whiflash-entropy", "calibrated optimum", "chosen threshold", "eagle3", "oracle-token", "ar"} <= \
            {d.name for d in fig.data}
        colours = {d.line.color for d in fig.data if d.name.startswith("oracle")}
        assert len(colours) == len({d.name for d in fig.data if d.name.startswith("oracle")}) == 4  # told apart
        assert not fig.layout.annotations or "grid's edge" not in str(fig.layout.annotations)
        cal.grids["entropy"] = [0.0, 100.0]  # every round to one drafter at either end: the optimum is at an edge
        cal.curves.pop("entropy")
        assert cal.at_edge("entropy", "code")
        edge = viz.calibration_figure(cal.curve("entropy"), refs, t, point, cal.best("entropy", "code"),
                                      VIEWS["entropy"], "code", at_edge=True)
        assert "grid's edge" in str(edge.layout.annotations)
        cal.grids.pop("entropy")
        cal.curves.pop("entropy")
        with pytest.raises(InvalidInput, match="category must be one of"):
            cal.at("entropy", t, "poetry")
        with pytest.raises(InvalidInput, match="threshold must be a finite number from 0 to"):
            check_threshold("entropy", -1, deep.vocab_size)
        save_thresholds("entropy", {"code": 0.5, "all": 0.75}, deep.fingerprint, {"test": True})
        assert default_threshold("entropy", "code", deep.fingerprint) == 0.5
        assert default_threshold("entropy", "math", deep.fingerprint) == 0.75  # 'all' is the global '*'
        live = cal.confirm(deep, route_models, "entropy", t, "code", 1, log=lambda s: None)
        assert live.prompts[0] == 1 and live.tau_live[0] == pytest.approx(live.tau_replay[0])
        assert live.tokens_per_s_live[0] > 0
        # route's rule: every arm profiled on the same AR outputs, its min_match swept over the calibration grid
        assert cal.routers() == ["entropy", "neural", "rule"]
        rule = cal.curve("rule")
        view = cal.arm_view()
        assert view["profiles"][0].arms == ("eagle3", "dflash", "pld", "none")
        assert {p.prompt_id: p.tokens.tolist() for p in view["profiles"]} == \
            {p.prompt_id: p.tokens.tolist() for p in cal.profiles}
        assert sorted(set(rule.threshold)) == grid("rule") == [float(m) for m in range(1, 17)]
        assert np.allclose(rule.pld_share + rule.eagle3_share, 1.0)  # the rule's two arms
        assert rule[rule.threshold == 16].pld_share.max() <= rule[rule.threshold == 1].pld_share.min()
        rb = cal.best("rule", "code")
        m = int(rb["threshold"])
        point = cal.at("rule", m, "code")
        assert point["tau"] == rule[(rule.category == "code") & (rule.threshold == m)].tau.iloc[0]
        refs = cal.references("rule").set_index(["policy", "category"])
        assert {"eagle3", "dflash", "pld", "ar", "oracle-token", "oracle-token-time"} <= \
            set(refs.index.get_level_values(0))
        for arm in ("eagle3", "dflash", "pld"):  # Oracle-Token (by accept length) is at least every arm alone
            assert refs.tau["oracle-token", "all"] >= refs.tau[arm, "all"]
        assert refs.tau["ar", "all"] == 1.0
        fig = viz.calibration_figure(rule, cal.references("rule"), m, point, rb, VIEWS["rule"], "code")
        assert {"route (rule)", "pld", "eagle3", "ar", "calibrated optimum"} <= {d.name for d in fig.data}
        assert "prompt lookup's match" in fig.layout.xaxis2.title.text
        with pytest.raises(InvalidInput, match="min_match must be an integer from 1 to 32"):
            check_threshold("rule", 2.5, deep.vocab_size)
        from speclab.routing.arms import build
        assert build(deep, route_models, category="code")[1].min_match == 3  # nothing calibrated: MIN_MATCH
        save_thresholds("rule", {"code": 5, "all": 2}, deep.fingerprint, {"test": True})
        assert build(deep, route_models, category="code")[1].min_match == 5  # what `route` decodes with
        assert build(deep, route_models, category="math")[1].min_match == 2
        assert build(deep, route_models, min_match=4, category="code")[1].min_match == 4  # given: as given
        from speclab.methods import build_method, method_params  # at T > 0 the longest match, not the calibration
        sampled = method_params("route", {}, deep, sampled=True)
        assert sampled["min_match"] == 32 and method_params("route", {}, deep)["min_match"] is None
        assert build_method("route", deep, route_models, sampled, "code", True)[1].min_match == 32
        live = cal.confirm(deep, route_models, "rule", m, "code", 1, log=lambda s: None)
        assert live.prompts[0] == 1 and live.tau_live[0] == pytest.approx(live.tau_replay[0])
        ran = store.query("SELECT DISTINCT method FROM runs WHERE method LIKE 'route%'").method.tolist()
        assert ran == [f"route:min_match={m}+router=rule"]
        from speclab.bench.routing import oracles, route_members, routing_table
        table = routing_table(store, cal.bench_id, oracles(cal.profiles))  # `speclab routing`'s Table 1
        assert set(table[table.method == ran[0]].category) == {"code", "all"}  # the routed method beside the rest
        assert route_members(["route:arms=pld.eagle3+none", "route", "eagle3"]) == {"pld", "eagle3", "dflash"}


def test_live_router_rounds_equal_the_trace(deep, models, thresholds, tmp_path):
    """The app's live router view (from RoundEvents) shows what the trace keeps for the run."""
    from speclab.bench.routing import event_rounds, router_rounds
    from speclab.trace import TraceStore

    with TraceStore(tmp_path / "r.duckdb") as store:
        evs = []
        res = generate(deep, PROMPTS[0], "whiflash-entropy", models=models, threshold=thresholds[1], max_new_tokens=32,
                       trace=store, on_round=evs.append)
        store.drain()
        live, traced = event_rounds(evs), router_rounds(store, res.run_id)
    cols = ["round", "signal", "threshold", "choice", "n_accepted", "backlog", "switch", "pos"]
    assert live[cols].astype(str).equals(traced[cols].astype(str)) and live.switch.any()
    # the counterfactuals at the round starts only (the app's router view) are the full profile's there
    ids = _ids(deep, PROMPTS[0])
    full = profile(deep, models, ids, res, 32)
    drafters, _ = build_method("whiflash-entropy", deep, models, method_params("whiflash-entropy", {}, deep))
    starts = live.pos.tolist()
    part = replay.profile_sequence(deep, drafters, ids, torch.tensor(res.token_ids), 32, positions=starts)
    assert (part.accepted[:, starts] == full.accepted[:, starts]).all()
    assert (np.delete(part.accepted, starts, axis=1) == -1).all()


def test_best_threshold_is_one_rule_everywhere():
    """The best threshold of a sweep (`best_per_category`): per category the highest modeled tokens/s, the lowest
    threshold among equals. `best_thresholds` (what `speclab calibrate` saves) and `Calibrator.best` (the app's
    and the notebook widget's optimum) give the same."""
    from types import SimpleNamespace

    import pandas as pd

    from speclab.bench.calibration import Calibrator
    from speclab.bench.routing import best_per_category, best_thresholds
    sw = pd.DataFrame({"category": ["a"] * 4 + ["all"] * 3, "threshold": [1.5, 0.0, 0.5, 1.0, 0.0, 0.5, 1.0],
                       "tokens_per_s": [2.0, 1.0, 3.0, 3.0, 5.0, 4.0, 6.0], "tau": [1.0] * 7})
    best = best_per_category(sw)
    assert best.loc["a", "threshold"] == 0.5 and best.loc["all", "threshold"] == 1.0
    assert best_thresholds(sw) == {"a": 0.5, "*": 1.0}
    cal = Calibrator(None, "b", [SimpleNamespace(category="a")], None, curves={"entropy": sw})
    assert cal.best("entropy", "a")["threshold"] == 0.5 and cal.best("entropy", "all")["threshold"] == 1.0


def test_calibration_grids_are_one_definition():
    """`GRIDS` is what every calibration sweeps: the calibrator (the app, the notebook widget) and, by default,
    `speclab calibrate` and `speclab sweep`."""
    from speclab.bench.calibration import GRIDS, grid, grid_text
    from speclab.bench.routing import parse_thresholds
    from speclab.cli.main import parser
    for router, (start, stop, step) in GRIDS.items():
        g = grid(router)
        assert g[0] == start and g[-1] == stop and g[1] - g[0] == pytest.approx(step)
        assert parse_thresholds(grid_text(router)) == g  # the text the CLI resolves its default grid from
    ca = parser().parse_args(["calibrate"])
    sw = parser().parse_args(["sweep", "--router", "neural"])
    assert ca.entropy_grid is None and ca.neural_grid is None and sw.grid is None  # None: the router's GRIDS


def test_router_data_extends_and_refuses_other_settings(deep, models, tmp_path):
    """`speclab train router`'s profiles: prompt i depends only on (seed, i), so a larger run resumes a smaller one's
    cache and a smaller run reads the first sequences of a larger one's; a cache from other settings is refused."""
    from speclab.errors import SpeclabError
    from speclab.train.router import RouterTrainConfig, collect, corpus_prompts

    rng = np.random.default_rng(0)
    data = {d: {"train": rng.integers(0, 200, 500)} for d in ("code", "stories", "literature", "math")}
    def cfg(n, new_tokens=6):
        return RouterTrainConfig(corpus_dir="-", out_dir="-", sequences=n, prompt_tokens=8, new_tokens=new_tokens)

    small, large = corpus_prompts(data, cfg(2)), corpus_prompts(data, cfg(4))
    assert [d for d, _ in small] == [d for d, _ in large[:2]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(small, large))
    cache = tmp_path / "pairs.pt"
    two = collect(deep, models, small, cfg(2), cache, log=lambda s: None)
    four = collect(deep, models, large, cfg(4), cache, log=lambda s: None)
    assert len(four["al"]) == 4 and all(torch.equal(a, b) for a, b in zip(two["delta"], four["delta"][:2]))
    assert len(collect(deep, models, small, cfg(2), cache, log=lambda s: None)["al"]) == 2
    with pytest.raises(SpeclabError, match="other settings \\(new_tokens\\)"):
        collect(deep, models, small, cfg(2, new_tokens=7), cache, log=lambda s: None)


# ---- routing v2: arms, merged arms, none ----

def test_merge_shares_point_mass_prefixes_and_accepts_the_longer_branch():
    """Greedy merge: a looked-up chain that an EAGLE-3-like tree already holds in part costs rows only past the shared
    prefix; each member's nodes map to merged ones; the merged tree accepts what the better member would."""
    from speclab.core.tree import DraftTree, merge
    from speclab.core.verify import verify_tokens
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]), torch.full((4,), 0.5))  # 5-7-8, 6
    chain = DraftTree.chain(torch.tensor([5, 7, 9, 4]), torch.full((4,), float("nan")))  # shares 5-7
    merged, (mt, mc) = merge([tree, chain])
    assert len(merged) == 6 and mt.tolist() == [0, 1, 2, 3] and mc.tolist() == [0, 2, 4, 5]
    assert merged.parents.tolist() == [-1, -1, 0, 2, 2, 4] and merged.child_dists is None
    for truth, best in (([5, 7, 9, 4, 1], 4), ([5, 7, 8, 0, 0], 3), ([6, 1, 0, 0, 0], 1), ([2, 0, 0, 0, 0], 0)):
        rows = torch.tensor(truth)[torch.cat([torch.zeros(1, dtype=torch.long), merged.depth])]
        got = verify_tokens(merged, rows).accepted
        assert got.numel() == best == max(verify_tokens(t, torch.tensor(truth)[torch.cat(
            [torch.zeros(1, dtype=torch.long), t.depth])]).accepted.numel() for t in (tree, chain))
    alone, maps = merge([DraftTree.empty(), chain])
    assert alone is chain and maps[0].numel() == 0 and maps[1].tolist() == [0, 1, 2, 3]


ARM_SPECS = ["route:arms=pld.eagle3", "route:arms=eagle3+dflash+pld+none+router=rule+min_match=1",
             "route:arms=pld+pld.dflash+router=rule", "route:arms=none",
             "route:arms=pld.eagle3.dflash+pld+router=rule+min_match=2",
             "route:arms=eagle3+dflash+pld+pld.eagle3+none+router=learned"]  # a random learned router here


COSTS = {"arms": ["eagle3", "dflash", "pld", "pld.eagle3", "none"], "draft": [1.0] * 5, "catchup0": [0.0] * 5,
         "catchup1": [0.0] * 5, "other": [0.0] * 5, "width": [4.0] * 5, "verify0": 1.0, "verify1": 0.0}  # alike


@pytest.fixture(scope="module")
def route_models(deep, models):
    """The models fixture and a random learned route router over five arms, biased so that it switches."""
    from speclab.routing.routers import ArmRouterConfig, ArmRouterMLP
    torch.manual_seed(1)
    arms = ["eagle3", "dflash", "pld", "pld.eagle3", "none"]
    mlp = ArmRouterMLP(ArmRouterConfig(deep.hidden_size, arms, COSTS, 16, 0.0)).eval().to(deep.device)
    with torch.no_grad():
        mlp.net[-1].weight.mul_(40.0)  # predictions that move with the hidden state: the router switches
    return {**models, "route": mlp}


def test_route_arms_greedy_equal_ar(deep, route_models):
    """Every arm kind (a drafter, a merged arm of two or three drafters, none) and the rule and learned routers
    switching among them: greedy output equals AR token for token (fp32), deferred or not, and the rounds use the
    arms they name."""
    used: set = set()
    for p, deferred in zip(PROMPTS[:3], (True, False, True)):
        ar = generate(deep, p, "ar", max_new_tokens=40)
        for spec in ARM_SPECS:
            evs = []
            res = generate(deep, p, spec, models=route_models, deferred=deferred, max_new_tokens=40,
                           on_round=evs.append)
            assert res.token_ids == ar.token_ids, (spec, p)
            used |= {(spec, ev.drafter) for ev in evs}
    assert {("route:arms=eagle3+dflash+pld+none+router=rule+min_match=1", d) for d in ("pld", "eagle3")} <= used
    assert ("route:arms=none", None) in used and ("route:arms=pld.eagle3", "pld.eagle3") in used
    assert len({d for s, d in used if s == ARM_SPECS[-1]}) >= 2  # the learned router switched


def test_route_refuses_bad_arms_in_one_line(deep):
    for arms, says in (("", "joined by '+'"), ("eagle3+.pld", "empty member"), ("eagle4", "not a registered drafter"),
                       ("pld.pld", "names a drafter twice"), ("pld+pld", "listed twice"),
                       ("confu.pld", "cannot be merged"), ("eagle3+dflash", "no pld arm")):
        with pytest.raises(InvalidInput, match=re.escape(says)):
            method_params(f"route:arms={arms}", {}, deep)


@pytest.mark.slow
def test_merged_arm_sampling_keeps_target_distribution(tiny_v8):
    """A merged arm under sampling (prompt lookup's point masses beside EAGLE-3's sampled tree, one verification):
    the first two sampled tokens follow the target's exact joint; rounds did verify both kinds of node. Power: a
    sample of the joint at temperature 0.7 is told apart."""
    from helpers import random_eagle3
    from speclab.core.tree import POINT
    from speclab.drafters.eagle3 import Eagle3Drafter
    from speclab.drafters.pld import PromptLookup
    from speclab.routing.arms import Merged
    from test_sampling import N_RUNS, V, chi2_p, exact_joint, told_apart

    target = tiny_v8
    prompt = torch.tensor([2, 5, 2])  # prompt lookup proposes [5, 2] in the first round
    want = exact_joint(target, prompt, Sampling(1.0))
    e = Eagle3Drafter(random_eagle3(target, 2), target, depth=2, tree_topk=2, total_tokens=6)
    look = PromptLookup(k=2, max_ngram=1, min_ngram=1)
    drafters = {"pld": look, "eagle3": e, "pld.eagle3": Merged("pld.eagle3", {"pld": look, "eagle3": e})}
    counts, mixed = np.zeros(V * V), 0
    for seed in range(N_RUNS):
        def seen(ev):
            nonlocal mixed
            g = ev.tree.child_groups
            mixed += g is not None and bool((g == POINT).any()) and bool((g != POINT).any())
        res = decode(target, prompt, drafters, ScheduleRouter(["pld.eagle3"]), max_new_tokens=3, listeners=(seen,),
                     sampling=Sampling(1.0, seed=seed))
        a, b = res.new_ids.tolist()[:2]
        counts[a * V + b] += 1
    assert mixed > N_RUNS // 2, mixed
    assert chi2_p(counts, want) > 1e-3
    assert told_apart(exact_joint(target, prompt, Sampling(0.7)), want)


def test_decision_loss_is_the_soft_choices_lost_share_of_the_best_rate():
    """Arms A, B and none with true rates 1.0, 2.0 and 0.5 tokens/ms: a prediction that makes B's predicted rate the
    highest loses almost nothing, one that makes A's loses A's half (none's prediction never counts), `captured`
    is the chosen arms' share of the best rate, and the loss has a gradient."""
    from speclab.train.route import captured, decision_loss
    y, ms = torch.tensor([[3.0, 1.0, 0.0]]), torch.tensor([[4.0, 1.0, 2.0]])
    none = torch.tensor([False, False, True])
    good = torch.tensor([[0.0, 1.0, 100.0]], requires_grad=True)
    assert float(decision_loss(good, y, ms, ms, none, 0.1)) < 1e-5
    assert float(decision_loss(torch.tensor([[20.0, 0.0, 0.0]]), y, ms, ms, none, 0.1)) == pytest.approx(0.5, abs=1e-3)
    soft = torch.tensor([[3.0, 1.0, 0.0]], requires_grad=True)  # the truth: B wins, A keeps some weight at temp 1
    loss = decision_loss(soft, y, ms, ms, none, 1.0)
    assert 0.1 < float(loss) < 0.5
    loss.backward()
    assert soft.grad[0, 0] > 0 and soft.grad[0, 2] == 0  # more A: more lost; none's prediction is masked
    assert captured(torch.tensor([1, 0]), y.repeat(2, 1), ms.repeat(2, 1)) == pytest.approx(0.75)


def test_catch_up_line_resists_a_few_slow_rounds_and_the_folded_router_is_the_mlp():
    """`robust_line` (the cost model's catch-up line) recovers 0.7 ms + 0.02 a token from rounds where a few slow
    ones at long backlogs pull least squares' slope up fivefold; `ArmRouterMLP.folded` (what `ArmRouter` runs) gives
    the MLP's outputs."""
    from speclab.routing.routers import ArmRouterConfig, ArmRouterMLP, n_extras, robust_line
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.integers(1, 8, 400), rng.integers(20, 60, 40)]).astype(float)
    y = 0.7 + 0.02 * x + rng.normal(0, 0.02, len(x))
    y[-6:] += 25.0  # six slow rounds
    lsq = np.linalg.lstsq(np.c_[np.ones(len(x)), x], y, rcond=None)[0]
    c0, c1 = robust_line(x, y)
    assert abs(c0 - 0.7) < 0.03 and abs(c1 - 0.02) < 0.003 and lsq[1] > 0.08
    torch.manual_seed(0)
    m = ArmRouterMLP(ArmRouterConfig(16, ["a", "b", "none"], COSTS, 8, 0.0)).eval()
    h, e = torch.randn(5, 16), torch.randn(5, n_extras(3))
    m.standardise(h * 3 + 1, e * 2)
    w1h, w1x, b1, w2, b2 = m.folded()
    torch.testing.assert_close(torch.nn.functional.gelu(h @ w1h.T + e @ w1x.T + b1) @ w2.T + b2, m(h, e))


def test_route_router_trains_saves_and_replays_as_live(deep, route_models, tmp_path):
    """Routing v2's learned router end to end on the tiny target: N-arm profiles (a merged arm accepts what its best
    member does, none nothing), training rows from replayed policies, a fit, a save / load round trip, and the
    router replayed on the profiles choosing, round by round, the arms it chose live."""
    from speclab.routing.replay import profile_sequence, router_choice, walk
    from speclab.routing.routers import ArmRouter, load_arm_router
    from speclab.train.route import RouteTrainConfig, fit, rows
    arms = ("eagle3", "dflash", "pld", "pld.eagle3", "none")
    spec = "route:arms=" + "+".join(arms)
    rule = spec + "+router=rule"
    drafters, _ = build_method(rule, deep, route_models, method_params(rule, {}, deep))
    profs = []
    for p in PROMPTS[:3]:
        out = generate(deep, p, "ar", max_new_tokens=32)
        profs.append(profile_sequence(deep, drafters, _ids(deep, p), torch.tensor(out.token_ids), 32, arms=arms))
    for p in profs:
        assert (p.accepted[3] == np.maximum(p.accepted[0], p.accepted[2])).all() and (p.accepted[4] == 0).all()
        assert (p.width[3] <= p.width[0] + p.width[2]).all() and "pld_match" in p.probe
    cfg = RouteTrainConfig("", str(tmp_path), "+".join(arms), epochs=3, random_walks=2, heldout=0.34, width=16)
    data = rows(profs, cfg, ArmCosts(**COSTS))
    assert data["y"].shape[1] == 5 and len(data["y"]) == len(data["hidden"]) == len(data["extras"]) == len(data["ms"])
    assert (data["ms"] > 0).all() and (data["ms_true"] > 0).all()
    m, records, held = fit(data, cfg, deep.hidden_size, list(arms), COSTS)
    assert len(records) == 3 and held["rows_heldout"] > 0 and "train_loss" in records[0]
    assert set(held["captured"]) == {"router", "rule (min_match 3)", *arms}
    assert all(0 < v <= 1 for v in held["captured"].values())
    with pytest.raises(ValueError, match="round times"):
        fit(rows(profs, cfg), cfg, deep.hidden_size, list(arms), COSTS)
    m.save(tmp_path / "r")
    back = load_arm_router(tmp_path / "r", deep)  # on the target's device; training ran on the CPU
    x = data["extras"][:5]
    assert torch.allclose(back(data["hidden"][:5].to(deep.device), x.to(deep.device)).cpu(),
                          m.eval()(data["hidden"][:5], x))
    models = {**route_models, "route": back}
    for prof, p in zip(profs, PROMPTS[:3]):
        evs = []
        generate(deep, p, spec + "+router=learned", models=models, max_new_tokens=32, on_round=evs.append)
        w = walk(prof, router_choice(prof, ArmRouter(back, list(arms))))
        assert [ev.drafter or "none" for ev in evs] == [arms[i] for i in w.drafter[w.start[:, 0] >= 0, 0]]
    from speclab.bench.routing import event_rounds, with_counterfactual
    from speclab.viz import router_figure
    fig = router_figure(with_counterfactual(event_rounds(evs), prof))  # every arm's counterfactual, drawn
    assert {f"{a} would accept" for a in arms} <= {t.name for t in fig.data}


@pytest.mark.slow
def test_route_arms_greedy_equal_ar_in_bf16_exact(deep):
    """bf16, the target in exact mode (a row's logits never depend on the rows beside it): a merged arm of three
    drafters and the rule router over every arm kind give AR's tokens bit for bit (random drafter models in bf16)."""
    from speclab.core.target import Target
    from speclab.drafters.registry import drafters
    t = Target.load(deep.name, dtype="bf16", exact=True)
    models = {r: drafters()[r].model.random(t, 0) for r in ("eagle3", "dflash")}
    for p in PROMPTS[:2]:
        ar = generate(t, p, "ar", max_new_tokens=24)
        for spec in ("route:arms=pld.eagle3.dflash", "route:arms=eagle3+dflash+pld+none+router=rule+min_match=1"):
            assert generate(t, p, spec, models=models, max_new_tokens=24).token_ids == ar.token_ids, (spec, p)


def test_round_costs_measured_here_are_kept_by_machine_and_the_learned_router_uses_them(deep, route_models, tmp_path,
                                                                                        monkeypatch):
    """`speclab.routing.local_costs`: costs measured here (`train.route.measure_costs` on live rounds, as `speclab
    costs route` does) are kept in the per-user cache under this machine's key; a learned route built afterwards
    uses them (and says so), over its arms; the key of another machine, a changed drafter model or a corrupt file
    give the router its shipped costs again."""
    import copy
    import json

    from speclab.routing import local_costs
    from speclab.train.route import RouteTrainConfig, measure_costs
    monkeypatch.setenv("SPECLAB_CACHE_DIR", str(tmp_path))
    mlp, spec = route_models["route"], "route:arms=pld+eagle3+none+router=learned"
    shipped = local_costs.for_router(mlp, deep, route_models)
    assert not shipped.here and shipped.costs == ArmCosts(**COSTS) and "shipped" in shipped.label
    prompts = [("code", _ids(deep, p)) for p in PROMPTS[:1]]
    cfg = RouteTrainConfig("", str(tmp_path), "+".join(mlp.config.arms), cost_prompts=1, new_tokens=12)
    measured, how = measure_costs(deep, route_models, prompts, cfg)
    assert measured.arms == mlp.config.arms and how["rounds"] > 0 and measured.verify0 > 0
    path = local_costs.store(mlp, deep, route_models, measured, how)
    used = local_costs.for_router(mlp, deep, route_models)
    assert used.here and used.costs == measured and "measured here" in used.label
    _, router = build_method(spec, deep, route_models, method_params(spec, {}, deep))
    assert router.costs == measured.of(["pld", "eagle3", "none"])
    other = {**route_models, "eagle3": copy.deepcopy(route_models["eagle3"]).to(torch.float64)}
    assert not local_costs.for_router(mlp, deep, other).here  # another drafter model (its dtype)
    with monkeypatch.context() as m:
        m.setattr(local_costs.precision, "machine", lambda: {"cpu": "another machine"})
        assert not local_costs.for_router(mlp, deep, route_models).here
    entries = json.loads(path.read_text())
    for e in entries["entries"].values():
        e["costs"]["draft"] = e["costs"]["draft"][:2]  # a malformed entry: one term short
    path.write_text(json.dumps(entries))
    assert not local_costs.for_router(mlp, deep, route_models).here
    path.write_text("{not json")
    assert not local_costs.for_router(mlp, deep, route_models).here
    local_costs.store(mlp, deep, route_models, measured, how)  # a corrupt file is replaced
    assert local_costs.for_router(mlp, deep, route_models).here


def test_the_learned_routers_features_and_costs_of_one_row_are_the_batched_ones():
    """`ArmRouter` computes one round start's features and costs in Python floats (`extras_row`,
    `ArmCosts.expected_row`); training computes many at once (`arm_extras`, `ArmCosts.expected_ms`): the same
    numbers, nan and no-round-yet included."""
    from speclab.routing.routers import N_RECENT, arm_extras, extras_row
    rng = np.random.default_rng(0)
    n = 200
    ent, match = rng.exponential(2, n), rng.integers(0, 40, n).astype(float)
    ent[::7], match[::11] = np.nan, np.nan
    tok, last, gen = rng.integers(0, 9, n).astype(float), rng.integers(-1, 5, n), rng.integers(0, 500, n)
    recent = [rng.integers(-1, 9, n) for _ in range(N_RECENT)]
    batch = arm_extras(ent, match, tok, recent, last, gen, 5)
    one = [extras_row(ent[i], match[i], tok[i], [r[i] for r in recent], int(last[i]), gen[i], 5) for i in range(n)]
    assert torch.equal(batch, torch.tensor(one))
    assert batch[0, 0] == 0.0 and batch[:, -1].sum() == (last < 0).sum()  # nan entropy is 0; none yet: the last slot
    c = ArmCosts(**{**COSTS, "draft": [1.0, 2.0, 0.1, 2.0, 0.0], "catchup0": [0.3, 0.3, 0.0, 0.4, 0.0],
                    "catchup1": [0.01, 0.02, 0.0, 0.01, 0.0], "verify1": 0.13})
    for tokens, back in ((3.0, [0.0, 5.0, 2.0, 0.0, 0.0]), (0.0, [1.0, 0.0, 0.0, 7.0, 0.0])):
        assert c.expected_row(tokens, back) == c.expected_ms(tokens, np.array(back)).tolist()


def test_costs_route_measures_the_zoo_router_here_and_reports_before_and_after(tmp_path):
    """`speclab costs route` on the zoo: one line of where the costs went, the report's table of both cost models
    (the zoo router's shipped ones before) and its bars, the cache written in the user's cache folder."""
    import json
    import os

    from helpers import run_cli
    env = {**os.environ, "SPECLAB_CACHE_DIR": str(tmp_path / "cache")}
    out = run_cli("costs", "route", "--prompts", "1", "--new-tokens", "12", "--dtype", "bf16", "--report",
                  str(tmp_path / "r.html"), env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "| before" in text and "| measured here" in text and "shipped with the router" in text
    assert "Plotly" in (tmp_path / "r.html").read_text()
    cache = json.loads((tmp_path / "cache" / "route-costs.json").read_text())
    (entry,) = cache["entries"].values()
    assert entry["costs"]["arms"] == ["eagle3", "dflash", "pld", "pld.eagle3", "none"] and entry["how"]["rounds"] > 0
