"""bf16 where the CPU computes it natively: the dtype choice, logits in fp32, exact (batch-invariant) mode, and
bf16 greedy decoding that equals AR or differs only at a numerical near-tie (never a bug)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import demo_rows, error_lines
from speclab import zoo
from speclab.core import precision
from speclab.core.target import Target
from speclab.core.tree import DraftTree, tree_attention_mask, tree_position_ids
from speclab.drafters.confu import load_confu
from speclab.drafters.dflash import load_dflash
from speclab.drafters.eagle3 import load_eagle3
from speclab.drafters.specblock import load_specblock
from speclab.equality import first_divergence, kind_of
from speclab.generate import generate
from speclab.methods import METHODS
from speclab.routing.routers import load_router
from speclab.trace import TraceStore

PROMPTS = [row["prompt"] for row in demo_rows()]


# ---- the dtype choice: --dtype auto, once per machine ---------------------------------------------------------

def fake_costs(ar="fp32", spec="bf16", draft=None):
    """What `speclab.bench.costs.dtype_decision` returns, with AR's and the speculative family's verdicts (and, with
    `draft`, the sps draft model's, measured alone)."""
    def one(v, fam):
        r = {"bf16": 0.8, "fp32": 1.2, "tie": 1.0}[v]
        return {"verdict": v, "dtype": "fp32" if v == "tie" else v, "fp32_ms": 5.0, "bf16_ms": 5.0 * r, "ratio": r,
                "lo": r - 0.01, "hi": r + 0.01, "reps": 12, "methods": [fam]}
    return {"ar": one(ar, "ar"), "speculative": one(spec, "pld"), **({"draft": one(draft, "sps")} if draft else {})}, \
        None


@pytest.fixture
def auto(monkeypatch, tmp_path):
    """A CPU with native bf16, a private cache, a quiet machine and a counted fake measurement (`auto.calls`,
    `auto.costs` sets what it finds, `auto.busy` the other processes' load)."""
    import types

    from speclab import models
    from speclab.bench import costs
    monkeypatch.setenv("SPECLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(precision, "cpu_info", lambda: ("Intel Xeon", ("amx_bf16",)))
    state = types.SimpleNamespace(calls=0, costs=fake_costs(), busy=0.0, lines=[])
    monkeypatch.setattr(precision, "other_load", lambda window_s=0.3: state.busy)

    def measure(load):
        state.calls += 1
        return state.costs
    monkeypatch.setattr(costs, "dtype_decision", measure)
    monkeypatch.setattr(models, "_DECIDED", {})

    def resolve(fam="speculative", **kw):
        models._DECIDED.clear()  # a new process each time: only the cache file carries the decision over
        # on the CPU: on CUDA bf16 is taken without measuring (test_auto_dtype_on_cuda_is_bf16_and_names_are_checked)
        return models.resolve_dtype(models.ModelPaths(device="cpu"), fam, log=state.lines.append, **kw)
    state.resolve = resolve
    return state


def test_auto_dtype_without_native_bf16_is_fp32_without_measuring(auto, monkeypatch):
    monkeypatch.setattr(precision, "cpu_info", lambda: ("Some CPU", ()))
    dt, d = auto.resolve()
    assert dt == "fp32" and auto.calls == 0 and "no native bf16" in d.line("ar")
    assert precision.pick_dtype(torch.device("cpu"), "auto") == torch.float32
    assert precision.pick_dtype(torch.device("cpu"), None) == torch.float32


def test_auto_dtype_is_measured_once_per_machine_and_family(auto):
    """Ten successive resolutions, as ten `speclab generate` processes would make: one measurement, the same
    answer, AR and the speculative methods each in the dtype measured faster for them."""
    seen = {(auto.resolve("ar")[0], auto.resolve("speculative")[0]) for _ in range(10)}
    assert seen == {("fp32", "bf16")} and auto.calls == 1
    _, d = auto.resolve("speculative")
    assert d.source.startswith("read from") and str(precision.cache_path()) in d.line("speculative")
    assert "measured now" not in d.line("ar") and "bf16 faster" in d.line("speculative")
    # what the cache holds is what a load without a measurement at hand reads too (Target.load(dtype="auto"))
    assert precision.pick_dtype(torch.device("cpu"), "auto", "speculative", d.key) == torch.bfloat16
    assert precision.pick_dtype(torch.device("cpu"), "auto", "ar", d.key) == torch.float32
    # another torch (or CPU, cores, models) is another key: measured again
    import speclab.core.precision as P
    orig = P.machine
    try:
        P.machine = lambda: {**orig(), "torch": "9.9"}
        auto.resolve()
    finally:
        P.machine = orig
    assert auto.calls == 2


def test_a_tie_picks_fp32(auto):
    auto.costs = fake_costs("tie", "tie")
    assert auto.resolve("ar")[0] == auto.resolve("speculative")[0] == "fp32"
    assert "a tie" in auto.resolve()[1].line("speculative")


@pytest.mark.parametrize("bad", ["{not json", '{"format": "other-tool", "entries": {}}',
                                 '{"format": "speclab-dtype-auto", "version": 99, "entries": {}}', "FOREIGN_ENTRY",
                                 "BAD_DTYPE", "\xff\xfe"])
def test_a_corrupt_or_foreign_cache_is_ignored_in_one_line_and_measured_again(auto, bad):
    import json
    _, d = auto.resolve()
    path = precision.cache_path()
    if bad in ("FOREIGN_ENTRY", "BAD_DTYPE"):  # the right key, but measured elsewhere / not a dtype
        data = json.loads(path.read_text())
        e = data["entries"][d.key]
        if bad == "FOREIGN_ENTRY":
            e["machine"] = {**e["machine"], "cpu": e["machine"]["cpu"] + " (another)"}  # not this machine's
        else:
            e["dtypes"]["speculative"] = "int4"
        bad = json.dumps(data)
    path.write_bytes(bad.encode("latin-1") if bad.startswith("\xff") else bad.encode())
    auto.lines.clear()
    assert auto.resolve()[0] == "bf16" and auto.calls == 2
    assert [ln for ln in auto.lines if "dtype cache" in ln] == [auto.lines[0]] and "ignoring" in auto.lines[0]
    auto.lines.clear()
    assert auto.resolve()[1].source.startswith("read from") and auto.calls == 2 and not auto.lines  # rewritten whole


def test_a_decision_measured_on_a_busy_machine_is_provisional(auto):
    auto.busy = 1.5
    _, d = auto.resolve()
    assert d.provisional and "provisional" in d.line("ar")
    auto.resolve()  # still busy: the provisional answer is kept (no coin flip under load)
    assert auto.calls == 1
    auto.busy = 0.0
    _, d = auto.resolve()  # quiet now: measured again, and final
    assert auto.calls == 2 and not d.provisional
    auto.resolve()
    assert auto.calls == 2


def test_an_unwritable_cache_costs_a_measurement_not_the_run(auto, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("SPECLAB_CACHE_DIR", str(tmp_path / "file" / "sub"))
    assert auto.resolve()[0] == "bf16"
    assert any("could not keep the dtype decision" in ln for ln in auto.lines)


def test_the_verdict_needs_a_resolved_interval():
    from speclab.bench.costs import median_ci, settle
    rng = np.random.default_rng(0)
    assert settle(np.log(0.85) + rng.normal(0, 0.02, 20)) == "bf16"
    assert settle(np.log(1.15) + rng.normal(0, 0.02, 20)) == "fp32"
    assert settle(rng.normal(0, 0.005, 40)) == "tie"
    assert settle(rng.normal(0, 0.3, 12)) is None  # noisy: not yet resolved
    # a few huge outliers (another process took the core) move neither the median nor its interval much
    x = np.r_[np.log(0.85) + rng.normal(0, 0.02, 20), np.log([5.0, 6.0, 7.0])]
    mid, lo, hi = median_ci(x)
    assert settle(x) == "bf16" and hi < 0 and abs(mid - np.log(0.85)) < 0.03


def test_dtype_decision_times_the_decodes_own_calls(qwen3, model_dir):
    """On a tiny target with a draft model, both families get a verdict from interleaved repetitions, within the
    repetition bounds, and so does the draft model alone (it runs apart from the target: `ModelRole.own_dtype`)."""
    from speclab.bench.costs import dtype_decision, role_programs, round_programs
    targets = {"fp32": qwen3, "bf16": Target.load(qwen3.name, dtype="bf16")}
    drafts = {dt: Target.load(model_dir["qwen3_draft"], dtype=dt) for dt in targets}
    costs, samples = dtype_decision(lambda dt: (targets[dt], {"draft": drafts[dt]}), min_reps=4, max_reps=8, calls=2,
                                    context=16, progress=False)
    assert set(costs) == {"ar", "speculative", "draft"}
    assert round_programs({})["speculative"] == {"pld": [("target", 9, 1)]}
    assert role_programs({}) == {} and role_programs({"draft": drafts["fp32"]}) == {
        "draft": {"sps": [("draft", 1, METHODS["sps"].defaults["k"]), ("draft", 2, 1)]}}
    for c in costs.values():
        assert c["verdict"] in ("bf16", "fp32", "tie") and c["dtype"] in ("bf16", "fp32") and 4 <= c["reps"] <= 8
        assert c["fp32_ms"] > 0 and c["bf16_ms"] > 0 and c["lo"] <= c["ratio"] <= c["hi"]
    assert set(samples.family) == {"ar", "speculative", "draft"} and (samples.rep.diff().fillna(0) >= 0).all()


@pytest.mark.parametrize("draft", ["fp32", "tie"])
def test_the_draft_model_runs_in_its_own_faster_dtype(auto, model_dir, tmp_path, capsys, draft):
    """The sps draft computes apart from the target (token ids in, logits out): under --dtype auto it loads in the
    dtype its own calls measured faster in (a tie: the target's), the load line and the run row say so, and the
    decode is still the target's own (its dtype never changes an output: test_a_draft_in_another_dtype_...)."""
    import json

    from speclab.cli import main
    auto.costs = fake_costs("bf16", "bf16", draft)
    db = tmp_path / "t.duckdb"
    assert main(["generate", "--model", str(model_dir["qwen3"]), "--draft", str(model_dir["qwen3_draft"]), "--db",
                 str(db), "--prompt", "Hello", "--method", "sps", "--max-new-tokens", "6"]) == 0
    err = capsys.readouterr().err
    own = draft == "fp32"
    assert ("qwen3_draft (fp32)" in err) == own
    assert ("--dtype auto -> fp32 for the draft model: fp32 faster" in err) == own
    entries = json.loads(precision.cache_path().read_text())["entries"]  # kept in the cache with its reason
    assert [(e["roles"], bool(e["role_reason"]["draft"])) for e in entries.values()] == [
        ({"draft": "fp32" if own else "bf16"}, True)]
    with TraceStore(db, read_only=True) as s:
        params = json.loads(s.query("SELECT params_json FROM runs").params_json[0])
    assert params.get("draft_dtype") == ("float32" if own else None)
    if own:  # a bench of sps beside sps@bf16: the pinned spec runs every model in bf16, on a model set of its own
        assert main(["bench", "--model", str(model_dir["qwen3"]), "--draft", str(model_dir["qwen3_draft"]), "--db",
                     str(db), "--suite", "demo", "--methods", "ar,sps,sps@bf16", "--limit", "1", "--max-new-tokens",
                     "6", "--no-peers", "--no-untraced", "--report", str(tmp_path / "b.md")]) == 0
        with TraceStore(db, read_only=True) as s:
            ran = s.query("SELECT method, params_json FROM runs WHERE bench_id IS NOT NULL")
        drafts = {m: json.loads(p).get("draft_dtype") for m, p in zip(ran.method, ran.params_json)}
        assert drafts == {"ar": None, "sps": "float32", "sps@bf16": None}


def test_a_draft_in_another_dtype_never_changes_the_output(qwen3, model_dir):
    """Greedy sps with the draft in bf16 and the target in fp32 equals AR token for token (the draft proposes,
    the target decides)."""
    draft = Target.load(model_dir["qwen3_draft"], dtype="bf16")
    for prompt in PROMPTS[:3]:
        ar = generate(qwen3, prompt, "ar", max_new_tokens=24).token_ids
        assert generate(qwen3, prompt, "sps", models={"draft": draft}, max_new_tokens=24).token_ids == ar


def test_a_method_spec_can_pin_its_dtype(qwen3, capsys):
    from helpers import assert_one_error_line
    from speclab.methods import parse_spec, split_dtype
    assert split_dtype("eagle3:depth=6@bf16") == ("eagle3:depth=6", "bf16") and split_dtype("pld") == ("pld", None)
    assert parse_spec("pld:k=4@fp32") == ("pld", {"k": "4"})
    assert precision.family("ar@bf16") == "ar" and precision.family("pld@bf16") == "speculative"
    with pytest.raises(precision.InvalidInput, match="'@int8' is not a dtype"):
        parse_spec("pld@int8")
    with pytest.raises(precision.InvalidInput, match="decodes in bf16, but the target was loaded in float32"):
        generate(qwen3, "Hello", "pld@bf16", max_new_tokens=4)
    assert generate(qwen3, "Hello", "pld@fp32", max_new_tokens=4).token_ids
    assert_one_error_line(["generate", "--prompt", "x", "--method", "eagle3@bf17"], "'@bf17' is not a dtype", capsys)
    assert_one_error_line(["bench", "--methods", "ar,pld@int8"], "'@int8' is not a dtype", capsys)
    assert_one_error_line(["costs", "dtype", "--dtype", "bf16"], "--dtype bf16 chooses nothing", capsys)


def test_bench_and_generate_take_each_familys_auto_dtype_and_say_why(auto, model_dir, tmp_path, capsys):
    """`speclab bench --dtype auto` where AR measured faster in fp32 and the speculative methods in bf16: two model
    sets, AR in fp32, pld and ar@bf16 in bf16; `generate` loads each method in its family's dtype; every load line
    says the dtype, why, and whether it was measured now or read from the cache."""
    from speclab.cli import main
    from speclab.trace import TraceStore
    db = tmp_path / "t.duckdb"
    common = ["--model", str(model_dir["qwen3"]), "--db", str(db)]
    assert main(["bench", *common, "--suite", "demo", "--methods", "ar,pld", "--limit", "1", "--max-new-tokens", "6",
                 "--no-peers", "--no-untraced", "--report", str(tmp_path / "b.md")]) == 0
    err = capsys.readouterr().err
    assert auto.calls == 1 and "float32; --dtype auto -> fp32 for ar" in err
    assert "--dtype auto -> bf16 for speculative" in err
    assert "(measured now, kept in" in err
    with TraceStore(db, read_only=True) as s:
        ran = dict(s.query("SELECT method, dtype FROM runs").itertuples(index=False))
    assert ran == {"ar": "float32", "pld": "bfloat16", "ar@bf16": "bfloat16"}
    assert "Precision: ar float32, ar@bf16 bfloat16, pld bfloat16." in (tmp_path / "b.md").read_text()
    from speclab import models
    for method, dt in (("ar", "float32"), ("pld", "bfloat16"), ("pld@fp32", "float32")):
        models._DECIDED.clear()  # a new process: the decision comes from the cache file
        assert main(["generate", *common, "--prompt", "Hello", "--method", method, "--max-new-tokens", "4"]) == 0
        err = capsys.readouterr().err
        assert f"cpu, {dt}" in err and ("read from" in err or "@" in method) and auto.calls == 1


def test_auto_dtype_on_cuda_is_bf16_and_names_are_checked(monkeypatch):
    from speclab import models
    monkeypatch.setattr(models, "resolve_dtype", models.resolve_dtype)
    assert precision.pick_dtype(torch.device("cuda"), "auto") == torch.bfloat16
    assert precision.pick_dtype(torch.device("cpu"), "bf16") == torch.bfloat16
    assert precision.pick_dtype(torch.device("cpu"), "fp32") == torch.float32
    with pytest.raises(precision.InvalidInput, match="--dtype 'bf17' is not a dtype"):
        precision.pick_dtype(torch.device("cpu"), "bf17")
    with pytest.raises(precision.InvalidInput, match="--logits 'half'"):
        precision.check_logits("half")


def test_cpu_info_reads_this_machine():
    name, flags = precision.cpu_info()
    assert isinstance(name, str) and set(flags) <= set(precision.BF16_FLAGS)


# ---- logits in fp32 ----------------------------------------------------------------------------------------------

def test_head_refines_the_top_logits_to_exact_fp32():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(512, 64, generator=g) * 0.2).bfloat16()
    h = torch.randn(6, 64, generator=g)
    ref = F.linear(h, w.float())  # the fp32 head on the bf16 weights
    out = precision.Head(w, "fp32")(h)
    top = ref.topk(precision.REFINE_K, -1).indices
    assert torch.equal(out.gather(-1, top), (w.float()[top] * h[:, None]).sum(-1))  # fp32 values where they matter
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    low = precision.Head(w, "model")(h)
    assert low.dtype == torch.float32
    assert (low - ref).abs().max() > (out.gather(-1, top) - ref.gather(-1, top)).abs().max()


def test_head_falls_back_to_a_full_fp32_row_where_an_unrefined_logit_could_win():
    """Two rows whose bf16 logits tie exactly beyond the refined top-1: the bound sends them to a full fp32 row."""
    w = torch.zeros(4, 2, dtype=torch.bfloat16)
    w[:, 0] = torch.tensor([1.0, 1.0, 1.0, 0.0])
    w[:, 1] = torch.tensor([0.0, 2 ** -9, 2 ** -8, 0.0])  # differences below bf16's rounding of the output
    h = torch.tensor([[256.0, 1.0], [256.0, -1.0]])
    out = precision.Head(w, "fp32", k=1)(h)
    assert torch.equal(out, F.linear(h, w.float()))
    assert out[0].argmax() == 2 and out[1].argmax() == 0


@pytest.fixture(scope="module")
def zoo_bf16():
    """The zoo target in bf16 three ways: logits in bf16, logits in fp32 (the default), and exact mode."""
    return {"model": Target.load(zoo.default_target(), dtype="bf16", logits="model"),
            "fp32": Target.load(zoo.default_target(), dtype="bf16"),
            "exact": Target.load(zoo.default_target(), dtype="bf16", exact=True)}


@pytest.mark.slow
def test_fp32_logits_of_the_bf16_forward_match_an_fp32_reference(zoo_bf16):
    ref = Target.load(zoo.default_target(), dtype="fp32")
    ids = ref.tokenizer(PROMPTS[0] + " " + PROMPTS[1], return_tensors="pt")["input_ids"][0]
    want = ref.forward(ids, ref.new_cache()).logits
    got = zoo_bf16["fp32"].forward(ids, zoo_bf16["fp32"].new_cache()).logits
    err = (got - want).abs()
    # within bf16 tolerance: the body's rounding, a few units of bf16 epsilon of the logits' scale
    scale = want.abs().amax(-1, keepdim=True)
    assert (err <= 8 * torch.finfo(torch.bfloat16).eps * scale).all(), float((err / scale).max())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.97
    # and closer to it than logits in bf16 are
    low = zoo_bf16["model"].forward(ids, zoo_bf16["model"].new_cache()).logits
    assert err.mean() < (low - want).abs().mean()
    # bf16 logits tie exactly at the top far more often than fp32 ones
    ties = [int((v[:, 0] == v[:, 1]).sum()) for v in (got.topk(2, -1).values, low.topk(2, -1).values)]
    assert ties[0] <= ties[1]


# ---- exact mode: a row's result never depends on how many rows run with it ------------------------------------------

@pytest.mark.slow
def test_exact_mode_rows_are_bitwise_invariant_to_the_batch(zoo_bf16):
    t = zoo_bf16["exact"]
    ids = torch.randint(3, t.vocab_size, (100,), generator=torch.Generator().manual_seed(1))

    def stepped(n):
        c = t.new_cache(len(ids))
        t.forward(ids[:40], c)
        return torch.cat([t.forward(ids[j : j + n], c, layers=(1, 4), hidden=True).logits for j in range(40, 100, n)])

    one = stepped(1)
    for n in (3, 8, 11):
        assert torch.equal(stepped(n), one), n
    # tree verifications over three tiles: each node's row equals the row of its path forwarded as a chain (its
    # ancestors sit at scattered slots in the tree, at consecutive ones in the chain). A softmax summed in slot
    # order instead of sequence order failed this for 1 row in 120.
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        ctx = 30 + 9 * seed
        parents = torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, 20)])
        tree = DraftTree(ids[ctx + 1 : ctx + 21], parents, torch.ones(20))
        c = t.new_cache(len(ids))
        t.forward(ids[:ctx], c)
        out = t.forward(torch.cat([ids[ctx : ctx + 1], tree.tokens]), c, tree_position_ids(tree.depth, ctx, True),
                        tree_attention_mask(tree.ancestors, ctx, t.dtype, True)).logits
        for node in range(20):
            path = tree.ancestors[node].nonzero().flatten()
            c.crop(ctx)  # the slots after the prefix are overwritten, or masked
            chain = t.forward(torch.cat([ids[ctx : ctx + 1], tree.tokens[path]]), c).logits
            assert torch.equal(out[node + 1], chain[-1]), (seed, node, path.tolist())
    # the fast bf16 forward is not invariant where a row's sums depend on the rows beside it (oneDNN's product, the
    # AVX512-BF16 product's blocks of inputs, torch's fused attention): exact mode is needed there. On a CPU with AMX
    # the tiles' product and the native attention compute each of a decode's few rows alone, so there the fast rows
    # come out the same too (seen first on the Intel Xeon, 2026-11-29), and this part says so instead
    from speclab.core import native
    rows_alone = native.product() == "tiles" and native.attention_module() is not None
    fast = zoo_bf16["fp32"]
    c1, c8 = fast.new_cache(), fast.new_cache()
    fast.forward(ids[:40], c1)
    fast.forward(ids[:40], c8)
    a = torch.cat([fast.forward(ids[j : j + 1], c1).logits for j in range(40, 48)])
    assert torch.equal(a, fast.forward(ids[40:48], c8).logits) == rows_alone, native.product()


