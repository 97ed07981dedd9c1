"""Every plot and HTML fragment speclab shows, built once here and used by the CLI reports, the app and
the notebooks alike. Functions take DataFrames from the trace read API / metrics and return plotly figures
or HTML strings."""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

import plotly.graph_objects as go

from speclab.files import write_atomic

# the colours of what is not a drafter (a drafter's, and its methods', come from its registry entry: `method_color`)
METHOD_COLORS = {"ar": "#7f7f7f", "hf_assisted": "#aec7e8", "hf_pld": "#98df8a", "whiflash-entropy": "#ff7f0e",
                 "whiflash-neural": "#8c564b", "oracle-task": "#17becf", "oracle-prompt": "#bcbd22",
                 "oracle-token": "#e377c2", "oracle-token-time": "#404040"}
ORACLE_DASH = {"oracle-task": "dot", "oracle-prompt": "dashdot", "oracle-token": "dash",
               "oracle-token-time": "longdash"}


@dataclass
class Report:
    """What a command reports, built by library functions: a title, markdown `text` (its tables and notes), plotly
    `figs`, and the `summary` the command prints (default: the text). `speclab.cli.common.write_report` prints and
    writes it (markdown and/or the HTML page of `write_html_report`)."""
    title: str
    text: str
    figs: list = field(default_factory=list)
    summary: str | None = None


def method_color(method: str) -> str | None:
    """A registered method's colour (a drafter's and its methods' from its registry entry, `DrafterEntry.color`);
    None (plotly's palette) for specs and variants, so they stay apart."""
    from speclab.drafters.registry import drafters
    for e in drafters().values():
        if method == e.name or method in e.methods:
            return e.color
    return METHOD_COLORS.get(method)




def bench_bars(table, metric: str, title: str) -> go.Figure:
    """Grouped bars: one group per category, one bar per method (rows with the metric missing are left out)."""
    fig = go.Figure()
    for method, g in table.groupby("method", sort=False):
        g = g[g[metric].notna()]
        if len(g):
            fig.add_bar(name=method, x=g["category"], y=g[metric], marker_color=method_color(method),
                        text=[f"{v:.2f}" for v in g[metric]], textposition="outside")
    if metric == "speedup":
        fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    fig.update_layout(title=title, barmode="group", yaxis_title=metric, xaxis_title="category",
                      template="plotly_white", height=420)
    return fig


def paired_gains(pairs) -> go.Figure:
    """Each pair of methods: the mean per-prompt gain of one over the other in tau and in tokens/s, with its 95%
    confidence interval as error bars (`speclab.metrics.paired_gains`); an interval across 0 is no difference."""
    labels = [f"{m} vs {a}" for m, a in zip(pairs.method, pairs.against)]
    fig = go.Figure()
    for key, name, color in (("tau_gain", "tau", "#4c78a8"), ("speed_gain", "tokens/s", "#f58518")):
        fig.add_bar(name=name, y=labels, x=100 * pairs[key], orientation="h", marker_color=color,
                    error_x={"type": "data", "array": 100 * pairs[f"{key}_ci95"].fillna(0)},
                    customdata=pairs.prompts, hovertemplate="%{x:+.1f}% over %{customdata} prompts")
    fig.add_vline(x=0, line_color="gray")
    fig.update_layout(title="Gain per prompt, paired (mean and 95% confidence interval)", barmode="group",
                      xaxis_title="gain of the first method over the second, %", yaxis_autorange="reversed",
                      template="plotly_white",
                      height=200 + 60 * len(labels))
    return fig


def position_acceptance(pos) -> go.Figure:
    """Per-position acceptance curves: P(depth d accepted | the draft reached depth d), one line per method."""
    fig = go.Figure()
    for method, g in pos.groupby("method", sort=False):
        fig.add_scatter(name=method, x=g["depth"], y=g["acceptance"], mode="lines+markers",
                        line_color=method_color(method),
                        customdata=g["rounds_reaching"], hovertemplate="depth %{x}: %{y:.2f} of %{customdata} rounds")
    fig.update_layout(title="Per-position acceptance", xaxis_title="draft depth", yaxis_title="acceptance",
                      yaxis_range=[0, 1.05], template="plotly_white", height=380)
    return fig


