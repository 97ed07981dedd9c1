"""FlashHead: a clustered draft LM head (cluster-first retrieval, exact scores on the candidates).

After the FlashHead thesis (../shared/papers/flashhead-thesis.txt, §3): the V rows of a head matrix E [V, H] are
partitioned offline into c clusters of equal size b = V / c, so the cluster -> token index M is one dense [c, b]
tensor. A draft step then scores the c centroids, s = G h, keeps p clusters and computes exact logits only on
their p * b tokens. Work per row: c*H + p*b*H multiply-adds instead of V*H.

- **Building** (`build_index`): equal-size spherical k-means. Rows and centroids are compared by cosine (unit
  rows); each iteration assigns rows to clusters by rounds of proposals: every unplaced row proposes to its next
  best cluster, and a cluster keeps, up to its remaining room, the proposers it is closest to (ties by row index),
  so every cluster ends with exactly b rows. The thesis leaves the balancing, the normalisation and the centroid's
  definition open; these are speclab's choices. The stored centroid is the *mean of its rows as they are* (not
  normalised), so a cluster's score G_j h is the mean logit of its tokens: the centroid softmax that sampling draws
  clusters from is over mean logits. Deterministic given the seed (CPU, float32).
- **Retrieval** (`FlashHead`): greedy decoding keeps the top p clusters; sampling draws p clusters without
  replacement from softmax(s / T) (Gumbel top-p with the session's generator). Adaptive probes (the thesis's
  future work, `margin` > 0): a row keeps every cluster whose score is within `margin` of its best, at least one and
  at most p. The candidates' exact logits come from `kernels.ops.flash_gather_score`; every other token gets -inf,
  so the draft distribution q = softmax over the candidates, zero elsewhere, is exactly what the drafter samples
  from and what verification divides by: speculative decoding stays lossless (the target's head is untouched).
- **Stored** beside the drafter: `flashhead/c<C>/flashhead.safetensors` (`centroids` [c, H] float32, `index` [c, b]
  int32) and `flashhead.json` (the build's settings, the head's shape and fingerprint, the objective).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import ops
from speclab.checks import Bound, InvalidInput
from speclab.drafters.registry import Param

FORMAT = 1
PREFER = 32  # candidate clusters per row kept from the similarity scan (the rest only for leftovers)


def index_dir(model_dir: str | Path, clusters: int) -> Path:
    """Where the FlashHead index of `clusters` clusters of the head in `model_dir` lives."""
    return Path(model_dir) / "flashhead" / f"c{clusters}"


def head_fingerprint(weight: torch.Tensor) -> str:
    """A short hash of a head matrix (its shape and its values rounded to bf16): an index is refused for another
    head. A weight made int8 when it loaded (`speclab.models.quantize_drafter`) keeps the fingerprint of the values
    it loaded with: an index built for that head serves its int8 rounding too."""
    kept = getattr(weight, "_speclab_fingerprint", None)
    if kept is not None:
        return kept
    w = weight.detach().to("cpu", torch.bfloat16).contiguous()
    h = hashlib.sha256(str(tuple(w.shape)).encode())
    h.update(w.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class FlashIndex:
    """The offline part: centroids [c, H] (float32, the mean of each cluster's rows) and index [c, b] (token ids,
    each cluster's rows in ascending order; together they cover the vocabulary exactly once)."""
    centroids: torch.Tensor
    index: torch.Tensor
    meta: dict = field(default_factory=dict)

    @property
    def clusters(self) -> int:
        return self.index.shape[0]

    @property
    def cluster_size(self) -> int:
        return self.index.shape[1]

    def save(self, out_dir: str | Path) -> Path:
        """Written to a temp dir, then renamed: a kill never leaves half an index."""
        from safetensors.torch import save_file

        from speclab.files import atomic_dir
        with atomic_dir(out_dir) as tmp:
            save_file({"centroids": self.centroids.float().contiguous(),
                       "index": self.index.to(torch.int32).contiguous()},
                      str(tmp / "flashhead.safetensors"), metadata={"format": "pt"})
            (tmp / "flashhead.json").write_text(json.dumps(self.meta, indent=2) + "\n")
        return Path(out_dir)

    @classmethod
    def load(cls, path: str | Path, weight: torch.Tensor | None = None) -> FlashIndex:
        """The index in `path`; checked against the head `weight` when given (shape and fingerprint)."""
        from safetensors.torch import load_file
        p = Path(path)
        if not (p / "flashhead.safetensors").is_file() or not (p / "flashhead.json").is_file():
            raise InvalidInput(f"no FlashHead index in {p} (build one with `speclab flashhead build`)")
        try:
            meta = json.loads((p / "flashhead.json").read_text())
            sd = load_file(str(p / "flashhead.safetensors"))
            idx = cls(sd["centroids"].float(), sd["index"].long(), meta)
        except Exception as e:  # a truncated or hand-edited file: named, not a traceback
            raise InvalidInput(f"the FlashHead index in {p} is unreadable ({type(e).__name__}: {e})") from e
        if weight is not None:
            V, H = weight.shape
            if idx.index.numel() != V or idx.centroids.shape[1] != H:
                raise InvalidInput(f"the FlashHead index in {p} is for a [{idx.index.numel()}, "
                                   f"{idx.centroids.shape[1]}] head, not this [{V}, {H}] one")
            if meta.get("head_fingerprint") not in (None, head_fingerprint(weight)):
                raise InvalidInput(f"the FlashHead index in {p} was built for another head (fingerprint "
                                   f"{meta.get('head_fingerprint')}); rebuild it with `speclab flashhead build`")
        return idx


def _balanced_assign(pref: torch.Tensor, sims: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """Rows [n] placed into clusters with `room` [c] places left: rounds of proposals down each row's preference
    list pref [n, T] (similarities sims [n, T], best first); a cluster keeps its closest proposers (ties: the
    lower row). Returns each row's cluster, -1 where its list ran out."""
    n, T = pref.shape
    out = torch.full((n,), -1, dtype=torch.long)
    ptr = torch.zeros(n, dtype=torch.long)
    todo = torch.arange(n)
    room = room.clone()
    while todo.numel():
        todo = todo[ptr[todo] < T].sort().values
        if not todo.numel():
            break
        cl = pref[todo, ptr[todo]]
        s = sims[todo, ptr[todo]]
        # sort by cluster, then by similarity (descending), then by row: a stable lexicographic order
        order = torch.argsort(-s, stable=True)
        order = order[torch.argsort(cl[order], stable=True)]
        cl_sorted = cl[order]
        first = torch.searchsorted(cl_sorted, cl_sorted)  # the first proposal of each cluster in the sorted order
        rank = torch.arange(order.numel()) - first
        take = rank < room[cl_sorted]
        won = todo[order[take]]
        out[won] = cl_sorted[take]
        room -= torch.bincount(cl_sorted[take], minlength=room.numel())
        lost = todo[order[~take]]
        ptr[lost] += 1
        todo = lost
    return out


def build_index(weight: torch.Tensor, clusters: int, *, seed: int = 0, iters: int = 25, progress=None,
                meta: dict | None = None) -> FlashIndex:
    """Equal-size spherical k-means of the rows of `weight` [V, H] into `clusters` clusters (which must divide
    V). `progress(i, iters, objective, moved)` is called after each iteration."""
    V, H = weight.shape
    if clusters < 1 or V % clusters:
        raise InvalidInput(f"clusters must divide the head's {V} rows (got {clusters}; e.g. {_divisors_near(V)})")
    b = V // clusters
    t0 = time.perf_counter()
    w = weight.detach().to("cpu", torch.float32)
    wn = torch.nn.functional.normalize(w, dim=1)
    g = torch.Generator().manual_seed(seed)
    cent = wn[torch.randperm(V, generator=g)[:clusters]].clone()
    assign = torch.full((V,), -1, dtype=torch.long)
    T = min(clusters, PREFER)
    objective, moved, it = float("nan"), V, 0
    for it in range(1, iters + 1):
        sims, pref = _top_similar(wn, cent, T)
        new = _balanced_assign(pref, sims, torch.full((clusters,), b, dtype=torch.long))
        left = (new < 0).nonzero().flatten()
        if left.numel():  # rows whose T best clusters filled up: the same proposals over every cluster with room
            room = b - torch.bincount(new[new >= 0], minlength=clusters)
            s_all = wn[left] @ cent.T
            s_all[:, room == 0] = float("-inf")
            s_left, p_left = s_all.sort(dim=1, descending=True, stable=True)
            new[left] = _balanced_assign(p_left, s_left, room)
        moved = int((new != assign).sum())
        assign = new
        cent = torch.nn.functional.normalize(torch.zeros(clusters, H).index_add_(0, assign, wn), dim=1)
        objective = float((wn * cent[assign]).sum(1).mean())  # mean cosine of a row to its centroid
        if progress is not None:
            progress(it, iters, objective, moved)
        if moved == 0:
            break
    order = torch.argsort(assign * V + torch.arange(V))  # by cluster, rows ascending inside
    index = order.view(clusters, b)
    centroids = w[index].mean(1)
    info = {"format": FORMAT, "rows": V, "hidden": H, "clusters": clusters, "cluster_size": b, "seed": seed,
            "iters": it, "converged": moved == 0, "objective_mean_cosine": round(objective, 6),
            "assignment": "equal-size spherical k-means (cosine; balanced proposals, closest rows kept)",
            "centroid": "mean of the cluster's rows (not normalised): a cluster's score is its tokens' mean logit",
            "head_fingerprint": head_fingerprint(weight), "build_s": round(time.perf_counter() - t0, 3),
            **(meta or {})}
    return FlashIndex(centroids, index, info)


def _top_similar(wn: torch.Tensor, cent: torch.Tensor, T: int, chunk: int = 16384):
    """Each row's T most similar centroids (cosine, descending; ties by cluster id), in chunks of rows."""
    sims, pref = [], []
    for i in range(0, wn.shape[0], chunk):
        s = wn[i:i + chunk] @ cent.T
        v, j = s.sort(dim=1, descending=True, stable=True)
        sims.append(v[:, :T])
        pref.append(j[:, :T])
    return torch.cat(sims), torch.cat(pref)


def _divisors_near(v: int) -> str:
    ds = [d for d in range(2, min(v, 4096) + 1) if v % d == 0]
    return ", ".join(str(d) for d in ds[-4:]) or "1"


# -- retrieval ------------------------------------------------------------------------------------------------------
def probe_counts(sorted_scores: torch.Tensor, probes: int, margin: float) -> torch.Tensor:
    """Clusters each row probes [R]: `probes` when margin is 0; otherwise every cluster within `margin` of the
    row's best (scores sorted descending [R, >= probes]), at least 1 and at most `probes`."""
    R = sorted_scores.shape[0]
    if margin <= 0:
        return torch.full((R,), probes, dtype=torch.long, device=sorted_scores.device)
    close = sorted_scores[:, :probes] >= sorted_scores[:, :1] - margin
    return close.sum(1).clamp(min=1)


def pick_clusters(scores: torch.Tensor, probes: int, temperature: float, generator: torch.Generator | None):
    """[R, probes] cluster ids, best first: the top clusters (greedy, temperature 0), or `probes` draws without
    replacement from softmax(scores / T) (Gumbel top-k, with uniforms from the session's CPU generator, as
    `speclab.core.sampling.sample` draws)."""
    if temperature <= 0:
        return scores.topk(probes, -1).indices
    u = torch.rand(scores.shape, generator=generator, device="cpu").to(scores.device)
    gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1 - 1e-7)))
    return (scores.float() / temperature + gumbel).topk(probes, -1).indices


