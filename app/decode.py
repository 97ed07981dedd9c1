"""Side by side: the chosen methods decode one prompt interleaved round by round, streamed to the page.

Each method has its own parameters (shown only while it is chosen). Tokens are coloured by the drafter that
drafted them; a routed run also gets a live router plot (signal against threshold, choices, accepted lengths)
and, when greedy, the counterfactual accept lengths of both drafters once it ends.

Streaming stays light: updates are throttled (STREAM_EVERY_S), a column's token HTML only ever grows (Gradio
sends the appended part, not the whole column), its stats header is a separate small component, and router
plots refresh at most every ROUTER_EVERY_S.
"""
from __future__ import annotations

import time
import uuid

import gradio as gr
import torch

from app.lab import Lab, answers, waiting
from speclab import viz
from speclab.bench.routing import event_rounds, with_counterfactual
from speclab.bench.suites import SUITES, load_suite
from speclab.checks import MAX_TEMPERATURE, Bound, check_number
from speclab.equality import first_divergence, kind_of
from speclab.errors import InvalidInput, SpeclabError
from speclab.generate import Generation, check_generation, encode_prompt
from speclab.methods import METHODS, method_params
from speclab.metrics import acceptance_rate, speedup, tau, time_split, tokens_per_s
from speclab.routing import replay
from speclab.trace import decision_columns, token_columns

STREAM_EVERY_S = 0.25  # at most four page updates a second while decoding
ROUTER_EVERY_S = 2.0  # router plots are whole figures (~10 KB, and costly to draw): refreshed less often, not in
# the first update (which carries only tokens, so they show at once)
MAX_COLUMNS = 4
# once a decode is drawn: its verdict and its columns' start on screen (the columns' start alone when both don't fit)
SHOW_RESULTS = """() => requestAnimationFrame(() => requestAnimationFrame(() => {
    const status = document.querySelector('#status'), col = document.querySelector('#col0');
    if (!status || !col) return;
    const top = status.getBoundingClientRect().top + window.scrollY;
    const cols = col.getBoundingClientRect().top + window.scrollY;
    window.scrollTo(0, cols - top > 0.6 * window.innerHeight ? cols - 0.4 * window.innerHeight : top);
}))"""
MAX_PROMPT_CHARS = 20000  # beyond this a prompt cannot fit any context speclab decodes in
DEFAULT_METHODS = ("ar", "eagle3", "dflash", "whiflash-neural")
# a column is one card: its header block on top of its token block, no gap between them (item 13 of app v4: Gradio
# puts elem_classes on the block and on the HTML inside it, so the box is drawn on the block only). The cards share
# one grid whose rows each card spans (subgrid): every header row is as tall as the tallest header, so the token
# blocks start on one line
CSS = (".speclab-metric{white-space:nowrap}.speclab-timebar span{white-space:nowrap}"
       ".speclab-cards{display:grid !important;grid-template-columns:repeat(auto-fit,minmax(200px,1fr));"
       "grid-template-rows:auto auto;column-gap:16px}"
       ".speclab-card{display:grid !important;grid-row:span 2;grid-template-rows:subgrid;gap:0 !important}"
       ".block.speclab-head,.block.speclab-toks{border:1px solid #ddd !important;box-shadow:none !important;"
       "padding:6px 8px !important}"
       ".block.speclab-head{border-bottom:none !important;border-radius:6px 6px 0 0 !important}"
       ".block.speclab-toks{border-top:1px dashed #eee !important;border-radius:0 0 6px 6px !important;"
       "min-height:80px}"
       ".speclab-head .html-container,.speclab-toks .html-container{padding:0 !important}"
       ".prose.speclab-toks{white-space:pre-wrap;overflow-wrap:anywhere;font-family:monospace;font-size:13px;"
       "line-height:1.7}")


def routed(gen: Generation) -> bool:
    return gen.router is not None and gen.router.policy != "fixed"


