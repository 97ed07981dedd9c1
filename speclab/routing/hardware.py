"""Hardware cost profiles: what a round costs on one machine in one dtype, as a file (`speclab costs measure --out`
writes one wherever it runs; `--costs PROFILE` hands it to `speclab routing`, `sweep`, `calibrate`, the app and the
notebooks), so a router's replay and its thresholds can be seen under another machine's costs than this one's.

A profile is JSON (`FORMAT`):
- `name`, `source` ("measured": by `speclab costs measure`, or "published": built from a paper's figures, with
  `citation` saying which), `machine` (device, CPU or GPU name, threads, torch), `dtype`, `models` (the target and
  drafters it was measured with: path and fingerprint);
- `measured` (what was timed, medians in ms): `target_forward_ms` by rows after `context` tokens, `prefill_ms` by
  prompt tokens, `head_ms` (the target's final norm and LM head, one row), and per drafter `draft_ms` (one propose
  at its default parameters), `width` (the nodes it drafted), `catchup_ms` by backlog, `other_ms` (routing, commit
  and recording per round, from a short decode);
- `cost_model`: the round-cost model's terms (`speclab.routing.replay.CostModel`) fitted to `measured`: verification
  = verify0 + verify1 x rows, catch-up = catchup0 + catchup1 x backlog, prefill = prefill0 + prefill1 x prompt tokens.
Every figure replayed under a profile is *modeled*: the tables and plots say so, with the profile's name.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from speclab.errors import InvalidInput
from speclab.routing.replay import DRAFTERS, CostModel

FORMAT = "speclab-cost-profile/1"
SOURCES = ("measured", "published")


@dataclass
class HardwareProfile:
    name: str
    source: str  # "measured" or "published"
    machine: dict
    dtype: str
    cost: CostModel
    models: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)
    citation: str | None = None  # a published profile's source
    path: str | None = None

    @property
    def label(self) -> str:
        """'cpu-bf16 (measured: cpu, bf16)': how tables and plots name the profile."""
        where = self.machine.get("gpu") or self.machine.get("device", "?")
        return f"{self.name} ({self.source}: {where}, {self.dtype})"

    def to_json(self) -> str:
        d = {"format": FORMAT, "name": self.name, "source": self.source, "citation": self.citation,
             "machine": self.machine, "dtype": self.dtype, "models": self.models, "measured": self.measured,
             "cost_model": self.cost.to_dict()}
        return json.dumps(d, indent=1, default=float) + "\n"

    def save(self, path: str | Path) -> Path:
        from speclab.files import write_atomic
        return write_atomic(path, self.to_json())


def fit_line(xs, ys) -> tuple[float, float]:
    """Least-squares intercept and slope of ys (ms) over xs (a single point: its value, slope 0). Neither is
    negative: a slope below 0 is 0, and where the intercept would be below 0 (times that grow faster than a line,
    as a prefill's over prompt lengths can with one repetition each) the line goes through the origin instead."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(np.unique(xs)) < 2:
        return float(max(ys.mean(), 0.0)), 0.0
    b, a = np.polyfit(xs, ys, 1)
    if a < 0:
        a, b = 0.0, float((xs * ys).sum() / (xs * xs).sum())
    return float(a), float(max(b, 0.0))


def cost_model(measured: dict) -> CostModel:
    """The round-cost model fitted to a profile's measured tables."""
    fw = measured["target_forward_ms"]
    v0, v1 = fit_line([int(k) for k in fw], list(fw.values()))
    pf = measured["prefill_ms"]
    p0, p1 = fit_line([int(k) for k in pf], list(pf.values()))
    draft, c0, c1, other = [], [], [], []
    for name in DRAFTERS:
        d = measured["drafters"][name]
        draft.append(float(d["draft_ms"]))
        a, b = fit_line([int(k) for k in d["catchup_ms"]], list(d["catchup_ms"].values()))
        c0.append(a)
        c1.append(b)
        other.append(float(d.get("other_ms", 0.0)))
    return CostModel(draft, v0, v1, c0, c1, other, p0, p1, label="measured here")


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile file, checked: one line naming the file and what is wrong, before any model work."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise InvalidInput(f"--costs {path}: no such file (`speclab costs measure --out FILE` writes one; the shipped "
                           "ones are in data/costs/)")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidInput(f"--costs {path}: not a JSON cost profile ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise InvalidInput(f"--costs {path}: not a speclab cost profile (its format is not {FORMAT!r})")
    if d.get("source") not in SOURCES:
        raise InvalidInput(f"--costs {path}: source must be one of {', '.join(SOURCES)} (got {d.get('source')!r})")
    if d["source"] == "published" and not d.get("citation"):
        raise InvalidInput(f"--costs {path}: a published profile names its source in 'citation'")
    cm = d.get("cost_model")
    need = [k for k in CostModel.__dataclass_fields__ if k not in ("rounds_fitted", "runs_fitted", "label", "here")]
    if not isinstance(cm, dict) or any(k not in cm for k in need):
        raise InvalidInput(f"--costs {path}: its cost_model lacks {', '.join(k for k in need if k not in (cm or {}))}")
    for k in need:
        per = k in ("draft", "catchup0", "catchup1", "other")
        vals = cm[k] if per and isinstance(cm[k], list) else [cm[k]]
        if (per and (not isinstance(cm[k], list) or len(cm[k]) != len(DRAFTERS))) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                for v in vals):
            what = f"a list of one number per drafter ({', '.join(DRAFTERS)})" if per else "a number"
            raise InvalidInput(f"--costs {path}: cost_model.{k} must be {what}, each >= 0 ms")
    if not str(d.get("name") or "").strip():
        raise InvalidInput(f"--costs {path}: the profile has no name")
    prof = HardwareProfile(str(d["name"]), d["source"], d.get("machine") or {}, str(d.get("dtype") or "?"),
                           CostModel.from_dict(cm), d.get("models") or {}, d.get("measured") or {}, d.get("citation"),
                           str(p))
    prof.cost.label, prof.cost.here = f"profile {prof.label}", False
    return prof
