#!/usr/bin/env bash
# Issue 28's GPU measurements in one go, on one CUDA GPU (results under ${OUT:-gpu_issue28_out}/):
#   1. tests/test_cuda.py (the Triton kernel bit for bit against torchao in bf16/fp16/fp32, the custom op, a compiled
#      2-step QLoRA run that is one graph per block);
#   2. benchmarks/gpu_dequant.py: the kernel against torchao and the old PyTorch path, per 8B weight shape;
#   3. benchmarks/gpu_profile.py, one 8B step (2x2048, checkpointing, r 8 on every linear, dropout 0.05) A/B:
#      before (LIT_QLORA_NF4_TRITON=0) / after, LoRA, dropout replayed / nn.Dropout, save_dense, compiled;
#   4. benchmarks/gpu_suite.py: `litqlora finetune` QLoRA and LoRA, eager and --compile true;
#   5. benchmarks/gpu_peers.py: torchtune QLoRA/LoRA compiled and peft + bitsandbytes QLoRA on the same checkpoint.
# Needs ~20 minutes of GPU time in all; on a machine without internet, the peers' wheels in WHEELS
# (`bash benchmarks/gpu_peer_envs.sh download DIR` where pip works) and `pip install -e .` done beforehand.
#   OUT=results WHEELS=.devcarry/peerwhl TOKENIZER=.devcarry/smol bash benchmarks/gpu_issue28.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-gpu_issue28_out}"
tok="${TOKENIZER:?a tokenizer directory (SmolLM2s: its ids fit every vocabulary here)}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
bash "$here/gpu_peer_envs.sh" > "$out/envs.log" 2>&1  # offline from $WHEELS when set
LIT_QLORA_TEST_TOKENIZER="$tok" "$PY" -m pytest -q tests/test_cuda.py 2>&1 | tail -5 | tee "$out/test_cuda.txt"
"$PY" "$here/gpu_dequant.py" | tee "$out/dequant.txt"
P="$PY $here/gpu_profile.py --preset Llama-3.1-8B --batch 2 --seq 2048 --steps 3"
{
  LIT_QLORA_NF4_TRITON=0 $P --quantize nf4 --no_replay
  $P --quantize nf4
  $P --quantize nf4 --no_replay --no_profile
  $P --quantize none --no_profile
  $P --quantize none --no_replay --no_profile
  $P --quantize nf4 --save_dense --no_profile
  $P --quantize nf4 --compile
  $P --quantize none --compile --no_profile
} 2>&1 | tee "$out/profiles.txt" | grep '^{'
"$PY" "$here/gpu_suite.py" --models llama-3.1-8b --quantize nf4 none --compile false true --tokenizer_dir "$tok" \
  --out "$out/gpu_suite.json" | tail -8
"$PY" "$here/gpu_peers.py" --runs torchtune:qlora-compile torchtune:lora-compile peft-bnb:qlora \
  --tokenizer_dir "$tok" --out "$out/gpu_peers.json" | grep -v '^{'
