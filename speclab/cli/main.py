"""`speclab`'s entry point: the parser (each command group adds its own commands), the checks every command gets
before it runs (its model options, its report path), errors as one line, SIGTERM as Ctrl-C; `speclab app` execs
the Gradio app (`python -m app`)."""
from __future__ import annotations

import argparse
import sys

from speclab.cli import adapt, bench, costs, decode, export, flashhead, imports, routing, serve, train
from speclab.cli.common import _check_writable, _Parser, _sigterm_interrupts
from speclab.errors import SpeclabError
from speclab.models import check_model_args


def parser() -> argparse.ArgumentParser:
    """Every command, grouped as speclab/cli/ is."""
    ap = _Parser(prog="speclab", description="speculative decoding laboratory")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("app", help="the Gradio app (side-by-side decoding, trees, trace explorer); --help for options")
    decode.add_parsers(sub)  # generate, stats
    bench.add_parsers(sub)  # bench, grid
    costs.add_parsers(sub)  # costs forward | catchup | switch | block | kernels
    routing.add_parsers(sub)  # profile, sweep, calibrate, routing
    train.add_parsers(sub)  # train, zoo
    adapt.add_parsers(sub)  # adapt (SpecBlock's serving-time adaptation)
    flashhead.add_parsers(sub)  # flashhead build | costs (FlashHead, the clustered draft head)
    imports.add_parsers(sub)  # import (vLLM, SGLang, llama.cpp metrics into the trace)
    serve.add_parsers(sub)  # serve-bench (batched serving under load)
    export.add_parsers(sub)  # export gguf (a checkpoint for llama.cpp)
    return ap


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["app"]:  # the Gradio app is its own program (app/ imports speclab, never the reverse)
        import os

        from speclab.zoo import REPO_ROOT
        path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "app", *argv[1:]], {**os.environ, "PYTHONPATH": path})
    a = parser().parse_args(argv)
    try:
        with _sigterm_interrupts():
            return _run(a)
    except SpeclabError as e:
        print(f"speclab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("speclab: interrupted", file=sys.stderr)
        return 130


def _run(a: argparse.Namespace) -> int:
    """The command's checks that need no model, then the command."""
    from speclab.core.verify import check_chain_rule
    check_chain_rule()  # SPECLAB_CHAIN_VERIFY, where set
    if hasattr(a, "logits"):  # a model-loading command: its model options first, before any file is touched
        check_model_args(a)
    if getattr(a, "report", None):  # written at the end: refused now if it could not be, not after the work
        _check_writable(a.report, "--report")
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
