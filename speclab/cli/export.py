"""`speclab export gguf`: a checkpoint speclab loads as one GGUF file for llama.cpp (`speclab.gguf`), its tokenizer
proven by a round trip through llama.cpp (`speclab.llamacpp.round_trip`) over every bundled prompt and the hand-made
texts (`speclab.gguf.EDGE_TEXTS`). A file whose round trip fails is removed: a wrong tokenizer is never left behind."""
from __future__ import annotations

import argparse
from pathlib import Path

from speclab.errors import SpeclabError


def round_trip_texts() -> list[str]:
    """Every prompt of every bundled suite, and the hand-made texts."""
    from speclab.bench.suites import SUITES, load_suite
    from speclab.gguf import EDGE_TEXTS
    texts = [r["prompt"] for name in SUITES for r in load_suite(name)]
    return list(dict.fromkeys([*texts, *EDGE_TEXTS]))


def cmd_export_gguf(a: argparse.Namespace) -> int:
    from speclab import gguf, llamacpp
    from speclab.zoo import default_target, display_path
    model = Path(a.model) if a.model else default_target()
    out = Path(a.out) if a.out else Path("build/gguf") / f"{model.name}-{a.type}.gguf"
    p = gguf.plan(model, out, a.type)
    print(f"exporting {display_path(model)} ({p.arch.gguf_name}, pre-tokenizer {p.pre!r}) to {out} in {a.type} ...")
    gguf.export(p)
    size = out.stat().st_size / 2**20
    if a.no_check:
        print(f"wrote {out} ({size:.1f} MiB); tokenizer round trip skipped (--no-check)")
        return 0
    if llamacpp.available() is None:
        print(f"wrote {out} ({size:.1f} MiB); tokenizer round trip not run: llama-cpp-python is not installed")
        return 0
    texts = round_trip_texts()
    bad = llamacpp.round_trip(model, out, texts)
    if bad:
        out.unlink(missing_ok=True)
        text, ours, theirs = bad[0]
        raise SpeclabError(f"tokenizer round trip failed on {len(bad)} of {len(texts)} texts (first: {text[:40]!r}: "
                           f"speclab {ours[:8]} vs llama.cpp {theirs[:8]}); {out} removed")
    print(f"wrote {out} ({size:.1f} MiB); tokenizer round trip: identical ids on all {len(texts)} texts")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint for another engine (gguf: llama.cpp)")
    fmt = p.add_subparsers(dest="format", required=True)
    g = fmt.add_parser("gguf", help="a Qwen3 / Qwen2 / Llama checkpoint as one GGUF file for llama.cpp, its "
                       "tokenizer checked by a round trip")
    g.add_argument("--model", help="checkpoint folder (config.json, tokenizer.json, *.safetensors); default: the zoo "
                   "target")
    g.add_argument("--out", help="the .gguf file to write (default build/gguf/<model>-<type>.gguf)")
    g.add_argument("--type", default="bf16", choices=("f32", "f16", "bf16"),
                   help="matrices in this type (norms and vectors stay f32, as llama.cpp's converter keeps them)")
    g.add_argument("--no-check", action="store_true", help="skip the tokenizer round trip through llama.cpp")
    g.set_defaults(fn=cmd_export_gguf)
