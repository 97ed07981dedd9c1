"""The speclab Gradio app: a thin layer over `speclab` (decoding, trace) and `speclab.viz` (every figure and
HTML fragment). Run it with `make run` or `speclab app`.

Tabs: side-by-side live decoding with per-token acceptance shading; draft trees and per-round charts of
any run; a trace explorer (runs list, reopen a run, a read-only SQL box).
"""
from __future__ import annotations

import argparse
import time

import gradio as gr
import pandas as pd

from speclab import viz
from speclab.cli import add_model_args, load_models
from speclab.equality import first_divergence
from speclab.errors import SpeclabError
from speclab.generate import Generation
from speclab.methods import METHODS
from speclab.metrics import tau, tokens_per_s
from speclab.suites import SUITES, load_suite
from speclab.target import Target
from speclab.trace import TraceStore, token_columns, vocab_text

STREAM_EVERY_S = 0.25  # throttle: at most four UI updates per second while decoding
MAX_COLUMNS = 4
CSS = ".speclab-col{border:1px solid #ddd;border-radius:6px;padding:6px;min-height:80px}"


class Lab:
    """The models and the trace shared by all browser sessions (decodes are serialised by the event queue)."""

    def __init__(self, target: Target, models: dict, store: TraceStore):
        self.target, self.models, self.store = target, models, store  # drafter models by role (speclab.methods)
        self.text = vocab_text(target.tokenizer)

    # ---- side by side ----
    def side_by_side(self, prompt, methods, k, tree_topk, deferred, max_new, temperature, seed, shade, stop_prob=0.0):
        """Generator for the Run button: decodes the chosen methods interleaved round by round, streaming."""
        methods = list(methods or [])
        if not methods:
            raise gr.Error("Choose at least one method.")
        if len(methods) > MAX_COLUMNS:
            raise gr.Error(f"Choose at most {MAX_COLUMNS} methods.")
        if not prompt or not prompt.strip():
            raise gr.Error("The prompt is empty.")
        try:
            gens = {m: Generation(self.target, prompt, m, **self.models, max_new_tokens=int(max_new),
                                  temperature=float(temperature), seed=int(seed) if seed is not None else None,
                                  deferred=bool(deferred), trace=self.store, k=int(k), depth=int(k),
                                  tree_topk=int(tree_topk), stop_prob=float(stop_prob or 0.0))
                    for m in methods}
        except (SpeclabError, ValueError) as e:
            raise gr.Error(str(e))
        cols = {m: {"spans": [], "tokens": 0, "rounds": 0, "calls": 0, "s": 0.0, "last_round": None} for m in methods}
        iters = {m: iter(g) for m, g in gens.items()}
        legend = viz.legend_html(list(dict.fromkeys(d for g in gens.values() for d in g.drafters)), shade)
        last = 0.0
        while iters:
            for m in list(iters):
                try:
                    ev = next(iters[m])
                except StopIteration:
                    del iters[m]
                    cols[m]["s"] = gens[m].result.elapsed_s  # the run's decode time, as in the trace
                    continue
                c = cols[m]
                c["spans"] += viz.token_spans(token_columns([ev], self.text), c["last_round"], shade)
                c["last_round"] = ev.round
                c["tokens"] += ev.committed.numel()
                c["rounds"] += 1
                c["calls"] += ev.target_calls
                c["s"] = ev.elapsed_ms / 1e3
            if time.perf_counter() - last > STREAM_EVERY_S or not iters:
                last = time.perf_counter()
                if iters:
                    status = "decoding: " + ", ".join(f"{m} {cols[m]['tokens']} tokens" for m in methods)
                    pick = gr.update()
                else:  # done: offer the runs in the other tabs, the first drafting method's run selected
                    status = "done: " + ", ".join(f"{m} run {g.run_id}" for m, g in gens.items())
                    status += self._equality_note(gens, float(temperature))
                    shown = next((m for m in methods if METHODS[m].build), methods[0])
                    pick = gr.update(choices=self.run_choices(), value=str(gens[shown].run_id))
                yield (status, legend, *self._columns(methods, cols), pick)

    def _equality_note(self, gens, temperature) -> str:
        """Greedy runs beside AR: where an output differs, the first position and the target's top-2 logit gap."""
        ar = gens.get("ar")
        if ar is None or temperature > 0 or ar.result is None:
            return ""
        notes = []
        for m, g in gens.items():
            div = first_divergence(self.target, g.prompt_ids, ar.result.token_ids, g.result.token_ids) if m != "ar" else None
            notes.append(f"{m} {div.describe()}" if div else (f"{m} equals AR" if m != "ar" else ""))
        return " · " + "; ".join(n for n in notes if n)

    def _columns(self, methods, cols):
        ar = cols.get("ar")
        ar_tps = tokens_per_s(ar["tokens"], ar["s"]) if ar and ar["s"] else None
        out = []
        for m in methods:
            c = cols[m]
            tps = tokens_per_s(c["tokens"], c["s"]) if c["s"] else 0.0
            stats = {"tok/s": f"{tps:.1f}", "tau": f"{tau(c['tokens'], c['rounds']):.2f}", "rounds": c["rounds"],
                     "target calls": c["calls"]}
            if ar_tps:
                stats["speedup"] = f"{tps / ar_tps:.2f}x"
            out.append(gr.update(value=viz.tokens_html(c["spans"], viz.stats_header(m, stats)), visible=True))
        out += [gr.update(value="", visible=False)] * (MAX_COLUMNS - len(methods))
        return out

    # ---- runs, trees, charts ----
    def run_choices(self) -> list[str]:
        return [str(r) for r in self.store.query("SELECT run_id FROM runs ORDER BY run_id DESC LIMIT 200").run_id]

    def run_view(self, run_id, shade="depth"):
        """Token HTML, round slider range and charts of one run (and of the runs decoded with it)."""
        rid = _run_id(run_id)
        runs = self.store.query("SELECT * FROM runs WHERE run_id = ?", [rid])
        if runs.empty:
            raise gr.Error(f"No run {run_id} in {self.store.path}.")
        r = runs.iloc[0]
        toks = self.store.tokens(rid)
        cols = {c: toks[c].tolist() for c in viz.TOKEN_COLUMNS}
        header = viz.stats_header(f"run {rid} · {r.method}", {"status": r.status, "tokens": len(toks),
                                                                "category": r.category or "-"})
        html = viz.legend_html([r.method] if r.method in METHODS and METHODS[r.method].build else [], shade) + \
            viz.tokens_html(viz.token_spans(cols, None, shade), header)
        # charts: this run and the runs decoded together with it (same prompt, started within a minute)
        peers = self.store.query("""SELECT run_id, method FROM runs WHERE prompt_text IS NOT DISTINCT FROM ?
                                    AND abs(epoch(started_at) - epoch(?::TIMESTAMP)) < 60 ORDER BY run_id""",
                                 [r.prompt_text, r.started_at])
        ids = peers.run_id.tolist() or [rid]
        labels = {int(i): f"{m} #{i}" for i, m in zip(peers.run_id, peers.method)} or {rid: f"{r.method} #{rid}"}
        rounds = self.store.query(f"SELECT * FROM rounds WHERE run_id IN ({','.join('?' * len(ids))}) ORDER BY run_id, round", ids)
        rounds["label"] = rounds.run_id.map(labels)
        pos = self.store.query(f"""SELECT run_id, depth, acceptance, rounds_reaching FROM position_acceptance
                                   WHERE run_id IN ({','.join('?' * len(ids))}) ORDER BY run_id, depth""", ids)
        pos["method"] = pos.run_id.map(labels)
        n_rounds = max(0, len(self.store.rounds(rid)) - 1)
        return (html, gr.update(maximum=max(1, n_rounds), value=0), viz.accepted_per_round(rounds),
                viz.position_acceptance(pos), viz.phase_breakdown(rounds), self.tree(rid, 0))

    def tree(self, run_id, rnd):
        rid = _run_id(run_id)
        nodes = self.store.draft_nodes(rid, int(rnd))
        nodes["text"] = self.text[nodes.token_id.to_numpy()] if len(nodes) else []
        if nodes.empty:
            return viz.tree_figure(pd.DataFrame(columns=["node", "parent", "depth", "token_id", "draft_prob",
                                                         "target_prob", "accepted", "text"]),
                                   title=f"run {rid}, round {int(rnd)}: no draft (target step)")
        root = self.store.query("SELECT text FROM tokens WHERE run_id = ? AND round < ? ORDER BY pos DESC LIMIT 1",
                                [rid, int(rnd)])
        return viz.tree_figure(nodes, root.text[0] if len(root) else "prompt", f"run {rid}, round {int(rnd)}")

    # ---- trace explorer ----
    def runs_table(self, method, category):
        df = self.store.runs(method=method or None, category=category or None)
        keep = ["run_id", "started_at", "method", "category", "status", "new_tokens", "rounds", "target_calls", "elapsed_s"]
        return df[keep].sort_values("run_id", ascending=False).head(500)

    def sql(self, query):
        try:
            df, truncated = self.store.safe_query(query, max_rows=1000, timeout_s=5.0)
        except SpeclabError as e:
            return pd.DataFrame(), f"**Refused:** {e}"
        return df, f"{len(df)} row(s)" + (" (first 1000 shown)" if truncated else "")


