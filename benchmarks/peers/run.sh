#!/usr/bin/env bash
# The table against the peers: sets up benchmarks/peers/.venv (TransformerLens and nnsight, in
# their own environment, never the project's) on first use, then times every tool in one sitting.
#   ./benchmarks/peers/run.sh [--repeats N] [--no-vllm] [--no-peers]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bash "$root/scripts/bootstrap.sh"
peers="$here/.venv"
stamp="$peers/.peers_stamp"
want="torch==2.13.0 transformer-lens==4.3.0 nnsight==0.8.1"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[peers] installing $want into $peers (once)" >&2
  [ -x "$peers/bin/python" ] || python3 -m venv "$peers"
  # shellcheck disable=SC2086
  "$peers/bin/python" -m pip install -q --disable-pip-version-check $want
  echo "$want" > "$stamp"
fi
cd "$root"
PYTHONPATH="$root" exec "$root/.venv/bin/python" "$here/ours.py" "$@"
