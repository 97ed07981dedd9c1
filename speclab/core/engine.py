"""The decode loop: route, catch up, draft, verify (one target forward), commit, record.

Read `decode_rounds` top to bottom: it is the whole algorithm. AR decoding is the same loop with no drafter.

The engine owns the committed sequence (`Committed`: preallocated token ids and, when a drafter asks for target
layers, the target's features of those tokens). Each round one index of kept verification rows (the root and
the accepted path) updates the target's KV cache, the feature buffer and the router's signals together.

Deferred (the default): the target's bonus token is not forwarded on its own; it is the root of the next round
and leads that round's verification batch (one target call per round). So at round start the committed tokens
x_0..x_{n-1} all exist but features only for x_0..x_{n-2}: the pending root x_{n-1} has none yet.
Not deferred: the bonus token is forwarded alone at the end of its round (two target calls per round), so at
round start every committed token x_0..x_{n-1} has its feature and the root's next-token distribution is known.
Either way a drafter gets token x_t paired with f_{t-1} (EAGLE's pairing), which both modes always have.

Router signals (`speclab.routing.routers.Signals`) describe the position that produced the last committed token: the
entropy of the target distribution it was drawn from and that row's final-norm hidden state; both come from the
verification row of the last kept node (the prefill's last row in the first round). They are computed only when
the router asks for them.

With nobody listening (no trace, no callback) no RoundEvent is built and phases are not synchronised on CUDA.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from kernels import ops as kernel_ops
from speclab.drafters.base import Drafter
from speclab.errors import InvalidInput
from speclab.metrics import tokens_per_s
from speclab.routing.routers import Decision, FixedRouter, Router, Signals
from speclab.core.sampling import Sampling
from speclab.core.target import Target, forward_clock, keep_cache
from speclab.core.tree import DraftTree, tree_attention_mask, tree_position_ids
from speclab.core.verify import verify

PHASES = ("route", "catchup", "draft", "verify", "commit", "record")
HISTORY = 32  # rounds of accept-length history a router sees


@dataclass
class RoundEvent:
    """Everything one round did; the trace writer and every live view consume this (per-token columns come
    from `speclab.trace.token_columns`, vectorised over rounds)."""
    round: int
    drafter: str | None
    tree: DraftTree
    accepted: torch.Tensor  # node indices of the accepted path that was committed (cut at EOS / max tokens)
    committed: torch.Tensor  # token ids committed this round (accepted drafts, then the target's token)
    node_logp: torch.Tensor  # [n] log target prob (softmax, T=1) of each node's token at its parent's row
    row_entropy: torch.Tensor  # [n + 1] target entropy (nats) of every verification row; row 0 = the root
    bonus_logp: torch.Tensor  # [n + 1] log target prob of the target's own token (correction / bonus) at every row
    timings_ms: dict[str, float]  # per phase (PHASES); "record" is complete once the event is yielded
    target_calls: int
    backlog: int  # tokens the round's drafter digested in its catch-up (the prompt too, on its first turn)
    pos0: int  # index (in generated tokens) of the first token committed this round
    decision: Decision | None = None  # the router's decision (None when the method has no drafter)
    elapsed_ms: float = 0.0  # the run's decode time so far: prefill + every phase of every round up to this one
    logits: torch.Tensor | None = None  # [n + 1, V] the verification logits, kept only with keep_logits (inspection)

    @property
    def n_accepted(self) -> int:
        return self.accepted.numel()


def round_event(rnd, name, tree, accepted, new, logits, bonus, timings, calls, backlog, pos0, decision) -> RoundEvent:
    """What the listeners need, in five tensor ops over the verification logits (no host sync, no per-token
    work); `token_columns` derives the per-token figures from it, in batches."""
    lse, ent = kernel_ops.softmax_entropy(logits)  # one pass over the vocabulary (a Triton kernel on CUDA)
    rows = tree.parents + 1
    return RoundEvent(rnd, name, tree, accepted, new, logits[rows, tree.tokens].float() - lse[rows], ent,
                      logits[:, bonus].float() - lse, timings, calls, backlog, pos0, decision)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats, T = 1) of every row of logits [..., V] (`kernels.ops.softmax_entropy`)."""
    return kernel_ops.softmax_entropy(logits.reshape(-1, logits.shape[-1]))[1].reshape(logits.shape[:-1])


