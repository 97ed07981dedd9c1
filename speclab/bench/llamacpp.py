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
from speclab.metrics import paired_gain

PEERS = {"llamacpp": "plain", "llamacpp_pld": "pld", "llamacpp_sps": "sps"}
GGUF_TYPE = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}  # speclab's dtype -> the GGUF file type


def model_dirs(target_dir, draft_dir) -> tuple[Path, Path | None]:
    """The checkpoints the peers export (None: the zoo's): the target, and the draft of `llamacpp_sps`, which is the
    zoo's only beside the zoo's target (its tokenizer); another target without a draft gets no `llamacpp_sps`."""
    from speclab.zoo import default_draft, default_target
    draft = draft_dir or (default_draft() if target_dir is None else None)
    return Path(target_dir or default_target()), None if draft is None else Path(draft)


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


def bench_peers(cfg, paths, target, pld_k: int, sps_k: int, log=print) -> LlamaCppPeers | None:
    """The llama.cpp peers of a greedy CPU bench with peers (`speclab.bench.run.BenchConfig` cfg, on the models of
    `paths`, a `speclab.models.ModelPaths`), in the dtype of the bench's speculative methods (AR's when it has
    none); None, said in one line, where they cannot run."""
    from speclab.core.precision import family
    if not (cfg.peers and cfg.temperature == 0 and target.device.type == "cpu"):
        return None
    spec = [cfg.dtypes[m] for m in cfg.methods if family(m) != "ar"]
    dtype = max(set(spec), key=spec.count) if spec else cfg.dtypes[next(m for m in cfg.methods if family(m) == "ar")]
    try:
        return open_peers(*model_dirs(paths.target, paths.models.get("draft")), dtype, pld_k, sps_k,
                          target.max_context, log=log)
    except InvalidInput as e:
        log(f"llama.cpp peers left out: {e}")
        return None


def record(store, peers: LlamaCppPeers, peer: str, res: lc.PeerDecode, meta: dict, output_text: str) -> int:
    """The peer's run in the trace: a plain run row; a speculative one through the import mapping of llama.cpp's
    timings, with its steps (`speclab.production`). -> run id."""
    from speclab.equality import output_hash
    from speclab.production.llamacpp import from_response
    digest = output_hash(res.ids)
    if not res.per_step:
        rid = store.start_run(method=peer, params=peers.params(peer), engine="llama.cpp",
                              engine_version=peers.version, source=f"{peer} (bench)", **meta)
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


def per_token_costs(targets: dict, target_dir, prompts: list, tokens: int, eos: list[int], progress=None):
    """ms per generated token of speclab's AR and llama.cpp's plain decoding, per dtype (`targets`: dtype ->
    speclab Target), prompt by prompt, interleaved: speclab's decode time after the prefill, llama.cpp's one-token
    forwards (its own timer) and its wall time after the prompt. Returns one row per (dtype, prompt)."""
    import pandas as pd

    from speclab import gguf
    from speclab.generate import generate
    rows = []
    for dtype, t in targets.items():
        llm = lc.load(gguf.cached(target_dir, GGUF_TYPE[dtype]), n_ctx=t.max_context)
        generate(t, prompts[0], "ar", max_new_tokens=8)  # warm-up, both engines
        lc.decode(llm, prompts[0].tolist(), 8, eos)
        for i, ids in enumerate(prompts):
            r = generate(t, ids, "ar", max_new_tokens=tokens)
            p = lc.decode(llm, ids.tolist(), tokens, eos)
            n, m = len(r.token_ids), len(p.ids)
            rows.append({"dtype": dtype, "prompt": i, "tokens": n,
                         "speclab_ms_per_token": (r.elapsed_s * 1e3 - r.decode.prefill_ms) / max(n - 1, 1),
                         "llamacpp_ms_per_token": p.eval_ms / max(m - 1, 1),
                         "llamacpp_wall_ms_per_token": (p.elapsed_s * 1e3 - p.prompt_ms) / max(m - 1, 1),
                         "same_output": r.token_ids == p.ids})
            if progress:
                progress()
    return pd.DataFrame(rows)


def k_sweep(peers: LlamaCppPeers, prompts: list, tokens: int, eos: list[int], ks: dict, progress=None):
    """tokens/s of llama.cpp's plain decoding and of each speculative peer at each k in `ks` (peer -> ks), prompt by
    prompt; one row per (peer, k, prompt)."""
    import pandas as pd
    rows = []
    for i, ids in enumerate(prompts):
        runs = [("llamacpp", 0)] + [(p, k) for p, kk in ks.items() for k in kk]
        for p, k in runs[i % len(runs):] + runs[: i % len(runs)]:  # rotated: drift hits all alike
            if p != "llamacpp":
                peers.drafters[p] = lc.drafter(PEERS[p], k, peers.draft)
            r = peers.decode(p, ids.tolist(), tokens, eos)
            steps = r.per_step or []
            rows.append({"peer": p, "k": k, "prompt": i, "tokens": len(r.ids), "tokens_per_s": len(r.ids) / r.elapsed_s,
                         "tau": (sum(a + 1 for _, a in steps) / len(steps)) if steps else 1.0})
            if progress:
                progress()
    return pd.DataFrame(rows)


