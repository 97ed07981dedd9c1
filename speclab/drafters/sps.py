"""Standalone speculative sampling (SpS): a smaller HF model with the target's tokenizer drafts a chain of
k tokens, or a top-k tree (each level expands the frontier by its top-k children and keeps the best
`tree_topk` by cumulative log-probability, EAGLE-style, one draft call per level)."""
from __future__ import annotations

import torch

from speclab.sampling import Sampling, logits_to_probs, sample
from speclab.target import Target, crop_cache
from speclab.tree import DraftTree


class StandaloneDraft:
    name = "sps"

    def __init__(self, model: Target, k: int = 4, tree_topk: int = 1):
        if k < 1 or tree_topk < 1:
            raise ValueError(f"sps needs k >= 1 and tree_topk >= 1 (got k={k}, tree_topk={tree_topk})")
        self.model, self.k, self.topk = model, k, tree_topk
        self.cache = None
        self.backlog = torch.zeros(0, dtype=torch.long)

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.cache = self.model.new_cache()
        self.backlog = prompt_ids.detach().cpu().long().clone()

    def catch_up(self, backlog: torch.Tensor) -> None:
        # lazy: the backlog's KV is computed in the first draft call (logits of its last row only matter)
        self.backlog = torch.cat([self.backlog, backlog.detach().cpu().long()])

    def propose(self, max_depth: int, sampling: Sampling, generator=None) -> DraftTree:
        depth = min(self.k, max_depth)
        if depth <= 0:
            return DraftTree.empty()
        m, dev = self.model, self.model.device
        committed = self.cache.get_seq_length() + self.backlog.numel()
        logits = m.forward(self.backlog, self.cache).logits[-1:]  # catch-up + the root's distribution
        self.backlog = self.backlog[:0]
        sampled_chain = not sampling.greedy and self.topk == 1
        n_max = depth * self.topk
        tokens = torch.zeros(n_max, dtype=torch.long, device=dev)
        parents = torch.zeros(n_max, dtype=torch.long, device=dev)
        dprobs = torch.zeros(n_max, device=dev)
        anc = torch.zeros(n_max, n_max, dtype=torch.bool, device=dev)
        dists = []
        frontier = torch.tensor([-1], device=dev)
        score = torch.zeros(1, device=dev)
        n = 0
        for level in range(1, depth + 1):
            logp = torch.log_softmax(logits, -1)  # [f, V]
            if sampled_chain:
                q = logits_to_probs(logits, sampling)
                dists.append(q)
                tok = sample(q, generator)
                par_j, new_tok, new_score = torch.zeros(1, dtype=torch.long, device=dev), tok, score
            else:
                vals, idx = logp.topk(self.topk, -1)  # [f, topk]
                cand = (score[:, None] + vals).flatten()
                best = cand.topk(min(self.topk, cand.numel())).indices
                par_j, new_tok, new_score = best // self.topk, idx.flatten()[best], cand[best]
            new = torch.arange(n, n + new_tok.numel(), device=dev)
            par = frontier[par_j]
            tokens[new], parents[new] = new_tok, par
            dprobs[new] = logp[par_j, new_tok].exp()
            anc[new] = anc[par.clamp(min=0)] & (par >= 0)[:, None]
            anc[new, new] = True
            n += new.numel()
            if level == depth:
                break
            past = self.cache.get_seq_length()
            pos = committed - 1 + level + torch.zeros_like(new)
            mask = None
            if self.topk > 1:
                allowed = torch.cat([torch.ones(new.numel(), past - (n - new.numel()), dtype=torch.bool, device=dev),
                                     anc[new, :n]], dim=1)
                mask = torch.zeros(allowed.shape, dtype=m.dtype, device=dev).masked_fill_(~allowed, torch.finfo(m.dtype).min)
                mask = mask.view(1, 1, *allowed.shape)
            logits = m.forward(new_tok, self.cache, pos, mask).logits
            frontier, score = new, new_score
        crop_cache(self.cache, committed)  # drop the speculative nodes; accepted ones come back via catch_up
        draft_dists = None
        if sampled_chain:
            dists.append(torch.zeros_like(dists[0]))  # the last node has no children
            draft_dists = torch.cat(dists)
        return DraftTree(tokens[:n], parents[:n], dprobs[:n], draft_dists)

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        pass