class Column:
    """One method's live view: its token spans (append-only), counters and round events."""

    def __init__(self, gen: Generation):
        self.gen, self.spans, self.events, self.token_cols = gen, [], [], []
        self.tokens = self.rounds = self.calls = self.switches = self.eagle3_rounds = self.drafted = self.accepted = 0
        self.drafting_rounds = 0  # rounds the router gave a drafter (the rest: the target alone)
        self.s, self.last_round, self.profile = 0.0, None, None
        self.phase_ms: dict[str, float] = {}

    def add(self, ev, text, shade: str) -> None:
        cols = token_columns([ev], text)
        if routed(self.gen):
            cols.update(decision_columns([ev]))
        self.token_cols.append((cols, self.last_round))  # kept: a new shade re-renders what is shown
        self.spans += viz.token_spans(cols, self.last_round, shade)
        self.switches += bool(self.events) and ev.drafter != self.events[-1].drafter
        self.eagle3_rounds += ev.decision is not None and ev.decision.choice == "eagle3"
        self.drafting_rounds += ev.decision is not None and ev.decision.choice is not None
        self.events.append(ev)
        self.last_round = ev.round
        self.tokens += ev.committed.numel()
        self.drafted += len(ev.tree)
        self.accepted += ev.n_accepted
        self.rounds += 1
        self.calls = ev.run_calls  # prefill included, as the run row counts
        self.s = ev.elapsed_ms / 1e3
        for p, ms in ev.timings_ms.items():
            self.phase_ms[p] = self.phase_ms.get(p, 0.0) + ms

    def finish(self) -> None:
        """The run's own figures, as its run row has them (decode time with the trace's flush)."""
        res = self.gen.result
        self.s, self.tokens, self.rounds, self.calls = (res.elapsed_s, len(res.token_ids), res.decode.rounds,
                                                        res.decode.target_calls)

    def header(self, method: str, ar_tps: float | None, final: bool) -> str:
        """The column's figures; once the decode ends, with their definitions on hover and the time bar (while it
        streams, the bare figures: the header is re-sent whole with every update)."""
        if not final:
            return viz.stats_header(method, self.stats(ar_tps), explain=False)
        return viz.stats_header(method, self.stats(ar_tps), time_split(self.phase_ms, self.s * 1e3,
                                                                       drafted=bool(self.gen.drafters)))

    def stats(self, ar_tps: float | None) -> dict:
        tps = tokens_per_s(self.tokens, self.s) if self.s else 0.0
        out = {"tok/s": f"{tps:.1f}", "tau": f"{tau(self.tokens, self.rounds):.2f}", "tokens": self.tokens,
               "rounds": self.rounds, "target calls": self.calls}
        if ar_tps:
            out["speedup"] = f"{speedup(tps, ar_tps):.2f}x"
        if self.drafted:  # beside the speedup: how much of what was drafted was kept
            out["acceptance"] = f"{acceptance_rate(self.accepted, self.drafted):.0%}"
        if routed(self.gen) and self.rounds:  # counted as rounds arrive: no table rebuilt per update
            out["switches"] = self.switches
            if "eagle3" in self.gen.drafters and len(self.gen.drafters) > 1:  # WhiFlash's split
                out["EAGLE-3 rounds"] = f"{self.eagle3_rounds / self.rounds:.0%}"
            out["drafted rounds"] = f"{self.drafting_rounds / self.rounds:.0%}"
        return out

    def router_plot(self, method: str):
        rr = with_counterfactual(event_rounds(self.events), self.profile)
        note = "" if self.profile is not None else " (counterfactuals: greedy runs, once decoded)"
        return viz.router_figure(rr, f"{method}: router signal vs threshold per round{note}")


