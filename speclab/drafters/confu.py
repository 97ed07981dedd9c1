"""ConFu: EAGLE-3 with a "future" token from contemplate rows on the frozen target (../shared/papers/confu.txt).

The target side (speclab.drafters.contemplate) stays frozen: `s` learned soft-prompt keys and values per target layer,
seen only by contemplate rows, and a contemplate row after the token t whose drafter pair is the newest (the token
before the round's root). Its input embedding [con] comes from an MoE over the target's features of t, its
final-norm hidden state is the future vector f_t. The drafter is EAGLE-3's, with one more key/value slot per round
built from f_t: its "token embedding" is [f] (an MoE over the drafter's own projected feature of t, fc(h_t)) and
its "hidden" is f_t, in EAGLE-3's row layout cat(input_layernorm(emb), hidden_norm(h)). The slot sits at position
t + 1, after the committed pairs; the root row of the draft and every draft node see it, and `commit` drops it
with the nodes. Everything else (trees, catch-up, verification) is EAGLE-3's.

    MoE (ExpertMix): gates = softmax(router(x)); the top-k experts (learned embeddings), weighted by their gates
    renormalised over the top k.

Choices the paper leaves open (its section 3 gives no numbers; each is a field of the checkpoint's `confu` config):
the number of experts and k, where f enters the drafter (the slot above), f after the target's final norm, the
soft prompts as post-RoPE keys and values in every layer, and the contemplate row computed after verification, per
round, for the last committed pair (one extra one-row target call: `schedule` "after").

Checkpoint: EAGLE-3's public layout (config.json with `eagle_config`, plus a `confu` section) and its tensors,
plus `confu.soft_k`, `confu.soft_v` [target layers, kv heads, s, head dim], `confu.con.*` and `confu.future.*`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn

from speclab.core.layers import Linear
from speclab.core.protocol import ExtraRows, RoundView
from speclab.drafters import eagle3
from speclab.drafters.checkpoint import load_strict, place, read_checkpoint
from speclab.drafters.contemplate import contemplate, last_token_rows
from speclab.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Model, _check_against
from speclab.drafters.flashhead import HEAD_PARAMS, head_same_decode, with_head
from speclab.drafters.registry import SAMPLING_PARAMS, CostBench, DrafterEntry, ModelRole, Param, Shape, TrainEntry
from speclab.drafters.schedule import pays_params
from speclab.errors import ModelNotFound


@dataclass
class ConFuConfig:
    """The ConFu part of a checkpoint's config.json (its `confu` section)."""
    soft_prompts: int = 16  # s: soft-prompt key/value entries per target layer
    experts: int = 8  # per MoE module (1: a static embedding, the paper's "without MoE")
    expert_topk: int = 2
    target_layers: int = 0  # the soft prompts' shape: the target's layers, kv heads and head dim
    target_kv_heads: int = 0
    target_head_dim: int = 0

    @classmethod
    def for_target(cls, target, **kw) -> ConFuConfig:
        c = target.config
        return cls(target_layers=target.num_layers, target_kv_heads=c.num_key_value_heads,
                   target_head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads, **kw)


class ExpertMix(nn.Module):
    """An MoE of learned embeddings: a linear router over `experts` embeddings of width `d_out`; the output is the
    top-k experts weighted by their softmax gates, renormalised over the k."""

    def __init__(self, d_in: int, d_out: int, experts: int, topk: int):
        super().__init__()
        self.topk = min(topk, experts)
        self.router = Linear(d_in, experts, bias=False)
        self.experts = nn.Parameter(torch.zeros(experts, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x).float(), -1)
        w, idx = gates.topk(self.topk, -1)
        w = (w / w.sum(-1, keepdim=True)).to(self.experts.dtype)
        return (w[..., None] * self.experts[idx]).sum(-2)


class Contemplation(nn.Module):
    """What ConFu adds on the target side: the soft prompts and the MoE that makes the contemplate embedding [con]
    from the target's features (3 layers, concatenated) of the token it follows."""

    def __init__(self, c: ConFuConfig, feature_width: int, d_target: int):
        super().__init__()
        shape = (c.target_layers, c.target_kv_heads, c.soft_prompts, c.target_head_dim)
        self.soft_k = nn.Parameter(torch.zeros(shape))
        self.soft_v = nn.Parameter(torch.zeros(shape))
        self.con = ExpertMix(feature_width, d_target, c.experts, c.expert_topk)