@pytest.mark.slow
def test_exact_mode_wide_eagle3_tree_equals_ar(zoo_bf16, drafters):
    """The case that found the slot-order softmax: a 17-row EAGLE-3 tree on a zoo prompt parted from AR at token
    125 (a top-2 gap of 0.002) until each row's softmax ran in sequence order."""
    from speclab.bench.suites import load_suite
    t = zoo_bf16["exact"]
    prompt = next(r["prompt"] for r in load_suite("zoo", 4) if r["prompt_id"] == "literature-1")
    ar = generate(t, prompt, "ar", max_new_tokens=128)
    tree = generate(t, prompt, "eagle3:tree_topk=3+total_tokens=16", models={"eagle3": drafters["exact"]["eagle3"]},
                    max_new_tokens=128)
    assert tree.token_ids == ar.token_ids


def test_exact_mode_refuses_the_hf_backend(model_dir):
    with pytest.raises(ValueError, match="exact mode runs on the lean forward only"):
        Target.load(model_dir["qwen3"], dtype="fp32", backend="hf", exact=True)


# ---- bf16 greedy decoding: equal to AR, or a near-tie; in exact mode always equal ------------------------------------

@pytest.fixture(scope="module")
def drafters(zoo_bf16):
    out = {}
    for mode, t in zoo_bf16.items():
        out[mode] = {"draft": Target.load(zoo.default_draft(), dtype="bf16", logits=t.logits),
                     "eagle3": load_eagle3(zoo.default_eagle3(), t), "dflash": load_dflash(zoo.default_dflash(), t),
                     "router": load_router(zoo.default_router(), t),
                     "specblock": load_specblock(zoo.model("specblock"), t),
                     "confu": load_confu(zoo.model("confu"), t)}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["model", "fp32", "exact"])
