"""Every decoding parameter checked in one place, at the boundary, before any model work.

The CLI, `speclab.generate` (and so the app and the bench) all go through `check_sampling` and
`speclab.methods.method_params`, so they refuse the same inputs with the same one-line message: the parameter,
its value and what is allowed. Ranges follow from the model where they can (a tree no wider than the
vocabulary and no larger than one verification can hold, a draft no longer than the context).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from speclab.errors import InvalidInput

MAX_TREE_NODES = 1024  # nodes one verification forward takes (its ancestor mask is nodes^2)


@dataclass(frozen=True)
class Bound:
    """Allowed values of one numeric parameter: lo <= v <= hi (v < hi when `hi_open`)."""
    lo: float | None = None
    hi: float | None = None
    hi_open: bool = False

    def describe(self, kind: type) -> str:
        what = "an integer" if kind is int else "a finite number"
        if self.lo is not None and self.hi is not None:
            return f"{what} from {_fmt(self.lo)} to {_fmt(self.hi)}" + (" (excluded)" if self.hi_open else "")
        if self.lo is not None:
            return f"{what} of at least {_fmt(self.lo)}"
        if self.hi is not None:
            return f"{what} {'<' if self.hi_open else '<='} {_fmt(self.hi)}"
        return what


def _fmt(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def check_number(name: str, value, kind: type = float, bound: Bound = Bound()):
    """`value` as `kind` if it is one (finite, integral for int) and within `bound`; else InvalidInput naming it."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    ok = math.isfinite(v) and not isinstance(value, bool) and (kind is not int or v.is_integer())
    if ok:
        v = int(v) if kind is int else v
        ok = (bound.lo is None or v >= bound.lo) and (
            bound.hi is None or (v < bound.hi if bound.hi_open else v <= bound.hi))
    if not ok:
        raise InvalidInput(f"{name} must be {bound.describe(kind)} (got {_shown(value)})")
    return v


def _shown(value) -> str:
    """A value as the user typed it: finite numbers given as text (options, method specs) bare, an empty box
    (None or blank text) as "nothing", anything else quoted."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "nothing"
    try:
        return value if isinstance(value, str) and math.isfinite(float(value)) else repr(value)
    except ValueError:
        return repr(value)


MAX_TEMPERATURE = 10.0  # past this the target's distribution is close to uniform noise: a typo, not an experiment


def check_sampling(temperature=0.0, top_k=0, top_p=1.0, seed=None, vocab_size: int | None = None):
    """The sampling parameters, checked: (temperature, top_k, top_p, seed)."""
    temperature = check_number("temperature", temperature, float, Bound(0.0, MAX_TEMPERATURE))
    top_k = check_number("top_k", top_k, int, Bound(0, vocab_size))
    top_p = check_number("top_p", top_p, float, Bound(0.0, 1.0))
    if top_p == 0:
        raise InvalidInput("top_p must be a finite number above 0, up to 1 (got 0; 1 = off)")
    if seed is not None:
        seed = check_number("seed", seed, int, Bound(0, 2**63 - 1))
    return temperature, top_k, top_p, seed
