"""Drafters v2: the regenerated training data (`speclab data regenerate`), the trainers' new settings (top-k loss,
a smaller EAGLE-3 head, bf16 autocast) and the checkpoint curve, on a tiny target and a small slice of the corpus."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import assert_one_error_line, random_eagle3
from speclab.train.corpus import DOMAINS
from speclab.train.regenerate import RegenConfig, load_token_data, regenerate
from speclab.zoo import REPO_ROOT


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first 20 kB of every split of the zoo corpus."""
    out = tmp_path_factory.mktemp("corpus")
    for d in DOMAINS:
        for split in ("train", "val"):
            text = (REPO_ROOT / "data" / "corpus" / f"{d}.{split}.txt").read_text(encoding="utf-8")
            (out / f"{d}.{split}.txt").write_text(text[:20_000], encoding="utf-8")
    return out


def _cfg(deep, corpus, out, **kw) -> RegenConfig:
    base = dict(target_dir=deep.name, corpus_dir=str(corpus), out_dir=str(out), mode="mix", train_sequences=6,
                val_sequences=2, prompt_len=12, new_tokens=10, batch=4, dtype="fp32", seed=3)
    return RegenConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def regenerated(deep, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("regen") / "mix"
    regenerate(_cfg(deep, corpus, out), log=lambda s: None)
    return out


def test_regenerated_rows_are_the_targets_own_continuations(deep, regenerated):
    """Every greedy row is exactly speclab's AR decode of its prompt (fp32); the sampled rows are the other half
    (mix alternates), start with their prompt and differ from the greedy continuation somewhere."""
    from speclab.generate import generate

    prov = json.loads((regenerated / "provenance.json").read_text())
    assert prov["counts"]["code.train"] == {"sequences": 6, "sampled": 3, "openings": prov["counts"]["code.train"]
                                            ["openings"]}
    assert prov["settings"]["prompt_len"] == 12 and prov["new_tokens"] == 4 * (6 + 2) * 10
    assert not (regenerated / "shards").exists()
    differs = 0
    for d in DOMAINS:
        z = np.load(regenerated / f"{d}.train.npz")
        assert z["ids"].shape == (6, 22) and z["ids"].dtype == np.uint16
        assert z["sampled"].tolist() == [False, True, False, True, False, True]
        for row, sampled in zip(z["ids"].astype(np.int64), z["sampled"]):
            ar = generate(deep, torch.from_numpy(row[:12]), "ar", max_new_tokens=10).token_ids
            if sampled:
                differs += ar != row[12:].tolist()
            else:
                assert ar == row[12:].tolist()
    assert differs >= 6  # sampling at temperature 1 from a random tiny target parts from greedy nearly always


def test_prompts_come_from_their_split_with_their_offsets(deep, corpus, regenerated):
    from speclab.train.corpus import tokenize_corpus

    data = tokenize_corpus(corpus, deep.tokenizer, corpus / ".tokens")
    for d in DOMAINS:
        for split in ("train", "val"):
            z = np.load(regenerated / f"{d}.{split}.npz")
            for row, off, opening in zip(z["ids"], z["offset"], z["opening"]):
                assert (row[:12] == data[d][split][off : off + 12]).all()
                assert not opening or off == 0 or data[d][split][off - 1] == 0  # a document opening follows an EOS


def test_an_interrupted_regeneration_resumes_to_the_same_data(deep, corpus, regenerated, tmp_path, monkeypatch):
    """Killed after two shards, then run again with the same settings: the same files, sampled rows included;
    other settings on the same folder are refused before any work."""
    import speclab.train.regenerate as rg

    out = tmp_path / "mix"
    real, calls = rg._save_npz, []

    def dying_save(path, **arrays):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(path, **arrays)
    monkeypatch.setattr(rg, "_save_npz", dying_save)
    with pytest.raises(KeyboardInterrupt):
        regenerate(_cfg(deep, corpus, out), log=lambda s: None)
    assert len(list((out / "shards").glob("*.npz"))) == 2 and not list((out / "shards").glob("*.tmp*"))
    monkeypatch.setattr(rg, "_save_npz", real)
    regenerate(_cfg(deep, corpus, out), log=lambda s: None)
    for d in DOMAINS:
        a, b = np.load(regenerated / f"{d}.train.npz"), np.load(out / f"{d}.train.npz")
        assert all((a[k] == b[k]).all() for k in ("ids", "offset", "opening", "sampled"))
    with pytest.raises(ValueError, match="other settings"):
        regenerate(_cfg(deep, corpus, out, seed=4), log=lambda s: None)


def test_the_command_regenerates_and_reports(deep, corpus, tmp_path, capsys):
    from speclab.cli import main

    out = tmp_path / "g"
    argv = ["data", "regenerate", "--target", deep.name, "--corpus", str(corpus), "--out", str(out), "--mode",
            "greedy", "--train-sequences", "2", "--val-sequences", "1", "--prompt-len", "8", "--new-tokens", "4",
            "--dtype", "fp32"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sampling"] == "argmax" and report["new_tokens"] == 4 * 3 * 4 and report["dtype"] == "float32"
    stamp = (out / "code.train.npz").stat().st_mtime_ns
    assert main(argv) == 0  # run again: complete, so nothing is generated or rewritten
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 48
    assert (out / "code.train.npz").stat().st_mtime_ns == stamp


def test_token_data_joins_rows_by_eos_and_folders_by_domain(deep, corpus, regenerated):
    one = load_token_data(str(regenerated), deep.tokenizer)
    z = np.load(regenerated / "math.train.npz")["ids"]
    assert one["math"]["train"].tolist() == np.concatenate([z, np.zeros((6, 1), z.dtype)], 1).reshape(-1).tolist()
    both = load_token_data(f"{regenerated},{corpus}", deep.tokenizer)
    text = load_token_data(str(corpus), deep.tokenizer)
    for d in DOMAINS:
        assert len(both[d]["val"]) == len(one[d]["val"]) + len(text[d]["val"])


@pytest.mark.cpu_only
def test_topk_loss_equals_the_full_loss_when_k_is_the_vocabulary(deep):
    """The top-k loss over all tokens is the full soft cross-entropy (and its accuracy and tau are the same);
    with a reduced head the top-k form drops the tokens outside the head as the full form does."""
    from speclab.train.eagle3 import target_features, ttt_forward, ttt_loss

    m = random_eagle3(deep, seed=0)
    ids = torch.randint(3, deep.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    embed = deep.model.get_input_embeddings()
    feats, full = target_features(deep.model, ids, m.config.layer_ids)
    _, top = target_features(deep.model, ids, m.config.layer_ids, topk=deep.vocab_size)
    logits = ttt_forward(m, embed, ids, feats, 3)
    a, b = ttt_loss(logits, full, m, 0.8), ttt_loss(logits, top, m, 0.8)
    assert torch.allclose(a[0], b[0], rtol=1e-4) and a[2] == b[2] and a[3] == b[3]
    assert len(a[4]) == 3 and all(0 < x <= 1 for x in a[4]) and b[4] == []  # sum min(p, q) needs full p
    small = random_eagle3(deep, seed=0, draft_vocab=deep.vocab_size // 4)
    logits = ttt_forward(small, embed, ids, feats, 2)
    a, b = ttt_loss(logits, full, small, 0.8), ttt_loss(logits, top, small, 0.8)
    assert torch.allclose(a[0], b[0], rtol=1e-4) and a[2] == b[2]
    # the acceptance term (DSpark's L_tv): the same in both forms, and per step 1 - sum min(p, q), the alpha above
    c, d = ttt_loss(logits, full, small, 0.8, tv=0.5), ttt_loss(logits, top, small, 0.8, tv=0.5)
    assert torch.allclose(c[0], d[0], rtol=1e-4)
    by_step = [lc - la for lc, la in zip(c[1], a[1])]
    assert by_step == pytest.approx([0.5 * (1 - alpha) for alpha in a[4]], rel=1e-4)


@pytest.mark.cpu_only
def test_dflash_acceptance_term_is_one_minus_sum_min_p_q_per_block_row(deep):
    """DFlash's --loss-tv adds tv x (1 - sum min(p, q)) per block row under the rows' weights, on each readout (base
    and Markov); the per-row acceptance it reports is that same sum, in (0, 1], and the term carries a gradient."""
    from speclab.drafters.dflash import DFlashModel, config_for
    from speclab.train.dflash import block_forward, block_loss, pick_blocks, target_features

    torch.manual_seed(0)
    m = DFlashModel(config_for(deep, markov_rank=8))
    ids = torch.randint(3, deep.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    embed_w, head_w = deep.model.get_input_embeddings().weight, deep.model.get_output_embeddings().weight
    feats, top = target_features(deep.model, ids, m.config.target_layer_ids)
    size = 5
    anchors = pick_blocks(ids.shape[1], size, 16, np.random.default_rng(0))
    logits = block_forward(m, embed_w, head_w, ids, feats, anchors, size)
    a, ma = block_loss(m, logits, ids, top, anchors, 4.0)
    c, _ = block_loss(m, logits, ids, top, anchors, 4.0, tv=0.5)
    w = torch.exp(-torch.arange(size - 1).float() / 4.0)
    expect = sum(0.5 * float(((1 - torch.tensor(r["alpha"])) * w).sum() / w.sum()) for r in ma.values())
    assert set(ma) == {"base", "markov"} and float(c - a) == pytest.approx(expect, rel=1e-4)
    assert all(0 < x <= 1 for r in ma.values() for x in r["alpha"]) and all(r["tau_sampled"] >= 1 for r in ma.values())
    m.zero_grad()
    (c - a).backward()
    assert m.fc.weight.grad is not None and m.fc.weight.grad.abs().sum() > 0


@pytest.mark.cpu_only
def test_dflash_full_distribution_loss_is_the_top_k_loss_over_every_token(deep):
    """`--loss-topk 0`: DFlash's loss against the target's full distribution equals the top-k form with k the whole
    vocabulary (loss, accuracy, acceptance, with and without the acceptance term), and its acceptance is the exact
    sum min(p, q), at least the top-32 lower bound."""
    from speclab.drafters.dflash import DFlashModel, config_for
    from speclab.train.dflash import block_forward, block_loss, pick_blocks, target_features

    torch.manual_seed(0)
    m = DFlashModel(config_for(deep, markov_rank=8))
    ids = torch.randint(3, deep.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    embed_w, head_w = deep.model.get_input_embeddings().weight, deep.model.get_output_embeddings().weight
    feats, full = target_features(deep.model, ids, m.config.target_layer_ids, top=0)
    _, every = target_features(deep.model, ids, m.config.target_layer_ids, top=deep.vocab_size)
    _, top32 = target_features(deep.model, ids, m.config.target_layer_ids)
    assert full[1] is None and full[0].shape == (*ids.shape, deep.vocab_size)
    anchors = pick_blocks(ids.shape[1], 6, 16, np.random.default_rng(1))
    logits = block_forward(m, embed_w, head_w, ids, feats, anchors, 6)
    for tv in (0.0, 0.5):
        (a, ma), (b, mb) = block_loss(m, logits, ids, full, anchors, 4.0, tv), block_loss(m, logits, ids, every,
                                                                                          anchors, 4.0, tv)
        assert float(a) == pytest.approx(float(b), rel=1e-4)
        for r in ma:
            assert ma[r]["acc"] == mb[r]["acc"] and ma[r]["alpha"] == pytest.approx(mb[r]["alpha"], rel=1e-4)
    _, m32 = block_loss(m, logits, ids, top32, anchors, 4.0)
    assert all(x >= y - 1e-6 for r in ma for x, y in zip(ma[r]["alpha"], m32[r]["alpha"]))


def test_topk_loss_keeps_a_bucket_for_the_rest():
    """The top-k loss is the cross-entropy against the top tokens plus one bucket for the rest of the mass, so its
    minimum puts exactly the target's rest mass on the drafter's other tokens (renormalising the top tokens would
    push that mass to zero)."""
    from speclab.train.lm import top_tokens, topk_soft_ce

    g = torch.Generator().manual_seed(0)
    target, lg = torch.randn(3, 50, generator=g) * 2, torch.randn(3, 50, generator=g)
    p, idx = top_tokens(target, 5)
    q = torch.softmax(lg, -1)
    q_top = q.gather(-1, idx)
    by_hand = -(p * q_top.log()).sum(-1) - (1 - p.sum(-1)) * (1 - q_top.sum(-1)).log()
    assert torch.allclose(topk_soft_ce(lg, p, idx), by_hand, atol=1e-5)
    x = torch.zeros(3, 50, requires_grad=True)  # gradient descent on the logits: the rest gets the rest mass
    opt = torch.optim.Adam([x], lr=0.1)
    for _ in range(500):
        opt.zero_grad()
        topk_soft_ce(x, p, idx).sum().backward()
        opt.step()
    q = torch.softmax(x.detach(), -1)
    assert torch.allclose(q.gather(-1, idx), p, atol=1e-3)
    assert torch.allclose(1 - q.gather(-1, idx).sum(-1), 1 - p.sum(-1), atol=1e-3)


@pytest.mark.cpu_only
def test_a_shrunk_head_keeps_the_kept_tokens_logits(deep):
    from speclab.train.eagle3 import shrink_vocab

    m = random_eagle3(deep, seed=1)
    keep = torch.arange(5, deep.vocab_size, 7)
    small = shrink_vocab(m, keep)
    assert torch.equal(small.lm_head.weight, m.lm_head.weight[keep])  # so its logits are the kept ones
    assert (torch.arange(keep.numel()) + small.d2t).tolist() == keep.tolist() and int(small.t2d.sum()) == keep.numel()
    with pytest.raises(ValueError, match="inside"):
        shrink_vocab(small, torch.arange(0, 10))


def test_implied_tau_is_one_plus_the_leading_acceptances():
    """The one definition every training's validation uses (speclab.metrics.implied_tau), on known numbers."""
    from speclab.metrics import implied_tau

    m = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]]).float()  # leading matches 2, 0, 4
    assert implied_tau(m) == 1 + (2 + 0 + 4) / 3
    assert implied_tau(m.numpy()) == implied_tau(m)  # numpy alike
    assert implied_tau(m[None].expand(2, -1, -1)) == implied_tau(m)  # any leading dims: rows
    assert implied_tau(m, torch.tensor([True, False, True])) == 1 + (2 + 4) / 2  # only the rows asked for
    assert implied_tau(torch.zeros(5, 3)) == 1.0 and implied_tau(torch.ones(5, 3)) == 4.0
    # sampled: per-step acceptance probabilities, independent steps: 1 + a1 + a1 a2 + ...
    assert implied_tau([0.5, 0.5, 1.0]) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    assert math.isnan(implied_tau([])) and math.isnan(implied_tau(torch.zeros(4, 0)))  # nothing measured


@pytest.mark.slow
def test_training_on_regenerated_data_in_bf16_keeps_checkpoints_and_curve(deep, regenerated, tmp_path):
    """`speclab train eagle3` on regenerated data, bf16 autocast, top-k loss, a smaller head: it runs, validates
    (greedy and sampled implied tau), keeps a checkpoint per validation, and `train curve` decodes each one."""
    from speclab.cli import main
    from speclab.drafters.eagle3 import load_eagle3
    from speclab.train.curve import checkpoints, curve_markdown, decode_tau, measure_curve
    from speclab.train.eagle3 import Eagle3TrainConfig, train_eagle3

    cfg = Eagle3TrainConfig(target_dir=deep.name, corpus_dir=str(regenerated), out_dir=str(tmp_path / "run"),
                            max_minutes=10, max_tokens=64, seq_len=16, batch_size=2, eval_windows=1,
                            eval_every_s=0, precision="bf16", loss_topk=8, draft_vocab_size=64, ttt_steps=2)
    torch.set_num_threads(1)  # the caller's; the training runs on cfg.threads (2) and hands the caller's back
    summary = train_eagle3(cfg, log=lambda s: None)
    assert torch.get_num_threads() == 1
    assert summary["steps"] > 0 and set(summary["val"]) == set(DOMAINS)
    assert all(v["tau"] >= 1 and v["tau_sampled"] >= 1 for v in summary["val"].values())
    cps = checkpoints(tmp_path / "run")
    final = json.loads((tmp_path / "run" / "model" / "train_config.json").read_text())["tokens"]
    # two steps of 32 tokens (a budget of tokens, not of seconds: a busy machine once made only one step in 3 s),
    # each validated: a snapshot each, and the final model is the last one's weights, listed once
    assert [t for t, _ in cps] == [32, 64] == [32, final] and cps[-1][1].name in ("model", f"{final:012d}")
    m = load_eagle3(cps[-1][1], deep)
    assert m.config.draft_vocab_size == 64
    prompts = [{"prompt_id": "p", "category": "code", "prompt": "def f(x):"}]
    records = measure_curve(tmp_path / "run", "eagle3", deep, lambda p, t: load_eagle3(p, t), prompts,
                            new_tokens=8, log=lambda s: None)
    assert [r["tokens"] for r in records] == [t for t, _ in cps]
    direct = decode_tau(deep, "eagle3", m.float(), prompts, 8, 0.0)
    assert records[-1]["tau"]["0.0"]["all"] == pytest.approx(direct["all"])
    assert "T=1.0 all" in curve_markdown(records)
    assert main(["train", "curve", "--out", str(tmp_path / "nothing"), "--drafter", "eagle3"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("s", [0, 2], ids=["no-soft-prompts", "s2"])
def test_confu_training_on_regenerated_data_stops_at_its_token_budget_and_resumes(deep, regenerated, tmp_path, s,
                                                                                  capsys):
    """`speclab train confu` from an EAGLE-3 drafter, with s soft prompts (0 included): it stops at --max-tokens
    with its progress counted in tokens, validates, saves a ConFu checkpoint that decodes greedy as AR, and
    `--init-from` that checkpoint resumes it (its ConFu shape kept)."""
    from speclab.core.engine import decode
    from speclab.drafters.confu import ConFuDrafter, load_confu
    from speclab.train.confu import ConFuTrainConfig, train_confu

    random_eagle3(deep, 0).save(tmp_path / "eagle3", dtype=torch.float32)
    base = dict(target_dir=deep.name, corpus_dir=str(regenerated), max_minutes=5.0, seq_len=16, batch_size=2,
                eval_windows=1, eval_every_s=600, max_tokens=96, soft_prompts=s, experts=2, replicate=1,
                loss_topk=8, ttt_steps=2)
    first = train_confu(ConFuTrainConfig(out_dir=str(tmp_path / "run"), init_from=str(tmp_path / "eagle3"), **base),
                        log=lambda line: None)
    assert first["steps"] == 3 and first["tokens"] == 96 and set(first["val"]) == set(DOMAINS)
    assert "train confu (tokens) 96/96" in capsys.readouterr().err
    m = load_confu(tmp_path / "run" / "model", deep)
    assert m.confu_config.soft_prompts == s and m.confu.contemplation.soft_k.shape[2] == s
    ids = deep.tokenizer("def f(x):", return_tensors="pt")["input_ids"][0]
    ar = decode(deep, ids, max_new_tokens=16)
    res = decode(deep, ids, {"confu": ConFuDrafter(m.float(), deep, depth=3, tree_topk=2, total_tokens=6)},
                 max_new_tokens=16)
    assert torch.equal(res.new_ids, ar.new_ids)
    again = train_confu(ConFuTrainConfig(out_dir=str(tmp_path / "resumed"), init_from=str(tmp_path / "run" / "model"),
                                         **{**base, "soft_prompts": 16}), log=lambda line: None)
    assert again["tokens"] == 96 and load_confu(tmp_path / "resumed" / "model", deep).confu_config.soft_prompts == s


@pytest.mark.parametrize("argv,says", [
    (["data", "regenerate", "--out", "X", "--prompt-len", "1000", "--new-tokens", "100"],
     "exceed the target's context"),
    (["data", "regenerate", "--out", "X", "--mode", "beam"], "invalid choice: 'beam'"),
    (["data", "regenerate", "--out", "X", "--batch", "0"], "argument --batch"),
    (["data", "regenerate", "--out", "X", "--corpus", "/nonexistent"], "lacks code.train.txt"),
    (["train", "target", "--out", "X", "--minutes", "1", "--corpus", "REGEN"], "is regenerated data"),
    (["train", "eagle3", "--out", "X", "--loss-topk", "-1"], "argument --loss-topk"),
    (["train", "curve", "--out", "X"], "needs --drafter"),
])
def test_bad_input_is_one_line(argv, says, regenerated, tmp_path, capsys):
    argv = [str(regenerated) if a == "REGEN" else str(tmp_path / "out") if a == "X" else a for a in argv]
    assert_one_error_line(argv, says, capsys)
    assert not (tmp_path / "out").exists()
