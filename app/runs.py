"""Any traced run reopened: its tokens, draft trees round by round, per-round charts, the router figure of a
routed run; and the trace explorer (the runs, refreshed whenever the tab opens or a decode ends, and a read-only
SQL box)."""
from __future__ import annotations

import json

import gradio as gr
import pandas as pd
import torch

from app.lab import Lab, answers, run_id_of
from speclab import export, viz
from speclab.bench.routing import router_rounds
from speclab.checks import Bound, check_number
from speclab.errors import InvalidInput, SpeclabError
from speclab.generate import encode_prompt
from speclab.methods import METHODS, build_method, get_method, method_params
from speclab.metrics import run_metrics, time_split
from speclab.production import view
from speclab.routing import replay


def routed_run(r) -> bool:
    return r.router not in (None, "fixed") and r.router == r.router


SQL_EXAMPLE = ("SELECT method, count(*) AS runs, avg(tau) AS tau, avg(tokens_per_s) AS tok_s\n"
               "FROM run_metrics GROUP BY method")


NO_RUNS = ("**No runs in the trace yet.** Decode a prompt in *Side by side* (every decode is traced here), or "
           "point `--db` at a trace made by `speclab bench`; then its rounds and trees show here.")


class Runs:
    def __init__(self, lab: Lab):
        self.lab = lab

    @answers(9)
    def view(self, run_id, shade="depth", compare=None):
        """Token HTML, round slider range and charts of one run (and of the runs decoded with it, and the run
        picked to compare with)."""
        if run_id in (None, ""):
            return ("", gr.update(maximum=1, value=0), None, None, None, None, None,
                    gr.update(visible=False, value=None), NO_RUNS if not self.lab.run_choices() else "")
        try:
            r = self.run_row(run_id)
        except InvalidInput as e:  # one message (the follow-up events stay quiet), and the run shown before is not
            gr.Warning(str(e))  # left under an id that is not its own
            return ("", gr.update(maximum=1, value=0), None, None, None, None, None,
                    gr.update(visible=False, value=None), f"{e}: pick a run from the list")
        rid = int(r.run_id)
        charts, n_rounds = self.charts(r, compare)
        return (self.tokens_html(r, shade), gr.update(maximum=max(1, n_rounds), value=0), *charts.values(),
                self.tree(rid, 0), self.router(r), "")

    def charts(self, r, compare=None) -> tuple[dict, int]:
        """Per-round, accept-length, per-position and phase charts of a run and the runs decoded with it (same
        prompt, started within a minute; an imported run: itself), and of `compare` (a run id: a speclab run
        beside an engine's, say); and the run's number of rounds."""
        store, rid = self.lab.store, int(r.run_id)
        ids = [rid] if isinstance(getattr(r, "engine", None), str) else store.decoded_with(rid)
        if compare not in (None, "") and run_id_of(compare) not in ids:
            ids.append(int(self.run_row(compare).run_id))
        labels = view.labels(store, ids)
        rounds = store.rounds_of(ids)
        rounds["label"] = rounds.run_id.map(labels)
        charts = {"per_round": viz.accepted_per_round(rounds),
                  "histogram": viz.accept_histogram(view.histogram_frame(store, ids)),
                  "per_pos": viz.position_acceptance(view.position_frame(store, ids)),
                  "phases": viz.phase_breakdown(rounds)}
        return charts, max(0, int((rounds.run_id == rid).sum()) - 1)

    def tokens_html(self, r, shade: str) -> str:
        """The run's tokens coloured by drafter, its header counted as the trace counts it (`run_metrics`)."""
        store, rid = self.lab.store, int(r.run_id)
        toks = store.tokens_with_decisions(rid)
        cols = {c: toks[c].tolist() for c in (*viz.TOKEN_COLUMNS, *viz.ROUTER_COLUMNS, "accept_prob") if c in toks}
        m = run_metrics(store, [rid])
        stats = {"status": r.status, "category": r.category or "-"}
        if len(m):
            x = m.iloc[0]
            stats |= {"tokens": int(x.new_tokens) if pd.notna(x.new_tokens) else "-",
                      "rounds": int(x.rounds or 0),
                      "target calls": int(x.target_calls) if x.target_calls == x.target_calls else "-",
                      "tau": f"{x.tau:.2f}", "tok/s": f"{x.tokens_per_s:.1f}" if pd.notna(x.tokens_per_s) else "-"}
        phases = store.phase_ms(rid)
        split = time_split(phases, 1e3 * r.elapsed_s, drafted=bool(r.drafters)) \
            if r.elapsed_s == r.elapsed_s and r.elapsed_s else None
        header = viz.stats_header(f"run {rid} · {r.method}", stats, split)
        if isinstance(getattr(r, "engine", None), str):  # an imported run: where it came from, how it was converted
            card = {"engine": r.engine, "version": r.engine_version or "unknown", "source": r.source,
                    "scope": json.loads(r.params_json or "{}").get("scope"), "model": r.target or "-"}
            return header + viz.engine_card(card, view.conversions(store, [rid]), r.output_text)
        drafters = (r.drafters or "").split(",")  # every drafter of the run (a single one's too), whatever its status
        sampled = bool(pd.notna(pd.Series(cols.get("accept_prob", []), dtype=float)).any())
        return viz.legend_html([d for d in drafters if d], shade, sampled) + viz.tokens_html(
            viz.token_spans(cols, None, shade), header)

    @answers(1)
    def reshade(self, run_id, shade):
        """The shown run's tokens with another shade."""
        if run_id in (None, ""):
            return gr.skip()
        return self.tokens_html(self.run_row(run_id), shade)

    def router(self, r):
        """The router figure of a routed run (hidden for others)."""
        fig = self.router_figure(r)
        return gr.update(visible=False, value=None) if fig is None else gr.update(visible=True, value=fig)

    def router_figure(self, r):
        """A routed run's router figure, with counterfactuals from its bench's profile or one made on demand
        (`counterfactuals`, the event that follows); None for a run without a router."""
        if not routed_run(r):
            return None
        profile = self.known_profile(r)
        why = "" if profile is not None else f" (counterfactuals: {self.on_demand(r) or 'profiling ...'})"
        rr = router_rounds(self.lab.store, int(r.run_id), profile)
        return viz.router_figure(rr, f"run {r.run_id} · {r.method}: router per round{why}")

    def run_row(self, run_id):
        """The run's row; InvalidInput for an id that is not one or not in the trace."""
        r = self.lab.store.run(run_id_of(run_id))
        if r is None:
            raise InvalidInput(f"no run {run_id} in the trace")
        return r

    @answers(1)
    def export_run(self, run_id, fmt):
        """The run's tables (runs, rounds, tokens, draft_nodes, router_decisions) as one zip of CSV or Parquet."""
        if run_id in (None, ""):
            raise InvalidInput("no run to export: pick one first")
        return str(export.export_run(self.lab.store, run_id_of(run_id), fmt, self.lab.exports))

    @answers(1)
    def export_figures(self, run_id, rnd):
        """The run's figures as one standalone HTML page (the round's tree, the router, the charts)."""
        if run_id in (None, ""):
            raise InvalidInput("no run to export: pick one first")
        r = self.run_row(run_id)
        charts, _ = self.charts(r)
        figs = [self.tree(int(r.run_id), int(rnd or 0)), self.router_figure(r), *charts.values()]
        return str(export.export_figures([f for f in figs if f is not None], f"run {r.run_id} · {r.method}",
                                         f"run-{r.run_id}-figures", self.lab.exports))

    def known_profile(self, r):
        """The run's greedy profile at hand: kept for it (side by side, on demand, or found before), else its
        bench's, loaded once and kept; None when there is none yet."""
        rid = int(r.run_id)
        if rid not in self.lab.profiles and r.bench_id:
            try:
                found = next((p for p in replay.load_profiles(self.lab.store, r.bench_id)[0]
                              if p.prompt_id == r.prompt_id), None)
            except InvalidInput:
                found = None
            if found is not None:
                self.lab.profiles[rid] = found
        return self.lab.profiles.get(rid)

    def on_demand(self, r) -> str | None:
        """Why the run's counterfactuals cannot be profiled now (None: they can)."""
        params = json.loads(r.params_json or "{}")
        if r.status != "done":
            return f"none: the run is {r.status}"
        if float(params.get("temperature") or 0) > 0:
            return "none: they exist for greedy runs only"
        if not r.prompt_text:
            return "none: the trace has no prompt text for this run"
        for role in get_method(r.method).needs:
            loaded = getattr(self.lab.models.get(role), "name", None)
            if params.get(role) != loaded:
                return f"none: the run's {role} model ({params.get(role)}) is not the one loaded"
        return None

    @answers(1)
    def counterfactuals(self, run_id, progress=gr.Progress()):
        """A reopened routed run without a profile: its greedy profile at its round starts, made now (waiting its
        turn for the models) and kept for the session; the router figure redrawn with it."""
        if run_id in (None, ""):
            return gr.skip()
        try:
            r = self.run_row(run_id)
        except InvalidInput:  # `view` has said so
            return gr.skip()
        rid = int(r.run_id)
        if not routed_run(r) or self.known_profile(r) is not None or self.on_demand(r):
            return gr.skip()
        lab, params = self.lab, json.loads(r.params_json or "{}")
        toks = lab.store.tokens(rid)
        starts = toks.groupby("round").pos.min().tolist()
        with lab.line.hold(progress):
            progress(0, desc=f"profiling its drafters at the {len(starts)} round starts of run {rid} ...")
            drafters, _ = build_method(r.method, lab.target, lab.models, method_params(r.method, params, lab.target))
            self.lab.profiles[rid] = replay.profile_sequence(
                lab.target, drafters, encode_prompt(lab.target, r.prompt_text), torch.tensor(toks.token_id.to_numpy()),
                int(params.get("max_new_tokens") or len(toks)), positions=starts, arms=tuple(drafters))
        return self.router(r)

    @answers(1)
    def tree(self, run_id, rnd, color_by: str = "accepted"):
        rid = run_id_of(run_id)
        last = int(self.lab.store.query("SELECT count(*) AS n FROM rounds WHERE run_id = ?", [rid]).n[0]) - 1
        rnd = check_number("round", rnd, int, Bound(0, max(1, last)))  # a typed round: in the slider's range
        nodes = self.lab.store.draft_nodes(rid, int(rnd))
        # an imported run's nodes have no tokens (engines report counts): shown as "?"
        nodes["text"] = [self.lab.text[int(t)] if pd.notna(t) else "?" for t in nodes.token_id]
        if nodes.empty:
            return viz.tree_figure(pd.DataFrame(columns=["node", "parent", "depth", "token_id", "draft_prob",
                                                         "target_prob", "accepted", "text"]),
                                   title=f"run {rid}, round {int(rnd)}: no draft (target step)")
        root = self.lab.store.text_before(rid, int(rnd))
        drafter = self.lab.store.round_drafter(rid, int(rnd))
        who = f"{drafter}'s draft" if drafter else "draft"
        return viz.tree_figure(nodes, "prompt" if root is None else root, f"run {rid}, round {int(rnd)}: {who}",
                               color_by)

    def table(self, method=None, category=None):
        """The newest 500 runs with their figures (`run_metrics`), rounded. A method name matches its specs too
        (`whiflash-neural` lists `whiflash-neural:threshold=0.45`)."""
        return self.lab.store.run_list(method, category, limit=500)

    def opened(self, evt: gr.SelectData):
        """A click on a row of the run list opens that run in 'Rounds & trees'."""
        row = getattr(evt, "row_value", None)
        if not row:
            return gr.skip(), gr.skip()
        return gr.update(value=str(int(row[0]))), gr.update(selected="rounds")

    def refresh(self, method=None, category=None, current=None):
        """The explorer's run list and the run picker, as the trace holds them now (the picker keeps its run, or
        takes the newest), and the line that says when there is none."""
        choices = self.lab.run_choices()
        value = current if current in choices else (choices[0] if choices else None)
        return self.table(method, category), gr.update(choices=choices, value=value), "" if choices else NO_RUNS

    @answers(1)
    def export_sql(self, query, fmt):
        """The SQL box's result (the query run again, read-only as ever) as CSV or Parquet."""
        df, _ = self.lab.store.safe_query(query, max_rows=1_000_000, timeout_s=30.0)
        return str(export.export_frame(df, "query-result", fmt, self.lab.exports))

    def sql(self, query):
        try:
            df, truncated = self.lab.store.safe_query(query, max_rows=1000, timeout_s=5.0)
        except SpeclabError as e:  # the result table says so too (an empty frame would show Gradio's "1 2 3")
            return pd.DataFrame({"refused: nothing ran (see the message above)": []}), f"**Refused:** {e}"
        ran = " ".join(str(query).split())
        ran = (ran[:100] + " ...") if len(ran) > 100 else ran
        shown = " (first 1000 shown)" if truncated else ""
        return df, f"{len(df)} row(s){shown} · `{ran.replace('`', chr(39))}`"  # the query echoed: which result this is


