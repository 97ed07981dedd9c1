"""WhiFlash's routed methods as registry entries: EAGLE-3 and DFlash under one router (entropy or neural), each
drafter configured as its standalone method (the paper's Table 7), and the neural router's model role.

`threshold` None = calibrated (`speclab.routing.routers.default_threshold`); `eager` = 1 keeps both drafters
caught up every round (the naive scheme lazy catch-up is measured against). The drafters' parameters are
their own declarations (speclab/drafters/eagle3.py, dflash.py); DFlash's tree parameters keep their defaults.
"""
from __future__ import annotations

from dataclasses import replace

from speclab.checks import Bound
from speclab.drafters.registry import ROUTER_PARAMS, ModelRole, Param, build_drafter, drafters
from speclab.routing.routers import EntropyRouter, NeuralRouter, default_threshold, load_router, threshold_bound

ROUTER_ROLE = ModelRole("router", "--router-model", "router", "a neural router",
                        lambda path, target, paths: load_router(path, target), zoo="router",
                        card="data/zoo/router/README.md",
                        help="neural router directory for whiflash-neural (default: the zoo's)")

DESCRIPTIONS = {
    "entropy": "WhiFlash-Entropy: EAGLE-3 when the target's last entropy > threshold (nats), else DFlash; threshold "
               "calibrated (your calibration file, else the zoo's) unless given; eager = 1 keeps both drafters caught "
               "up every round",
    "neural": "WhiFlash-Neural: EAGLE-3 when the router MLP's predicted AL_eagle3 - AL_dflash on the target's hidden "
              "state > threshold, else DFlash; threshold calibrated (or the router's hardware-aware one) unless given",
}
DFLASH_ROUTED = ("block_size", "markov")  # DFlash's parameters a routed method exposes (its tree ones stay default)


def params(policy: str) -> tuple[Param, ...]:
    e, d = drafters()["eagle3"], drafters()["dflash"]
    return (Param("threshold", None, lambda t: threshold_bound(policy, t.vocab_size),
                  help="the routing threshold (entropy: nats; neural: predicted AL_eagle3 - AL_dflash); "
                       "default: calibrated (your calibration file, else the zoo's)"),
            Param("eager", 0, lambda t: Bound(0, 1),
                  help="1 = catch both drafters up every round (the naive scheme); 0 = lazily, at a switch"),
            # no default grid: sweep a routed method's threshold instead; EAGLE-3's router parameters (`pays`) stay out
            *(replace(p, grid=()) for p in e.params if p.name not in ROUTER_PARAMS),
            *(replace(p, grid=()) for p in d.params if p.name in DFLASH_ROUTED))


def build(policy: str):
    # `p` comes resolved at the decode's temperature (EAGLE-3's and DFlash's parameters are the method's), so
    # `sampled` has nothing left to choose here
    def build_routed(target, models, threshold=None, eager=0, category=None, sampled=False, **p):
        eagle3 = {q.name for q in drafters()["eagle3"].params}
        built = {"eagle3": build_drafter("eagle3", target, models, **{k: v for k, v in p.items() if k in eagle3}),
                 "dflash": build_drafter("dflash", target, models,  # and EAGLE-3's draft_temp: one for both
                                         **{k: p[k] for k in (*DFLASH_ROUTED, "draft_temp")})}
        mlp = models.get("router") if policy == "neural" else None
        if threshold is None:
            threshold = default_threshold(policy, category, target.fingerprint, mlp)
        router = NeuralRouter(mlp, threshold, eager) if policy == "neural" else EntropyRouter(threshold, eager)
        return built, router
    return build_routed


def check(p: dict, target) -> None:
    drafters()["eagle3"].check(p, target)
