"""The speclab Gradio app: a thin layer over `speclab` (decoding, trace, calibration) and `speclab.viz` (every
figure and HTML fragment). Run it with `make run` or `python -m app` (`speclab app` starts the same program).

Tabs: side by side (every method, live, tokens coloured by drafter, router plots), rounds & trees (any run
reopened), calibration (instant threshold replay, save, confirm live), serving (a batch of requests under a
draft-length policy, live), trace explorer (runs, read-only SQL).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from speclab.errors import InvalidInput, SpeclabError
from speclab.models import ModelPaths, add_model_args, available_roles, check_model_args, load_models
from speclab.trace import TraceStore

if TYPE_CHECKING:
    import gradio as gr

    from app.lab import Lab


def build_app(lab: Lab) -> gr.Blocks:
    # Gradio and the tabs load here, after `main` has checked the options: a bad option answers in under 2 s, not
    # after the 3 s these imports take
    import gradio as gr

    from app import calibrate, decode, runs, serve
    r = runs.Runs(lab)
    with gr.Blocks(title="speclab", analytics_enabled=False) as demo:  # no calls home: the lab runs offline
        gr.Markdown(lab.header(), elem_id="header")
        with gr.Tabs() as tabs:
            with gr.Tab("Side by side", id="side"):
                side = decode.build(lab)
            with gr.Tab("Rounds & trees", id="rounds"):
                shade = gr.Radio(["depth", "draft_prob"], value="depth", label="shade by", elem_id="run_shade")
                rounds = runs.build_rounds(lab, r, shade)
            with gr.Tab("Calibration", id="calibration"):
                calibrate.build(lab)
            with gr.Tab("Serving", id="serving"):
                served = serve.build(lab)
            with gr.Tab("Trace explorer", id="explorer") as explorer:
                ex = runs.build_explorer(lab, r)
        listed = [ex["runs_df"], rounds["run_pick"], rounds["none"]]
        filters = [ex["f_method"], ex["f_cat"]]
        # the run lists follow the trace: on every fresh page, after every decode, whenever the explorer opens
        demo.load(r.refresh, filters, listed)
        side["run"].then(r.refresh, filters, listed)
        served["run"].then(r.refresh, filters, listed)
        explorer.select(r.refresh, [*filters, rounds["run_pick"]], listed)
        ex["runs_df"].select(r.opened, None, [rounds["run_pick"], tabs])  # a click on a run opens it
        demo.load(lambda s: gr.update(choices=side["prompts"](s)), side["suite"], side["pick"])
    return demo


def check_port(host: str, port: int) -> None:
    """The port is free to serve on (one line at start, not Gradio's traceback after the models load)."""
    import socket
    if not 1 <= port <= 65535:
        raise InvalidInput(f"--port {port}: a port is a number from 1 to 65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            raise InvalidInput(f"--port {port} on {host} is taken ({e.strerror}): another program serves there; "
                               "choose another with --port") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app", description="the speclab app (Gradio)")
    add_model_args(ap)
    ap.add_argument("--db", default="traces/app.duckdb", help="trace database (default traces/app.duckdb)")
    ap.add_argument("--calibration", help="your calibration file: the calibration tab writes it and routers read it "
                                          "first, the zoo's data/zoo/calibration.json where it has no threshold "
                                          "(default: calibration.json beside --db)")
    ap.add_argument("--costs", help="a hardware cost profile (speclab costs measure --out; shipped: data/costs/): the "
                                    "calibration tab replays under it and saves its thresholds under its name")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7860)
    a = ap.parse_args(argv)
    try:
        check_model_args(a)
        check_port(a.host, a.port)
        from speclab.core.verify import check_chain_rule
        check_chain_rule()  # SPECLAB_CHAIN_VERIFY, where set
        from speclab.routing.hardware import load_profile
        costs = load_profile(a.costs) if a.costs else None
        # the calibration tab saves to the user's file (never to the zoo's shipped one, which stays the fallback):
        # --calibration, else calibration.json beside the trace; refused now if it could not be written
        from speclab.files import check_writable
        from speclab.routing.routers import CALIBRATION_ENV
        calibration = Path(a.calibration or Path(a.db).parent / "calibration.json")
        try:
            check_writable(calibration, "the calibration file")
        except ValueError as e:
            where = "--calibration" if a.calibration else "the calibration file beside --db,"
            raise InvalidInput(f"{where} {calibration}: {e}") from e
        os.environ[CALIBRATION_ENV] = str(calibration.resolve())
        print(f"speclab app: opening trace {a.db} ...", flush=True)
        store = TraceStore(a.db)
        paths = ModelPaths.from_args(a)
        target, models = load_models(paths, roles=available_roles(paths),
                                     log=lambda s: print(f"speclab app: {s}", flush=True))
    except SpeclabError as e:
        print(f"speclab app: error: {e}", file=sys.stderr)
        return 2
    from app import calibrate, decode
    from app.lab import Lab
    lab = Lab(target, models, store, costs)
    print("speclab app: warming up every method ...", flush=True)
    lab.warm_up()
    demo = build_app(lab)
    demo.queue(default_concurrency_limit=4)
    demo.launch(server_name=a.host, server_port=a.port, css=decode.CSS, js=calibrate.THRESHOLD_JS, show_error=True)
    return 0