def _run_id(run_id) -> int:
    try:
        return int(str(run_id).strip())
    except ValueError:
        raise gr.Error(f"'{run_id}' is not a run id.")


def build_app(lab: Lab) -> gr.Blocks:
    methods = list(METHODS)
    with gr.Blocks(title="speclab") as demo:
        gr.Markdown(f"# speclab · speculative decoding lab\ntarget `{lab.target.name}` · "
                    + " · ".join(f"{role} `{getattr(m, 'name', '-')}`" for role, m in lab.models.items())
                    + f" · trace `{lab.store.path}`")
        with gr.Tab("Side by side"):
            with gr.Row():
                prompt = gr.Textbox(label="Prompt", lines=4, elem_id="prompt", scale=3)
                with gr.Column(scale=1):
                    suite = gr.Dropdown(list(SUITES), value="demo", label="Prompt set", elem_id="suite")
                    pick = gr.Dropdown([], label="Pick a prompt", elem_id="pick")
            with gr.Row():
                chosen = gr.CheckboxGroup(methods, value=[m for m in ("ar", "sps", "pld") if m in methods],
                                          label="Methods (2-4 side by side)", elem_id="methods")
                k = gr.Slider(1, 12, value=4, step=1, label="k (draft length / depth)", elem_id="k")
                topk = gr.Slider(1, 4, value=1, step=1, label="tree top-k (sps, eagle3; 1 = chain)", elem_id="topk")
                stop_prob = gr.Slider(0, 0.9, value=0, step=0.05, elem_id="stop_prob",
                                      label="sps chain: stop after a draft token below this probability (0 = off)")
            with gr.Row():
                deferred = gr.Checkbox(True, label="deferred bonus token")
                max_new = gr.Slider(8, 512, value=96, step=8, label="max new tokens", elem_id="max_new")
                temperature = gr.Number(0.0, label="temperature (0 = greedy)", minimum=0, elem_id="temperature")
                seed = gr.Number(0, label="seed", precision=0)
                shade = gr.Radio(["depth", "draft_prob"], value="depth", label="shade by")
            run = gr.Button("Decode side by side", variant="primary", elem_id="run")
            status = gr.Markdown("", elem_id="status")
            legend = gr.HTML("")
            with gr.Row():
                columns = [gr.HTML("", visible=False, elem_id=f"col{i}") for i in range(MAX_COLUMNS)]
        with gr.Tab("Rounds & trees"):
            with gr.Row():
                run_pick = gr.Dropdown(lab.run_choices(), label="Run", elem_id="run_pick", allow_custom_value=True)
                rnd = gr.Slider(0, 1, value=0, step=1, label="Round", elem_id="round")
            run_html = gr.HTML("")
            tree_plot = gr.Plot(label="Draft tree", elem_id="tree")
            with gr.Row():
                per_round = gr.Plot(label="Committed per round", elem_id="per_round")
                per_pos = gr.Plot(label="Per-position acceptance", elem_id="per_pos")
            phases = gr.Plot(label="Phase times", elem_id="phases")
        with gr.Tab("Trace explorer"):
            with gr.Row():
                f_method = gr.Dropdown([""] + methods + ["hf_assisted", "hf_pld"], value="", label="method")
                f_cat = gr.Textbox("", label="category")
                refresh = gr.Button("List runs")
            runs_df = gr.Dataframe(lab.runs_table(None, None), label="Runs (pick one in 'Rounds & trees')",
                                   interactive=False, elem_id="runs")
            sql_box = gr.Textbox("SELECT method, count(*) AS runs, avg(tau) AS tau, avg(tokens_per_s) AS tok_s\n"
                                 "FROM run_metrics GROUP BY method", lines=4, label="SQL (read-only; tables runs, rounds, "
                                 "tokens, draft_nodes, router_decisions; views run_metrics, position_acceptance)",
                                 elem_id="sql")
            sql_run = gr.Button("Run SQL", elem_id="sql_run")
            sql_msg = gr.Markdown("", elem_id="sql_msg")
            sql_out = gr.Dataframe(label="Result", interactive=False, elem_id="sql_out")

        suite.change(lambda s: gr.update(choices=[(r["prompt"][:80], r["prompt"]) for r in load_suite(s, 6)], value=None),
                     suite, pick)
        demo.load(lambda s: gr.update(choices=[(r["prompt"][:80], r["prompt"]) for r in load_suite(s, 6)]), suite, pick)
        pick.change(lambda p: p or gr.update(), pick, prompt)
        run.click(lab.side_by_side, [prompt, chosen, k, topk, deferred, max_new, temperature, seed, shade, stop_prob],
                  [status, legend, *columns, run_pick], concurrency_limit=1)
        run_pick.change(lab.run_view, [run_pick, shade], [run_html, rnd, per_round, per_pos, phases, tree_plot])
        rnd.release(lab.tree, [run_pick, rnd], tree_plot)
        refresh.click(lab.runs_table, [f_method, f_cat], runs_df)
        sql_run.click(lab.sql, sql_box, [sql_out, sql_msg])
    return demo


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="speclab app")
    add_model_args(ap)
    ap.add_argument("--db", default="traces/app.duckdb")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7860)
    a = ap.parse_args(argv)
    from pathlib import Path
    Path(a.db).parent.mkdir(parents=True, exist_ok=True)
    print(f"speclab app: opening trace {a.db} ...", flush=True)
    store = TraceStore(a.db)
    target, models = load_models(a, log=lambda s: print(f"speclab app: {s}", flush=True))
    demo = build_app(Lab(target, models, store))
    demo.queue(default_concurrency_limit=1)
    demo.launch(server_name=a.host, server_port=a.port, css=CSS, show_error=True)


if __name__ == "__main__":
    main()
