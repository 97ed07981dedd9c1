#!/usr/bin/env bash
# Pack what a CUDA check needs into .gpu/ (git-ignored) for the lent GPU machine, whose working-tree limit (64 MiB)
# the zoo (about 120 MB) exceeds: the target, the draft model and the EAGLE-3 drafter, xz-compressed (about 47 MB),
# plus scripts/cuda_check.py. Move data/ out of the checkout for the call (the tracked zoo would travel too), and
# in the call unpack first:
#   python3 -c "import tarfile; tarfile.open('.gpu/zoo.tar.xz').extractall()"; PYTHONPATH=$PWD python3 scripts/cuda_check.py
# (the GPU image has torch, transformers, pandas and pyarrow; speclab's decode path needs nothing else).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
tar -cf - --exclude=data/zoo/dflash/flashhead data/zoo/target data/zoo/eagle3 data/zoo/draft data/zoo/dflash data/zoo/tokenizer \
  data/zoo/router data/zoo/route data/zoo/calibration.json \
  data/zoo/README.md data/prompts/zoo_domains.jsonl | xz -T2 -6 > .gpu/zoo.tar.xz
ls -la .gpu
