#!/usr/bin/env bash
# Issue 28's three GPU calls, folded into the GPU kit (benchmarks/gpu/README.md), which carries and installs what the
# GPU image lacks itself and caps each step:
#
#   bash benchmarks/gpu/gpu_issue28.sh suite     # = python3 benchmarks/gpu/check.py main (now with tests/test_offload.py,
#                                            #   the suite's offload and compile rows and the long-context steps)
#   bash benchmarks/gpu/gpu_issue28.sh peers     # = python3 benchmarks/gpu/check.py peers
#   bash benchmarks/gpu/gpu_issue28.sh profile   # = python3 benchmarks/gpu/check.py profile
#
# Build the carry first where pip works (`python benchmarks/gpu/build_carry.py`: .devcarry/kit, .devcarry/peers) and
# carry it along; results go to $OUT. Further options are check.py's (--steps, --budget, --dry-run, ...).
set -euo pipefail
case "${1:-}" in
  suite) call=main ;;
  peers | profile) call="$1" ;;
  *)
    echo "usage: bash benchmarks/gpu/gpu_issue28.sh suite|peers|profile [check.py options] (see the top of this file)" >&2
    exit 2
    ;;
esac
exec "${PYTHON:-python3}" "$(cd "$(dirname "$0")" && pwd)/check.py" "$call" "${@:2}"
