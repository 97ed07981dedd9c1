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
fresh=$([ "$(cat "$stamp" 2>/dev/null)" != "$want" ] && echo 1 || true)
if [ -n "$fresh" ]; then
  echo "speclab setup: installing into .venv (first run takes a few minutes) ..."
  python -m pip install -q --upgrade "pip>=24" 2>&1 | quiet
fi
# llama.cpp, the CPU peer of the bench (speclab.llamacpp), for `setup.sh test` and `setup.sh peers` (make test,
# make bench; the app does not need it): llama-cpp-python built from its source distribution for this CPU
# (-march=native), kept in .venv, and without llama.cpp's common library, which its wheel does not ship
# (scripts/llamacpp-no-common.cmake: half the compile time). The first build takes about 3 minutes on 2 cores, so it
# runs in the background (a wheel built outside the venv, in pip's own build environment) while the packages install
# and the native layers build, and is installed at the end. The CPU's name and flags are stamped beside it: sessions
# move between machines, and a build for another CPU's instructions would crash on this one, so a changed CPU
# rebuilds (never from pip's wheel cache, which does not know the CPU).
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"
cpu_stamp=.venv/.llamacpp-cpu
cpu_now=$( (grep -m1 "model name" /proc/cpuinfo; grep -m1 "^flags" /proc/cpuinfo; echo "$LLAMA_CPP_PYTHON") 2>/dev/null \
  | sha256sum | cut -d' ' -f1)
want_peers=$([ "${1:-}" = "test" ] || [ "${1:-}" = "peers" ] && echo 1 || true)
llama_pid=
if [ -n "$want_peers" ] && { [ "$(cat "$cpu_stamp" 2>/dev/null)" != "$cpu_now" ] || \
   ! python -c "import llama_cpp" >/dev/null 2>&1; }; then
  echo "speclab setup: building $LLAMA_CPP_PYTHON from source for this CPU in the background (the llama.cpp peers;" \
       "about 3 minutes) ..."
  llama_start=$(date +%s)
  rm -rf .venv/.llamacpp-wheel
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_PROJECT_INCLUDE=$PWD/scripts/llamacpp-no-common.cmake" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || echo 2)" \
    python -m pip wheel -q --no-cache-dir --no-deps --no-binary llama-cpp-python -w .venv/.llamacpp-wheel \
    "$LLAMA_CPP_PYTHON" > .venv/.llamacpp-build.log 2>&1 &
  llama_pid=$!
  trap 'kill "$llama_pid" 2>/dev/null || true' EXIT  # a failed set-up leaves no build running
fi
if [ -n "$fresh" ]; then
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
  # Hugging Face's `kernels` (which transformers 5.25 required) imports as `kernels`, our kernels/ package: where
  # it is installed transformers takes ours for it and no model loads. A .venv made before the pin loses it here.
  if python -c "import importlib.metadata as m; m.distribution('kernels')" >/dev/null 2>&1; then
    echo "speclab setup: removing Hugging Face's 'kernels' package (its import name is this repository's kernels/)"
    python -m pip uninstall -q -y kernels 2>&1 | quiet
  fi
  python -c "import torch, transformers, duckdb, gradio, speclab; print('speclab setup: torch', torch.__version__, '| transformers', transformers.__version__, '| duckdb', duckdb.__version__, '| gradio', gradio.__version__)"
  # the linters `make test` runs
  python -m ruff --version >/dev/null && python -m mypy --version >/dev/null && lint-imports --help >/dev/null
  echo "$want" > "$stamp"
fi
# the decoder layers' C++ loop (speclab/core/native.cpp; about 25 s once per machine and torch, rebuilt when the
# source changes): built here so a first decode does not wait for it; without a compiler, decoding runs from Python
python -c "from speclab.core import native; native.main()"
if [ "${1:-}" = "test" ] && ! command -v chromium >/dev/null 2>&1; then
  # the app's browser tests drive Debian's chromium (Playwright's own browser download is not reachable here)
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "speclab setup: installing Debian's chromium for the browser tests ..."
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "speclab setup: warning: chromium is missing and needs root + apt to install; browser tests will skip" >&2
  fi
fi
if [ -n "$llama_pid" ]; then
  wait "$llama_pid" && built=1 || built=
  trap - EXIT  # the build is over: nothing to kill on exit
  if [ -n "$built" ] && python -m pip install -q --no-deps --force-reinstall .venv/.llamacpp-wheel/*.whl 2>&1 \
       | quiet && python -m pip install -q "diskcache>=5.6.1" "jinja2>=2.11.3" 2>&1 | quiet \
     && python -c "import llama_cpp" >/dev/null 2>&1; then
    echo "$cpu_now" > "$cpu_stamp"
    rm -f .venv/.llamacpp-failed
    echo "speclab setup: llama-cpp-python built in $(( $(date +%s) - llama_start )) s"
  else
    rm -f "$cpu_stamp"
    touch .venv/.llamacpp-failed  # the llama.cpp tests skip, saying why, instead of failing
    tail -5 .venv/.llamacpp-build.log >&2 || true
    echo "speclab setup: warning: llama-cpp-python did not build (a C++ compiler and cmake are needed): the bench" \
         "runs without its llama.cpp peers and their tests skip" >&2
  fi
  rm -rf .venv/.llamacpp-wheel
fi
