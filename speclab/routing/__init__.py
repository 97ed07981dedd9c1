"""Routing between drafters (WhiFlash): routers, counterfactual profiles and replay, oracles, the cost model,
calibration and the evaluation on a bench."""
