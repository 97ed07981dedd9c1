#!/usr/bin/env bash
# Create or reuse .venv and install speclab with the right torch build; re-runs only when the
# dependency list changes. CPU machines get the CPU build of torch 2.13.0 (served from this image's
# local wheel folder): the multi-gigabyte CUDA stack is never pulled on a machine without an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.speclab-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "speclab setup: installing into .venv (first run takes a few minutes) ..."
python -m pip install -q --upgrade "pip>=24" 2>&1 | grep -v "^WARNING: Location" || true
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "speclab setup: NVIDIA GPU found: installing a CUDA build of torch"
  python -m pip install -q "torch>=2.13,<=2.14.1" 2>&1 | grep -v "^WARNING: Location" || true
else
  echo "speclab setup: no NVIDIA GPU: installing the CPU build of torch 2.13.0"
  python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  if ! python -c "import torch, sys; sys.exit(torch.version.cuda is not None)"; then
    echo "speclab setup: warning: the torch that was installed is a CUDA build (no CPU wheel was found locally)" >&2
  fi
fi
python -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import torch, transformers, duckdb, speclab; print('speclab setup: torch', torch.__version__, '| transformers', transformers.__version__, '| duckdb', duckdb.__version__)"
echo "$want" > "$stamp"
