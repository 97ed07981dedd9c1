# The two commands of README.md: `make run` (the main job on the zoo) and `make test` (the suite).
# Both create/reuse .venv and install what they need (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup run test

setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m speclab.cli generate --prompts data/prompts/demo.jsonl --method sps --max-new-tokens 64

test: setup
	$(PY) -m pytest -q
