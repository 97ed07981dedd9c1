# The two commands of README.md: `make run` (the main job on the zoo) and `make test` (the suite).
# Both create/reuse .venv and install what they need (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup run demo test bench bench-quick

setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m speclab.cli app

demo: setup
	$(PY) -m speclab.cli generate --prompts data/prompts/demo.jsonl --method sps --max-new-tokens 64

test:
	@bash scripts/setup.sh test
	$(PY) -m pytest -q

# Benchmarks on the zoo (README "Benchmarks"): report in reports/bench.md + .html, rows in traces/bench.duckdb
bench: setup
	$(PY) -m speclab.cli bench --suite zoo --methods ar,sps,pld,eagle3,dflash,dflash:markov=0 --limit 8 --max-new-tokens 128

bench-quick: setup
	$(PY) -m speclab.cli bench --suite zoo --methods ar,sps,pld,eagle3,dflash --quick
