"""The Triton kernels and their launchers. On a GPU they compile; without one they run only under Triton's
interpreter (TRITON_INTERPRET=1, read when the kernels are first built), for correctness tests on small shapes.
Each launcher returns what its twin in `kernels.reference` returns."""
from __future__ import annotations

import functools

import torch


@functools.cache
def _kernels():
    """Build the kernels on first use (so TRITON_INTERPRET set by a test before that takes effect)."""
    import triton
    import triton.language as tl

    @triton.jit
    def softmax_entropy_kernel(x_ptr, lse_ptr, ent_ptr, V, stride, BLOCK: tl.constexpr):
        # one program per row, one pass over the vocabulary: running max m, s = sum e^(x - m), t = sum e^(x - m) x
        row = tl.program_id(0)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        t = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            scale = tl.exp(m - m_new)
            e = tl.where(cols < V, tl.exp(x - m_new), 0.0)
            s = s * scale + tl.sum(e, 0)
            t = t * scale + tl.sum(e * tl.where(cols < V, x, 0.0), 0)
            m = m_new
        lse = m + tl.log(s)
        tl.store(lse_ptr + row, lse)
        tl.store(ent_ptr + row, lse - t / s)

    @triton.jit
    def greedy_accept_kernel(tok_ptr, par_ptr, arg_ptr, alive_ptr, depth_ptr, path_ptr, out_ptr, n,
                             BLOCK: tl.constexpr):
        # one program: match every node at once, then propagate "alive" and depth down the tree one level per step
        i = tl.arange(0, BLOCK)
        ok = i < n
        tok = tl.load(tok_ptr + i, mask=ok, other=0)
        par = tl.load(par_ptr + i, mask=ok, other=-1)
        match = (tok == tl.load(arg_ptr + par + 1, mask=ok, other=-1)) & ok
        tl.store(alive_ptr + i, match.to(tl.int32), mask=ok)
        tl.store(depth_ptr + i, tl.full((BLOCK,), 1, tl.int32), mask=ok)
        tl.debug_barrier()
        has_par = (par >= 0) & ok
        for _ in range(0, n):
            up_alive = tl.load(alive_ptr + par, mask=has_par, other=1)
            up_depth = tl.load(depth_ptr + par, mask=has_par, other=0)
            tl.debug_barrier()
            tl.store(alive_ptr + i, (match & (up_alive != 0)).to(tl.int32), mask=ok)
            tl.store(depth_ptr + i, up_depth + 1, mask=ok)
            tl.debug_barrier()
        alive = tl.load(alive_ptr + i, mask=ok, other=0)
        depth = tl.load(depth_ptr + i, mask=ok, other=0)
        score = tl.where(alive != 0, depth, 0)
        best_score = tl.max(score, 0)
        best = tl.min(tl.where((score == best_score) & ok, i, BLOCK), 0)  # the first deepest alive node
        best = tl.where(best_score > 0, best, -1)
        tl.store(out_ptr, best)
        tl.store(out_ptr + 1, tl.load(arg_ptr + best + 1))
        # the path: walk up from best (at most n steps), marking each node
        tl.store(path_ptr + i, tl.zeros((BLOCK,), tl.int32), mask=ok)
        tl.debug_barrier()
        node = best.to(tl.int64)  # a loop-carried variable keeps one type: the parents it walks are int64
        for _ in range(0, n):
            tl.store(path_ptr + node, 1, mask=node >= 0)
            node = tl.where(node >= 0, tl.load(par_ptr + node, mask=node >= 0, other=-1), -1)

    @triton.jit
    def sampling_accept_kernel(p_ptr, q_ptr, x_ptr, u_ptr, acc_ptr, res_ptr, V, stride, BLOCK: tl.constexpr):
        # one program per position: the min(1, p/q) test, then norm(max(p - q, 0)) in two passes over the vocabulary
        row = tl.program_id(0)
        x = tl.load(x_ptr + row)
        px = tl.load(p_ptr + row * stride + x).to(tl.float32)
        qx = tl.load(q_ptr + row * stride + x).to(tl.float32)
        u = tl.load(u_ptr + row)
        tl.store(acc_ptr + row, (u < tl.minimum(px / tl.maximum(qx, 1e-30), 1.0)).to(tl.int8))
        total = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            p = tl.load(p_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            total += tl.sum(tl.maximum(p - q, 0.0), 0)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            p = tl.load(p_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.where(total > 0, tl.maximum(p - q, 0.0) / tl.maximum(total, 1e-30), p)
            tl.store(res_ptr + row * V + cols, r, mask=mask)

    @triton.jit
    def flash_gather_score_kernel(h_ptr, w_ptr, idx_ptr, cl_ptr, cand_ptr, out_ptr, H, b, P, scale,
                                  BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
        # one program per (row, probe): the cluster's b token ids, then their dot products with h over H in chunks
        row = tl.program_id(0)
        k = tl.program_id(1)
        j = tl.load(cl_ptr + row * P + k)
        lanes = tl.arange(0, BLOCK_B)
        ok = lanes < b
        tok = tl.load(idx_ptr + j * b + lanes, mask=ok, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK_B,), tl.float32)
        for start in range(0, H, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            cm = cols < H
            x = tl.load(h_ptr + row * H + cols, mask=cm, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + tok[:, None] * H + cols[None, :], mask=ok[:, None] & cm[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], 1)
        base = row * P * b + k * b
        tl.store(cand_ptr + base + lanes, tok, mask=ok)
        tl.store(out_ptr + base + lanes, acc * scale, mask=ok)

    return softmax_entropy_kernel, greedy_accept_kernel, sampling_accept_kernel, flash_gather_score_kernel


def _block(v: int, most: int = 1024) -> int:
    import triton
    return min(most, triton.next_power_of_2(max(int(v), 1)))


def softmax_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.contiguous()
    R, V = x.shape
    lse = torch.empty(R, dtype=torch.float32, device=x.device)
    ent = torch.empty(R, dtype=torch.float32, device=x.device)
    _kernels()[0][(R,)](x, lse, ent, V, x.stride(0), BLOCK=_block(V))
    return lse, ent


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor, ancestors=None):
    """(`ancestors` is for the twin's sake: the kernel walks the tree itself.)"""
    n, dev = tokens.numel(), tokens.device
    alive = torch.empty(max(n, 1), dtype=torch.int32, device=dev)
    depth = torch.empty(max(n, 1), dtype=torch.int32, device=dev)
    path = torch.zeros(max(n, 1), dtype=torch.int32, device=dev)
    out = torch.empty(2, dtype=torch.long, device=dev)
    _kernels()[1][(1,)](tokens.long().contiguous(), parents.long().contiguous(), target_argmax.long().contiguous(),
                        alive, depth, path, out, n, BLOCK=_block(n, 1 << 16))
    best, bonus = out.tolist()  # the one host sync: the answer
    return int(best), int(bonus), path[:n].bool()


def sampling_accept(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor):
    p, q = p.contiguous(), q.contiguous()
    B, V = p.shape
    acc = torch.empty(B, dtype=torch.int8, device=p.device)
    res = torch.empty(B, V, dtype=torch.float32, device=p.device)
    _kernels()[2][(B,)](p, q, x.long().contiguous(), u.float().contiguous(), acc, res, V, p.stride(0),
                        BLOCK=_block(V))
    return acc.bool(), res


def flash_gather_score(h: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, clusters: torch.Tensor,
                       scale: float = 1.0):
    h, weight = h.contiguous(), weight.contiguous()
    R, H = h.shape
    c, b = index.shape
    P = clusters.shape[1]
    cands = torch.empty(R, P * b, dtype=torch.long, device=h.device)
    logits = torch.empty(R, P * b, dtype=torch.float32, device=h.device)
    _kernels()[3][(R, P)](h, weight, index.contiguous(), clusters.long().contiguous(), cands, logits, H, b, P,
                          float(scale), BLOCK_B=_block(b), BLOCK_H=_block(H, 128))
    return cands, logits
