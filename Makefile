# The two commands of README.md: `make run` (the main job on the zoo) and `make test` (the suite;
# `make test-fast` skips the slow tests).
# Both create/reuse .venv and install what they need (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup setup-peers run demo test test-fast bench bench-sampled bench-quick route whiflash app-probe lab

setup:
	@bash scripts/setup.sh

# the set-up with llama-cpp-python built for this CPU (the bench's llama.cpp peers)
setup-peers:
	@bash scripts/setup.sh peers

run: setup
	$(PY) -m app

demo: setup
	$(PY) -m speclab.cli generate --prompts data/prompts/demo.jsonl --method sps --max-new-tokens 64

# The notebooks in JupyterLab (README "Notebooks"); the tests execute them top to bottom
lab: setup
	$(PY) -m jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1

# The app measured in a real browser (first tokens, bytes per update): README "The app"
app-probe:
	@bash scripts/setup.sh test
	$(PY) -m app.probe --methods ar,eagle3,dflash,whiflash-neural --tokens 256 --repeats 3

# The suite: lint (ruff), types of the core modules (mypy), the import contract (lint-imports: the layers of
# docs/ARCHITECTURE.md, no cycle), then every test; a failure of any fails the target
test:
	@bash scripts/setup.sh test
	$(PY) -m ruff check .
	$(PY) -m mypy
	.venv/bin/lint-imports
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile

# The same without the tests marked slow (notebooks, browser, zoo equality, training, subprocess CLIs)
test-fast:
	@bash scripts/setup.sh test
	$(PY) -m ruff check .
	$(PY) -m mypy
	.venv/bin/lint-imports
	$(PY) -m pytest -q -m "not slow" -n auto --maxprocesses 4 --dist loadfile

# Benchmarks on the zoo (README "Benchmarks"): report in reports/bench.md + .html, rows in traces/bench.duckdb
bench: setup-peers
	$(PY) -m speclab.cli bench --suite zoo --methods ar,sps,pld,eagle3,dflash,dflash:markov=0,whiflash-entropy,whiflash-neural --limit 8 --max-new-tokens 128

# Routing v2 (README "Routing v2"): the arms' round costs measured on this machine (for the learned router), the route
# method and the learned router beside their arms on the zoo (live, paired by prompt), then every
# arm profiled and each policy and Oracle-Token replayed, with the model error against the live runs
route: setup
	$(PY) -m speclab.cli costs route --report reports/route_costs.md
	$(PY) -m speclab.cli bench --suite zoo --methods ar,pld,eagle3,dflash,route,route:router=learned,route:arms=pld.eagle3 --limit 8 --max-new-tokens 128 --no-peers --no-untraced --db traces/route.duckdb --report reports/route_bench.md
	$(PY) -m speclab.cli route-table --db traces/route.duckdb --bench latest --report reports/route_table.md

# Sampled decoding on the zoo (README "Sampling"): every method at T = 0.7 and T = 1, fixed seeds (prompt i at seed i),
# paired by prompt; reports in reports/bench_t0.7.md and reports/bench_t1.md
SAMPLED_METHODS = ar,sps,pld,eagle3,dflash,specblock,confu,whiflash-entropy
bench-sampled: setup
	$(PY) -m speclab.cli bench --suite zoo --methods $(SAMPLED_METHODS) --limit 8 --max-new-tokens 128 --no-peers --no-untraced --temperature 0.7 --seed 0 --report reports/bench_t0.7.md
	$(PY) -m speclab.cli bench --suite zoo --methods $(SAMPLED_METHODS) --limit 8 --max-new-tokens 128 --no-peers --no-untraced --temperature 1 --seed 0 --report reports/bench_t1.md

bench-quick: setup
	$(PY) -m speclab.cli bench --suite zoo --methods ar,sps,pld,eagle3,dflash,whiflash-entropy --quick

# WhiFlash on the zoo (README "Routing"): calibrate on held-out prompts, then the per-category table, sweeps, switch costs
whiflash: setup
	$(PY) -m speclab.cli bench --suite zoo-calibration --methods ar,eagle3,dflash --limit 8 --max-new-tokens 128 --no-peers --no-untraced --db traces/calibration.duckdb --report reports/calibration_bench.md
	$(PY) -m speclab.cli calibrate --db traces/calibration.duckdb
	$(PY) -m speclab.cli bench --suite zoo --methods ar,eagle3,dflash,whiflash-entropy,whiflash-neural,whiflash-entropy:eager=1 --limit 8 --max-new-tokens 128 --no-peers --no-untraced --db traces/routing.duckdb --report reports/routing_bench.md
	$(PY) -m speclab.cli routing --db traces/routing.duckdb
	$(PY) -m speclab.cli sweep --router neural --grid=-2:3:0.25 --db traces/routing.duckdb --report reports/sweep_neural.html
	$(PY) -m speclab.cli sweep --router entropy --grid 0:4:0.25 --db traces/routing.duckdb --report reports/sweep_entropy.html
	$(PY) -m speclab.cli costs switch
