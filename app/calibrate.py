"""Calibration: pick a prompt suite and a router (WhiFlash's entropy or neural threshold, or the `route` rule's
min_match); the suite's bench and profiles are reused from the trace or made (with progress); a threshold slider
replays instantly (AL and modeled tokens/s against the threshold, the drafters alone and the oracles as reference
lines, the optimum starred); "Save" writes the threshold to the calibration file the routers read; "Confirm live"
decodes a few prompts at it and sets the measured tokens/s beside the modeled ones. All of it is
`speclab.bench.calibration`."""
from __future__ import annotations

import abc
import math
import time

import gradio as gr
import pandas as pd

from app.lab import Lab, answers
from speclab import viz
from speclab.bench.calibration import (
    GRIDS,
    ROUTERS,
    VIEWS,
    Calibrator,
    check_router,
    check_threshold,
    grid_text,
    save_thresholds,
)
from speclab.bench.suites import SUITES
from speclab.errors import InvalidInput
from speclab.methods import METHODS
from speclab.progress import listen
from speclab.routing.routers import calibration_path
from speclab.zoo import display_path


def _preprocess(self, payload):
    return payload  # as typed: speclab's check (`check_threshold`) answers a value out of range


# Gradio's slider minus its own bound check: a typed value out of range reaches speclab's check, which names the
# router's bound in one message (Gradio's generic check answered first, then the page clamped the value silently).
# A subclass, since Gradio rebuilds a component from its class on every update; made without ComponentMeta's
# __new__, which would write a .pyi stub beside this module (Slider's events and __init__ are inherited as made).
ThresholdSlider = abc.ABCMeta.__new__(type(gr.Slider), "ThresholdSlider", (gr.Slider,), {
    "__module__": __name__, "preprocess": _preprocess, "get_block_name": lambda self: "slider"})


# Gradio's slider says `release` on a drag's end and on its number box's blur, `input` on every keystroke and arrow
# key. So that a typed threshold is committed by Enter too, and one moved with the arrow keys when the key comes up,
# both end in a release (delegated from the document: the slider's elements are redrawn on updates).
THRESHOLD_JS = """
() => {
  const inSlider = (t) => t && t.closest && t.closest('#cal_threshold');
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && inSlider(e.target) && e.target.type === 'number') { e.preventDefault(); e.target.blur(); }
  }, true);
  const keys = ['ArrowLeft', 'ArrowRight', 'ArrowUp', 'ArrowDown', 'PageUp', 'PageDown', 'Home', 'End'];
  document.addEventListener('keyup', (e) => {
    if (keys.includes(e.key) && inSlider(e.target) && e.target.type === 'range') {
      e.target.dispatchEvent(new PointerEvent('pointerup', {bubbles: true}));
    }
  }, true);
}
"""


def bound(router: str, target):
    """The router's thresholds: its method's own bound (the registry's parameter the threshold sets)."""
    view = VIEWS[router]
    return METHODS[view.method].bounds(target)[view.param]


def _step(progress):
    """A progress listener (`speclab.progress.listen`) drawing on a Gradio progress bar, with the ETA."""
    def step(label, done, total, eta):
        progress((done, total), desc=f"{label} · ETA {eta:.0f} s" if math.isfinite(eta) else label)
    return step


