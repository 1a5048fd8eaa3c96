#!/usr/bin/env bash
# vllm-static's GPU check (see benchmarks/gpu_check.py and docs/vllm.md): on a machine with a
# CUDA GPU and the GPU build of vLLM, from the repository root:
#     benchmarks/gpu_check.sh          # CUDA graphs on, equality vs eager and hook vLLM, the hazard
#     benchmarks/gpu_check.sh --ops    # the op-level half alone: CUDA PyTorch, no vLLM needed
#     benchmarks/gpu_check.sh --cpu    # the same checks on CPU: a dry run that the script works
# Exit status 0 only when the op-level tests and (without --ops) every engine check pass.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
ops_only=0
[ "${1:-}" = "--ops" ] && { ops_only=1; shift; }
if [ "${1:-}" = "--cpu" ]; then
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "gpu_check: no CUDA device (use --cpu for the dry run)" >&2; exit 2; }
fi
status=0
echo "== op-level: row maps, both op paths (the CUDA-graph one on the GPU, captured and replayed), in-place hazard"
"$PY" -m pytest tests/bridge/vllm/test_static_ops.py -q -p no:cacheprovider || status=1
if [ $ops_only = 1 ]; then
    echo "== engine-level: not run (--ops)"
    exit $status
fi
echo "== engine-level: vllm-static vs eager vs hook vLLM"
"$PY" benchmarks/gpu_check.py "$@" || status=1
exit $status
