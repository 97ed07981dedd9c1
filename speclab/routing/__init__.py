"""Routing between drafters (WhiFlash): routers, the routed methods, counterfactual profiles and replay, oracles,
the cost model and hardware cost profiles. Their evaluation on a bench and the calibration, which run benches, are
in `speclab.bench` (`bench.routing`, `bench.calibration`): routing sits below the bench (docs/ARCHITECTURE.md)."""
