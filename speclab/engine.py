"""The decode loop: route, catch up, draft, verify (one target forward), commit, record.

Read `decode` top to bottom: it is the whole algorithm. AR decoding is the same loop with an empty draft.
With `deferred` (the default) the target's bonus token is not forwarded on its own: it leads the next
round's verification batch (one target call per round). Without it, the bonus token is forwarded alone at
the end of the round so the next root distribution is known before drafting (two calls per round).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from speclab.drafters.base import Drafter
from speclab.errors import InvalidInput
from speclab.sampling import Sampling
from speclab.target import Target, keep_cache
from speclab.tree import DraftTree, tree_attention_mask, tree_position_ids
from speclab.verify import verify

PHASES = ("route", "catchup", "draft", "verify", "commit")


@dataclass
class RoundEvent:
    """Everything one round did; the trace writer and every live view consume this."""
    round: int
    drafter: str | None
    tree: DraftTree
    accepted: torch.Tensor  # node indices of the accepted path
    committed: torch.Tensor  # token ids committed this round (accepted drafts, then the target's token)
    node_target_probs: torch.Tensor  # [n] target prob of each node's token at its parent (softmax, T=1)
    root_entropy: float  # target entropy at the root of this round
    # per committed token (same length as `committed`):
    depth: torch.Tensor  # draft depth; the target's own token gets n_accepted + 1
    draft_prob: torch.Tensor  # the drafter's prob of the token (NaN for the target's token or no-prob drafters)
    target_prob: torch.Tensor  # the target's prob of the token where it was verified / sampled
    entropy: torch.Tensor  # the target's entropy at that position
    timings_ms: dict[str, float]
    target_calls: int
    backlog: int
    pos0: int  # index (in generated tokens) of the first token committed this round
    decision: dict | None = None

    @property
    def n_accepted(self) -> int:
        return min(self.accepted.numel(), self.committed.numel())


def round_event(rnd, name, tree, accepted, new, logits, bonus, timings, calls, backlog, pos0, decision) -> RoundEvent:
    """Per-node and per-token probabilities for the listeners: a few tensor ops per round, no per-token Python."""
    logp = torch.log_softmax(logits.float(), -1)
    probs = logp.exp()
    ent = -(probs * logp).sum(-1)  # [n + 1]
    rows = tree.parents + 1
    node_tp = probs[rows, tree.tokens]
    bonus_row = accepted[-1:] + 1 if accepted.numel() else accepted.new_zeros(1)
    m = new.numel()
    nan = torch.full((1,), float("nan"), device=logits.device)
    return RoundEvent(
        rnd, name, tree, accepted, new, node_tp, float(ent[0]),
        depth=torch.cat([tree.depth[accepted], tree.depth.new_full((1,), accepted.numel() + 1)])[:m].cpu(),
        draft_prob=torch.cat([tree.draft_probs[accepted].float(), nan])[:m].cpu(),
        target_prob=torch.cat([node_tp[accepted], probs[bonus_row, bonus]])[:m].cpu(),
        entropy=torch.cat([ent[rows[accepted]], ent[bonus_row]])[:m].cpu(),
        timings_ms=timings, target_calls=calls, backlog=backlog, pos0=pos0, decision=decision)


@dataclass
class DecodeResult:
    prompt_ids: torch.Tensor
    new_ids: torch.Tensor
    rounds: int
    target_calls: int
    elapsed_s: float
    stopped: str  # "eos" | "max_new_tokens"
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.new_ids.numel() / self.elapsed_s if self.elapsed_s > 0 else 0.0


class FixedRouter:
    """Always the same drafter (or none, for AR)."""
    policy = "fixed"

    def __init__(self, name: str | None):
        self.name = name

    def choose(self, signals: dict) -> tuple[str | None, dict | None]:
        return self.name, None


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def check_request(target: Target, prompt_ids: torch.Tensor, max_new_tokens: int) -> None:
    if prompt_ids.numel() == 0:
        raise InvalidInput("the prompt is empty (it tokenizes to no tokens)")
    if max_new_tokens < 1:
        raise InvalidInput(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
    if prompt_ids.numel() + max_new_tokens > target.max_context:
        raise InvalidInput(
            f"prompt has {prompt_ids.numel()} tokens; with max_new_tokens={max_new_tokens} that exceeds the "
            f"model's context of {target.max_context} tokens")


def decode(target: Target, prompt_ids: torch.Tensor, drafters: dict[str, Drafter] | None = None, router=None,
           max_new_tokens: int = 128, sampling: Sampling | None = None, deferred: bool = True,
           stop_on_eos: bool = True, listeners: tuple[Callable[[RoundEvent], None], ...] = ()) -> DecodeResult:
    """Decode to the end, handing every RoundEvent to the listeners (trace writer, streamers)."""
    rounds = decode_rounds(target, prompt_ids, drafters, router, max_new_tokens, sampling, deferred, stop_on_eos)
    while True:
        try:
            ev = next(rounds)
        except StopIteration as end:
            return end.value
        for fn in listeners:
            fn(ev)


@torch.inference_mode()
def decode_rounds(target: Target, prompt_ids: torch.Tensor, drafters: dict[str, Drafter] | None = None, router=None,
                  max_new_tokens: int = 128, sampling: Sampling | None = None, deferred: bool = True,
                  stop_on_eos: bool = True) -> Iterator[RoundEvent]:
    """The decode loop as a generator: yields one RoundEvent per round and returns the DecodeResult.
    Several decodes can be interleaved round by round (the app's side-by-side view); phase timings
    exclude the time the consumer holds a round."""
    drafters = drafters or {}
    sampling = sampling or Sampling()
    router = router or FixedRouter(next(iter(drafters), None))
    prompt_ids = prompt_ids.detach().cpu().long().flatten()
    check_request(target, prompt_ids, max_new_tokens)
    dev = target.device
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    eos = torch.tensor(target.eos_ids or [-1])

    t_start = _now(dev)
    ids = prompt_ids.clone()  # committed tokens; the last one is the pending root of the next round
    n_prompt = ids.numel()
    cache = target.new_cache()
    calls0 = target.calls
    if deferred:
        if n_prompt > 1:
            target.prefill(ids[:-1], cache)
        root_logits = None
    else:
        root_logits = target.prefill(ids, cache).logits[-1:]
    n_calls = target.calls - calls0  # counted per round below: other decodes may share this target
    seen = {}
    for name, d in drafters.items():
        d.reset(prompt_ids)
        seen[name] = n_prompt
    totals = dict.fromkeys(PHASES, 0.0)
    rnd, stopped = 0, "max_new_tokens"

    while ids.numel() - n_prompt < max_new_tokens:
        calls_before = target.calls
        t0 = _now(dev)
        name, decision = router.choose({"round": rnd, "ids": ids, "root_logits": root_logits})
        t1 = _now(dev)
        backlog = 0
        if name is not None:
            d = drafters[name]
            backlog = ids.numel() - seen[name]
            d.catch_up(ids[seen[name]:])
            seen[name] = ids.numel()
        t2 = _now(dev)
        room = max_new_tokens - (ids.numel() - n_prompt) - 1  # the bonus token always fits
        tree = drafters[name].propose(room, sampling, gen) if name is not None and room > 0 else DraftTree.empty()
        tree = _to(tree, dev)
        t3 = _now(dev)

        # verify: ONE target forward over the flattened tree
        past = cache.get_seq_length()
        mask = None if tree.is_chain else tree_attention_mask(tree.ancestors, past, target.dtype, with_root=deferred)
        if deferred:
            inp = torch.cat([ids[-1:].to(dev), tree.tokens])
            logits = target.forward(inp, cache, tree_position_ids(tree.depth, past, True), mask).logits
        elif len(tree):
            out = target.forward(tree.tokens, cache, tree_position_ids(tree.depth, past, False), mask)
            logits = torch.cat([root_logits, out.logits])
        else:
            logits = root_logits
        verdict = verify(tree, logits, sampling, gen)
        t4 = _now(dev)

        # commit: the target cache keeps the accepted path; the next round starts from the bonus token
        accepted = verdict.accepted.to(dev)
        keep_cache(cache, past, torch.cat([accepted.new_zeros(1), accepted + 1]) if deferred else accepted)
        new = torch.cat([tree.tokens[accepted], torch.tensor([verdict.bonus], device=dev)]).cpu()
        new = new[: max_new_tokens - (ids.numel() - n_prompt)]
        hit = torch.isin(new, eos).nonzero() if stop_on_eos else torch.zeros(0, 1)
        if hit.numel():
            new = new[: int(hit[0]) + 1]
            stopped = "eos"
        pos0 = ids.numel() - n_prompt
        ids = torch.cat([ids, new])
        if name is not None:
            drafters[name].commit(tree, accepted)
        done = stopped == "eos" or ids.numel() - n_prompt >= max_new_tokens
        if not deferred and not done:
            root_logits = target.forward(new[-1:].to(dev), cache).logits[-1:]
        t5 = _now(dev)

        timings = {"route": (t1 - t0) * 1e3, "catchup": (t2 - t1) * 1e3, "draft": (t3 - t2) * 1e3,
                   "verify": (t4 - t3) * 1e3, "commit": (t5 - t4) * 1e3}
        for k, v in timings.items():
            totals[k] += v
        n_calls += target.calls - calls_before
        yield round_event(rnd, name, tree, accepted, new, logits, verdict.bonus, timings,
                          target.calls - calls_before, backlog, pos0, decision)
        rnd += 1
        if done:
            break

    return DecodeResult(prompt_ids, ids[n_prompt:], rnd, n_calls, _now(dev) - t_start, stopped, totals)


def _to(tree: DraftTree, dev: torch.device) -> DraftTree:
    if tree.tokens.device == dev:
        return tree
    return DraftTree(tree.tokens.to(dev), tree.parents.to(dev), tree.draft_probs.to(dev),
                     None if tree.draft_dists is None else tree.draft_dists.to(dev))