class FlashHead:
    """A head that scores `probes` clusters' tokens exactly and gives every other token -inf.

    `weight` [V, H] is the head's matrix (the drafter's, or the target's for DFlash), `scale` a logit multiplier
    (DFlash's output multiplier). Calling it on final hidden states h [R, H] returns logits [R, V] (float32) and
    remembers the candidate ids of the call (`last_candidates` [R, probes * b]; a row that probed fewer clusters
    repeats its best one)."""

    def __init__(self, weight: torch.Tensor, index: FlashIndex, probes: int, margin: float = 0.0, scale: float = 1.0):
        if not 1 <= probes <= index.clusters:
            raise InvalidInput(f"probes must be from 1 to the index's {index.clusters} clusters (got {probes})")
        self.weight, self.scale = weight, scale
        self.probes, self.margin = probes, margin
        self.index = index.index.to(weight.device)
        self.centroids = index.centroids.to(weight.device, weight.dtype)
        self.temperature = 0.0
        self.generator: torch.Generator | None = None
        self.last_candidates: torch.Tensor | None = None
        self.audit: list | None = None  # a list: every call also runs the dense head and appends (agree, recall) rows

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        lead = h.shape[:-1]
        x = h.reshape(-1, h.shape[-1]).to(self.centroids.dtype)  # states in fp32 (a refined norm) meet a bf16 head
        scores = (x @ self.centroids.T).float() * self.scale
        clusters = pick_clusters(scores, self.probes, self.temperature, self.generator)
        if self.margin > 0:  # adaptive probes: no row gathers past the widest row's count (one host sync), and
            n = probe_counts(scores.gather(1, clusters), self.probes, self.margin)  # a narrower row repeats its best
            clusters = clusters[:, : int(n.max())]
            keep = torch.arange(clusters.shape[1], device=x.device)[None] < n[:, None]
            clusters = torch.where(keep, clusters, clusters[:, :1])
        cands, logits = ops.flash_gather_score(x, self.weight, self.index, clusters, self.scale)
        out = torch.full((x.shape[0], self.weight.shape[0]), float("-inf"), device=x.device)
        out.scatter_(1, cands, logits)  # repeated candidates write the same value
        self.last_candidates = cands.view(*lead, -1)
        if self.audit is not None:  # measurement only: top-1 agreement with the dense head, and its recall
            top = (x.float() @ self.weight.float().T).argmax(-1)  # fp32, as the candidates' logits are
            self.audit.append(torch.stack([out.argmax(-1) == top, (cands == top[:, None]).any(-1)], 1))
        return out.view(*lead, -1)


