#!/usr/bin/env bash
# Creates the peers' virtual environments that benchmarks/peers/peers.py runs its LitGPT and torchtune children in
# (benchmarks/_work/venv-litgpt, benchmarks/_work/venv-torchtune) and benchmarks/peers/dpo_trl.py its TRL DPOTrainer
# child in (benchmarks/_work/venv-trl), all gitignored. Idempotent: an existing venv is
# reused and pip leaves satisfied pins alone. Every package is pinned by benchmarks/peers/peer_envs/<peer>.txt (a
# `pip freeze` of the venvs the recorded runs used), so a later resolution cannot drift.
# - torch goes in first, as the local CPU build: an unpinned torch would pull GBs of CUDA wheels.
# - torchtune 0.6.1 imports torchao.dtypes.nf4tensor (gone in torchao 0.18) and torchao.quantization's
#   int4_weight_only (gone in 0.16): 0.15.0 is the newest torchao with both, and its pure-Python NF4 runs
#   with torch 2.13 (it skips its C++ extensions, built for another torch, which the CPU path does not need).
# - trl: TRL 1.16 with peft, transformers, accelerate and datasets, and bitsandbytes 0.50.2 for the QLoRA side: its
#   4-bit (nf4, double quant) Linear4bit runs on CPU through bitsandbytes' torch fallback (it first looks for a
#   kernels-hub CPU gemm, needs the `kernels` package and the network for it, and says so once when it finds none).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

make_venv() {  # peer name, then the packages to install
  local venv="$here/../_work/venv-$1" pins="$here/peer_envs/$1.txt"
  shift
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/pip" install -q -c "$pins" torch
  "$venv/bin/pip" install -q -c "$pins" "$@"
}

make_venv litgpt litgpt
make_venv torchtune torchtune torchao
make_venv trl trl peft transformers accelerate datasets bitsandbytes
"$here/../_work/venv-litgpt/bin/python" -c "import litgpt.lora, torch; print('litgpt ok, torch', torch.__version__)"
"$here/../_work/venv-torchtune/bin/python" -W ignore -c "
from torchao.dtypes.nf4tensor import NF4Tensor
from torchtune.models.llama3 import lora_llama3
import torch; print('torchtune ok, torch', torch.__version__)" 2>&1 | grep -v '^Failed to load\|_pytree\|Skipping import'
"$here/../_work/venv-trl/bin/python" -c "
import bitsandbytes, peft, torch, transformers, trl
from trl import DPOConfig, DPOTrainer
print('trl ok:', trl.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__,
      'bitsandbytes', bitsandbytes.__version__, 'torch', torch.__version__)" 2>&1 | grep -v 'kernels'