class Calibration:
    def __init__(self, lab: Lab):
        self.lab = lab

    def _cal(self, bench_id) -> Calibrator:
        cal = self.lab.calibrators.get(bench_id)
        if cal is None:
            raise InvalidInput("profile a suite first (button 'Profile')")
        return cal

    @answers(7)
    def profile(self, suite, limit, max_new, router, progress=gr.Progress()):
        """Reuse or make the suite's bench and profiles; returns the bench id, categories, slider and plot."""
        lab = self.lab
        if suite not in SUITES:
            raise InvalidInput(f"unknown prompt suite {suite!r}")
        if router not in ROUTERS:
            raise InvalidInput(f"choose a router ({', '.join(ROUTERS)})")

        with self.lab.line.hold(progress), listen(_step(progress)):
            cal = Calibrator.prepare(lab.store, lab.target, lab.models, suite, limit, max_new,
                                     log=lambda s: print(f"speclab app: {s}", flush=True), costs=lab.costs)
            lab.calibrators[cal.bench_id] = cal
            t, slider = self._start(cal, router, "all")  # the rule's: its arms profiled now
        cats = cal.categories
        how = "reused from the trace" if cal.reused else "made now"
        cost = (f"tokens/s modeled under {cal.cost.label}" if not cal.cost.here else
                f"cost model fitted to {cal.cost.rounds_fitted} live rounds")
        msg = f"bench `{cal.bench_id}` · {len(cal.profiles)} prompts profiled ({how}) · {cost}"
        if router == "rule":
            msg += f" · route's arms modeled with {cal.cost_label(router)}"
        return (cal.bench_id, msg, gr.update(choices=cats, value="all"), slider,
                *self.replot(cal.bench_id, router, "all", t), t)

    def _start(self, cal: Calibrator, router: str, category: str):
        """The slider over the router's own bound (never narrower: no value is clamped), at the optimum."""
        b = bound(router, self.lab.target)
        t = float(cal.best(router, category)["threshold"])
        return t, gr.update(minimum=b.lo, maximum=b.hi, step=GRIDS[router][2], value=t, interactive=True,
                            label=f"threshold ({b.lo:g} to {b.hi:g}; calibration grid {grid_text(router)})")

    @answers(4)
    def switch(self, bench_id, router, category, progress=gr.Progress()):
        """A new router or category: the slider starts at its optimum (the rule's arms are profiled first, once)."""
        if not bench_id:
            return gr.update(), gr.update(), "", gr.skip()
        cal = self._cal(bench_id)
        with self.lab.line.hold(progress), listen(_step(progress)):
            t, slider = self._start(cal, check_router(router), category)
        return (slider, *self.replot(bench_id, router, category, t), t)

    @answers(4)
    def moved(self, bench_id, router, category, threshold, shown):
        """The slider moved or a value was typed: replayed at once; a value out of the router's range gets one
        message and the slider goes back to the threshold shown (never clamped to its end behind the user's
        back). `shown`: the threshold of the figure on the page."""
        if not bench_id:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        try:
            t = check_threshold(router, threshold, self.lab.target.vocab_size)
        except InvalidInput as e:
            gr.Warning(f"{e}; the threshold stays at {shown:g}" if shown is not None else str(e))
            return gr.skip(), gr.skip(), gr.update(value=shown) if shown is not None else gr.skip(), gr.skip()
        return (*self.replot(bench_id, router, category, t), gr.skip(), t)

    def replot(self, bench_id, router, category, t: float):
        """The exact replay at a checked threshold (instant: profiles are in memory): the figure and its line."""
        cal = self._cal(bench_id)
        t0 = time.perf_counter()
        point, best = cal.at(router, t, category), cal.best(router, category)
        edge = cal.at_edge(router, category)
        view = VIEWS[router]
        fig = viz.calibration_figure(cal.curve(router), cal.references(router), t, point, best, view, category, edge)
        ms = (time.perf_counter() - t0) * 1e3
        text = (f"**{view.label} · {category} · threshold {t:.2f}**: AL {point['tau']:.3f}, modeled "
                f"{point['tokens_per_s']:.1f} tokens/s, {view.share_name} in {point[view.share]:.0%} of rounds, "
                f"{int(point['switches'])} switches · optimum {best['threshold']:.2f} "
                f"({best['tokens_per_s']:.1f} tokens/s"
                + (", at the grid's edge: the best threshold may lie beyond it" if edge else "")
                + ")" + (f" · **AR is faster here** ({ar:.1f} tokens/s): at these settings no threshold beats plain "
                         f"decoding" if (ar := cal.ar_faster(router, category)) is not None else "")
                + f" · replayed and drawn in {ms:.0f} ms")
        return fig, text

    @answers(1)
    def save(self, bench_id, router, category, shown):
        """Save the threshold the figure shows (`shown`: the last one committed and accepted)."""
        cal = self._cal(bench_id)
        t = check_threshold(router, shown, self.lab.target.vocab_size)
        cal.check_category(category)
        costs = self.lab.costs
        saved = save_thresholds(router, {category: t}, self.lab.target.fingerprint,
                                {"app": {"bench": bench_id, "router": router, "category": category}},
                                profile=costs.name if costs is not None else None)
        key = "*" if category == "all" else category
        kept = saved.for_profile(costs.name) if costs is not None else saved
        used = (f"kept for profile {costs.name}: not used by runs here" if costs is not None else
                "used by runs from now on")
        return (f"saved: {VIEWS[router].label} threshold **{kept.thresholds[router][key]!r}** for "
                f"{'every category without its own' if key == '*' else category} in "
                f"`{display_path(calibration_path())}` ({used})")

    @answers(2)
    def confirm(self, bench_id, router, category, threshold, prompts, progress=gr.Progress()):
        from speclab.checks import Bound, check_number
        cal = self._cal(bench_id)
        t = check_threshold(router, threshold, self.lab.target.vocab_size)
        prompts = check_number("prompts to confirm", prompts, int, Bound(1, 16))

        def step(label, done, total, eta):
            progress((done, total), desc=label)
        with self.lab.line.hold(progress), listen(step):
            df = cal.confirm(self.lab.target, self.lab.models, router, t, category, prompts,
                             log=lambda s: print(f"speclab app: {s}", flush=True))
        r = df.iloc[0]
        msg = (f"live at threshold {t:.2f} on {int(r.prompts)} prompt(s) of {category}: "
               f"**{r.tokens_per_s_live:.1f} tokens/s measured** vs {r.tokens_per_s_modeled:.1f} modeled "
               f"({r.model_error:+.1%}); AL {r.tau_live:.3f} live vs {r.tau_replay:.3f} replayed")
        return df.round(3), msg