@dataclass
class DecodeResult:
    prompt_ids: torch.Tensor
    new_ids: torch.Tensor
    rounds: int
    target_calls: int
    stopped: str  # "eos" | "max_new_tokens"
    prefill_ms: float = 0.0
    timings_ms: dict[str, float] = field(default_factory=dict)  # per phase, summed over rounds
    model_s: float = 0.0  # time inside model forwards (target and drafters), prefill included (CPU: exact)
    wall_s: float = 0.0  # first to last instruction, including the time a consumer held the generator

    @property
    def elapsed_s(self) -> float:
        """Decode time: the prefill and the run's own phases, never the time a consumer holds the generator."""
        return (self.prefill_ms + sum(self.timings_ms.values())) / 1e3

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_s(self.new_ids.numel(), self.elapsed_s)


class Committed:
    """The committed sequence, preallocated once per decode: token ids (CPU) and, when drafters ask for target
    layers, the target's features of those tokens (target device). `n` tokens; features for the first `n_feats`."""

    def __init__(self, prompt_ids: torch.Tensor, capacity: int, feat_dim: int, device, dtype):
        self.ids = torch.zeros(capacity, dtype=torch.long)
        self.n = prompt_ids.numel()
        self.ids[: self.n] = prompt_ids
        self.feats = torch.zeros(capacity, feat_dim, dtype=dtype, device=device) if feat_dim else None
        self.n_feats = 0

    def append(self, new: torch.Tensor) -> None:
        self.ids[self.n : self.n + new.numel()] = new
        self.n += new.numel()

    def set_features(self, start: int, feats: torch.Tensor) -> None:
        """Features of the tokens from `start` on (contiguous with those already there)."""
        self.feats[start : start + feats.shape[0]] = feats
        self.n_feats = start + feats.shape[0]


class PhaseClock:
    """Contiguous laps of one round, in ms. Synchronises CUDA at each lap only when asked (traced runs); the
    untraced path synchronises once, at the end of the decode."""

    def __init__(self, device: torch.device, sync: bool):
        self.cuda = device.type == "cuda"
        self.sync = sync and self.cuda

    def _now(self, sync: bool = False) -> float:
        if self.sync or (sync and self.cuda):
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self.t, self.ms = self._now(), dict.fromkeys(PHASES, 0.0)

    def lap(self, phase: str, sync: bool = False) -> None:
        t = self._now(sync)
        self.ms[phase] = self.ms.get(phase, 0.0) + (t - self.t) * 1e3
        self.t = t


def feature_layers(target: Target, drafters: dict[str, Drafter]) -> tuple[int, ...]:
    """The union of the target layers the drafters draft from, checked against the target."""
    layers = sorted({i for d in drafters.values() for i in getattr(d, "layers", ())})
    bad = [i for i in layers if not 0 <= i < target.num_layers]
    if bad:
        raise InvalidInput(f"a drafter asks for target layer(s) {bad}, but the target has {target.num_layers} layers "
                           f"(0..{target.num_layers - 1})")
    return tuple(layers)


def feature_columns(wanted: tuple[int, ...], layers: tuple[int, ...], d: int, device) -> torch.Tensor | None:
    """Column index of a drafter's layers in the concatenated features (None: it wants them all, in order, or none)."""
    if not wanted or tuple(wanted) == layers:
        return None
    return torch.cat([torch.arange(layers.index(i) * d, (layers.index(i) + 1) * d) for i in wanted]).to(device)


