#!/usr/bin/env bash
# The whole test suite: set up (first time only), then pytest with the quick Hypothesis profile.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export INTERP_ENGINE_HYPOTHESIS_PROFILE="${INTERP_ENGINE_HYPOTHESIS_PROFILE:-quick}"
exec "$root/.venv/bin/python" -m pytest "$@"
