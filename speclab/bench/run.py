"""Running a benchmark: suites x methods, interleaved, traced, with Hugging Face's own speculative decoding as peers
(`run_bench`). Its tables and report: `speclab.bench.results`; parameter grids: `speclab.bench.grid`; cost
micro-benchmarks: `speclab.bench.costs`.

For every prompt the methods run in a rotated order (machine drift hits all alike) after a warm-up. Every
speclab run is a traced run tagged with the bench id; the peers (`hf_assisted`: `generate(assistant_model=
draft)`, `hf_pld`: `generate(prompt_lookup_num_tokens=k)`) are recorded as runs without rounds. Metrics come
from `speclab.metrics` (one SQL definition each); greedy output equality with AR is checked per run
through `runs.output_hash`; where an output differs, the first differing position and the target's top-2 logit
gap there go to `runs.diverges_at` / `runs.top2_gap` and the report says whether it is a numerical near-tie.
Every speclab method also runs untraced (`<method>-untraced`, a run row without rounds, like the peers): the peer
comparison uses those, traced / untraced time is the tracing overhead, and on CPU their `model_call_share` is the
share of decode time spent inside model forwards (the rest is the engine's own work).
"""
from __future__ import annotations

import json
import resource
import time
import uuid
from dataclasses import asdict, dataclass, field

import torch

from speclab.bench.suites import load_suite
from speclab.core import native, verify
from speclab.core.precision import dtype_name, family
from speclab.core.target import Target
from speclab.drafters.registry import drafters
from speclab.equality import first_divergence, output_hash
from speclab.errors import InvalidInput
from speclab.generate import encode_prompt, generate, model_ms, run_device
from speclab.methods import get_method
from speclab.progress import Progress
from speclab.trace import TraceStore

PEERS = ("hf_assisted", "hf_pld")


@dataclass
class BenchConfig:
    suite: str = "zoo"
    methods: list[str] = field(default_factory=lambda: ["ar", "sps", "pld"])
    limit: int | None = 8  # prompts per category
    max_new_tokens: int = 128
    drafter_params: dict = field(default_factory=lambda: {n: dict(e.bench) for n, e in drafters().items() if e.bench})
    # drafter -> the parameters its methods take in a bench (its registry entry's `bench`)
    tree_topk: int = 1  # the drafters run beside a transformers peer (sps): their tree (the peer's is a chain)
    stop_prob: float = 0.0  # and their early stop after a draft token below this probability (the peer's the same)
    peers: bool = True
    untraced: bool = True  # also time every method with tracing off (peer comparison, tracing overhead)
    warmup: int = 1
    temperature: float = 0.0  # > 0: every method samples (prompt i at seed `seed + i`); no equality, no peers
    seed: int = 0
    dtypes: dict = field(default_factory=dict)  # method -> the dtype it runs in (`plan_dtypes`); absent: the target's
    dtype_why: dict = field(default_factory=dict)  # method family -> why (`DtypeDecision.line`), for the report
    threads: int | None = None  # torch's threads while the bench ran (set by run_bench; the report says it)
    layers: str | None = None  # how the model layers ran: "native" (`speclab.core.native`) or "python" (set by
    # run_bench; SPECLAB_NATIVE=0 or no compiler: python)
    chain_verify: str | None = None  # how sampled chains were verified (`speclab.core.verify.CHAIN_RULE`: block or
    # token; set by run_bench)
    model_sets: dict = field(default_factory=dict)  # method -> the key of its model set when not its dtype (a spec
    # pinned to a dtype whose auto set runs a drafter model in its own dtype: `speclab.cli.bench.load_bench_sets`)


def plan_dtypes(methods: list[str], resolve) -> tuple[list[str], dict[str, str]]:
    """(methods, method -> dtype): each method in its pinned dtype (`eagle3@bf16`) or its family's
    (`resolve(family)`: --dtype, or what --dtype auto chose for AR and for the speculative methods), plus AR in
    every dtype a speculative method runs in and AR itself does not (`ar@bf16`: the equality reference and a
    same-dtype AR for those methods). One dtype for everything when --dtype names one and no spec pins another."""
    from speclab.methods import split_dtype
    dts = {m: split_dtype(m)[1] or resolve(family(m)) for m in methods}
    ar = {d for m, d in dts.items() if family(m) == "ar"}
    extra = [f"ar@{d}" for d in dict.fromkeys(d for m, d in dts.items() if family(m) != "ar") if d not in ar]
    return list(methods) + extra, {**dts, **{m: m.split("@")[1] for m in extra}}


