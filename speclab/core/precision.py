"""Numeric precision: which dtype a decode runs in, and logits that never tie by quantisation.

Three decisions live here, one concept: how precisely the models compute.

- **The dtype** (`pick_dtype`). `auto` (the default) is bf16 on CUDA, fp32 on a CPU without native bf16
  (`avx512_bf16` / `amx_bf16`), and elsewhere what this machine measured once for these models and keeps in a
  per-user cache (`DtypeDecision`, `cached_decision` / `store_decision`): per method family (AR, speculative) the
  decode's own calls timed in both dtypes, interleaved until the difference is resolved or a tie (a tie picks
  fp32). The measurement is `speclab.bench.costs.dtype_decision`; `speclab.models.resolve_dtype` ties it together.
- **Logits in fp32** (`head_logits`). In bf16 the LM head's outputs carry 8 mantissa bits, so near the top of
  the distribution two logits often tie exactly, and a 1-row AR step and an n-row verification break the tie
  differently. Here the final norm runs in fp32 on the bf16 hidden state, the head matmul runs in bf16 (the
  CPU has no bf16 x bf16 -> fp32 matmul in torch, and an fp32 head costs 3-4x as much), and the `REFINE_K`
  largest logits of every row are then recomputed exactly in fp32 (bf16 weights are exact in fp32). A row
  whose unrefined logits might still reach the refined maximum (by a bound on the bf16 error: output rounding
  plus |w| * |h - bf16(h)|) gets its whole row in fp32. So the argmax, the top-k and every logit that could
  matter for a tie are fp32 values; the far tail keeps bf16 precision.
- **Exact mode** lives in `speclab/core/lean.py` (`LeanDecoder(exact=True)`): every call on one fixed row tile, so
  per-row results do not depend on how many rows run together. `LOGITS` and `exact` are recorded on each run.
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from speclab.core import layers, native
from speclab.errors import InvalidInput

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")
LOGITS = ("fp32", "model")  # logits in fp32 (refined) or in the model's dtype
REFINE_K = 16  # logits of each row recomputed in fp32
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def dtype_option(name: str) -> str:
    """The --dtype value that selects the dtype called `name` ('bfloat16' -> 'bf16'); `name` when none does."""
    return next((k for k in DTYPE_CHOICES if k in DTYPES and DTYPES[k] is DTYPES.get(name)), name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_dtype(name):
    """`name` if it names a dtype speclab runs in ('auto' included), else InvalidInput."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or str(name) in DTYPE_CHOICES or str(name) in DTYPES:
        return name
    raise InvalidInput(f"--dtype {name!r} is not a dtype speclab runs in: choose one of {', '.join(DTYPE_CHOICES)}")


def check_logits(name: str) -> str:
    if name not in LOGITS:
        raise InvalidInput(f"--logits {name!r}: choose fp32 (the final norm and head's top logits in fp32) or model "
                           "(logits in the model's dtype)")
    return name