# -- the head option of every drafter with a head (the registry's parameters) -----------------------------------------
HEAD_PARAMS = (
    Param("head", "dense", choices=("dense", "flash"),
          help="the draft LM head: dense, or FlashHead (clustered; `speclab flashhead build` first)"),
    Param("clusters", 0, lambda t: Bound(0, 1 << 24), when=("head", "flash"),
          help="FlashHead: the index to use, by its clusters (0 = the one built beside the drafter)"),
    Param("probes", 8, lambda t: Bound(1, 1 << 24), grid=(1, 2, 4, 8, 16), when=("head", "flash"),
          help="FlashHead: clusters whose tokens are scored exactly, per row (at most, with margin)"),
    Param("margin", 0.0, lambda t: Bound(0.0, 1e6), when=("head", "flash"),
          help="FlashHead: adaptive probes, the clusters within this many logits of the best (0 = always probes)"),
)
HEAD_NAMES = tuple(p.name for p in HEAD_PARAMS)


def split_head(params: dict) -> tuple[dict, dict]:
    """(the head parameters, the drafter's own) of a drafter's parameters."""
    return ({k: v for k, v in params.items() if k in HEAD_NAMES},
            {k: v for k, v in params.items() if k not in HEAD_NAMES})


def locate_index(model_dir: str | Path, clusters: int, role: str) -> tuple[Path, int]:
    """(the folder, the clusters) of the index of `clusters` clusters beside the drafter in `model_dir` (0: the
    only one there), from its files alone: checked before any model is loaded."""
    build = f"build one with `speclab flashhead build --drafter {role} --clusters C`"
    if clusters:
        d = index_dir(model_dir, clusters)
        if not (d / "flashhead.json").is_file():
            raise InvalidInput(f"no FlashHead index of {clusters} clusters beside {model_dir}: {build}")
        return d, clusters
    base = Path(model_dir) / "flashhead"
    built = sorted(d for d in base.glob("c*") if (d / "flashhead.json").is_file()) if base.is_dir() else []
    if not built:
        raise InvalidInput(f"no FlashHead index beside {model_dir}: {build}")
    if len(built) > 1:
        raise InvalidInput(f"several FlashHead indexes beside {model_dir} ({', '.join(d.name for d in built)}): "
                           "choose one with clusters=C")
    try:
        return built[0], int(json.loads((built[0] / "flashhead.json").read_text())["clusters"])
    except Exception as e:  # a hand-edited file: named, not a traceback
        raise InvalidInput(f"the FlashHead index in {built[0]} is unreadable ({type(e).__name__}: {e})") from e