def format_prompt(target: Target, row: dict) -> torch.Tensor:
    """Chat prompts go through the tokenizer's chat template when it has one (real chat models on GPU)."""
    tok = target.tokenizer
    if row.get("chat") and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
        return torch.tensor(ids, dtype=torch.long)
    return encode_prompt(target, row["prompt"])


@torch.inference_mode()
def peer_generate(kind: str, target: Target, draft: Target | None, ids: torch.Tensor, max_new_tokens: int, k: int,
                  stop_prob: float = 0.0):
    """Hugging Face's own assisted generation / prompt lookup, greedy, on the same models, configured like
    speclab's method: k draft tokens a round (constant schedule) and the same early-stop threshold
    (`assistant_confidence_threshold`; HF's default is 0.4, 0 turns it off). Returns (ids, seconds)."""
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=target.eos_ids or None,
              pad_token_id=target.tokenizer.pad_token_id or (target.eos_ids or [0])[0])
    if kind == "hf_assisted":
        draft.model.generation_config.num_assistant_tokens = k
        draft.model.generation_config.num_assistant_tokens_schedule = "constant"
        draft.model.generation_config.assistant_confidence_threshold = stop_prob
        kw.update(assistant_model=draft.model)
    elif kind == "hf_pld":
        kw.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=3)
    inp = ids.view(1, -1).to(target.device)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = target.model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), **kw)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, inp.shape[1]:].cpu(), time.perf_counter() - t0


def new_bench_id(suite: str) -> str:
    """A bench's id: its suite, the time and a random tail ("zoo-20261126-172206-ccaf20")."""
    return f"{suite}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


