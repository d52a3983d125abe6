#!/usr/bin/env bash
# Issue 28's GPU measurements, one CUDA GPU, in three one-go calls of under 10 minutes each (results under $OUT):
#
#   bash benchmarks/gpu_issue28.sh suite    # ~8 min: tests/test_cuda.py (the Triton kernel against torchao, the
#                                           # custom op, a compiled 2-step QLoRA run, one graph per block), then
#                                           # `litqlora finetune` on the 8B shape at 2x2048: QLoRA and LoRA eager,
#                                           # QLoRA compiled (offload off, as the earlier H200 rows), QLoRA eager with
#                                           # the default offload (auto: on at this size, 1 GiB of block inputs)
#   bash benchmarks/gpu_issue28.sh peers    # ~8 min: LoRA compiled through the CLI, then torchtune QLoRA compiled
#                                           # and transformers + peft + bitsandbytes QLoRA on the same checkpoint
#   bash benchmarks/gpu_issue28.sh profile  # ~6 min: the kernel per 8B weight shape (gpu_dequant.py) and one-step
#                                           # profiles (gpu_profile.py): QLoRA, LoRA, nn.Dropout, save_dense, compiled
#
# Environment: OUT (results folder; default gpu_issue28_out), TOKENIZER (a tokenizer directory: SmolLM2's ids fit
# every vocabulary here), DEPS (optional: a folder of this project's dependency wheels, installed with --no-index
# into /tmp/site, for a machine without internet), WHEELS (the peers' wheels, `bash benchmarks/gpu_peer_envs.sh
# download DIR` where pip works). Steps per call are capped (timeout) so a call ends inside 10 minutes.
#   OUT=$OUT TOKENIZER=.devcarry/smol DEPS=.devcarry/whl WHEELS=.devcarry/peerwhl bash benchmarks/gpu_issue28.sh suite
set -uo pipefail
export PYTHONUNBUFFERED=1
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-gpu_issue28_out}"
tok="${TOKENIZER:?a tokenizer directory (SmolLM2s: its ids fit every vocabulary here)}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
quiet() { grep -v "Warn\|Failed to load\|FQNs\|_pytree\|_warn_once"; }
if [ -n "${DEPS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$DEPS"/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
"$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
  | tee -a "$out/gpu.txt"
suite() { timeout "$1" "$PY" "$here/gpu_suite.py" --models llama-3.1-8b --tokenizer_dir "$tok" "${@:2}" 2>&1 | quiet \
  | tail -6; }

case "${1:-}" in
  suite)
    LIT_QLORA_TEST_TOKENIZER="$tok" timeout 170 "$PY" -m pytest -q tests/test_cuda.py -p no:cacheprovider 2>&1 \
      | tail -8 | tee "$out/test_cuda.txt"
    suite 200 --quantize nf4 none --offload false --out "$out/suite_eager.json"
    suite 100 --quantize nf4 --compile true --offload false --out "$out/suite_compiled.json"
    suite 100 --quantize nf4 --out "$out/suite_offload_auto.json"
    ;;
  peers)
    WHEELS="${WHEELS:-}" bash "$here/gpu_peer_envs.sh" > "$out/envs.log" 2>&1 &
    envs=$!
    suite 110 --quantize none --compile true --offload false --out "$out/suite_lora_compiled.json"
    wait "$envs"; tail -3 "$out/envs.log"
    timeout 330 "$PY" "$here/gpu_peers.py" --time_budget 320 --child_timeout 200 --tokenizer_dir "$tok" \
      --runs torchtune:qlora-compile peft-bnb:qlora torchtune:lora-compile --out "$out/gpu_peers.json" 2>&1 \
      | grep -v '^{' | quiet | tail -20
    ;;
  profile)
    timeout 60 "$PY" "$here/gpu_dequant.py" 2>&1 | quiet | tee "$out/dequant.txt"
    P="$PY $here/gpu_profile.py --preset Llama-3.1-8B --batch 2 --seq 2048 --steps 3"
    {
      for args in "--quantize nf4 --rows 12" "--quantize none --no_profile" "--quantize nf4 --no_replay --no_profile" \
                  "--quantize nf4 --save_dense --no_profile" "--quantize nf4 --compile --rows 12" \
                  "--quantize none --compile --no_profile"; do
        echo "== gpu_profile.py $args"; timeout 55 $P $args 2>&1 | quiet | head -60
      done
    } | tee "$out/profiles.txt" | grep '^{'
    ;;
  *)
    echo "usage: bash benchmarks/gpu_issue28.sh suite|peers|profile (see the top of this file)" >&2
    exit 2
    ;;
esac
