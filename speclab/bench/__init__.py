"""Benchmarks: prompt suites, bench runs, result tables and reports, parameter grids, cost micro-benchmarks."""