class Bench:
    """One benchmark's decoding, prompt by prompt: its prompts (the suite's that fit the context), methods, peers
    and models. `run_bench` decodes every prompt in one process; `speclab.cluster` gives each Ray worker its
    own Bench (the same prompts, methods and id) and the prompts to decode. `llamacpp`: the llama.cpp peers
    (`speclab.bench.llamacpp.open_peers`), run beside the others when the bench runs peers."""

    def __init__(self, cfg: BenchConfig, target: Target, models: dict, sets: dict | None = None, llamacpp=None,
                 bench_id: str | None = None, log=print):
        self.cfg, self.target, self.models, self.sets, self.llamacpp = cfg, target, models, sets or {}, llamacpp
        self.draft = models.get("draft")
        for m in cfg.methods:
            get_method(m)
        if not any(family(m) == "ar" for m in cfg.methods):
            raise InvalidInput("a benchmark needs 'ar' among its methods: speedups and equality are measured "
                               "against it")
        self.rows, self.skipped = [], []
        for r in load_suite(cfg.suite, cfg.limit):
            ids = format_prompt(target, r)
            (self.rows if ids.numel() + cfg.max_new_tokens <= target.max_context else self.skipped).append((r, ids))
        if not self.rows:
            raise InvalidInput(f"no prompt of suite '{cfg.suite}' fits the context ({target.max_context} tokens)")
        peers = [p for p in PEERS if cfg.peers and (p != "hf_assisted" or self.draft is not None)]
        self.lc_peers = llamacpp.peers() if cfg.peers and llamacpp is not None and cfg.temperature == 0 else []
        peers += self.lc_peers
        if peers and cfg.temperature > 0:
            log("the peers decode greedily only: left out of a sampled bench")
            peers = []
        self.peers = peers
        self.bench_id = bench_id or new_bench_id(cfg.suite)
        self.untraced = [f"{m}-untraced" for m in cfg.methods] if cfg.untraced else []
        self.order = cfg.methods + self.untraced + self.peers  # every prompt's runs, rotated by the prompt's index
        cfg.threads = torch.get_num_threads()
        cfg.layers = native.mode()
        cfg.chain_verify = verify.CHAIN_RULE

    def on(self, m):
        """(target, models) of method m."""
        return self.sets.get(self.cfg.model_sets.get(m, self.cfg.dtypes.get(m)), (self.target, self.models))

    def params(self, m):
        """The bench's settings of the method's drafter (`drafter_params`, and --tree-topk / --stop-prob where it
        runs beside a transformers peer); a spec's own parameters override them, others keep defaults."""
        cfg, method = self.cfg, get_method(m)
        e = drafters().get(method.drafter or "")
        if e is None:
            return {}
        matched = {"tree_topk": cfg.tree_topk, "stop_prob": cfg.stop_prob} if e.peer else {}
        return {**cfg.drafter_params.get(e.name, {}), **{k: v for k, v in matched.items() if k in method.defaults}}

    def sampling(self, i):
        return {"temperature": self.cfg.temperature, "seed": self.cfg.seed + i} if self.cfg.temperature > 0 else {}

    def group(self, i):
        """The decode group of prompt i's runs: every method and peer decoded on it in this bench."""
        return f"{self.bench_id}/{i}"

    def start(self, store: TraceStore) -> None:
        """The bench's row, `running` until `finish`."""
        store.append_row("benches", **self.row(), status="running")

    def row(self) -> dict:
        cfg = self.cfg
        return dict(bench_id=self.bench_id, suite=cfg.suite, methods=",".join(cfg.methods + self.peers),
                    config_json=json.dumps(asdict(cfg)), device=str(self.target.device))

    def warm_up(self) -> None:
        """Every code path once, untraced and traced, unrecorded."""
        with TraceStore(":memory:") as scratch:
            for _, ids in self.rows[: self.cfg.warmup]:
                for m in self.cfg.methods:
                    t, ms = self.on(m)
                    for trace in (None, scratch):
                        generate(t, ids, m, models=ms, max_new_tokens=16, trace=trace, **self.params(m))
                for p in self.peers:
                    if p in self.lc_peers:
                        self.llamacpp.decode(p, ids.tolist(), 16, self.target.eos_ids)
                    else:
                        peer_generate(p, self.target, self.draft, ids, 16, 4, self.cfg.stop_prob)

    def decode(self, i: int, store: TraceStore, done=lambda m: None) -> None:
        """Prompt i's runs, every method, its untraced twin and every peer, in the prompt's rotated order (machine
        drift hits all alike), each written to `store` (`done(method)` after each); then, greedy, where each output
        differs from AR's."""
        r, ids = self.rows[i]
        order = self.order
        outputs = {}  # method -> (run id, generated ids) for this prompt
        for m in order[i % len(order):] + order[: i % len(order)]:
            if self.target.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            if m in self.peers:
                outputs[m] = self._peer(m, r, ids, i, store)
            elif m in self.untraced:
                outputs[m] = self._untraced(m.removesuffix("-untraced"), r, ids, i, store)
            else:
                outputs[m] = self._traced(m, r, ids, i, store)
                store.drain()  # its trace lands before the next run starts timing (no overlap with it)
                if self.target.device.type == "cuda":
                    store.finish_run(outputs[m][0], "done", peak_mem_mb=torch.cuda.max_memory_allocated() / 2**20)
            done(m)
        if self.cfg.temperature == 0:  # sampled outputs differ from AR's by design
            lc = self.sets.get(self.llamacpp.dtype, (self.target,))[0] if self.lc_peers else None
            record_divergences(store, ids, outputs, {m: lc if m in self.lc_peers else
                                                     self.on(m.removesuffix("-untraced"))[0] for m in order})

    def finish(self, store: TraceStore) -> None:
        """The bench's tracing overhead (traced / untraced decode time over every prompt and method: same run, same
        outputs) and peak memory on its row, and `done`."""
        overhead = self.overhead(store.query("SELECT method, elapsed_s FROM runs WHERE bench_id = ?",
                                             [self.bench_id]), self.cfg)
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        store.execute("UPDATE benches SET trace_overhead = ?, peak_rss_mb = ?, status = 'done' WHERE bench_id = ?",
                      [overhead, peak_rss, self.bench_id])

    @staticmethod
    def overhead(runs, cfg: BenchConfig) -> float | None:
        """Traced over untraced decode time, summed over the bench's methods (`runs`: method, elapsed_s)."""
        if not cfg.untraced:
            return None
        t = runs.groupby("method").elapsed_s.sum()
        return sum(t[m] for m in cfg.methods) / sum(t[f"{m}-untraced"] for m in cfg.methods)

    def _traced(self, m, r, ids, i, store):
        t, ms = self.on(m)
        res = generate(t, ids, m, models=ms, max_new_tokens=self.cfg.max_new_tokens, trace=store,
                       prompt_id=r["prompt_id"], category=r["category"], bench_id=self.bench_id, group=self.group(i),
                       **self.params(m), **self.sampling(i))
        return res.run_id, res.token_ids

    def _untraced(self, m, r, ids, i, store):
        t, ms = self.on(m)
        params = {**self.params(m), **self.sampling(i)}
        res = generate(t, ids, m, models=ms, max_new_tokens=self.cfg.max_new_tokens, **params)
        rid = store.start_run(method=f"{m}-untraced", target=t.name, params=params, prompt_id=r["prompt_id"],
                              category=r["category"], **run_device(t), bench_id=self.bench_id,
                              prompt_tokens=ids.numel(), decode_group=self.group(i))
        store.finish_run(rid, "done", new_tokens=len(res.token_ids), elapsed_s=res.elapsed_s, wall_s=res.decode.wall_s,
                         prefill_ms=res.decode.prefill_ms, model_ms=model_ms(t, res.decode),
                         target_calls=res.decode.target_calls, output_hash=output_hash(res.token_ids))
        return rid, res.token_ids

    def _llamacpp(self, p, r, ids, i, store):
        from speclab.bench.llamacpp import record
        lc, target, draft = self.llamacpp, self.target, self.draft
        lc_target = self.sets.get(lc.dtype, (target, None))[0]
        res = lc.decode(p, ids.tolist(), self.cfg.max_new_tokens, target.eos_ids)
        meta = {"target": target.name, "drafters": draft.name if p == "llamacpp_sps" and draft else None,
                "prompt_id": r["prompt_id"], "category": r["category"], "bench_id": self.bench_id,
                "prompt_tokens": ids.numel(), "decode_group": self.group(i),
                **{**run_device(lc_target), "logits_dtype": lc.dtype, "exact": False}}
        rid = record(store, lc, p, res, meta, target.tokenizer.decode(res.ids, skip_special_tokens=True))
        return rid, res.ids

    def _peer(self, p, r, ids, i, store):
        if p in self.lc_peers:
            return self._llamacpp(p, r, ids, i, store)
        cfg, target, draft = self.cfg, self.target, self.draft
        beside = next(n for n, e in drafters().items() if e.peer == p)  # the drafter it runs beside: its k
        k = cfg.drafter_params.get(beside, {}).get("k", 4)
        out, secs = peer_generate(p, target, draft, ids, cfg.max_new_tokens, k, cfg.stop_prob)
        peer_params = {"k": k, "stop_prob": cfg.stop_prob} if p == "hf_assisted" else {"k": k}
        rid = store.start_run(method=p, target=target.name, drafters=draft.name if p == "hf_assisted" else None,
                              params=peer_params, prompt_id=r["prompt_id"], category=r["category"],
                              **{**run_device(target), "logits_dtype": dtype_name(target.dtype),
                                 "exact": False},  # transformers' own forward and head
                              bench_id=self.bench_id, prompt_tokens=ids.numel(), decode_group=self.group(i))
        store.finish_run(rid, "done", new_tokens=out.numel(), elapsed_s=secs, output_hash=output_hash(out.tolist()),
                         output_text=target.tokenizer.decode(out.tolist(), skip_special_tokens=True))
        return rid, out.tolist()


