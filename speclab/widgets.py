"""Jupyter widgets (ipywidgets + plotly FigureWidget) over `speclab.bench.calibration`, for the notebooks: the
threshold calibration widget replays a threshold the moment the slider moves (the figure is
`viz.calibration_figure`, the app's) and saves it to the calibration file the routers read."""
from __future__ import annotations

from speclab import viz
from speclab.bench.calibration import GRIDS, VIEWS, Calibrator, check_threshold, grid, save_thresholds
from speclab.errors import SpeclabError


class CalibrationWidget:
    """Category and router pickers, a threshold slider, the live calibration figure and a Save button.

    `widget` is the ipywidgets box to display; `figure` the plotly FigureWidget it updates; `set(...)` and
    `save()` are what the controls call (and what tests call)."""

    def __init__(self, cal: Calibrator, target, router: str = "entropy", category: str = "all", path=None):
        import ipywidgets as w
        import plotly.graph_objects as go

        self.cal, self.target, self.path = cal, target, path  # path None: the routers' calibration file
        self.router = w.ToggleButtons(options=cal.routers(), value=router, description="router")
        self.category = w.Dropdown(options=cal.categories, value=category, description="category")
        self.slider = w.FloatSlider(description="threshold", step=GRIDS[router][2], continuous_update=True,
                                    readout_format=".2f", layout=w.Layout(width="60%"))
        self.button = w.Button(description="Save threshold", icon="save")
        self.message = w.HTML()
        self.figure = go.FigureWidget()
        self._range()
        self.slider.value = float(cal.best(router, category)["threshold"])
        self.slider.observe(lambda ch: self.set(), "value")
        self.router.observe(lambda ch: self.set(optimum=True), "value")
        self.category.observe(lambda ch: self.set(optimum=True), "value")
        self.button.on_click(lambda _: self.save())
        self.widget = w.VBox([w.HBox([self.router, self.category]), w.HBox([self.slider, self.button]),
                              self.message, self.figure])
        self.set()

    def _range(self) -> None:
        g = grid(self.router.value)  # the calibration's grid (`GRIDS`): the CLI and the app sweep the same
        self.slider.min, self.slider.max = -1e9, 1e9  # widen first: ipywidgets clamps min against the old max
        self.slider.min, self.slider.max, self.slider.step = g[0], g[-1], GRIDS[self.router.value][2]

    def set(self, optimum: bool = False) -> None:
        """Replay at the slider's threshold (or first move the slider to the optimum of the router and category)
        and redraw."""
        r, cat = self.router.value, self.category.value
        if optimum:
            with self.slider.hold_trait_notifications():
                self._range()
                self.slider.value = float(self.cal.best(r, cat)["threshold"])
        t = float(self.slider.value)
        try:
            point, best = self.cal.at(r, t, cat), self.cal.best(r, cat)
        except SpeclabError as e:
            self.message.value = f"<b>{e}</b>"
            return
        fig = viz.calibration_figure(self.cal.curve(r), self.cal.references(r), t, point, best, VIEWS[r], cat)
        with self.figure.batch_update():
            self.figure.data = []
            self.figure.add_traces(fig.data)
            self.figure.layout = fig.layout
        self.message.value = (f"{VIEWS[r].label} on {cat}: threshold {t:.2f} -> AL {point['tau']:.3f}, modeled "
                              f"{point['tokens_per_s']:.1f} tokens/s (optimum {best['threshold']:.2f})")

    def save(self):
        """Write the slider's threshold for the chosen category ('all' = the global one) to the calibration file."""
        r, cat = self.router.value, self.category.value
        t = check_threshold(r, self.slider.value, self.target.vocab_size)
        cal = save_thresholds(r, {cat: t}, self.target.fingerprint, {"notebook": {"bench": self.cal.bench_id}},
                              self.path)
        self.message.value = f"saved {VIEWS[r].label} threshold {t:g} for {cat}"
        return cal