def accept_histogram(hist) -> go.Figure:
    """Share of verification steps by accepted draft tokens (bonus excluded), grouped bars per run label: an
    engine's histogram beside speclab's rounds (`speclab.metrics.ACCEPT_HISTOGRAM_SQL`)."""
    fig = go.Figure()
    for label, g in hist.groupby("label", sort=False):
        fig.add_bar(name=label, x=g["accepted"], y=g["share"], marker_color=method_color(label.split(" ")[0]),
                    customdata=g["steps"], hovertemplate="%{x} accepted: %{y:.1%} (%{customdata} steps)")
    fig.update_layout(title="Accepted draft tokens per step", barmode="group", xaxis_title="accepted draft tokens "
                      "(bonus excluded)", yaxis_title="share of steps", xaxis_dtick=1, template="plotly_white",
                      height=380)
    return fig


def lines_figure(df, x: str, y: str, group: str, title: str, x_title: str | None = None,
                 y_title: str | None = None, hover: str | None = None) -> go.Figure:
    """One line per value of `group` (y against x): parameter grids, cost curves."""
    fig = go.Figure()
    for name, g in df.groupby(group, sort=False):
        g = g.sort_values(x)
        fig.add_scatter(name=str(name), x=g[x], y=g[y], mode="lines+markers", line_color=method_color(str(name)),
                        customdata=g[hover] if hover else None,
                        hovertemplate=f"{x} %{{x}}: %{{y:.2f}}" + (" (%{customdata})" if hover else ""))
    fig.update_layout(title=title, xaxis_title=x_title or x, yaxis_title=y_title or y, template="plotly_white",
                      height=420, legend_title=group)
    return fig


def write_html_report(path: str | Path, title: str, figs: list[go.Figure], text: str = "") -> Path:
    """A self-contained HTML page (plotly.js embedded once: no network needed to view it)."""
    parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figs)]
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family:sans-serif;max-width:1100px;margin:auto'><h1>{html.escape(title)}</h1>"
            + "".join(parts) + f"<pre style='white-space:pre-wrap'>{html.escape(text)}</pre></body></html>")
    return write_atomic(path, page)


# ---- tokens: per-token acceptance shading ----

TARGET_BG = "#e8e8e8"
DRAFTER_COLORS = {"target": "#9e9e9e", "tie": "#bbbbbb"}  # non-method groups in histograms
_FALLBACK_RGB = [(255, 127, 14), (140, 86, 75), (227, 119, 194), (23, 190, 207)]
TOKEN_COLUMNS = ("pos", "round", "text", "source", "depth", "draft_prob", "target_prob", "entropy")
ROUTER_COLUMNS = ("drafter", "signal", "threshold")  # per token, the round's router decision (routed runs)


def drafter_rgb(name: str) -> tuple[int, int, int]:
    """A drafter's colour (its registry entry's) as RGB, for token shading; one of a few others for a name the
    registry does not know."""
    color = method_color(name)
    if color is None:
        return _FALLBACK_RGB[sum(map(ord, name)) % len(_FALLBACK_RGB)]
    h = color.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def _missing(v) -> bool:
    """None, NaN or pandas' NA (a nullable column's missing value)."""
    import pandas as pd
    return v is None or bool(pd.isna(v))


def _fmt(v) -> str:
    return "–" if _missing(v) else f"{v:.2f}"


def _int(v) -> str:
    return "–" if _missing(v) else str(int(v))