def build(lab: Lab) -> dict:
    """The tab's components and events (inside a gr.Blocks); returns the components other tabs wire to."""
    with gr.Row():
        prompt = gr.Textbox(label="Prompt", lines=4, elem_id="prompt", scale=3)
        with gr.Column(scale=1):
            suite = gr.Dropdown(list(SUITES), value="demo", label="Prompt set", elem_id="suite")
            pick = gr.Dropdown([], label="Pick a prompt", elem_id="pick")
    served = lab.methods()  # the methods whose models are loaded
    chosen = gr.CheckboxGroup(served, value=[m for m in DEFAULT_METHODS if m in served],
                              label=f"Methods (up to {MAX_COLUMNS} side by side)", elem_id="methods")
    keys, widgets, groups, follows = [], [], {}, []
    with gr.Row(equal_height=False):
        for name, m in METHODS.items():
            if not m.params or name not in served:
                continue
            defaults = method_params(name, {}, lab.target)
            with gr.Group(visible=name in DEFAULT_METHODS, elem_id=f"params-{name}") as groups[name]:
                gr.Markdown(f"**{name}**: {m.description}", elem_classes=["speclab-params"])
                mine = {}
                with gr.Row():
                    for p in m.params:  # the registry's declarations: default, bounds, help
                        info = f"{p.help} ({_range(p.bound(lab.target))})"  # one line under the name
                        shows = p.when is None or defaults[p.when[0]] == p.when[1]  # shown only where it applies
                        if p.choices:  # a named choice (FlashHead's head)
                            w = gr.Dropdown(list(p.choices), value=defaults[p.name], label=p.name,
                                            elem_id=f"p-{name}-{p.name}", min_width=110, info=p.help, visible=shows)
                        elif p.many:  # a '+'-joined list (a route's arms), checked by the method on Decode
                            w = gr.Textbox(defaults[p.name], label=p.name, elem_id=f"p-{name}-{p.name}", min_width=240,
                                           info=p.help, visible=shows)
                        elif p.default is None:  # an optional value (a router's threshold): empty = calibrated
                            w = gr.Textbox("", label=p.name, elem_id=f"p-{name}-{p.name}", min_width=160,
                                           info=f"{info}; empty = calibrated", placeholder="calibrated", visible=shows)
                        else:  # no precision: 2.5 reaches the check, not rounded
                            w = gr.Number(defaults[p.name], label=p.name, elem_id=f"p-{name}-{p.name}", min_width=110,
                                          info=info, visible=shows)
                        widgets.append(w)
                        keys.append((name, p.name))
                        mine[p.name] = w
                        if p.sampled is not None:  # a default of its own at T > 0 (DFlash's block size)
                            follows.append((p, w))
                for key, ctrl in mine.items():  # a parameter that governs others (head) shows them as it changes
                    deps = [(p, mine[p.name]) for p in m.params if p.when is not None and p.when[0] == key]
                    if deps:
                        ctrl.change(lambda v, deps=deps: [gr.update(visible=v == p.when[1]) for p, _ in deps],
                                    ctrl, [w for _, w in deps], show_progress="hidden")
    with gr.Row():
        deferred = gr.Checkbox(True, label="deferred bonus token")
        max_new = gr.Number(96, label="max new tokens", elem_id="max_new")
        temperature = gr.Number(0.0, label="temperature (0 = greedy)", elem_id="temperature")
        seed = gr.Number(0, label="seed", elem_id="seed")
        shade = gr.Radio(["depth", "draft_prob"], value="depth", label="shade by", elem_id="shade")
    if follows:  # a box holding one temperature's default takes the other's as the temperature crosses 0
        temperature.change(lambda t, *v: _follow(lab.target, follows, t, v), [temperature, *(w for _, w in follows)],
                           [w for _, w in follows], show_progress="hidden")
    shown = gr.State(None)  # the token columns on the page (plain data): a new shade re-renders them
    run = gr.Button("Decode side by side", variant="primary", elem_id="run")
    status = gr.Markdown("", elem_id="status")
    legend = gr.HTML("", elem_id="legend")
    heads, toks = [], []
    with gr.Row(equal_height=False, elem_classes=["speclab-cards"]):
        for i in range(MAX_COLUMNS):
            with gr.Column(min_width=200, elem_classes=["speclab-card"]):
                heads.append(gr.HTML("", visible=False, elem_id=f"head{i}", elem_classes=["speclab-head"]))
                toks.append(gr.HTML("", visible=False, elem_id=f"col{i}", elem_classes=["speclab-toks"]))
    plots = [gr.Plot(visible=False, elem_id=f"router{i}", label="Router") for i in range(MAX_COLUMNS)]

    decoder = SideBySide(lab, keys)
    suite.change(lambda s: gr.update(choices=_prompts(s), value=None), suite, pick)
    pick.change(lambda p: p or gr.update(), pick, prompt)
    chosen.change(lambda ms: [gr.update(visible=n in (ms or [])) for n in groups], chosen, list(groups.values()))
    # no Gradio concurrency limit: decodes wait their turn for the models in `lab.line`, saying how many are ahead
    event = run.click(decoder.decode, [prompt, chosen, max_new, temperature, seed, deferred, shade, *widgets],
                      [status, legend, *heads, *toks, *plots, shown], concurrency_limit=None, api_name="decode")
    # the results in view once Decode is pressed (the parameter panels above can fill the screen): the status while
    # it runs, then, once the columns are drawn, the verdict and the columns' start together (when the verdict is too
    # long for both, the columns' start in the screen's upper part)
    run.click(None, None, None, js="() => { document.querySelector('#status')?.scrollIntoView({block: 'start'}); }")
    event.then(None, None, None, js=SHOW_RESULTS)
    shade.change(decoder.reshade, [shown, shade], [legend, *toks])
    return {"run": event, "suite": suite, "pick": pick, "prompts": _prompts}


