#!/usr/bin/env bash
# The main job: set up (first time only), then run the demo on the built-in tiny Qwen3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/interp-engine" demo "$@"