def token_spans(cols: dict, first_round_seen: int | None = None, shade: str = "depth") -> list[str]:
    """One <span> per token from per-token columns (TOKEN_COLUMNS): background = who produced it (drafter colour,
    or grey for the target's own token), opacity = draft depth or draft probability; a bar marks round starts;
    hovering shows round, drafter, depth, draft p, target p, entropy and, for routed runs (columns `drafter`,
    `signal` and `threshold`: the round's router decision), the router's choice, signal and threshold. A sampled run's
    accepted drafts (column `accept_prob`: min(1, p / q) of the test each passed) are underlined, the darker the less
    likely their acceptance was, and the tip gives the probability."""
    out = []
    prev = first_round_seen
    n = len(cols["pos"])
    routed = zip(*(cols[c] for c in ROUTER_COLUMNS)) if all(c in cols for c in ROUTER_COLUMNS) else [None] * n
    accept = cols["accept_prob"] if "accept_prob" in cols else [None] * n
    for (pos, rnd, text, src, depth, dp, tp, ent), rd, ap in zip(zip(*(cols[c] for c in TOKEN_COLUMNS)), routed,
                                                                accept):
        if src == "target":
            bg = TARGET_BG
        else:
            r, g, b = drafter_rgb(src)
            a = max(0.25, 0.9 - 0.13 * (depth - 1)) if shade == "depth" else 0.2 + 0.7 * (dp if dp == dp else 0.5)
            bg = f"rgba({r},{g},{b},{a:.2f})"
        edge = "border-left:2px solid #444;" if rnd != prev else ""
        prev = rnd
        tip = (f"#{pos} round {rnd} · {src} · depth {depth} · draft p {_fmt(dp)} · target p {_fmt(tp)} "
               f"· entropy {_fmt(ent)}")
        if rd is not None and rd[0] and rd[1] == rd[1]:  # a routed round (fixed routers have no signal)
            tip += f" · router chose {rd[0]}: signal {_fmt(rd[1])} vs threshold {_fmt(rd[2])}"
        if not _missing(ap):  # a sampled draft: how likely its acceptance was
            tip += f" · accepted with probability {_fmt(ap)} (min(1, p/q))"
            edge += f"border-bottom:2px solid rgba(0,0,0,{0.9 * (1 - ap):.2f});"
        out.append(f'<span class="tok" data-src="{html.escape(str(src))}" title="{html.escape(tip)}" '
                   f'style="background:{bg};{edge}">{html.escape(str(text))}</span>')
    return out


def tokens_html(spans: list[str], header: str = "") -> str:
    return (f'<div class="speclab-col">{header}<div class="speclab-tokens" style="white-space:pre-wrap;'
            f'font-family:monospace;font-size:13px;line-height:1.7">{"".join(spans)}</div></div>')


def legend_html(drafters: list[str], shade: str = "depth", sampled: bool = False) -> str:
    items = [f'<span style="background:{TARGET_BG};padding:1px 6px">target (AR step, bonus or correction)</span>']
    for d in drafters:
        r, g, b = drafter_rgb(d)
        items.append(f'<span style="background:rgba({r},{g},{b},0.85);padding:1px 6px">'
                     f'{html.escape(d)}: accepted draft</span>')
    how = "darker = shallower draft depth" if shade == "depth" else "darker = higher draft probability"
    if sampled:
        how += " · underline: a sampled draft, darker = accepted against the odds (hover: min(1, p/q))"
    return (f'<div class="speclab-legend" style="font-size:12px">{" ".join(items)} · {how} · '
            '<span style="border-left:2px solid #444;padding-left:4px">round start</span> · '
            'hover a token for details</div>')


TIME_COLORS = {"draft": "#9467bd", "verify": "#ff7f0e", "catch-up": "#17becf", "other": "#c7c7c7"}


def stats_header(method: str, stats: dict, time_ms: dict | None = None, explain: bool = True) -> str:
    """A column's header: the method, its figures (with `explain`, each with its definition as a tooltip, from
    `speclab.metrics.METRIC_HELP`) and, with `time_ms` (`speclab.metrics.time_split`), a bar of where the decode
    time went."""
    from speclab.metrics import METRIC_HELP

    def tip(k):
        return f' title="{html.escape(METRIC_HELP.get(k, k))}"' if explain else ""
    parts = [f"<b>{html.escape(method)}</b>"] + [
        f'<span class="speclab-metric"{tip(k)}>{html.escape(k)} <b>{html.escape(str(v))}</b></span>'
        for k, v in stats.items()]
    bar = time_bar(time_ms) if time_ms else ""
    return f'<div class="speclab-stats" style="font-size:12px;margin-bottom:4px">{" · ".join(parts)}{bar}</div>'


def engine_card(run: dict, conversions: list[str], text: str | None) -> str:
    """An imported run's provenance (engine, version, file, scope), the conversions its figures went through
    and its output text, under its stats header."""
    rows = "".join(f"<tr><td style='padding-right:8px'>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
                   for k, v in run.items())
    notes = "".join(f"<li>{html.escape(c)}</li>" for c in conversions)
    out = f"<pre style='white-space:pre-wrap'>{html.escape(text)}</pre>" if text else ""
    return (f"<div class='speclab-engine' style='font-size:12px'><table>{rows}</table>"
            f"<details><summary>conversions to speclab's definitions ({len(conversions)})</summary><ul>{notes}</ul>"
            f"</details>{out}</div>")