@functools.lru_cache(maxsize=1)
def _cpu() -> tuple[str, frozenset[str]]:
    """(CPU model name, all its flags) from /proc/cpuinfo (no flags where it cannot be read)."""
    name, flags = platform.processor() or platform.machine(), frozenset[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    name = value.strip()
                elif key == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return name, flags


def cpu_info() -> tuple[str, tuple[str, ...]]:
    """(CPU model name, its bf16 flags)."""
    name, flags = _cpu()
    return name, tuple(f for f in BF16_FLAGS if f in flags)


def cpu_label() -> str:
    name, flags = cpu_info()
    return f"{name} ({', '.join(flags) if flags else 'no native bf16'})"


def precision_label(target) -> str:
    """'bfloat16, fp32 logits, exact' and the like: how a target computes, in a few words (headers, reports)."""
    p = target.precision
    return (f"{p['dtype']}" + (", fp32 logits" if p["logits_dtype"] == "float32" and p["dtype"] != "float32" else "")
            + (", exact" if p["exact"] else ""))


# ---- --dtype auto: one decision per machine, kept in a per-user cache ------------------------------------------
# The decision is measured above this layer (`speclab.bench.costs.dtype_decision`: the decode's own calls in both
# dtypes, interleaved until resolved) and resolved by `speclab.models.resolve_dtype`; here live what it is, its
# key and its cache, so that every later run on the machine reads the same answer.

FAMILIES = {"ar": "AR (one target row per token)",
            "speculative": "speculative methods (a verification of several rows plus the drafter's calls per round)"}
TIE_DTYPE = "fp32"  # a tie (neither dtype measurably faster) picks the exact reference: output equal to AR, no ties
TIE_MARGIN = 0.03  # a difference under 3% either way, resolved as such, is a tie
BUSY_CORES = 0.3  # other processes using more CPU than this while measuring: the decision is provisional
CACHE_FORMAT, CACHE_VERSION = "speclab-dtype-auto", 2  # 2: role dtypes (`DtypeDecision.roles`)


def family(method: str) -> str:
    """The method family a method spec decodes in: 'ar' or 'speculative'."""
    return "ar" if str(method).split("@")[0].split(":")[0] == "ar" else "speculative"


def machine() -> dict:
    """What the decision depends on besides the models: CPU model, a hash of all its flags, cores, threads, torch,
    how bf16 matmuls run (`speclab.core.layers.linear`: AMX tiles, AVX512-BF16 dot products, oneDNN's prepacked
    layout or F.linear) and attention (`layers.attend`: `native.cpp`'s or torch's fused kernel), and whether the
    layers run from C++ (`speclab.core.native`), and from which source (a change to it measures again)."""
    import hashlib
    import os
    name, flags = _cpu()
    return {"cpu": name, "flags": hashlib.sha1(" ".join(sorted(flags)).encode()).hexdigest()[:12],
            "bf16": list(cpu_info()[1]), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "linear": "F.linear" if not layers.PACKED else native.product() or "prepacked",
            "attention": "native" if native.attention_module() is not None else "fused",
            "layers": native.mode(), "native_source": native.source_hash()}


def other_load(window_s: float = 0.3) -> float:
    """How many cores other processes kept busy over the next `window_s` (Linux: /proc/stat minus this process);
    0.0 where that cannot be read. Timings taken meanwhile are not this machine's own."""
    import os
    import time

    def busy():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        mine = os.times()
        return sum(v) - v[3] - v[4], sum(v), mine.user + mine.system

    try:
        b0, t0, m0 = busy()
        time.sleep(window_s)
        b1, t1, m1 = busy()
    except (OSError, ValueError, IndexError):
        return 0.0
    hz, cores = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    return max(0.0, ((b1 - b0) - (m1 - m0) * hz) / max(t1 - t0, 1) * cores)


def model_key(path) -> str:
    """A model's identity for the cache, wherever its folder lies: its config.json and its weight files' names and
    sizes (a hub name stands for itself)."""
    import hashlib
    from pathlib import Path
    p = Path(str(path)).expanduser()
    if not p.is_dir():
        return str(path)
    h = hashlib.sha1((p / "config.json").read_bytes() if (p / "config.json").exists() else b"")
    for f in sorted(p.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".pt"):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def decision_key(models: dict) -> str:
    """The cache key of a decision: this machine and the models it was measured on (role -> `model_key`)."""
    import hashlib
    import json
    return hashlib.sha1(json.dumps([machine(), sorted(models.items())]).encode()).hexdigest()[:16]


@dataclass
class DtypeDecision:
    """What `--dtype auto` means on this machine for these models, per method family, and the measurement behind it.

    `costs[family]`: ms of the family's calls per round in each dtype (medians), the bf16 / fp32 ratio and its 95%
    interval over paired repetitions, how many, and the verdict ('bf16', 'fp32' or 'tie'). `roles`: the dtype of each
    drafter model that computes apart from the target (`ModelRole.own_dtype`: the sps draft), decided the same way
    from its own calls (`costs[role]`); a tie leaves it in the speculative family's dtype."""
    dtypes: dict  # family -> 'fp32' | 'bf16'
    reason: dict  # family -> one line: why
    costs: dict = field(default_factory=dict)
    roles: dict = field(default_factory=dict)  # role -> 'fp32' | 'bf16'
    role_reason: dict = field(default_factory=dict)  # role -> one line: why
    key: str = ""
    models: dict = field(default_factory=dict)  # role -> model key, what was measured
    machine: dict = field(default_factory=dict)
    measured_at: str = ""
    busy: float = 0.0  # cores other processes kept busy while it was measured (`other_load`)
    source: str = "measured now"  # or "read from <cache file>" (set on read, never stored)
    samples: object = field(default=None, repr=False)  # the paired repetitions, when measured now (never stored)

    @property
    def provisional(self) -> bool:
        """Measured while other processes held the CPU: kept, and measured again once the machine is quiet."""
        return self.busy > BUSY_CORES

    def dtype(self, fam: str) -> str:
        return self.dtypes[fam]

    def line(self, fam: str) -> str:
        """One line for load lines, headers and reports: the dtype, why, and whether measured now or cached."""
        when = f", {self.measured_at}" if self.source != "measured now" and self.measured_at else ""
        busy = f"; provisional: other processes used {self.busy:.1f} cores meanwhile" if self.provisional else ""
        kept = f", kept in {cache_path()}" if self.source == "measured now" else ""
        return f"--dtype auto -> {self.dtypes[fam]} for {fam}: {self.reason[fam]} ({self.source}{kept}{when}{busy})"

    def role_lines(self, roles=None) -> list[str]:
        """One line per own-dtype role (of `roles`; None: all) whose dtype differs from the speculative family's:
        which and why."""
        return [f"--dtype auto -> {dt} for the {role} model: {self.role_reason[role]}"
                for role, dt in self.roles.items()
                if dt != self.dtypes.get("speculative") and (roles is None or role in roles)]

    def to_json(self) -> dict:
        return {"dtypes": self.dtypes, "reason": self.reason, "costs": self.costs, "roles": self.roles,
                "role_reason": self.role_reason, "key": self.key, "models": self.models, "machine": self.machine,
                "measured_at": self.measured_at, "busy": self.busy}


def fixed_decision(dtype: str, why: str) -> DtypeDecision:
    """A decision that needs no measurement (CUDA; a CPU without native bf16): one dtype for every family."""
    return DtypeDecision({f: dtype for f in FAMILIES}, {f: why for f in FAMILIES}, source="no measurement needed")


def cache_path():
    """The per-user cache file, in `speclab.files.cache_dir`."""
    from speclab.files import cache_dir
    return cache_dir() / "dtype-auto.json"


def _read_cache(path) -> tuple[dict, str | None]:
    """(entries, why the file cannot be trusted or None): a missing file is no entries and no complaint."""
    import json
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return {}, f"not readable JSON ({type(e).__name__})"
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        return {}, f"not a speclab dtype cache (no \"format\": \"{CACHE_FORMAT}\")"
    if data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        return {}, f"cache version {data.get('version')!r}, this speclab reads {CACHE_VERSION}"
    return data["entries"], None


def _valid_entry(e, key: str) -> str | None:
    """Why a cached entry cannot be trusted for `key` on this machine (None: it can)."""
    if not isinstance(e, dict):
        return "its entry is not an object"
    if e.get("key") != key or e.get("machine") != machine():
        return "its entry was measured on another machine or torch"
    d, r = e.get("dtypes"), e.get("reason")
    if not (isinstance(d, dict) and set(d) == set(FAMILIES) and all(v in ("fp32", "bf16") for v in d.values())):
        return "its entry names no fp32/bf16 choice for every method family"
    if not (isinstance(r, dict) and set(r) == set(FAMILIES) and all(isinstance(v, str) for v in r.values())):
        return "its entry has no reason for every family"
    ro, rr = e.get("roles"), e.get("role_reason")
    if not (isinstance(ro, dict) and isinstance(rr, dict) and set(ro) == set(rr)
            and all(v in ("fp32", "bf16") for v in ro.values()) and all(isinstance(v, str) for v in rr.values())):
        return "its entry names no fp32/bf16 choice and reason for its drafter models"
    if not isinstance(e.get("costs", {}), dict) or not isinstance(e.get("measured_at", ""), str) or \
            not isinstance(e.get("busy", 0.0), (int, float)) or isinstance(e.get("busy", 0.0), bool):
        return "its measurements are malformed"
    return None


def cached_decision(key: str, warn=None) -> DtypeDecision | None:
    """The decision cached for `key`, or None (never measured here; or the file or entry is corrupt or foreign:
    then `warn` gets one line and the caller measures again)."""
    path = cache_path()
    entries, bad = _read_cache(path)
    if bad is None and key in entries:
        bad = _valid_entry(entries[key], key)
        if bad is None:
            e = entries[key]
            return DtypeDecision(e["dtypes"], e["reason"], e.get("costs", {}), e["roles"], e["role_reason"], key,
                                 e.get("models", {}), e["machine"], e.get("measured_at", ""),
                                 float(e.get("busy", 0.0)), source=f"read from {path}")
    if bad is not None and warn is not None:
        warn(f"ignoring the dtype cache {path}: {bad}; measuring again")
    return None


def store_decision(d: DtypeDecision, warn=None) -> None:
    """Keep `d` in the cache (written whole: a temporary file, then one rename); the file's other valid entries
    stay, a corrupt file is replaced. A cache that cannot be written costs a measurement next time, nothing else."""
    import json

    from speclab.files import write_atomic
    path = cache_path()
    entries, bad = _read_cache(path)
    entries = {} if bad else {k: v for k, v in entries.items() if _valid_entry(v, k) is None or k == d.key}
    entries[d.key] = d.to_json()
    try:
        write_atomic(path, json.dumps({"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": entries},
                                      indent=1))
    except OSError as e:
        if warn is not None:
            warn(f"could not keep the dtype decision in {path} ({e.strerror or e}): it is measured again next time")


def pick_dtype(device: torch.device, dtype: str | torch.dtype | None = None, fam: str = "speculative",
               key: str | None = None) -> torch.dtype:
    """The dtype a model runs in: a name, a torch dtype, or None / 'auto'. `auto` is bf16 on CUDA, fp32 on a CPU
    without native bf16, and elsewhere the cached decision for `key` (`speclab.models.resolve_dtype` measures and
    caches it before loading); with none at hand, fp32, the exact reference, so 'auto' is never a coin flip."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype and dtype != "auto":
        return DTYPES[check_dtype(dtype)]
    if device.type == "cuda":
        return torch.bfloat16
    d = cached_decision(key) if key and cpu_info()[1] else None
    return DTYPES[d.dtype(fam)] if d else torch.float32


# ---- logits in fp32 -------------------------------------------------------------------------------------------

def rms_norm32(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 of a (bf16) hidden state: the input of an fp32 head."""
    if native.active(h):  # the same op in one pass (`speclab.core.native`)
        return native.rms_norm(h.float(), weight.float(), eps)
    return F.rms_norm(h.float(), h.shape[-1:], weight.float(), eps)


class Head:
    """An LM head `weight` [V, d] whose logits are fp32 where it matters (`logits='fp32'`) or in the weight's dtype
    upcast (`logits='model'`). Per row the result depends on that row only (exact mode relies on it)."""

    def __init__(self, weight: torch.Tensor, logits: str = "fp32", k: int = REFINE_K):
        self.weight, self.logits, self.k = weight, check_logits(logits), min(k, weight.shape[0])
        self.refine = logits == "fp32" and weight.dtype != torch.float32
        # the largest row norm of the head: bounds a logit's error from rounding the hidden state to bf16
        self.w_norm = float(weight.detach().float().norm(dim=-1).max()) if self.refine else 0.0

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [..., V] of hidden states h [..., d] (fp32 from `rms_norm32`, or the model's dtype)."""
        w = self.weight
        if self.refine and native.active(h):  # the same ops from C++ (`speclab.core.native`)
            out, risky = native.refined_head(h, w, self.k, self.w_norm)
            return self.full_rows(out, h, risky)
        low = layers.linear(h.to(w.dtype), w).float()
        if not self.refine:
            return low
        shape = low.shape
        low, h = low.reshape(-1, shape[-1]), h.reshape(-1, h.shape[-1]).float()
        top = low.topk(self.k, -1)
        exact = (w[top.indices].float() * h[:, None, :]).sum(-1)  # [rows, k] fp32 dot products
        out = low.scatter_(-1, top.indices, exact)
        if self.k < shape[-1]:  # could an unrefined logit reach the refined maximum? then that row in full fp32
            kth = top.values[:, -1]
            err = kth.abs() * 2.0 ** -7 + self.w_norm * (h - h.to(w.dtype).float()).norm(dim=-1) + 1e-3
            out = self.full_rows(out.view(shape), h, kth + err >= exact.max(-1).values)
        return out.view(shape)

    def full_rows(self, out: torch.Tensor, h: torch.Tensor, risky: torch.Tensor) -> torch.Tensor:
        """`out` [.., V] with the `risky` rows (of the rows flattened) recomputed in full fp32: rare; one row at a
        time, so a row's result never depends on the others (`refined_head`'s second output; `native.lean_forward`)."""
        rows = risky.nonzero().flatten().tolist()
        if rows:
            flat, h, w32 = out.view(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]).float(), self.weight.float()
            for r in rows:
                flat[r] = F.linear(h[r : r + 1], w32)[0]
        return out