def _follow(target, follows: list, temperature, values) -> list:
    """The boxes of parameters whose default differs at T > 0: each still holding the default of the other side of
    T = 0 gets this side's; a value typed in stays (so does every box while the temperature box holds no number)."""
    try:
        sampled = float(temperature) > 0
    except (TypeError, ValueError):
        return [gr.skip() for _ in follows]
    return [gr.update(value=p.default_on(target, sampled)) if v == p.default_on(target, not sampled) else gr.skip()
            for (p, _), v in zip(follows, values)]


def _range(b) -> str:
    if b is None or (b.lo is None and b.hi is None):
        return "any"
    if b.hi is None:
        return f">= {b.lo:g}"
    return f"{b.lo:g} to {b.hi:g}" + (" excl." if b.hi_open else "")


def _prompts(suite: str) -> list:
    return [(r["prompt"][:80], r["prompt"]) for r in load_suite(suite, 6)]


class SideBySide:
    def __init__(self, lab: Lab, keys: list[tuple[str, str]]):
        self.lab, self.keys = lab, keys

    def _check(self, prompt, methods, max_new, temperature, seed, values) -> dict[str, dict]:
        """Every input checked before any run starts (a run row exists only for decodes that can go ahead)."""
        if not methods:
            raise InvalidInput("choose at least one method")
        if len(methods) > MAX_COLUMNS:
            raise InvalidInput(f"choose at most {MAX_COLUMNS} methods (got {len(methods)})")
        if not prompt or not str(prompt).strip():
            raise InvalidInput("the prompt is empty")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise InvalidInput(f"the prompt is too long ({len(prompt)} characters; at most {MAX_PROMPT_CHARS})")
        # the shared boxes first, named as the page labels them (an empty box says so)
        max_new = check_number("max new tokens", max_new, int, Bound(1, self.lab.target.max_context))
        check_number("temperature", temperature, float, Bound(0.0, MAX_TEMPERATURE))
        check_number("seed", seed, int, Bound(0, 2**63 - 1))
        n = encode_prompt(self.lab.target, prompt).numel()
        if n + max_new > self.lab.target.max_context:
            raise InvalidInput(f"the prompt has {n} tokens: with {max_new} max new tokens that exceeds the model's "
                               f"context of {self.lab.target.max_context} tokens")
        params = {m: {} for m in methods}
        for (m, p), v in zip(self.keys, values):
            if m in params:
                params[m][p] = v
        check_generation(self.lab.target, prompt, "ar", {}, max_new, temperature, seed=seed)  # the shared inputs
        for m in methods:  # then each method's parameters, named in the message
            try:
                check_generation(self.lab.target, prompt, m, self.lab.models, max_new, temperature, seed=seed,
                                 params=params[m])
            except SpeclabError as e:
                raise InvalidInput(f"{m}: {e}") from e
        return params

    @answers(1 + MAX_COLUMNS)
    def reshade(self, shown, shade):
        """The shown columns and legend re-rendered with another shade."""
        if not shown:
            return [gr.skip()] * (1 + MAX_COLUMNS)
        toks = [gr.update(value="".join(span for cols, last in shown["cols"][m]
                                        for span in viz.token_spans(cols, last, shade))) for m in shown["methods"]]
        legend = viz.legend_html(shown["drafters"], shade, shown.get("sampled", False))
        return [legend, *toks, *[gr.skip()] * (MAX_COLUMNS - len(toks))]

    @answers(3 + 3 * MAX_COLUMNS)
    def decode(self, prompt, methods, max_new, temperature, seed, deferred, shade, *values):
        """Generator for the Decode button: waits its turn for the models (saying how many are ahead), then the
        methods interleaved round by round, streamed."""
        lab = self.lab
        methods = [m for m in METHODS if m in (methods or [])]  # columns in the order of the method list
        params = self._check(prompt, methods, max_new, temperature, seed, values)
        ticket = lab.line.join()
        try:
            while n := lab.line.ahead(ticket):
                yield [waiting(n)] + [gr.skip()] * (2 + 3 * MAX_COLUMNS)
            yield from self._decode(prompt, methods, max_new, temperature, seed, deferred, shade, params)
        finally:
            lab.line.leave(ticket)

    def _decode(self, prompt, methods, max_new, temperature, seed, deferred, shade, params):
        lab = self.lab
        gens = {}
        group = f"app-{uuid.uuid4().hex[:12]}"  # this press's runs: the runs decoded beside each other
        for m in methods:  # every column built (its drafter too) before any decode starts and writes a run row
            try:
                gens[m] = Generation(lab.target, prompt, m, models=lab.models, max_new_tokens=max_new,
                                     temperature=temperature, seed=seed, deferred=bool(deferred), trace=lab.store,
                                     group=group, **params[m])
            except SpeclabError as e:
                raise InvalidInput(f"{m}: {e}") from e
        cols = {m: Column(g) for m, g in gens.items()}
        iters = {m: iter(g) for m, g in gens.items()}
        drafters = list(dict.fromkeys(d for g in gens.values() for d in g.drafters))
        greedy = not temperature or float(temperature) == 0  # counterfactuals (a profile) exist for greedy runs only
        legend = viz.legend_html(drafters, shade, sampled=not greedy)
        last, last_plot = 0.0, time.perf_counter()
        first = True
        late = [m for m in methods if routed(gens[m]) and greedy]
        try:
            while iters:
                for m in list(iters):
                    try:
                        cols[m].add(next(iters[m]), lab.text, shade)
                    except StopIteration:
                        del iters[m]
                        cols[m].finish()  # the run's figures, as in the trace
                now = time.perf_counter()
                if now - last > STREAM_EVERY_S or not iters:
                    plots = now - last_plot > ROUTER_EVERY_S or not iters
                    last, last_plot = now, (now if plots else last_plot)
                    if iters:
                        status = "decoding: " + ", ".join(f"{m} {cols[m].tokens} tokens" for m in methods)
                    else:
                        note = self._equality_note(gens, temperature)  # last: one line per method
                        done = ", ".join(f"{m} run {g.run_id}" for m, g in gens.items())
                        status = (f"decoded: {done} · computing counterfactual accept lengths of {', '.join(late)} ..."
                                  f"{note}" if late else f"done: {done}{note}")
                    shown = gr.skip() if iters else {"methods": methods, "drafters": drafters, "sampled": not greedy,
                                                      "cols": {m: c.token_cols for m, c in cols.items()}}
                    yield [*self._update(methods, cols, status, legend if first else gr.skip(), plots, first,
                                         not iters), shown]
                    first = False
        finally:  # a page closed mid-decode: its unfinished runs are marked cancelled in the trace now
            for it in iters.values():
                it.close()
        if late:
            for m in late:
                g = gens[m]
                cols[m].profile = replay.profile_sequence(  # at the run's round starts: what the plot shows
                    lab.target, g.drafters, g.prompt_ids, torch.tensor(g.result.token_ids), int(max_new),
                    positions=[ev.pos0 for ev in cols[m].events], arms=tuple(g.drafters))  # each of its arms
                lab.profiles[g.run_id] = cols[m].profile  # the run reopened in 'Rounds & trees' reuses it
            yield [*self._update(methods, cols, f"done: {done}{note}", gr.skip(), True, False, True), gr.skip()]

    def _update(self, methods, cols, status, legend, plots: bool, first: bool, final: bool) -> list:
        ar = cols.get("ar")
        ar_tps = tokens_per_s(ar.tokens, ar.s) if ar and ar.s else None
        heads, toks, figs = [], [], []
        for i in range(MAX_COLUMNS):
            if i >= len(methods):
                off = gr.update(value="", visible=False) if first else gr.skip()
                heads.append(off)
                toks.append(off)
                figs.append(gr.update(visible=False) if first else gr.skip())
                continue
            m, c = methods[i], cols[methods[i]]
            heads.append(gr.update(value=c.header(m, ar_tps, final), visible=True))
            toks.append(gr.update(value="".join(c.spans), visible=True))
            if not routed(c.gen):
                figs.append(gr.update(visible=False) if first else gr.skip())
            else:
                figs.append(gr.update(value=c.router_plot(m), visible=True) if plots and c.events else gr.skip())
        return [status, legend, *heads, *toks, *figs]

    def _equality_note(self, gens, temperature) -> str:
        """Greedy runs beside AR: where an output differs, the first position and the target's top-2 logit gap.
        Sampled runs: that no output is compared with AR's (each samples its own continuation), and where the
        columns stopped at different lengths, each one's length and why it stopped."""
        if temperature and float(temperature) > 0:
            note = (f" · sampled at T = {float(temperature):g}: outputs are not compared with AR's (each column "
                    "samples its own continuation; the target's distribution is what is kept)")
            ends = {m: (len(g.result.token_ids), g.result.decode.stopped) for m, g in gens.items() if g.result}
            if len({n for n, _ in ends.values()}) > 1:
                note += "; the columns stopped at different lengths: " + ", ".join(
                    f"{m} {n} tokens ({'an end-of-text token' if why == 'eos' else 'max new tokens'})"
                    for m, (n, why) in ends.items())
            return note
        ar = gens.get("ar")
        if ar is None or ar.result is None:
            return ""
        notes, groups = [], []
        for m, g in gens.items():
            if m == "ar":
                continue
            div = first_divergence(self.lab.target, g.prompt_ids, ar.result.token_ids, g.result.token_ids)
            notes.append(f"{m} equals AR" if div is None else f"{m} {div.describe(self.lab.target.tokenizer)}")
            groups.append(kind_of(div))
            if div is not None and g.run_id is not None:  # kept on the run row, as the bench does
                self.lab.store.record_divergence(g.run_id, div)
        summary = ", ".join(f"{groups.count(k)} {k}" for k in ("equal", "near-tie", "bug") if groups.count(k))
        return f" · vs AR: {summary}:\n" + "".join(f"\n- {n}" for n in notes) if notes else ""  # a line each