def time_bar(time_ms: dict) -> str:
    """Where the decode time went, as one stacked bar with a legend (draft, verify, catch-up, other)."""
    total = sum(time_ms.values()) or 1.0
    segs, keys = [], []
    for part, ms in time_ms.items():
        share, color = ms / total, TIME_COLORS.get(part, "#999")
        tip = html.escape(f"{part}: {ms:.0f} ms ({share:.0%} of the decode time)")
        segs.append(f'<span title="{tip}" style="display:inline-block;height:100%;width:{100 * share:.2f}%;'
                    f'background:{color}"></span>')
        keys.append(f'<span title="{tip}"><span style="color:{color}">&#9632;</span> {html.escape(part)} '
                    f"{share:.0%}</span>")
    return ('<div class="speclab-timebar" title="where the decode time went">'
            '<div style="display:flex;height:8px;border-radius:3px;overflow:hidden;margin:3px 0 1px">'
            f'{"".join(segs)}</div><div style="font-size:11px;color:#555">time: {" ".join(keys)}</div></div>')


# ---- draft trees and per-round charts ----

NODE_GROUPS = {"block": lambda v: f"block {v}",
               "bucket": lambda v: f"bucket b{v} ({('rank 1', 'rank 2-4', 'rank 5-10', 'rank > 10')[v]})"}