class _ConFuParts(nn.Module):
    def __init__(self, c: ConFuConfig, e: Eagle3Config):
        super().__init__()
        self.contemplation = Contemplation(c, len(e.layer_ids) * e.target_hidden_size, e.target_hidden_size)
        self.future = ExpertMix(e.hidden_size, e.hidden_size, c.experts, c.expert_topk)  # [f] from fc(h_t)


class ConFuModel(Eagle3Model):
    """EAGLE-3's weights (public layout) plus ConFu's under `confu.` (`contemplation` and `future`)."""

    def __init__(self, config: Eagle3Config, confu: ConFuConfig, with_embedding: bool = False):
        super().__init__(config, with_embedding)
        if config.hidden_size != config.target_hidden_size:
            raise ValueError(f"ConFu feeds the target's f ({config.target_hidden_size} wide) into the drafter's "
                             f"hidden slot ({config.hidden_size} wide): they must be equal")
        self.confu_config = confu
        self.confu = _ConFuParts(confu, config)

    def future_row(self, h_t: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding, hidden) of the future slot: [f] = MoE(fc(h_t)) and f itself."""
        return self.confu.future(h_t), f.to(h_t.dtype)

    def save(self, out_dir: str | Path, dtype=torch.bfloat16, extra_files: dict[str, str] | None = None) -> None:
        from speclab.drafters.checkpoint import save_checkpoint
        cfg = self.config.to_dict()
        cfg["confu"] = asdict(self.confu_config)
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]  # the EAGLE-3 part reads as EAGLE-3 elsewhere
        save_checkpoint(self, cfg, out_dir, dtype, extra_files)

    @classmethod
    def from_eagle3(cls, eagle: Eagle3Model, confu: ConFuConfig) -> ConFuModel:
        """A ConFu drafter whose EAGLE-3 part is `eagle` (a copy) and whose ConFu part is zero: soft prompts and
        experts 0, routers uniform (train it: `speclab train confu`)."""
        m = cls(eagle.config, confu, with_embedding=eagle.embed_tokens is not None)
        m.load_state_dict(eagle.state_dict(), strict=False)
        return m.to(eagle.fc.weight.dtype)


def load_confu(path: str | Path, target=None, device=None, dtype=None) -> ConFuModel:
    """A ConFu drafter from its directory; checked against `target` (EAGLE-3's checks, and the soft prompts'
    shape against the target's layers, kv heads and head dim). A missing or unexpected weight is refused by name."""
    p, raw, sd = read_checkpoint(path, "ConFu drafter")
    if not isinstance(raw.get("confu"), dict):
        raise ModelNotFound(f"{p / 'config.json'} has no `confu` section: not a ConFu drafter (an EAGLE-3 one loads "
                            "with --eagle)")
    try:
        cfg = Eagle3Config.from_dict({k: v for k, v in raw.items() if k != "confu"},
                                     target.num_layers if target is not None else None)
        confu = ConFuConfig(**raw["confu"])
        model = ConFuModel(cfg, confu, with_embedding="embed_tokens.weight" in sd)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelNotFound(f"{p / 'config.json'} is not a ConFu config ({type(e).__name__}: {e})") from e
    load_strict(model, sd, p, "ConFu drafter", optional={"d2t", "t2d"})
    if target is not None:
        _check_against(cfg, target, p)
        want = ConFuConfig.for_target(target)
        have = (confu.target_layers, confu.target_kv_heads, confu.target_head_dim)
        if have != (want.target_layers, want.target_kv_heads, want.target_head_dim):
            raise ModelNotFound(f"the ConFu drafter in {p} has soft prompts for {have[0]} layers of {have[1]} kv "
                                f"heads of {have[2]}; the target has {want.target_layers} x {want.target_kv_heads} x "
                                f"{want.target_head_dim}: it was trained for another target")
    return place(model, path, target, device, dtype)


class ConFuDrafter(Eagle3Drafter):
    """EAGLE-3's drafter with the future slot, its f from contemplate rows on the target through the engine's round
    hooks (`speclab.core.protocol.RoundHooks`): wide, its rows ride in the verification call (`extra_rows`) and the
    state after the round's last token is its next f (`after_verify`); after (or where the target cannot carry
    them: the hf forward, exact mode), one contemplate row in a call of its own before its catch-up
    (`before_catch_up`), whenever its f is stale."""
    name = "confu"

    def __init__(self, model: ConFuModel, target, *, schedule: str = "wide", **params):
        super().__init__(model, target, **params)
        self.contemplation = model.confu.contemplation
        self.schedule = schedule  # "wide": f from the verification call; "after": one more target row per round
        self.f: torch.Tensor | None = None  # [1, d]: the future vector for the next catch-up (None: no slot)
        self.f_tokens = -1  # the committed tokens f was computed after (`before_catch_up` refreshes a stale one)

    @property
    def draft_slots(self) -> int:
        return super().draft_slots + 1  # the future slot after the committed pairs

    def reset(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None,
              capacity: int | None = None) -> None:
        super().reset(prompt_ids, prompt_features, capacity)
        self.f, self.f_tokens = None, -1

    def see_future(self, f: torch.Tensor | None, tokens: int) -> None:
        """f [d] of the contemplate row after the first `tokens` committed tokens (None: none)."""
        self.f = None if f is None else f.reshape(1, -1).to(self.device, self.dtype)
        self.f_tokens = tokens

    def _con_input(self, view: RoundView, t: int) -> torch.Tensor:
        """[con] = the MoE over the target's features of token t [1, d]."""
        c = self.contemplation
        feats = view.features(t, t + 1)
        assert feats is not None, "a contemplating drafter reads target layers"
        with torch.inference_mode():
            return c.con(feats.to(c.soft_k.dtype))

    def before_catch_up(self, view: RoundView) -> None:
        """f of the token before the root (its newest pair after the catch-up), unless the last verification gave
        it: one contemplate row after that token over the target's cache, its embedding [con] from the MoE over the
        target's features of the token (`speclab.drafters.contemplate`). A one-token prompt has no such token: no f."""
        if self.f_tokens == view.tokens - 1:
            return
        c, t = self.contemplation, view.tokens - 2
        if t < 0:
            return self.see_future(None, view.tokens - 1)
        pos, visible = last_token_rows(t + 1, view.cache.get_seq_length(), view.target.device)
        f = contemplate(view.target, view.cache, self._con_input(view, t), pos, visible, c.soft_k, c.soft_v)
        self.see_future(f, view.tokens - 1)

    def extra_rows(self, view: RoundView) -> ExtraRows | None:
        """Wide (where the target can carry them): one contemplate row after each verification row, its embedding
        [con] the MoE over the target's features of the newest token that has them (the last accepted one before
        the round), with the soft prompts. None before any token has features (a one-token prompt's first round)."""
        if self.schedule != "wide" or not view.rows_ride or view.featured == 0:
            return None
        c = self.contemplation
        return ExtraRows(self._con_input(view, view.featured - 1), c.soft_k, c.soft_v)

    def after_verify(self, state: torch.Tensor, tokens: int) -> None:
        """Wide: the contemplate row after the round's last accepted node (the root when none) is the next f."""
        self.see_future(state, tokens)

    def _prefill(self, m: int) -> None:
        if self.f is None:  # no future yet (a one-token prompt): EAGLE-3's catch-up
            return super()._prefill(m)
        emb, h = self._embed(self.pending_ids), self.m.fc(self.pending_feats.to(self.dtype))
        self.pending_ids, self.pending_feats = self.pending_ids[:0], self.pending_feats[:0]
        start, end = self.known, self.known + m
        f_emb, f_h = self.m.future_row(h[-1:], self.f)
        cos, sin = self._rope(torch.arange(start, end + 1, device=self.device))  # the slot at position end
        rows = slice(m - 1, m) if self.kv_only else slice(0, m)
        q, k, v = self.m.qkv(torch.cat([emb, f_emb]), torch.cat([h, f_h]), cos, sin, q_rows=rows)
        mask = None
        if not self.kv_only:  # every row causal over the backlog; the slot only for the last (the draft's root)
            mask = torch.ones(m, end + 1, dtype=torch.bool, device=self.device).tril(start)
            mask[:, end] = False
            mask[-1, end] = True
        out = self._attend(q, k, v, start, mask)
        if self.kv_only:
            h = h[-1:]
        h = self.m.finish(h, out)
        logits = self._logits(h)
        self.known = end  # the slot (at `end`) is dropped with the draft nodes at commit
        self.root_h, self.root_logits = h[-1:], logits[-1:]
        self.root_cands = self._cands()[-1:] if self.flash is not None else None


# the tree shapes are EAGLE-3's (the same CPU defaults and GPU presets), so ConFu and EAGLE-3 compare shape for shape
PARAMS = (Param("schedule", "wide", choices=("wide", "after"),
                help="the contemplate rows: in the verification call (wide; lean forward) or one row after it"),)

# the shapes the conformance suite checks for this drafter (tests/test_conformance.py: greedy equals AR, sampling
# keeps the target's distribution, catch-up, reset), each with the random model `ModelRole.random` builds
SHAPES = (Shape("chain", dict(depth=4, tree_topk=1, total_tokens=4)),
          Shape("tree", dict(depth=4, tree_topk=3, total_tokens=10)),
          Shape("tree-narrow", dict(depth=3, tree_topk=2, total_tokens=6)),
          Shape("after-chain", dict(depth=4, tree_topk=1, total_tokens=4, schedule="after")),
          Shape("after-tree", dict(depth=4, tree_topk=3, total_tokens=10, schedule="after")),
          Shape("reduced-vocab", dict(depth=3, tree_topk=2, total_tokens=6), dict(draft_vocab="half")),
          Shape("reduced-vocab-after", dict(depth=4, tree_topk=3, total_tokens=10, schedule="after"),
                dict(draft_vocab="half")))

# stand down where drafting does not pay (`speclab.drafters.schedule.PaysRouter`), measured by `speclab grid` at T >
# 0: 0.69x AR at T = 1 without it, 0.80x with 4, zoo, AMD EPYC, 2026-12-02
PAYS = pays_params(4.0, probe=128)

ENTRY = DrafterEntry(
    name="confu", label="ConFu", color="#c5b0d5", hooks=True,
    train=TrainEntry("speclab.train.confu", "ConFuTrainConfig", "train_confu", "ConFu online from the frozen "
                     "target, from a trained EAGLE-3", init_from="EAGLE-3 or ConFu drafter",
                     needs_init="train confu starts from a trained EAGLE-3 drafter (the paper's start): give "
                     "--init-from (e.g. data/zoo/eagle3), or a ConFu run's OUT/model to resume",
                     check_resume="check_resume"),
    costs=(CostBench("contemplate", "contemplate_costs", "what ConFu's contemplate rows add to a verification "
                     "(plain, wide, after)", "nodes", "--nodes", "1,2,4,8,16", 1, "nodes",
                     ("plain_ms", "wide_ms", "after_ms"), "verification",
                     "ConFu: what the contemplate rows add to a verification (plain, wide, after)",
                     "ms per verification of the root and n chain nodes after a {context}-token context (lower is "
                     "better)", "draft nodes"),),
    params=eagle3.PARAMS + SAMPLING_PARAMS + PARAMS + PAYS + HEAD_PARAMS, check=eagle3._check,
    same_decode=head_same_decode(eagle3._same_decode),
    build=with_head(lambda target, model, **params: ConFuDrafter(model, target, **params), "confu",
                    lambda model, target: model.lm_head.weight),
    methods={"confu": "ConFu: EAGLE-3 plus a future token from a contemplate row on the frozen target (soft "
                      "prompts, MoE); EAGLE-3's trees"},
    model=ModelRole("confu", "--confu", "ConFu", "a ConFu drafter",
                    lambda path, target, paths: load_confu(path, target), zoo="confu", card="data/zoo/confu/README.md",
                    help="ConFu drafter directory for confu (EAGLE-3 layout plus `confu`; default: the zoo's)",
                    random=lambda target, seed, **kw: random_confu(target, seed, **kw),
                    call=eagle3.row_call),  # its drafter's calls are EAGLE-3's (its contemplate rows ride in the
    # target's verification: `speclab costs contemplate`)
    shapes=SHAPES)


# ---- random drafters: `ModelRole.random` (the conformance suite's and the smoke tests' models, no files) ------------

def random_confu(target, seed: int, draft_vocab: int | str | None = None, soft_prompts: int = 4,
                 experts: int = 3) -> ConFuModel:
    """A random ConFu drafter for `target` (seeded): a random EAGLE-3 part (`eagle3.random_eagle3`, `draft_vocab`
    as there) and random soft prompts and MoEs at scales that move f; frozen, in its dtype and on its device."""
    m = ConFuModel.from_eagle3(eagle3.random_eagle3(target, seed, draft_vocab),
                               ConFuConfig.for_target(target, soft_prompts=soft_prompts, experts=experts))
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for p in m.confu.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