def build(lab: Lab) -> None:
    c = Calibration(lab)
    bench = gr.State(None)
    shown = gr.State(None)  # the threshold the figure shows (the slider returns to it after a value out of range)
    with gr.Row():
        suite = gr.Dropdown(list(SUITES), value="zoo-calibration", label="Prompt suite", elem_id="cal_suite")
        limit = gr.Number(2, label="prompts per category (1-64)", elem_id="cal_limit")
        max_new = gr.Number(64, label="max new tokens (8-1024)", elem_id="cal_max_new")
        router = gr.Radio(list(ROUTERS), value="neural", label="router", elem_id="cal_router")
        go = gr.Button("Profile", variant="primary", elem_id="cal_profile")
    status = gr.Markdown("Profile a suite: its bench (AR, EAGLE-3, DFlash) and profiles are reused from the trace "
                         "when there are some for these settings (for the rule, every arm of route on its AR "
                         "outputs too).",
                         elem_id="cal_status")
    with gr.Row():
        category = gr.Dropdown([], label="category", elem_id="cal_category")
        b = bound("neural", lab.target)
        threshold = ThresholdSlider(b.lo, b.hi, value=0, step=GRIDS["neural"][2], interactive=False,
                                    label="threshold (profile a suite first)", elem_id="cal_threshold")
    point = gr.Markdown("", elem_id="cal_point")
    plot = gr.Plot(label="Calibration", elem_id="cal_plot")
    with gr.Row():
        save = gr.Button("Save threshold", elem_id="cal_save")
        n_live = gr.Number(2, label="prompts to confirm (1-16)", elem_id="cal_n")
        confirm = gr.Button("Confirm live", elem_id="cal_confirm")
    saved = gr.Markdown("", elem_id="cal_saved")
    live_msg = gr.Markdown("", elem_id="cal_live_msg")
    live = gr.Dataframe(pd.DataFrame({"confirm a threshold live to see measured against modeled tokens/s": []}),
                        label="Live vs modeled", interactive=False, elem_id="cal_live")

    # model work waits its turn in lab.line (saying how many are ahead), not in a Gradio concurrency group
    go.click(c.profile, [suite, limit, max_new, router], [bench, status, category, threshold, plot, point, shown],
             concurrency_limit=None)
    router.change(c.switch, [bench, router, category], [threshold, plot, point, shown])
    category.input(c.switch, [bench, router, category], [threshold, plot, point, shown])
    # a threshold is taken when the user commits it: the end of a drag, the number box's blur or Enter, the arrow
    # keys' release (`THRESHOLD_JS`), and checked once; a half-typed value ("4" of "45") is never replayed, and Save
    # writes the threshold the figure shows (`shown`), never a refused or unfinished one
    threshold.release(c.moved, [bench, router, category, threshold, shown], [plot, point, threshold, shown],
                      trigger_mode="always_last", show_progress="hidden")
    save.click(c.save, [bench, router, category, shown], saved)
    confirm.click(c.confirm, [bench, router, category, threshold, n_live], [live, live_msg], concurrency_limit=None)