def run_bench(cfg: BenchConfig, target: Target, models: dict, store: TraceStore, log=print,
              sets: dict | None = None, llamacpp=None) -> str:
    """Run the benchmark of `cfg.methods` (method specs) with the drafter models by role (`models`: "draft" also
    drives the hf_assisted peer) in this process; returns its bench id (rows in `runs` / `benches` of the store). A
    method whose dtype (`cfg.dtypes`) names one of `sets` (dtype -> (target, models)) runs on that set, every other
    on (`target`, `models`), which also format the prompts and run the peers (`Bench`)."""
    bench = Bench(cfg, target, models, sets, llamacpp, log=log)
    bench.start(store)
    if bench.skipped:
        log(f"skipping {len(bench.skipped)} prompt(s) longer than the context ({target.max_context} tokens)")
    bench.warm_up()
    prog = Progress(len(bench.rows) * len(bench.order), f"bench {cfg.suite}")
    try:
        for i, (r, _) in enumerate(bench.rows):
            bench.decode(i, store, lambda m, r=r: prog.update(prog.done + 1, prompt=r["prompt_id"], method=m))
    except BaseException as e:  # Ctrl-C / SIGTERM / a failure: the bench row says so (its runs say it themselves)
        store.execute("UPDATE benches SET status = ? WHERE bench_id = ?",
                      ["interrupted" if isinstance(e, KeyboardInterrupt) else "failed", bench.bench_id])
        raise
    bench.finish(store)
    return bench.bench_id


def record_divergences(store: TraceStore, prompt_ids: torch.Tensor, outputs: dict, targets: dict) -> None:
    """For every output that differs from the output of AR in its dtype on this prompt (`outputs`: method -> (run
    id, ids); `targets`: method -> the target it ran on, peers absent: AR's): where, and that target's top-2 logit
    gap there."""
    default = targets.get("ar")
    ars = {targets.get(m, default).dtype: out for m, out in outputs.items() if family(m) == "ar" and "-" not in m}
    for m, (rid, ids) in outputs.items():
        t = targets.get(m, default)
        ar = ars.get(t.dtype)
        div = first_divergence(t, prompt_ids, ar[1], ids) if ar and (rid, ids) is not ar else None
        if div is not None:
            store.record_divergence(rid, div)
