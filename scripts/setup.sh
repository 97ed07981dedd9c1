#!/usr/bin/env bash
# Create or reuse .venv and install speclab with the right torch build; the pip part re-runs only when the
# dependency list changes. CPU machines get the CPU build of torch 2.13.0 (served from this image's local
# wheel folder): the multi-gigabyte CUDA stack is never pulled on a machine without an NVIDIA GPU.
# The test extra (pytest, scipy, playwright, and ruff + mypy + import-linter, which `make test` runs before pytest)
# comes with every set-up; `setup.sh test` also makes sure Debian's chromium is there for the app's browser tests.
# The notebooks' tools (JupyterLab, ipywidgets, the kernel and nbclient) come with every set-up: `make lab` and the
# tests use them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
quiet() { grep -v "^WARNING: Location" || true; }
stamp=.venv/.speclab-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "speclab setup: installing into .venv (first run takes a few minutes) ..."
  python -m pip install -q --upgrade "pip>=24" 2>&1 | quiet
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "speclab setup: NVIDIA GPU found: installing a CUDA build of torch"
    python -m pip install -q "torch>=2.13,<=2.14.1" 2>&1 | quiet
  else
    echo "speclab setup: no NVIDIA GPU: installing the CPU build of torch 2.13.0"
    python -m pip install -q "torch==2.13.0" 2>&1 | quiet
    if ! python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" 2>/dev/null; then
      echo "speclab setup: warning: the torch that was installed is a CUDA build (no CPU wheel was found locally)" >&2
    fi
  fi
  python -m pip install -q -e ".[test,lab]" 2>&1 | quiet
  python -c "import torch, transformers, duckdb, gradio, speclab; print('speclab setup: torch', torch.__version__, '| transformers', transformers.__version__, '| duckdb', duckdb.__version__, '| gradio', gradio.__version__)"
  # the linters `make test` runs
  python -m ruff --version >/dev/null && python -m mypy --version >/dev/null && lint-imports --help >/dev/null
  echo "$want" > "$stamp"
fi
if [ "${1:-}" = "test" ] && ! command -v chromium >/dev/null 2>&1; then
  # the app's browser tests drive Debian's chromium (Playwright's own browser download is not reachable here)
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "speclab setup: installing Debian's chromium for the browser tests ..."
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "speclab setup: warning: chromium is missing and needs root + apt to install; browser tests will skip" >&2
  fi
fi