GROUP_COLORS = ["#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]


def tree_figure(nodes, root_text: str = "root", title: str = "", color_by: str = "accepted") -> go.Figure:
    """A draft tree (rows of draft_nodes for one round): accepted path highlighted, rejected branches dimmed.
    `color_by` "block" or "bucket" colours the nodes by that column (SpecBlock's trees; the accepted ones keep a
    green ring) where the round has it."""
    nodes = nodes.sort_values("node")
    children: dict[int, list[int]] = {}
    for n, p in zip(nodes.node, nodes.parent):
        children.setdefault(int(p), []).append(int(n))
    y, leaf = {}, [0]

    def place(n):  # leaves get consecutive rows, parents sit at the mean of their children
        kids = children.get(n, [])
        if not kids:
            y[n] = leaf[0]
            leaf[0] += 1
        else:
            for c in kids:
                place(c)
            y[n] = sum(y[c] for c in kids) / len(kids)
    place(-1)
    info = {int(r.node): r for r in nodes.itertuples()}
    ex, ey, ax, ay = [], [], [], []
    for n, r in info.items():
        px, py = (0, y[-1]) if r.parent < 0 else (info[int(r.parent)].depth, y[int(r.parent)])
        xs, ys = (ax, ay) if r.accepted else (ex, ey)
        xs += [px, r.depth, None]
        ys += [py, y[n], None]
    fig = go.Figure()
    fig.add_scatter(x=ex, y=ey, mode="lines", line=dict(color="#bbb", width=1), hoverinfo="skip", name="rejected")
    fig.add_scatter(x=ax, y=ay, mode="lines", line=dict(color="#2ca02c", width=3), hoverinfo="skip",
                    name="accepted path")
    grouped = bool(color_by in NODE_GROUPS and color_by in nodes and nodes[color_by].notna().any())
    flash = bool("in_cands" in nodes and nodes["in_cands"].notna().any())

    def group(r):
        v = getattr(r, color_by, None) if grouped else None
        return None if _missing(v) else int(v)
    named: set = set()  # groups already in the legend
    for g, acc in sorted({(group(r) if grouped else None, bool(r.accepted)) for r in info.values()},
                         key=lambda k: (k[0] is None, k[0] or 0, k[1])):
        sel = [r for r in info.values() if (group(r) if grouped else None) == g and bool(r.accepted) == acc]
        if grouped:
            color = "#dddddd" if g is None else GROUP_COLORS[g % len(GROUP_COLORS)]
            marker = dict(size=12, color=color, line=dict(color="#2ca02c" if acc else "#ffffff", width=3 if acc else 1))
            name = "no " + color_by if g is None else NODE_GROUPS[color_by](g)
        else:
            marker = dict(size=12, color="#2ca02c" if acc else "#bbbbbb", opacity=1.0 if acc else 0.5)
            name = "accepted" if acc else "rejected"
        cols = [c for c in NODE_GROUPS if c in nodes]
        extra = "".join(f"<br>{c} %{{customdata[{3 + i}]}}" for i, c in enumerate(cols))
        if flash:  # FlashHead: a rejection by retrieval (the target's token was not a candidate) or by the drafter
            extra += f"<br>target's token among the candidates: %{{customdata[{3 + len(cols)}]}}"
        fig.add_scatter(
            x=[r.depth for r in sel], y=[y[int(r.node)] for r in sel], mode="markers+text",
            text=[repr(str(getattr(r, "text", r.token_id)))[1:-1][:12] for r in sel], textposition="top center",
            marker=marker, legendgroup=name, showlegend=grouped and name not in named,
            customdata=[[r.node, _fmt(r.draft_prob), _fmt(r.target_prob), *[_int(getattr(r, c)) for c in cols],
                         *([_retrieved(r.in_cands)] if flash else [])] for r in sel],
            hovertemplate=("node %{customdata[0]}<br>%{text}<br>draft p %{customdata[1]}"
                           "<br>target p %{customdata[2]}" + extra + "<extra></extra>"),
            name=name, cliponaxis=False)
        named.add(name)
    fig.add_scatter(x=[0], y=[y[-1]], mode="markers+text", text=[repr(root_text)[1:-1][:12]], textposition="top center",
                    marker=dict(size=14, color="#444"), name="root", cliponaxis=False,
                    hovertemplate="root (last committed token)<extra></extra>")
    deepest = max([int(r.depth) for r in info.values()], default=0)
    fig.update_layout(title=title or "Draft tree", template="plotly_white", height=max(300, 40 * leaf[0] + 120),
                      showlegend=True, margin=dict(t=70),
                      # whole depths only, and room around the outermost nodes for their labels (no clipping)
                      xaxis=dict(title="depth", tick0=0, dtick=1, range=[-0.5, deepest + 0.5]),
                      yaxis=dict(visible=False, range=[min(y.values()) - 0.6, max(y.values()) + 0.9]))
    return fig


def _retrieved(v) -> str:
    return "-" if _missing(v) else "yes" if int(v) else "no (a retrieval miss: no draft could match)"


def accepted_per_round(rounds) -> go.Figure:
    """Tokens committed per round (accepted drafts + the target's token), one trace per method/run label."""
    fig = go.Figure()
    for label, g in rounds.groupby("label", sort=False):
        fig.add_scatter(x=g["round"], y=g["committed"], mode="lines+markers", name=label,
                        line_color=method_color(label.split(" ")[0]))
    fig.update_layout(title="Tokens committed per round", xaxis_title="round", yaxis_title="tokens",
                      template="plotly_white", height=340)
    return fig


def phase_breakdown(rounds) -> go.Figure:
    """Mean time per round in each phase (route, catch-up, draft, verify, commit, record), stacked, per method/run
    label."""
    from speclab.core.engine import PHASES
    phases = [p for p in PHASES if f"t_{p}_ms" in rounds]
    means = rounds.groupby("label", sort=False)[[f"t_{p}_ms" for p in phases]].mean()
    fig = go.Figure()
    for p in phases:
        fig.add_bar(name=p, x=means.index, y=means[f"t_{p}_ms"])
    fig.update_layout(title="Time per round by phase (ms)", barmode="stack", template="plotly_white", height=340,
                      yaxis_title="ms per round")
    return fig


def stacked_bars(df, x: str, part: str, y: str, title: str, y_title: str | None = None) -> go.Figure:
    """One stacked bar per value of `x`, a segment per value of `part` (its `y`): a round's time by op."""
    fig = go.Figure()
    for name, g in df.groupby(part, sort=False):
        fig.add_bar(name=str(name), x=g[x], y=g[y])
    fig.update_layout(title=title, barmode="stack", template="plotly_white", height=460, yaxis_title=y_title or y,
                      legend_title=part)
    return fig


def volatility_figure(prof, title: str = "") -> go.Figure:
    """WhiFlash's Figure 2 from a profile (rows: pos, drafter, accepted): how many draft tokens each drafter would
    get accepted by a round starting at every position of one sequence."""
    fig = go.Figure()
    for name, g in prof.groupby("drafter", sort=False):
        fig.add_scatter(name=name, x=g["pos"], y=g["accepted"], mode="lines", line_shape="hv",
                        line_color=method_color(name), hovertemplate="position %{x}: %{y} accepted")
    fig.update_layout(title=title or "Accepted draft tokens of a round starting at each position",
                      xaxis_title="position in the output (tokens)", yaxis_title="accepted draft tokens",
                      template="plotly_white", height=380)
    return fig


def sweep_figure(sw, live=None, y: str = "tokens_per_s", title: str = "") -> go.Figure:
    """Threshold sweeps: one replayed line per category (y against threshold), live runs as markers on top."""
    fig = lines_figure(sw, "threshold", y, "category", title or f"{y} by routing threshold (replay)",
                       x_title="threshold", y_title=y)
    if live is not None and len(live):
        for cat, g in live.groupby("category", sort=False):
            fig.add_scatter(name=f"{cat} (live)", x=g["threshold"], y=g[y], mode="markers",
                            marker=dict(size=11, symbol="diamond-open"), hovertemplate="live: %{y:.2f}")
    return fig


def router_figure(rr, title: str = "") -> go.Figure:
    """One routed run, round by round (rows of `speclab.bench.routing.router_rounds`). Top: the router's signal
    (entropy or predicted Delta AL) with its threshold, markers coloured by the drafter chosen, switches annotated with
    their backlog and catch-up time. Bottom: the accepted length of the round and, where a profile exists (greedy),
    what each arm would have had accepted there: the rounds where the router chose wrong stand out."""
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.55, 0.45])
    fig.add_scatter(x=rr["round"], y=rr["signal"], mode="lines", line_color="#999", name="signal", row=1, col=1,
                    hovertemplate="round %{x}: signal %{y:.3f}")
    fig.add_scatter(x=rr["round"], y=rr["threshold"], mode="lines", line=dict(dash="dash", color="#444"),
                    name="threshold", row=1, col=1)
    for name, g in rr.groupby("choice", sort=False):
        text = [f"switch: backlog {b}, catch-up {c:.2f} ms" if s else "" for b, c, s in
                zip(g["backlog"], g["catchup_ms"], g["switch"])]
        fig.add_scatter(x=g["round"], y=g["signal"], mode="markers", name=f"chose {name}", text=text,
                        marker=dict(color=method_color(name), size=[10 if s else 6 for s in g["switch"]],
                                    symbol=["diamond" if s else "circle" for s in g["switch"]]),
                        hovertemplate="round %{x}: %{y:.3f} %{text}", row=1, col=1)
    fig.add_bar(x=rr["round"], y=rr["n_accepted"], name="accepted (chosen)", marker_color="#cfcfcf", row=2, col=1)
    # every arm the profile holds (WhiFlash's two, a route's N), each narrower and more dashed than the one before, so
    # where several would accept the same, each stays visible on the wider lines under it (DFlash's dashes on
    # EAGLE-3's solid line)
    arms = [c[: -len("_would_accept")] for c in rr.columns if c.endswith("_would_accept")]
    arms = sorted(arms, key=lambda a: ({"eagle3": 0, "dflash": 1}.get(a, 2)))
    for i, name in enumerate(arms):
        col = f"{name}_would_accept"
        if rr[col].notna().any():
            style = dict(width=max(4 - 2 * i, 1), dash=(None, "dash", "dot", "dashdot", "longdash")[min(i, 4)])
            fig.add_scatter(x=rr["round"], y=rr[col], mode="lines", line_shape="hvh",
                            line=dict(color=method_color(name), **style), name=f"{name} would accept", row=2, col=1)
    fig.update_yaxes(title_text="signal", row=1, col=1)
    fig.update_yaxes(title_text="accepted drafts", row=2, col=1)
    fig.update_xaxes(title_text="round", row=2, col=1)
    fig.update_layout(title=title or "Router decisions", template="plotly_white", height=520, barmode="overlay")
    return fig