def sweep_table(df):
    """Per (peer, k): tokens/s, tau, and the gain over plain decoding paired by prompt (95% half-width)."""
    import pandas as pd
    base = df[df.peer == "llamacpp"].set_index("prompt").tokens_per_s
    out = []
    for (p, k), g in df.groupby(["peer", "k"], sort=True):
        g = g.set_index("prompt")
        gain, ci = paired_gain(g.tokens_per_s, base.loc[g.index])
        out.append({"peer": p, "k": k, "tokens_per_s": g.tokens.sum() / (g.tokens / g.tokens_per_s).sum(),
                    "tau": g.tau.mean(), "gain_vs_plain": gain, "gain_ci95": ci})
    return pd.DataFrame(out)


def cost_summary(per, targets: dict, bw: dict):
    """Per dtype, from `per_token_costs`' rows: the medians of both engines' ms per token, speclab's over llama.cpp's
    paired by prompt (`metrics.paired_gain`, + 1) with its half-width, the target's weight bytes over the read
    bandwidth `bw` (`roofline.bandwidths`: a one-token forward's floor), and how many outputs were identical."""
    import pandas as pd
    out = []
    for d, g in per.groupby("dtype", sort=False):
        weight_bytes = sum(p.numel() * p.element_size() for p in targets[d].model.parameters())
        gain, ci = paired_gain(g.speclab_ms_per_token, g.llamacpp_ms_per_token)
        out.append({"dtype": d, "speclab_ar_ms": g.speclab_ms_per_token.median(),
                    "llamacpp_ms": g.llamacpp_ms_per_token.median(),
                    "llamacpp_wall_ms": g.llamacpp_wall_ms_per_token.median(),
                    "speclab_over_llamacpp": gain + 1, "ci95": ci,
                    "bound_ms": weight_bytes / (bw["dram_gbs"] * 1e9) * 1e3, "weights_mb": weight_bytes / 2**20,
                    "same_output": f"{int(g.same_output.sum())}/{len(g)}"})
    return pd.DataFrame(out)


def costs_report(summary, table, profile, peers: LlamaCppPeers, bw: dict, what: str):
    """`speclab costs llamacpp`'s report: the per-token table (`cost_summary`), the draft-length sweep
    (`sweep_table`) with its plot, and the AR step profile (`steps.steps_report`'s `profile`)."""
    import torch

    from speclab.core.precision import cpu_label
    from speclab.viz import Report, lines_figure
    fmt = dict(index=False, floatfmt=".3f")
    cpu = cpu_label()
    text = "\n".join([
        f"{cpu}; speclab: torch {torch.__version__}, {torch.get_num_threads()} threads; llama.cpp: "
        f"{peers.version}, {peers.threads} threads. {what}, greedy.", "",
        "## ms per token: llama.cpp's plain decoding against speclab's AR", "",
        ("speclab_ar_ms: speclab's decode time after the prefill per later token; llamacpp_ms: llama.cpp's own timer "
         "over its one-token forwards; llamacpp_wall_ms: its wall time after the prompt per token (the bindings' "
         "Python included); medians over the prompts. speclab_over_llamacpp: the ratio, paired by prompt, with its "
         "95% half-width. bound_ms: the target's weight bytes over the read bandwidth "
         f"({bw['dram_gbs']:.1f} GB/s, {bw['large_mb']:.0f} MB working set): a one-token forward's floor. "
         "same_output: prompts where both engines' greedy text is identical."), "",
        summary.to_markdown(**fmt), "",
        f"## llama.cpp's draft lengths ({GGUF_TYPE[peers.dtype]} GGUF)", "",
        ("tokens/s and tau per peer and k; gain_vs_plain: over llama.cpp's plain decoding, paired by prompt (95% "
         "half-width). The bindings recommend k = 2 on CPU and 10 on GPU."), "", table.to_markdown(**fmt), ""])
    fig = lines_figure(table, "k", "tokens_per_s", "peer", f"llama.cpp: tokens/s by draft length ({cpu})",
                       "k (draft tokens a step)", "tokens/s")
    base = table[table.peer == "llamacpp"].tokens_per_s
    if len(base):
        fig.add_hline(y=float(base.iloc[0]), line_dash="dot", annotation_text="plain decoding")
    return Report(f"llama.cpp against speclab ({cpu})", text + "\n## Where one speclab AR step goes\n\n" +
                  profile.text, [fig, *profile.figs], summary=text)