def find_index(model_dir: str | Path, clusters: int, weight: torch.Tensor, role: str) -> FlashIndex:
    """The index of `clusters` clusters beside the drafter in `model_dir` (0: the only one there), checked
    against the head `weight`."""
    return FlashIndex.load(locate_index(model_dir, clusters, role)[0], weight)


def make_head(weight: torch.Tensor, model_dir, role: str, *, head: str = "dense", clusters: int = 0,
              probes: int = 8, margin: float = 0.0, scale: float = 1.0) -> FlashHead | None:
    """None for the dense head; a FlashHead on `weight` with the index beside `model_dir` otherwise."""
    if head != "flash":
        return None
    if model_dir is None:
        raise InvalidInput(f"the {role} drafter was not loaded from a directory, so it has no FlashHead index")
    return FlashHead(weight, find_index(model_dir, clusters, weight, role), probes, margin, scale)


def with_head(build, role: str, weight, scale=lambda model: 1.0):
    """A drafter's registry `build` that also takes the head parameters: the drafter built from its own, then its
    `flash` head (None = dense) from `weight(model, target)` and the index beside the drafter's directory."""
    def built(target, model, **params):
        head, own = split_head(params)
        drafter = build(target, model, **own)
        drafter.flash = make_head(weight(model, target), getattr(model, "name", None), role, scale=scale(model),
                                  **head)
        return drafter
    built.head_weight = weight  # `speclab flashhead build` clusters this head
    return built


def head_same_decode(own=None):
    """A drafter's `same_decode` that also knows the head: with the dense head, FlashHead's parameters change
    nothing (a grid over probes with head=dense decodes once)."""
    defaults = {p.name: p.default for p in HEAD_PARAMS if p.name != "head"}

    def same(params: dict) -> dict:
        params = own(params) if own else params
        return {**params, **defaults} if params.get("head", "dense") == "dense" else params
    return same