def calibration_figure(curve, refs, threshold: float, point: dict, best: dict, view, category: str,
                       at_edge: bool = False) -> go.Figure:
    """A router's threshold calibration for one category: replayed tau (AL, top) and modeled tokens/s (bottom) against
    the threshold (rows of `speclab.bench.routing.sweep`; `view`, `speclab.bench.calibration.VIEWS`' entry of the
    router, names the policy, the threshold's signal and the share of rounds shown), each drafter alone and the
    oracles as horizontal reference
    lines (`speclab.bench.routing.oracles`; AR too, at AL 1 and its measured tokens/s), each in its own colour
    and dash, named in the legend; the chosen threshold as a vertical line with its exact replay, the calibrated
    optimum (the highest modeled tokens/s) as a star, with a note when it sits at an end of the grid (`at_edge`)."""
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.07,
                        subplot_titles=("AL (tokens per round)", "modeled tokens/s"))
    c = curve[curve.category == category].sort_values("threshold")
    r = refs[refs.category == category]
    named = set()  # reference lines already in the legend
    for row, y in ((1, "tau"), (2, "tokens_per_s")):
        fig.add_scatter(x=c["threshold"], y=c[y], mode="lines", name=view.label, showlegend=row == 1,
                        line=dict(color=method_color(view.method), width=3), row=row, col=1,
                        customdata=c[[view.share, "switches"]].to_numpy(),
                        hovertemplate=f"threshold %{{x:.2f}}: %{{y:.3f}}<br>{view.share_name} share "
                                      "%{customdata[0]:.2f}, %{customdata[1]} switches<extra></extra>")
        for ref in r.itertuples():
            v = getattr(ref, y)
            if v == v:
                fig.add_scatter(x=[c["threshold"].min(), c["threshold"].max()], y=[v, v], mode="lines",
                                name=ref.policy, legendgroup=ref.policy, showlegend=ref.policy not in named,
                                line=dict(color=method_color(ref.policy) or "#404040",
                                          dash=ORACLE_DASH.get(ref.policy, "solid" if ref.policy == "ar" else "dash"),
                                          width=2), row=row, col=1,
                                hovertemplate=f"{ref.policy}: %{{y:.3f}}<extra></extra>")
                named.add(ref.policy)
        fig.add_scatter(x=[best["threshold"]], y=[best[y]], mode="markers", name="calibrated optimum",
                        showlegend=row == 1, marker=dict(symbol="star", size=16, color="#e6b800",
                                                         line=dict(color="#444", width=1)), row=row, col=1,
                        hovertemplate="optimum %{x:.2f}: %{y:.3f}<extra></extra>")
        fig.add_scatter(x=[threshold], y=[point[y]], mode="markers", name="chosen threshold", showlegend=row == 1,
                        marker=dict(symbol="diamond", size=12, color="#111"), row=row, col=1,
                        hovertemplate="chosen %{x:.2f}: %{y:.3f}<extra></extra>")
        fig.add_vline(x=threshold, line=dict(color="#111", width=1, dash="dot"), row=row, col=1)
    fig.update_xaxes(title_text=f"threshold on {view.signal}", row=2, col=1)
    fig.update_layout(title=f"{view.label} on {category}: threshold {threshold:.2f} -> AL {point['tau']:.3f}, "
                            f"{point['tokens_per_s']:.1f} tokens/s (optimum {best['threshold']:.2f}: "
                            f"{best['tokens_per_s']:.1f})", template="plotly_white", height=600,
                      legend=dict(orientation="h", y=-0.18))
    if at_edge:
        fig.add_annotation(x=best["threshold"], y=best["tokens_per_s"], row=2, col=1, showarrow=True, ay=-40,
                           text="optimum at the grid's edge: the best threshold may lie beyond the grid",
                           bgcolor="#fff3cd", bordercolor="#e6b800", font=dict(size=11))
    return fig


