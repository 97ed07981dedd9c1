"""Any traced run reopened: its tokens, draft trees round by round, per-round charts, the router figure of a
routed run; and the trace explorer (the runs, refreshed whenever the tab opens or a decode ends, and a read-only
SQL box)."""
from __future__ import annotations

import gradio as gr
import pandas as pd

from app.lab import Lab, answers, run_id_of
from speclab import viz
from speclab.errors import InvalidInput, SpeclabError
from speclab.methods import METHODS
from speclab.routing import replay
from speclab.routing.evaluate import router_rounds

RUN_COLUMNS = ["run_id", "started_at", "method", "category", "status", "new_tokens", "rounds", "target_calls",
               "elapsed_s"]
SQL_EXAMPLE = ("SELECT method, count(*) AS runs, avg(tau) AS tau, avg(tokens_per_s) AS tok_s\n"
               "FROM run_metrics GROUP BY method")


class Runs:
    def __init__(self, lab: Lab):
        self.lab = lab

    @answers(7)
    def view(self, run_id, shade="depth"):
        """Token HTML, round slider range and charts of one run (and of the runs decoded with it)."""
        store, rid = self.lab.store, run_id_of(run_id)
        runs = store.query("SELECT * FROM runs WHERE run_id = ?", [rid])
        if runs.empty:
            raise InvalidInput(f"no run {run_id} in the trace")
        r = runs.iloc[0]
        toks = store.query("""SELECT t.*, d.choice AS drafter, d.signal, d.threshold FROM tokens t
                              LEFT JOIN router_decisions d USING (run_id, round) WHERE t.run_id = ? ORDER BY t.pos""",
                           [rid])
        cols = {c: toks[c].tolist() for c in (*viz.TOKEN_COLUMNS, *viz.ROUTER_COLUMNS)}
        header = viz.stats_header(f"run {rid} · {r.method}", {"status": r.status, "tokens": len(toks),
                                                                "category": r.category or "-"})
        base = r.method.split(":")[0]
        drafters = (r.drafters or "").split(",") if base in METHODS and METHODS[base].build else []
        html = viz.legend_html([d for d in drafters if d], shade) + viz.tokens_html(viz.token_spans(cols, None, shade),
                                                                                    header)
        # charts: this run and the runs decoded together with it (same prompt, started within a minute)
        peers = store.query("""SELECT run_id, method FROM runs WHERE prompt_text IS NOT DISTINCT FROM ?
                               AND abs(epoch(started_at) - epoch(?::TIMESTAMP)) < 60 ORDER BY run_id""",
                            [r.prompt_text, r.started_at])
        ids = peers.run_id.tolist() or [rid]
        labels = {int(i): f"{m} #{i}" for i, m in zip(peers.run_id, peers.method)} or {rid: f"{r.method} #{rid}"}
        marks = ",".join("?" * len(ids))
        rounds = store.query(f"SELECT * FROM rounds WHERE run_id IN ({marks}) ORDER BY run_id, round", ids)
        rounds["label"] = rounds.run_id.map(labels)
        pos = store.query(f"""SELECT run_id, depth, acceptance, rounds_reaching FROM position_acceptance
                              WHERE run_id IN ({marks}) ORDER BY run_id, depth""", ids)
        pos["method"] = pos.run_id.map(labels)
        n_rounds = max(0, int((rounds.run_id == rid).sum()) - 1)
        return (html, gr.update(maximum=max(1, n_rounds), value=0), viz.accepted_per_round(rounds),
                viz.position_acceptance(pos), viz.phase_breakdown(rounds), self.tree(rid, 0), self.router(r))

    def router(self, r):
        """The router figure of a routed run, with counterfactuals when its bench was profiled."""
        if r.router in (None, "fixed") or r.router != r.router:
            return gr.update(visible=False, value=None)
        profile = None
        if r.bench_id:
            try:
                profile = next((p for p in replay.load_profiles(self.lab.store, r.bench_id)[0]
                                if p.prompt_id == r.prompt_id), None)
            except InvalidInput:
                profile = None
        rr = router_rounds(self.lab.store, int(r.run_id), profile)
        return gr.update(visible=True, value=viz.router_figure(rr, f"run {r.run_id} · {r.method}: router per round"))

    @answers(1)
    def tree(self, run_id, rnd):
        rid = run_id_of(run_id)
        nodes = self.lab.store.draft_nodes(rid, int(rnd))
        nodes["text"] = self.lab.text[nodes.token_id.to_numpy()] if len(nodes) else []
        if nodes.empty:
            return viz.tree_figure(pd.DataFrame(columns=["node", "parent", "depth", "token_id", "draft_prob",
                                                         "target_prob", "accepted", "text"]),
                                   title=f"run {rid}, round {int(rnd)}: no draft (target step)")
        root = self.lab.store.query("SELECT text FROM tokens WHERE run_id = ? AND round < ? ORDER BY pos DESC LIMIT 1",
                                    [rid, int(rnd)])
        drafter = self.lab.store.query("SELECT drafter FROM rounds WHERE run_id = ? AND round = ?", [rid, int(rnd)])
        who = f"{drafter.drafter[0]}'s draft" if len(drafter) and drafter.drafter[0] else "draft"
        return viz.tree_figure(nodes, root.text[0] if len(root) else "prompt", f"run {rid}, round {int(rnd)}: {who}")

    def table(self, method=None, category=None):
        df = self.lab.store.runs(method=method or None, category=category or None)
        return df[RUN_COLUMNS].sort_values("run_id", ascending=False).head(500)

    def refresh(self, method=None, category=None, current=None):
        """The explorer's run list and the run picker, as the trace holds them now."""
        choices = self.lab.run_choices()
        value = current if current in choices else (choices[0] if choices else None)
        return self.table(method, category), gr.update(choices=choices, value=value)

    def sql(self, query):
        try:
            df, truncated = self.lab.store.safe_query(query, max_rows=1000, timeout_s=5.0)
        except SpeclabError as e:
            return pd.DataFrame(), f"**Refused:** {e}"
        ran = " ".join(str(query).split())
        ran = (ran[:100] + " ...") if len(ran) > 100 else ran
        shown = " (first 1000 shown)" if truncated else ""
        return df, f"{len(df)} row(s){shown} · `{ran.replace('`', chr(39))}`"  # the query echoed: which result this is


