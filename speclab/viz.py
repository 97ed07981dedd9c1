"""Every plot and HTML fragment speclab shows, built once here and used by the CLI reports, the app and
the notebooks alike. Functions take DataFrames from the trace read API / metrics and return plotly figures
or HTML strings."""
from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go

METHOD_COLORS = {"ar": "#7f7f7f", "sps": "#1f77b4", "pld": "#2ca02c", "hf_assisted": "#aec7e8", "hf_pld": "#98df8a"}


def _color(method: str) -> str | None:
    return METHOD_COLORS.get(method)


def bench_bars(table, metric: str, title: str) -> go.Figure:
    """Grouped bars: one group per category, one bar per method (rows with the metric missing are left out)."""
    fig = go.Figure()
    for method, g in table.groupby("method", sort=False):
        g = g[g[metric].notna()]
        if len(g):
            fig.add_bar(name=method, x=g["category"], y=g[metric], marker_color=_color(method),
                        text=[f"{v:.2f}" for v in g[metric]], textposition="outside")
    if metric == "speedup":
        fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    fig.update_layout(title=title, barmode="group", yaxis_title=metric, xaxis_title="category",
                      template="plotly_white", height=420)
    return fig


def position_acceptance(pos) -> go.Figure:
    """Per-position acceptance curves: P(depth d accepted | the draft reached depth d), one line per method."""
    fig = go.Figure()
    for method, g in pos.groupby("method", sort=False):
        fig.add_scatter(name=method, x=g["depth"], y=g["acceptance"], mode="lines+markers", line_color=_color(method),
                        customdata=g["rounds_reaching"], hovertemplate="depth %{x}: %{y:.2f} of %{customdata} rounds")
    fig.update_layout(title="Per-position acceptance", xaxis_title="draft depth", yaxis_title="acceptance",
                      yaxis_range=[0, 1.05], template="plotly_white", height=380)
    return fig


def write_html_report(path: str | Path, title: str, figs: list[go.Figure], text: str = "") -> Path:
    """A self-contained HTML page (plotly.js embedded once: no network needed to view it)."""
    parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figs)]
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family:sans-serif;max-width:1100px;margin:auto'><h1>{html.escape(title)}</h1>"
            + "".join(parts) + f"<pre style='white-space:pre-wrap'>{html.escape(text)}</pre></body></html>")
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path