def build_rounds(lab: Lab, runs: Runs, shade) -> dict:
    """The tab's components; the page's load event fills the run picker with the trace's newest run *now*."""
    with gr.Row():
        run_pick = gr.Dropdown([], value=None, label="Run", elem_id="run_pick", allow_custom_value=True)
        rnd = gr.Slider(0, 1, value=0, step=1, label="Round", elem_id="round")
    none = gr.Markdown("", elem_id="run_none")
    run_html = gr.HTML("", elem_id="run_html")
    router_plot = gr.Plot(visible=False, label="Router", elem_id="run_router")
    tree_color = gr.Radio(["accepted", "block", "bucket"], value="accepted", elem_id="tree_color",
                          label="colour tree nodes by (block, bucket: SpecBlock's trees)")
    tree_plot = gr.Plot(label="Draft tree", elem_id="tree")
    compare = gr.Dropdown([], value=None, label="Compare with run (its accept lengths and per-position acceptance "
                          "beside this run's: a speclab run beside an imported one)", elem_id="run_compare",
                          allow_custom_value=True)
    with gr.Row():
        per_round = gr.Plot(label="Committed per round", elem_id="per_round")
        histogram = gr.Plot(label="Accepted draft tokens per step", elem_id="histogram")
    with gr.Row():
        per_pos = gr.Plot(label="Per-position acceptance", elem_id="per_pos")
        phases = gr.Plot(label="Phase times", elem_id="phases")
    with gr.Row():  # PNG: the camera button in each figure's toolbar
        fmt = gr.Radio(list(export.FORMATS), value="csv", label="table format", elem_id="run_fmt")
        run_export = gr.Button("Export the run's tables", elem_id="run_export")
        figs_export = gr.Button("Export the figures (HTML)", elem_id="figs_export")
    run_files = gr.File(label="Exported (PNG: each figure's camera button)", elem_id="run_files", interactive=False)
    run_export.click(runs.export_run, [run_pick, fmt], run_files)
    figs_export.click(runs.export_figures, [run_pick, rnd], run_files)
    shown = [run_html, rnd, per_round, histogram, per_pos, phases, tree_plot, router_plot, none]
    run_pick.change(runs.view, [run_pick, shade, compare], shown).then(
        runs.counterfactuals, run_pick, router_plot, concurrency_limit=None)  # waits its turn in lab.line
    compare.change(runs.view, [run_pick, shade, compare], shown)
    compare.focus(lambda: gr.update(choices=[""] + lab.run_choices()), None, compare)
    shade.change(runs.reshade, [run_pick, shade], run_html)
    # a drag ends on release; a typed round (Enter) or the arrow keys are inputs (always the last one drawn). Gradio
    # checks the round against the slider's range first, in a step with no output: a refused round is one toast,
    # the tree stays as drawn (an error on the tree's own event would cover it with an "Error" box), and the box
    # shows the drawn round again
    drawn = "() => +((document.querySelector('#tree .gtitle')?.textContent.match(/round (\\d+)/) || [0, 0])[1])"
    for moved in (rnd.release, rnd.input):
        check = moved(lambda r: None, rnd, None, trigger_mode="always_last", show_progress="hidden")
        check.success(runs.tree, [run_pick, rnd, tree_color], tree_plot)
        check.failure(None, None, rnd, js=drawn)
    tree_color.change(runs.tree, [run_pick, rnd, tree_color], tree_plot)
    return {"run_pick": run_pick, "none": none, "compare": compare}