def test_bf16_greedy_equals_ar_or_differs_at_a_near_tie(zoo_bf16, drafters, mode):
    t, models = zoo_bf16[mode], drafters[mode]
    kinds = {}
    for p in PROMPTS:
        ar = generate(t, p, "ar", max_new_tokens=48)
        for m in METHODS:
            if m == "ar":
                continue
            res = generate(t, p, m, models=models, max_new_tokens=48)
            div = first_divergence(t, ar.decode.prompt_ids, ar.token_ids, res.token_ids)
            kinds.setdefault(kind_of(div), []).append((m, p[:20], div.describe() if div else ""))
    assert "bug" not in kinds, kinds["bug"]
    if mode == "exact":
        assert set(kinds) == {"equal"}, kinds.get("near-tie")
    assert len(kinds["equal"]) >= len(PROMPTS) * (len(METHODS) - 1) // 2  # most outputs are equal in any mode


@pytest.mark.slow
def test_runs_record_how_they_computed(zoo_bf16, tmp_path):
    with TraceStore(tmp_path / "t.duckdb") as s:
        for t in zoo_bf16.values():
            generate(t, PROMPTS[0], "ar", max_new_tokens=4, trace=s)
        runs = s.runs().sort_values("run_id")
    assert runs.dtype.tolist() == ["bfloat16"] * 3
    assert runs.logits_dtype.tolist() == ["bfloat16", "float32", "float32"]
    assert runs.exact.tolist() == [False, False, True]
    assert runs.cpu.str.contains(precision.cpu_info()[0], regex=False).all()


