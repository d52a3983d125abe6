"""Where a GPU training step's time and memory go: one fine-tune step (FinetuneModule's loss, backward, clipping,
fused AdamW) of a preset's shape with random weights built on the GPU, profiled with torch.profiler (CPU and CUDA).

    python benchmarks/gpu/gpu_profile.py --preset SmolLM2-135M --quantize nf4 --batch 4 --seq 512 [--dropout 0.05]
        [--compile] [--save_dense] [--no_replay]

--compile compiles each block as `--compile true` does (the warm-up steps are not timed); --save_dense keeps each
NF4 weight's dense copy from the checkpointed recompute for its backward (LIT_QLORA_NF4_SAVE_DENSE=1) instead of
dequantizing again; --no_replay runs CUDA's LoRA dropout as nn.Dropout (mask and dropped copy kept) instead of
drawing the mask again in backward (LIT_QLORA_DROPOUT_REPLAY=0). LIT_QLORA_NF4_TRITON=0 in the environment runs the PyTorch dequantize (the "before" profile).

Prints the step's wall time after warm-up, tokens/s, torch.cuda's allocated/reserved peaks of the step, and the top
ops by self CUDA time and by self CPU time (a CPU-bound step shows up as CPU time far above CUDA time).
--trace PATH also writes the profiled step's Chrome trace (shapes recorded, the step in a `step` annotation) for
kernel_table.py, which groups its kernels beside torchtune's (issue 48 item 2). --device cpu --tiny: the kit's dry run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from lit_qlora.model.presets import PRESETS
from lit_qlora.checkpoint.loading import random_base
from lit_qlora.lora.layer import apply_lora
from lit_qlora.train.args import TrainArgs
from lit_qlora.train.module import FinetuneModule


def main() -> None:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as `litqlora` sets it
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="SmolLM2-135M")
    parser.add_argument("--quantize", choices=["nf4", "none"], default="nf4")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--no_checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--save_dense", action="store_true")
    parser.add_argument("--no_replay", dest="replay", action="store_false")
    parser.add_argument("--no_profile", dest="profile", action="store_false")
    parser.add_argument("--trace", type=Path, help="the profiled step's Chrome trace, for kernel_table.py")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of --preset's kind (dry runs)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if args.save_dense:
        os.environ["LIT_QLORA_NF4_SAVE_DENSE"] = "1"
    if not args.replay:
        os.environ["LIT_QLORA_DROPOUT_REPLAY"] = "0"

    torch.manual_seed(0)
    config = PRESETS[args.preset]
    if args.tiny:
        config = config.replace(n_layer=2, n_embd=128, n_head=4, n_query_groups=2, head_dim=32, intermediate_size=256)
    with torch.device(args.device):  # built and quantized on the GPU: an 8B shape in seconds
        model = random_base(config, args.quantize, torch.bfloat16)
    apply_lora(model, r=8, alpha=16, dropout=args.dropout, targets="all", dtype=torch.bfloat16)
    model.checkpoint_blocks = model.config.n_layer if args.checkpointing else 0
    model.train()
    if args.compile:
        from lit_qlora.train.compile import compile_blocks

        compile_blocks(model)
    train = TrainArgs(max_steps=2, micro_batch_size=args.batch, global_batch_size=args.batch, max_seq_length=args.seq)
    module = FinetuneModule(model, train, total_steps=2)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=args.device)
    batch = {"input_ids": ids, "labels": ids.clone()}

    def step() -> None:
        (module.micro_loss_sum(batch) / ids.numel()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()
    step()  # a second warm-up: the first step's optimizer state, compile's second graph set
    sync()
    warmup = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    wall = (time.perf_counter() - t0) / args.steps
    row = {"preset": args.preset, "quantize": args.quantize, "batch": args.batch, "seq": args.seq,
           "dropout": args.dropout, "checkpointing": args.checkpointing, "compile": args.compile,
           "save_dense": args.save_dense, "replay": args.replay, "triton": os.environ.get("LIT_QLORA_NF4_TRITON", "1") != "0",
           "warmup_seconds": round(warmup, 2), "step_seconds": round(wall, 4),
           "tokens_per_sec": round(ids.numel() / wall, 1),
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3) if cuda else None,
           "device": torch.cuda.get_device_name() if cuda else "cpu"}
    print(json.dumps(row), flush=True)
    if not args.profile:
        return
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities, record_shapes=args.trace is not None) as prof:
        with record_function("step"):
            step()
            sync()
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    table = prof.key_averages()
    if cuda:
        print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