# ---- inside one round (the anatomy notebook) ----

def tree_mask_figure(tree, labels: list[str] | None = None, title: str = "") -> go.Figure:
    """The verification's tree attention mask as an image: row i (the root, then node i - 1) may attend to column
    j when j is the root or an ancestor of the node (itself included); committed context, always visible, is
    left out."""
    import torch

    from speclab.core.tree import tree_attention_mask
    m = tree_attention_mask(tree.ancestors.cpu(), 0, torch.float32, True)
    allowed = (m.reshape(m.shape[-2], m.shape[-1]) == 0).int().numpy()
    labels = labels or ["root"] + [f"node {i}" for i in range(len(tree))]
    fig = go.Figure(go.Heatmap(z=allowed, x=labels, y=labels, colorscale=[[0, "#f4f4f4"], [1, "#2ca02c"]],
                               showscale=False, xgap=1, ygap=1,
                               hovertemplate="%{y} attends to %{x}: %{z}<extra></extra>"))
    fig.update_layout(title=title or "Tree attention mask (green: may attend)", yaxis_autorange="reversed",
                      xaxis_title="key (root, draft nodes)", yaxis_title="query row", template="plotly_white",
                      height=120 + 32 * len(labels), width=160 + 40 * len(labels))
    return fig


def distributions_figure(dists: dict, labels, top: int = 20, title: str = "") -> go.Figure:
    """Several distributions over the vocabulary (name -> probabilities [V]) on their `top` most likely tokens
    under the first one, as grouped bars (target p, draft q, the residual norm(max(p - q, 0)))."""
    import numpy as np
    first = np.asarray(next(iter(dists.values())), dtype=float)
    idx = np.argsort(-first)[:top]
    names = [repr(str(labels[i]))[1:-1] for i in idx]
    fig = go.Figure()
    for name, p in dists.items():
        fig.add_bar(name=name, x=names, y=np.asarray(p, dtype=float)[idx])
    fig.update_layout(title=title or "Distributions", barmode="group", yaxis_title="probability",
                      template="plotly_white", height=380)
    return fig


