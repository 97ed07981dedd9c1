"""bf16 where the CPU computes it natively: the dtype choice, logits in fp32, exact (batch-invariant) mode, and
bf16 greedy decoding that equals AR or differs only at a numerical near-tie (never a bug)."""

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


# ---- the dtype choice ---------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_choice():
    precision.auto_choice.cache_clear()
    yield
    precision.auto_choice.cache_clear()


def test_auto_dtype_without_native_bf16_is_fp32(monkeypatch, fresh_choice):
    monkeypatch.setattr(precision, "cpu_info", lambda: ("Some CPU", ()))
    monkeypatch.setattr(precision, "measure_bf16", lambda: pytest.fail("no measurement without the capability"))
    c = precision.auto_choice("cpu")
    assert c.dtype == torch.float32 and "no native bf16" in c.reason and "no native bf16" in c.cpu
    assert precision.pick_dtype(torch.device("cpu"), "auto") == torch.float32
    assert precision.pick_dtype(torch.device("cpu"), None) == torch.float32


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_dtype_with_native_bf16_is_confirmed_by_a_measurement(monkeypatch, fresh_choice, flag):
    monkeypatch.setattr(precision, "cpu_info", lambda: ("AMD EPYC", (flag,)))
    monkeypatch.setattr(precision, "measure_bf16", lambda: (0.19, 0.07))  # fp32 ms, bf16 ms
    c = precision.auto_choice("cpu")
    assert c.dtype == torch.bfloat16 and flag in c.reason and flag in c.cpu
    precision.auto_choice.cache_clear()
    monkeypatch.setattr(precision, "measure_bf16", lambda: (0.05, 0.08))  # the flag, but bf16 measured slower
    c = precision.auto_choice("cpu")
    assert c.dtype == torch.float32 and "slower" in c.reason


def test_auto_dtype_on_cuda_is_bf16_and_names_are_checked(monkeypatch, fresh_choice):
    monkeypatch.setattr(precision, "measure_bf16", lambda: pytest.fail("no CPU measurement for CUDA"))
    assert precision.auto_choice("cuda").dtype == torch.bfloat16
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
    # the fast bf16 forward is not invariant (its fused attention differs for 1 and n rows): exact mode is needed
    fast = zoo_bf16["fp32"]
    c1, c8 = fast.new_cache(), fast.new_cache()
    fast.forward(ids[:40], c1)
    fast.forward(ids[:40], c8)
    a = torch.cat([fast.forward(ids[j : j + 1], c1).logits for j in range(40, 48)])
    assert not torch.equal(a, fast.forward(ids[40:48], c8).logits)


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
