"""A checkpoint speclab loads, as one GGUF file for llama.cpp (`speclab export gguf`).

The conversion follows llama.cpp's own rules for the architecture (its `convert_hf_to_gguf.py`, as vendored in
llama-cpp-python 0.3.36): tensor names from the `gguf` package's name map, one- dimensional tensors and norms kept in
f32, the rest in the file's type; Llama's q and k rows permuted from Hugging Face's rotate-half layout to the
interleaved one llama.cpp's NORM rope reads (Qwen2 and Qwen3 use NEOX rope: unpermuted); a tied head writes no
`output.weight` (llama.cpp reuses the embedding).

The tokenizer. llama.cpp tokenizes a byte-level BPE model by splitting the text with a pre-tokenizer regex named in
the file (`tokenizer.ggml.pre`); its converter picks that name by hashing the tokenizer's output on a fixed text, and
stops on a hash it does not know (every tokenizer trained here is one). speclab maps the tokenizer by what its
`tokenizer.json` says instead: a ByteLevel pre-tokenizer with its own regex is GPT-2's split (llama.cpp's "gpt-2"); a
Split with Qwen2's or Llama 3's pattern before a regex-free ByteLevel is "qwen2" / "llama-bpe". Anything else is
refused: a wrong mapping tokenizes silently wrong. The mapping is proven by `round_trip` (llama.cpp's token ids
against the checkpoint's own tokenizer, text by text: `speclab.llamacpp.round_trip`), which the tests and
`speclab export gguf` run.

Files land whole or not at all (`speclab.files.atomic_path`); `cached` keeps one export per (checkpoint, type) in the
per-user cache, named by a hash of the checkpoint's files, for the bench's llama.cpp peers.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from speclab.errors import InvalidInput
from speclab.files import atomic_path, cache_dir, check_writable

TYPES = ("f32", "f16", "bf16")  # the file types: every matrix in this type, norms and vectors in f32


@dataclass(frozen=True)
class Arch:
    gguf_name: str  # llama.cpp's architecture name (`general.architecture`)
    permute_qk: bool = False  # Llama: q / k rows to llama.cpp's interleaved rope layout


ARCHS = {
    "Qwen3ForCausalLM": Arch("qwen3"),
    "Qwen2ForCausalLM": Arch("qwen2"),
    "LlamaForCausalLM": Arch("llama", permute_qk=True),
}

# pre-tokenizer regexes (Hugging Face's Split patterns) -> llama.cpp's pre-tokenizer name with the same regex
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
           r"\s+(?!\S)|\s+")
SPLIT_PRE = {_QWEN2: "qwen2", _LLAMA3: "llama-bpe"}


@dataclass(frozen=True)
class ExportPlan:
    """Everything checked before a byte is written: the checkpoint's files, its architecture, its tokenizer's
    mapping to llama.cpp, the output path."""
    model_dir: Path
    out: Path
    type: str
    arch: Arch
    config: dict
    tokenizer: dict  # tokenizer.json
    pre: str  # llama.cpp's pre-tokenizer name
    weights: tuple[Path, ...]


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidInput(f"{path.parent} has no {path.name}: not a checkpoint speclab can export ({what})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInput(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path} is not a JSON object")
    return data


def pre_tokenizer(tok: dict) -> str:
    """llama.cpp's name for the pre-tokenizer of this tokenizer.json, by what it says (module doc); InvalidInput
    when llama.cpp has none with the same regex."""
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise InvalidInput(f"tokenizer model {model.get('type')!r}: the export writes byte-level BPE tokenizers only")
    if tok.get("normalizer"):
        raise InvalidInput("the tokenizer normalizes its text first (a normalizer): llama.cpp's BPE tokenizer "
                           "does not, so the ids would differ")
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if steps[0].get("behavior") == "Isolated" and pattern in SPLIT_PRE:
            return SPLIT_PRE[pattern]
    raise InvalidInput(f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds)) or 'none'}) has no "
                       "llama.cpp pre-tokenizer with the same regex: exporting it would tokenize silently wrong")


def plan(model_dir: str | Path, out: str | Path, type: str = "bf16") -> ExportPlan:
    """Check an export before any work (one line each: InvalidInput)."""
    if type not in TYPES:
        raise InvalidInput(f"GGUF type {type!r}: use one of {', '.join(TYPES)}")
    d = Path(model_dir).expanduser()
    if not d.is_dir():
        raise InvalidInput(f"{d} is not a folder: give a checkpoint folder (config.json, tokenizer.json, weights)")
    config = _read_json(d / "config.json", "config.json")
    names = config.get("architectures") or []
    arch = next((ARCHS[a] for a in names if a in ARCHS), None)
    if arch is None:
        raise InvalidInput(f"{d.name}: architecture {', '.join(names) or 'unnamed'} is not one the export knows "
                           f"({', '.join(ARCHS)})")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
               if not isinstance(config.get(k), int) or config[k] <= 0]
    if missing:
        raise InvalidInput(f"{d.name}/config.json: no {', '.join(missing)} (a positive integer each)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        raise InvalidInput(f"{d.name}: rope scaling {rope.get('rope_type') or rope.get('type')!r}: the export writes "
                           "plain rope only")
    tok = _read_json(d / "tokenizer.json", "a tokenizer.json is needed: llama.cpp embeds the tokenizer")
    pre = pre_tokenizer(tok)
    weights = tuple(sorted(d.glob("*.safetensors")))
    if not weights:
        raise InvalidInput(f"{d} has no *.safetensors weights")
    out = Path(out).expanduser()
    if out.suffix != ".gguf":
        raise InvalidInput(f"{out}: the output file must end in .gguf")
    try:
        check_writable(out, "the GGUF file")
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    return ExportPlan(d, out, type, arch, config, tok, pre, weights)


def _vocab(p: ExportPlan):
    """(tokens, token types, merges) in llama.cpp's layout: one entry per id up to the model's vocab size."""
    import gguf
    model = p.tokenizer["model"]
    added = {a["id"]: a for a in p.tokenizer.get("added_tokens", [])}
    by_id = {i: t for t, i in model["vocab"].items()} | {i: a["content"] for i, a in added.items()}
    size = max(int(p.config.get("vocab_size") or 0), max(by_id) + 1)
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def _first_id(v):
    return v[0] if isinstance(v, list) and v else v if isinstance(v, int) else None


def source_hash(model_dir: str | Path) -> str:
    """A hash of the checkpoint's config, tokenizer and weight files (names, sizes and bytes)."""
    d = Path(model_dir)
    h = hashlib.sha256()
    for f in [d / "config.json", d / "tokenizer.json", *sorted(d.glob("*.safetensors"))]:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _permute(w, n_head: int):
    """Hugging Face's rotate-half q / k rows to llama.cpp's interleaved pairs (its LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export(p: ExportPlan, log: Callable[[str], None] = lambda s: None) -> Path:
    """Write the GGUF file of plan `p`; returns its path. Written to a temporary file and renamed into place."""
    import gguf
    import numpy as np
    from safetensors import safe_open
    c = p.config
    n_head, n_kv = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // n_head)
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16}[p.type]
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16}[p.type]
    n_layer = int(c["num_hidden_layers"])
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == p.arch.gguf_name),
                                     n_layer)
    tokens, types, merges = _vocab(p)
    from tokenizers import Tokenizer
    hf_tok = Tokenizer.from_file(str(p.model_dir / "tokenizer.json"))
    bos, eos, pad = (_first_id(c.get(k)) for k in ("bos_token_id", "eos_token_id", "pad_token_id"))
    probe = hf_tok.encode("a").ids
    add_bos = bos is not None and bool(probe) and probe[0] == bos
    with atomic_path(p.out) as tmp:
        w = gguf.GGUFWriter(tmp, p.arch.gguf_name)
        w.add_name(p.model_dir.name)
        w.add_file_type(ftype)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_string("speclab.source_sha256", source_hash(p.model_dir))
        w.add_context_length(int(c.get("max_position_embeddings") or 2048))
        w.add_embedding_length(int(c["hidden_size"]))
        w.add_block_count(n_layer)
        w.add_feed_forward_length(int(c["intermediate_size"]))
        w.add_head_count(n_head)
        w.add_head_count_kv(n_kv)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0))
        w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps") or 1e-6))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(p.pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        if eos is not None:
            w.add_eos_token_id(eos)
        if bos is not None:
            w.add_bos_token_id(bos)
        if pad is not None:
            w.add_pad_token_id(pad)
        w.add_add_bos_token(add_bos)
        w.add_add_eos_token(False)
        tied = bool(c.get("tie_word_embeddings"))
        for f in p.weights:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if tied and key == "lm_head.weight":
                        continue
                    name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                    if name is None:
                        raise InvalidInput(f"{f.name}: tensor {key} has no GGUF name for {p.arch.gguf_name}")
                    t = st.get_tensor(key).float()
                    if p.arch.permute_qk and key.endswith("q_proj.weight"):
                        t = _permute(t, n_head)
                    elif p.arch.permute_qk and key.endswith("k_proj.weight"):
                        t = _permute(t, n_kv)
                    a = t.numpy()
                    if a.ndim <= 1 or name.endswith("_norm.weight") or qtype == gguf.GGMLQuantizationType.F32:
                        w.add_tensor(name, a.astype(np.float32))
                    elif qtype == gguf.GGMLQuantizationType.F16:
                        w.add_tensor(name, a.astype(np.float16))
                    else:
                        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
                    log(f"{key} -> {name}")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return p.out


def cached(model_dir: str | Path, type: str) -> Path:
    """The GGUF file of a checkpoint in `type`, exported once into the per-user cache and reused while its files
    are unchanged (the file's name carries their hash)."""
    d = Path(model_dir)
    out = cache_dir() / "gguf" / f"{d.name}-{source_hash(d)[:16]}-{type}.gguf"
    if not out.exists():
        export(plan(d, out, type))
    return out



# Hand-made texts for the tokenizer round trip, beside every bundled prompt: whitespace runs, digits, unicode,
# code, contractions, added tokens, and llama.cpp's own pre-tokenizer check text (its converter's `chktxt`, rebuilt)
EDGE_TEXTS = (
    "", " ", "  ", "\n", "\n\n", " \n \n\n", "\t", "a\tb\t\tc", "   leading and trailing   ", "line\r\nwindows\r\n",
    "3 33 333 3333 33333 333333 3333333", "3.14159 -2e-10 1,000,000 0x1F 1/2 12:30", "v1.2.3-rc4",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "naïve café résumé Ångström", "нещо на Български", "我想在apple工作1314151天～", "日本語のテキスト。",
    "🚀 (normal) 😶\u200d🌫️ (emojis) ✅ 🦙🦙", "កាន់តែពិសេសអាច😁", "مرحبا بالعالم", "Δx → ∞, ∑ᵢ xᵢ² ≤ ε",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { s += a[i]; }",
    "if __name__ == '__main__':\n\tmain()\n", "SELECT * FROM runs WHERE id >= 10;",
    "------======= '''''' ``````` \"\"\"\" ...... !!!!!! ??????", "<|endoftext|>", "a<|endoftext|>b",
    "Once upon a time<|endoftext|>\n\nThe end.", "\u00a0non\u00a0breaking\u2009thin space", "zero\u200bwidth",
)