def build_rounds(lab: Lab, runs: Runs, shade) -> dict:
    with gr.Row():
        run_pick = gr.Dropdown(lab.run_choices(), label="Run", elem_id="run_pick", allow_custom_value=True)
        rnd = gr.Slider(0, 1, value=0, step=1, label="Round", elem_id="round")
    run_html = gr.HTML("", elem_id="run_html")
    router_plot = gr.Plot(visible=False, label="Router", elem_id="run_router")
    tree_plot = gr.Plot(label="Draft tree", elem_id="tree")
    with gr.Row():
        per_round = gr.Plot(label="Committed per round", elem_id="per_round")
        per_pos = gr.Plot(label="Per-position acceptance", elem_id="per_pos")
    phases = gr.Plot(label="Phase times", elem_id="phases")
    run_pick.change(runs.view, [run_pick, shade], [run_html, rnd, per_round, per_pos, phases, tree_plot, router_plot])
    rnd.release(runs.tree, [run_pick, rnd], tree_plot)
    return {"run_pick": run_pick}


def build_explorer(lab: Lab, runs: Runs) -> dict:
    with gr.Row():
        f_method = gr.Dropdown([""] + list(METHODS) + ["hf_assisted", "hf_pld"], value="", label="method",
                               allow_custom_value=True, elem_id="f_method")
        f_cat = gr.Textbox("", label="category", elem_id="f_cat")
        refresh = gr.Button("Refresh", elem_id="refresh")
    runs_df = gr.Dataframe(runs.table(), label="Runs (open one in 'Rounds & trees')", interactive=False,
                           elem_id="runs")
    sql_box = gr.Textbox(SQL_EXAMPLE, lines=4, elem_id="sql",
                         label="SQL (read-only; tables runs, rounds, tokens, draft_nodes, router_decisions, benches, "
                               "profiles; views run_metrics, position_acceptance)")
    sql_run = gr.Button("Run SQL", elem_id="sql_run")
    sql_msg = gr.Markdown("", elem_id="sql_msg")
    sql_out = gr.Dataframe(label="Result", interactive=False, elem_id="sql_out")
    refresh.click(runs.table, [f_method, f_cat], runs_df)
    sql_run.click(runs.sql, sql_box, [sql_out, sql_msg])
    return {"runs_df": runs_df, "f_method": f_method, "f_cat": f_cat}
