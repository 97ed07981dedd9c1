"""llama.cpp as the bench's CPU peer: the bench's target and draft exported to GGUF (`speclab.gguf.cached`) and
decoded through llama-cpp-python (`speclab.llamacpp`) beside speclab's methods, on the same prompt ids and token
budget, greedily, with the machine's cores as threads in both engines.

Three peers, each a run whose `method` is its name:
- `llamacpp`: plain decoding;
- `llamacpp_pld`: llama.cpp's prompt-lookup drafting (k draft tokens a step, n-grams of up to 3);
- `llamacpp_sps`: draft-model speculation with the bench's draft model (the bindings' draft-model interface).
A speculative peer's counts go through the `speclab import` mapping of llama.cpp's server timings
(`speclab.production.llamacpp.from_response`: draft_n, draft_n_accepted, the step count, prompt and generation ms),
with every step's (drafted, accepted) as `per_step`, so its run shows tau and the per-position acceptance.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from speclab import llamacpp as lc
from speclab.errors import InvalidInput

PEERS = {"llamacpp": "plain", "llamacpp_pld": "pld", "llamacpp_sps": "sps"}
GGUF_TYPE = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}  # speclab's dtype -> the GGUF file type


@dataclass
class LlamaCppPeers:
    """The llama.cpp models of a bench, loaded once: the target's GGUF twice (plain decoding keeps only the last
    row's logits; speculation keeps every row's, as the bindings need) and the draft's."""
    dtype: str  # speclab's name of the GGUF's type (the runs' dtype)
    k: dict  # peer -> draft tokens a step
    target_file: Path
    draft_file: Path | None
    plain: object = None
    spec: object = None
    draft: object = None
    version: str = ""
    threads: int = 1
    drafters: dict = field(default_factory=dict)

    def peers(self) -> list[str]:
        return [p for p in PEERS if p != "llamacpp_sps" or self.draft is not None]

    def decode(self, peer: str, prompt: list[int], max_new_tokens: int, eos: list[int]) -> lc.PeerDecode:
        kind = PEERS[peer]
        if kind == "plain":
            return lc.decode(self.plain, prompt, max_new_tokens, eos)
        if peer not in self.drafters:
            self.drafters[peer] = lc.drafter(kind, self.k[peer], self.draft)
        return lc.decode(self.spec, prompt, max_new_tokens, eos, self.drafters[peer])

    def params(self, peer: str) -> dict:
        p = {"engine": "llama.cpp", "threads": self.threads, "gguf": self.target_file.name,
             "type": GGUF_TYPE[self.dtype]}
        if peer != "llamacpp":
            p["k"] = self.k[peer]
        if peer == "llamacpp_pld":
            p["max_ngram_size"] = 3
        if peer == "llamacpp_sps" and self.draft_file is not None:
            p["draft_gguf"] = self.draft_file.name
        return p


def open_peers(target_dir: str | Path, draft_dir: str | Path | None, dtype: str, k_pld: int, k_sps: int,
               n_ctx: int, log=print) -> LlamaCppPeers:
    """Export (once, cached) and load the bench's models in llama.cpp. InvalidInput when it cannot (the bindings
    missing, a model the export does not know): the bench says so in one line and goes on without these peers."""
    from speclab import gguf
    version = lc.available()
    if version is None:
        raise InvalidInput("llama-cpp-python is not installed: the llama.cpp peers are left out (scripts/setup.sh "
                           "builds it)")
    if dtype not in GGUF_TYPE:
        raise InvalidInput(f"llama.cpp peers: dtype {dtype} has no GGUF type")
    t = gguf.cached(target_dir, GGUF_TYPE[dtype])
    d = gguf.cached(draft_dir, GGUF_TYPE[dtype]) if draft_dir is not None else None
    n = lc.threads()
    peers = LlamaCppPeers(dtype, {"llamacpp_pld": k_pld, "llamacpp_sps": k_sps}, t, d, threads=n)
    peers.plain = lc.load(t, n_ctx=n_ctx)
    peers.spec = lc.load(t, n_ctx=n_ctx, speculative=True)
    peers.draft = lc.load(d, n_ctx=n_ctx) if d is not None else None
    peers.version = lc.engine_version()
    log(f"llama.cpp peers: {', '.join(peers.peers())} ({version}, {n} threads, {GGUF_TYPE[dtype]} GGUF)")
    return peers


def record(store, peers: LlamaCppPeers, peer: str, res: lc.PeerDecode, meta: dict, output_text: str) -> int:
    """The peer's run in the trace: a plain run row; a speculative one through the import mapping of llama.cpp's
    timings, with its steps (`speclab.production`). -> run id."""
    from speclab.equality import output_hash
    from speclab.production.llamacpp import from_response
    digest = output_hash(res.ids)
    if not res.per_step:
        rid = store.start_run(method=peer, params=peers.params(peer), engine="llama.cpp",
                              engine_version=peers.version, **meta)
        store.finish_run(rid, "done", new_tokens=len(res.ids), elapsed_s=res.elapsed_s,
                         prefill_ms=res.prompt_ms, output_hash=digest, output_text=output_text)
        return rid
    drafted = sum(d for d, _ in res.per_step)
    accepted = sum(a for _, a in res.per_step)
    timings = {"prompt_n": meta.get("prompt_tokens"), "prompt_ms": res.prompt_ms, "predicted_n": len(res.ids),
               "predicted_ms": res.eval_ms, "draft_n": drafted, "draft_n_accepted": accepted,
               "draft_n_verif_steps": len(res.per_step)}
    run = from_response({"timings": timings, "content": output_text}, f"{peer} (bench)", peers.version)
    run.per_step = list(res.per_step)
    run.max_draft = peers.k[peer]
    run.check()
    row = run.meta(meta.get("category"), meta.get("device"))
    params = {**peers.params(peer), **run.params()}
    row.update({k: v for k, v in meta.items() if k not in ("device", "category")}, method=peer,
               params_json=json.dumps(params, sort_keys=True, default=str),
               elapsed_s=res.elapsed_s, output_hash=digest,
               new_tokens=len(res.ids))
    return store.add_finished_runs([row], [run.tables()])[0]
