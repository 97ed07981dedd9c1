"""Benchmarks: prompt suites, bench runs, result tables and reports, parameter grids, cost micro-benchmarks, and
WhiFlash's evaluation on a bench (`routing`) and router calibration (`calibration`)."""
