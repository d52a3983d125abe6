#!/usr/bin/env bash
# The peers' virtual environments for benchmarks/gpu/gpu_peers.py, under benchmarks/_work/ (gitignored):
#   gpu-venv-torchtune  torchtune 0.6.1 + torchao 0.15.0 (+ omegaconf, datasets, dill, multiprocess: imported when
#                       `import torchtune` runs; the GPU image lacks them)
#   gpu-venv-bnb        bitsandbytes 0.50.2, trl 1.16.0 (transformers, peft, accelerate come from the base
#                       interpreter) + datasets, dill, multiprocess (as for torchtune)
#   gpu-venv-unsloth    only where unsloth installs (online, or its wheels in WHEELS)
# Each venv sits on top of the base interpreter ($PYTHON, default python3: on the GPU machine the one with torch).
# That interpreter may itself be a venv (/opt/torch/.venv there), whose packages `--system-site-packages` does not
# reach, so a .pth file adds the base's own site-packages after the venv's: the venv's pins win, torch is shared.
# Installs are --no-deps from a pinned list, so nothing can pull a second torch.
#
#   WHEELS=.devcarry/peers bash benchmarks/gpu/gpu_peer_envs.sh     # offline (GPU machine): from a wheel folder
#   bash benchmarks/gpu/gpu_peer_envs.sh                            # online: the same pins from PyPI
#   bash benchmarks/gpu/gpu_peer_envs.sh download DIR               # here: the GPU machine's wheels into DIR
#                                                               # (PYVER=3.11 for wheels of this machine's Python)
# Why torchao 0.15.0: torchtune 0.6.1 (the newest) imports torchao.dtypes.nf4tensor (gone in 0.18) and
# torchao.quantization's int4_weight_only (gone in 0.16). 0.15.0's C++ extensions are built for another torch and
# are skipped with a warning; its NF4 is pure PyTorch and does not need them.
set -uo pipefail
unset PYTHONPATH  # a torchao there (ours needs 0.18) would shadow the torchtune venv's 0.15
here="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
TORCHTUNE=(torchtune==0.6.1 torchao==0.15.0 omegaconf==2.4.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
# trl: check.py grpo_peers's TRL GRPOTrainer (the image has accelerate; datasets and its two as for torchtune)
BNB=(bitsandbytes==0.50.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)

if [ "${1:-}" = download ]; then
  dir="${2:?usage: gpu_peer_envs.sh download DIR}"
  mkdir -p "$dir"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" "${TORCHTUNE[@]}" "${BNB[@]}" || exit 1
  du -sh "$dir"
  exit 0
fi

make_venv() {  # name, then pinned requirements
  local venv="$here/../_work/gpu-venv-$1"
  shift
  if [ ! -x "$venv/bin/python" ]; then
    # --without-pip: pip comes from the base (the .pth), and a base without ensurepip can still make venvs
    "$PY" -m venv --system-site-packages --without-pip "$venv"
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/_base_site.pth"
  fi
  if [ -n "${WHEELS:-}" ]; then
    "$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --find-links "$WHEELS" "$@"
  else
    "$venv/bin/python" -m pip install -q --no-deps "$@"
  fi
}

# A failed venv or check does not stop the others: gpu_peers.py records that peer's row with the error.
make_venv torchtune "${TORCHTUNE[@]}" || echo "gpu-venv-torchtune: install FAILED"
make_venv bnb "${BNB[@]}" || echo "gpu-venv-bnb: install FAILED"
"$here/../_work/gpu-venv-torchtune/bin/python" -W ignore -c "
import torchtune, torchao
from torchtune.models.llama3_1 import qlora_llama3_1_8b
print('torchtune', torchtune.__version__, 'torchao', torchao.__version__)" 2>&1 |
  grep -v '^Failed to load\|_pytree\|Skipping import\|register_constant' || echo "gpu-venv-torchtune: import FAILED"
"$here/../_work/gpu-venv-bnb/bin/python" -c "import bitsandbytes, peft, transformers
print('bitsandbytes', bitsandbytes.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__)" \
  || echo "gpu-venv-bnb: import FAILED"
"$here/../_work/gpu-venv-bnb/bin/python" -c "import trl; from trl import GRPOConfig, GRPOTrainer; print('trl', trl.__version__)" \
  || echo "gpu-venv-bnb: trl import FAILED (check.py grpo_peers records TRL's row as failed)"

# unsloth: best effort. Its requirements would replace torch, so its install is pinned to the base's torch; where
# it cannot install, gpu_peers.py records the row as not run, with the reason.
if [ -n "${WHEELS:-}" ] && ! ls "$WHEELS"/unsloth-*.whl >/dev/null 2>&1; then
  echo "unsloth: no wheel in $WHEELS, not installed (gpu_peers.py records it as not run)"
else
  pin="torch==$("$PY" -c 'import torch; print(torch.__version__)')"
  src=(); [ -n "${WHEELS:-}" ] && src=(--no-index --find-links "$WHEELS")
  make_venv unsloth unsloth && "$here/../_work/gpu-venv-unsloth/bin/python" -m pip install -q "${src[@]}" \
    -c <(echo "$pin") unsloth || echo "unsloth: install failed (gpu_peers.py records it as not run)"
fi