def test_equality_groups_in_the_metrics(tmp_path):
    """equal / near-tie / bug per method, from the trace (the bench's and `speclab stats`' columns)."""
    from speclab.equality import Divergence
    from speclab.metrics import run_summary
    with TraceStore(tmp_path / "t.duckdb") as s:
        def run(method, prompt, h):
            rid = s.start_run(method=method, bench_id="b", prompt_id=prompt)
            s.finish_run(rid, "done", output_hash=h, new_tokens=4, elapsed_s=1.0)
            return rid
        for p in "abcd":
            run("ar", p, p)
        run("x", "a", "a")
        run("x", "b", "b")
        s.record_divergence(run("x", "c", "z"), Divergence(3, 1, 2, 0.01, 0.1))
        s.record_divergence(run("x", "d", "y"), Divergence(2, 1, 2, 0.5, 0.1))
        s.start_run(method="x", prompt_id="e")  # no bench: not compared
        df = run_summary(s, by="method").set_index("method")
    assert df.loc["x", "equal_to_ar"] == 0.5 and df.loc["x", "near_tie"] == 0.25 and df.loc["x", "bug"] == 0.25
    assert df.loc["ar", "equal_to_ar"] == 1.0


def test_cli_refuses_bad_precision_options_in_one_line(model_dir, capsys):
    from speclab.cli import main
    for argv, says in [(["--dtype", "bf17"], "--dtype 'bf17' is not a dtype"),
                       (["--logits", "half"], "--logits 'half'"),
                       (["--exact", "--backend", "hf"], "--exact needs speclab's lean forward")]:
        rc = main(["generate", "--model", str(model_dir["qwen3"]), "--prompt", "hi", "--db", "none", *argv])
        err = capsys.readouterr().err
        lines = error_lines(err)
        assert rc == 2 and len(lines) == 1 and says in lines[0] and "loading" not in err, err