def build_explorer(lab: Lab, runs: Runs) -> dict:
    with gr.Row():
        f_method = gr.Dropdown([""] + list(METHODS) + ["hf_assisted", "hf_pld"], value="", label="method",
                               allow_custom_value=True, elem_id="f_method")
        f_cat = gr.Textbox("", label="category", elem_id="f_cat")
        refresh = gr.Button("Refresh", elem_id="refresh")
    runs_df = gr.Dataframe(runs.table(), label="Runs (click a row to open it in 'Rounds & trees')",
                           interactive=False, elem_id="runs", max_height=420)
    sql_box = gr.Textbox(SQL_EXAMPLE, lines=4, elem_id="sql",
                         label="SQL (read-only; tables runs, rounds, tokens, draft_nodes, router_decisions, benches, "
                               "profiles, engine_totals, engine_steps, steps; views run_metrics, position_acceptance, "
                               "accept_histogram)")
    sql_run = gr.Button("Run SQL", elem_id="sql_run")
    sql_msg = gr.Markdown("", elem_id="sql_msg")
    sql_out = gr.Dataframe(pd.DataFrame({"run a query to see its result": []}), label="Result", interactive=False,
                           elem_id="sql_out")
    with gr.Row():
        sql_fmt = gr.Radio(list(export.FORMATS), value="csv", label="format", elem_id="sql_fmt")
        sql_export = gr.Button("Export the result", elem_id="sql_export")
    sql_file = gr.File(label="Exported result", elem_id="sql_file", interactive=False)
    sql_export.click(runs.export_sql, [sql_box, sql_fmt], sql_file)
    refresh.click(runs.table, [f_method, f_cat], runs_df)
    # the filters act as they change (a method picked or typed, a category as it is typed), not only on Refresh
    f_method.change(runs.table, [f_method, f_cat], runs_df, trigger_mode="always_last", show_progress="hidden")
    f_cat.change(runs.table, [f_method, f_cat], runs_df, trigger_mode="always_last", show_progress="hidden")
    # a click while a query runs is kept (the last one), not dropped: the message says which query each result is
    sql_run.click(runs.sql, sql_box, [sql_out, sql_msg], trigger_mode="always_last")
    return {"runs_df": runs_df, "f_method": f_method, "f_cat": f_cat}