def check_request(target: Target, prompt_ids: torch.Tensor, max_new_tokens: int) -> None:
    if prompt_ids.numel() == 0:
        raise InvalidInput("the prompt is empty (it tokenizes to no tokens)")
    if max_new_tokens < 1:
        raise InvalidInput(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
    if prompt_ids.numel() + max_new_tokens > target.max_context:
        raise InvalidInput(
            f"prompt has {prompt_ids.numel()} tokens; with max_new_tokens={max_new_tokens} that exceeds the "
            f"model's context of {target.max_context} tokens")


def decode(target: Target, prompt_ids: torch.Tensor, drafters: dict[str, Drafter] | None = None,
           router: Router | None = None, max_new_tokens: int = 128, sampling: Sampling | None = None,
           deferred: bool = True, stop_on_eos: bool = True,
           listeners: tuple[Callable[[RoundEvent], None], ...] = ()) -> DecodeResult:
    """Decode to the end, handing every RoundEvent to the listeners (trace writer, streamers); with no listener
    no RoundEvent is built (the fast path)."""
    rounds = decode_rounds(target, prompt_ids, drafters, router, max_new_tokens, sampling, deferred, stop_on_eos,
                           listeners, record=bool(listeners))
    while True:
        try:
            next(rounds)
        except StopIteration as end:
            return end.value


@torch.inference_mode()
def decode_rounds(target: Target, prompt_ids: torch.Tensor, drafters: dict[str, Drafter] | None = None,
                  router: Router | None = None, max_new_tokens: int = 128, sampling: Sampling | None = None,
                  deferred: bool = True, stop_on_eos: bool = True,
                  listeners: tuple[Callable[[RoundEvent], None], ...] = (),
                  record: bool = True, keep_logits: bool = False) -> Iterator[RoundEvent | None]:
    """The decode loop as a generator: one item per round (its RoundEvent, or None when not `record`ing), and
    the DecodeResult as its return value. Listeners are called inside the round (timed as "record"). Several
    decodes can be interleaved round by round (the app's side-by-side view); their time counts only the
    rounds' own phases, never the time the consumer holds a round. `keep_logits` leaves each round's
    verification logits on its RoundEvent (for inspecting a round: the anatomy notebook), off by default
    (a traced run holds its events until they are written)."""
    drafters = drafters or {}
    sampling = sampling or Sampling()
    router = router or FixedRouter(next(iter(drafters), None))
    prompt_ids = prompt_ids.detach().cpu().long().flatten()
    check_request(target, prompt_ids, max_new_tokens)
    layers = feature_layers(target, drafters)
    dev, d_model = target.device, target.hidden_size
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    eos = torch.tensor(target.eos_ids or [-1])
    want_entropy, want_hidden = "entropy" in router.needs, "hidden" in router.needs
    eager = getattr(router, "eager", False)
    record = record or bool(listeners)
    clock = PhaseClock(dev, sync=record)
    wall0 = time.perf_counter()

    # prefill: the KV cache, the features of the prompt and the first round's signals
    clock.start()
    calls0, model0 = target.calls, forward_clock.seconds
    n_prompt = prompt_ids.numel()
    seq = Committed(prompt_ids, n_prompt + max_new_tokens, len(layers) * d_model, dev, target.dtype)
    cache = target.new_cache(n_prompt + max_new_tokens)
    sig_logits = sig_hidden = root_logits = root_hidden = None
    if deferred:
        if n_prompt > 1:
            out = target.prefill(seq.ids[: n_prompt - 1], cache, layers, hidden=want_hidden)
            sig_logits, sig_hidden = out.logits[-1:], out.hidden
    else:
        out = target.prefill(seq.ids[:n_prompt], cache, layers, last=min(2, n_prompt), hidden=want_hidden)
        root_logits, root_hidden = out.logits[-1:], out.hidden[-1:] if want_hidden else None
        if n_prompt > 1:
            sig_logits, sig_hidden = out.logits[-2:-1], out.hidden[-2:-1] if want_hidden else None
    if layers and (n_prompt > 1 or not deferred):
        seq.set_features(0, out.features)
    cols = {name: feature_columns(getattr(d, "layers", ()), layers, d_model, dev) for name, d in drafters.items()}

    def features(name: str, a: int, b: int) -> torch.Tensor | None:
        """The target's features of tokens a..b-1, the columns of drafter `name`'s layers."""
        if not getattr(drafters[name], "layers", ()):
            return None
        f = seq.feats[a:b]
        return f if cols[name] is None else f.index_select(1, cols[name])

    seen, unread = {}, {}  # per drafter: tokens it has been handed; prompt tokens it holds undigested since reset
    for name, d in drafters.items():
        d.reset(seq.ids[:n_prompt], features(name, 0, n_prompt - 1))
        seen[name], unread[name] = n_prompt, n_prompt - 1
    clock.lap("prefill")
    prefill_ms = clock.ms["prefill"]
    n_calls, model_s = target.calls - calls0, forward_clock.seconds - model0
    totals = dict.fromkeys(PHASES, 0.0)
    history_acc: list[int] = []
    history_drafters: list[str | None] = []
    rnd, stopped = 0, "max_new_tokens"

    while seq.n - n_prompt < max_new_tokens:
        clock.start()
        calls_before, model_before = target.calls, forward_clock.seconds

        # route: the router picks the drafter of this round from the signals of the last committed token
        decision, name = None, None
        if drafters:
            signals = Signals(rnd, float(entropy(sig_logits)[0])
                              if want_entropy and sig_logits is not None else math.nan,
                              sig_hidden[0] if want_hidden and sig_hidden is not None else None,
                              history_acc[-HISTORY:], history_drafters[-HISTORY:])
            decision = router.choose(signals)
            name = decision.choice
        clock.lap("route")

        # catch up: the chosen drafter digests every token committed since it last looked (lazily, only now;
        # an eager router keeps every drafter current instead)
        backlog = 0
        for nm in (drafters if eager else [name] if name is not None else []):
            s = seen[nm]
            if nm == name:  # what it digests: tokens since it last looked, and the prompt on its first turn
                backlog = seq.n - s + unread.pop(nm, 0)
            drafters[nm].catch_up(seq.ids[s : seq.n], features(nm, s - 1, seq.n - 1))
            seen[nm] = seq.n
            unread.pop(nm, None)
        clock.lap("catchup")

        # draft
        room = max_new_tokens - (seq.n - n_prompt) - 1  # the bonus token always fits
        proposed = name is not None and room > 0
        tree = drafters[name].propose(room, sampling, gen).to(dev) if proposed else DraftTree.empty(dev)
        clock.lap("draft")

        # verify: ONE target forward over the root (deferred) and the flattened tree
        past = cache.get_seq_length()
        chain = tree.is_chain  # causal mask and consecutive positions: the forward's defaults
        mask = None if chain else tree_attention_mask(tree.ancestors, past, target.dtype, with_root=deferred)
        pos = None if chain else tree_position_ids(tree.depth, past, deferred)
        out = None
        if deferred:
            inp = torch.cat([seq.ids[seq.n - 1 : seq.n].to(dev), tree.tokens])
            out = target.forward(inp, cache, pos, mask, layers=layers, hidden=want_hidden)
            logits = out.logits
        elif len(tree):
            out = target.forward(tree.tokens, cache, pos, mask, layers=layers, hidden=want_hidden)
            logits = torch.cat([root_logits, out.logits])
        else:
            logits = root_logits
        verdict = verify(tree, logits, sampling, gen)
        clock.lap("verify")

        # commit: the kept rows (root + accepted path) go to the KV cache, the features and the next signals
        accepted = verdict.accepted.to(dev)
        new = torch.cat([tree.tokens[accepted].cpu(), torch.tensor([verdict.bonus])])
        m = min(new.numel(), max_new_tokens - (seq.n - n_prompt))
        hit = torch.isin(new[:m], eos).nonzero() if stop_on_eos else new[:0]
        if hit.numel():
            m, stopped = int(hit[0]) + 1, "eos"
        new, accepted = new[:m], accepted[:m]  # an EOS inside the accepted drafts cuts both
        done = stopped == "eos" or seq.n + m - n_prompt >= max_new_tokens
        kept = torch.cat([accepted.new_zeros(1), accepted + 1]) if deferred else accepted
        keep_cache(cache, past, kept)
        bonus_row = accepted[-1:] + 1 if accepted.numel() else accepted.new_zeros(1)  # row that drew the bonus
        if want_entropy:
            sig_logits = logits[bonus_row]
        if want_hidden:
            sig_hidden = out.hidden[bonus_row] if deferred else (out.hidden[bonus_row - 1] if accepted.numel() else root_hidden)
        if layers and out is not None and not done:
            seq.set_features(seq.n - 1 if deferred else seq.n, out.features[kept])
        pos0 = seq.n - n_prompt
        seq.append(new)
        if proposed:
            drafters[name].commit(tree, accepted)
        if not deferred and not done:  # the bonus token alone: its features and the next root distribution
            out = target.forward(new[-1:].to(dev), cache, layers=layers, hidden=want_hidden)
            root_logits, root_hidden = out.logits, out.hidden
            if layers:
                seq.set_features(seq.n - 1, out.features)
        history_acc.append(accepted.numel())
        history_drafters.append(name)
        clock.lap("commit", sync=done)
        calls = target.calls - calls_before
        n_calls += calls
        model_s += forward_clock.seconds - model_before

        # record: the RoundEvent for the listeners (only when someone listens)
        ev = None
        if record:
            ev = round_event(rnd, name, tree, accepted, new, logits, verdict.bonus, clock.ms, calls, backlog, pos0,
                             decision)
            if keep_logits:
                ev.logits = logits
            for fn in listeners:
                fn(ev)
            clock.lap("record")
        for k, v in clock.ms.items():
            totals[k] += v
        if ev is not None:
            ev.elapsed_ms = prefill_ms + sum(totals.values())
        if len(history_acc) > 4 * HISTORY:
            del history_acc[:-HISTORY], history_drafters[:-HISTORY]
        yield ev
        rnd += 1
        if done:
            break

    return DecodeResult(prompt_ids, seq.ids[n_prompt : seq.n].clone(), rnd, n_calls, stopped, prefill_ms, totals,
                        model_s, time.perf_counter() - wall0)