def histograms(df, x: str, group: str, title: str = "", x_title: str | None = None) -> go.Figure:
    """Overlaid histograms of `x`, one per value of `group`, each normalised to shares (a router's signal where
    each drafter would win, from `speclab.bench.routing.signals_table`; the entropy of tokens by who produced
    them)."""
    fig = go.Figure()
    for name, g in df[df[x].notna()].groupby(group, sort=True):
        fig.add_histogram(x=g[x], name=f"{name} ({len(g)})", histnorm="probability", opacity=0.6, nbinsx=40,
                          marker_color=method_color(str(name)) or DRAFTER_COLORS.get(str(name)))
    fig.update_layout(title=title or f"{x} by {group}", barmode="overlay", xaxis_title=x_title or x,
                      yaxis_title="share", legend_title=group, template="plotly_white", height=380)
    return fig


def prediction_figure(sig, title: str = "") -> go.Figure:
    """The neural router's predicted Delta AL against the true one (rows of `signals_table` with `predicted`), the
    diagonal for reference, one colour per category."""
    fig = go.Figure()
    for cat, g in sig[sig.predicted.notna()].groupby("category", sort=True):
        fig.add_scatter(x=g["delta_tau"], y=g["predicted"], mode="markers", name=str(cat), opacity=0.5,
                        marker=dict(size=5), hovertemplate="true %{x:.0f}, predicted %{y:.2f}<extra></extra>")
    lo, hi = float(sig.delta_tau.min()), float(sig.delta_tau.max())
    fig.add_scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="predicted = true", line=dict(dash="dot", color="#444"))
    fig.update_layout(title=title or "Neural router: predicted vs true Delta AL", xaxis_title="true Delta AL "
                      "(AL_eagle3 - AL_dflash)", yaxis_title="predicted Delta AL", template="plotly_white", height=420)
    return fig


# ---- batched serving ----

def step_slots(steps, title: str = "") -> go.Figure:
    """Each batched step's verification slots per request (`speclab.core.batch.StepEvent`s): x the step, y the
    request, colour the rows it verified (its pending root and its draft); hover says the draft tokens accepted."""
    xs, ys, rows, acc = [], [], [], []
    for ev in steps:
        for rid, d, a in zip(ev.rids, ev.drafted, ev.accepted):
            xs.append(ev.step)
            ys.append(f"request {rid}")
            rows.append(1 + d)
            acc.append(a)
    fig = go.Figure(go.Scatter(x=xs, y=ys, mode="markers", customdata=acc,
                               marker=dict(symbol="square", size=9, color=rows, colorscale="Viridis", showscale=True,
                                           colorbar=dict(title="rows")),
                               hovertemplate="step %{x}, %{y}: %{marker.color} rows, %{customdata} drafts accepted"
                                             "<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="batched step (one target forward)", yaxis_title="request",
                      template="plotly_white", height=max(260, 40 + 18 * len(set(ys))))
    return fig


def metrics_table(figures: dict, help: dict | None = None) -> str:
    """Named figures as a small HTML table, each name with its definition as a tooltip (`help`, default
    `speclab.metrics.SERVING_HELP` by the figure's name without its _p50_ms / _p95_ms / _tok_s suffix)."""
    from speclab.metrics import SERVING_HELP
    help = help if help is not None else SERVING_HELP

    def tip(k: str) -> str:
        base = next((h for h in help if k.startswith(h.removesuffix("_ms").removesuffix("_tok_s"))), k)
        return html.escape(help.get(base, k))
    rows = "".join(f"<tr><td title='{tip(k)}' style='padding-right:12px'>{html.escape(k)}</td>"
                   f"<td style='text-align:right'>{html.escape(str(v) if isinstance(v, int) else _fmt(v))}</td></tr>"
                   for k, v in figures.items())
    return f"<table class='speclab-metrics' style='font-size:13px'>{rows}</table>"
