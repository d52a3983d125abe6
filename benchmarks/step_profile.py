"""Where one training step's time goes: torch.profiler CPU time by op, plus the heap-release calls.

    python benchmarks/step_profile.py --checkpoint_dir checkpoints/SmolLM2-135M-Instruct --quantize nf4

Loads the base (NF4 or bf16), adds LoRA (r=8, every linear), registers the same per-block heap release as
FinetuneModule on CPU, runs one warm-up step and profiles the next (FinetuneModule.micro_loss_sum, activation checkpointing
unless --no_checkpointing, backward, clipping, fused AdamW). Prints the wall time, the number and total time of the
malloc_trim calls (not torch ops, so invisible to the profiler) and the top ops by self CPU time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import lit_qlora.training as training
from lit_qlora.export import load_base
from lit_qlora.lora import apply_lora


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--quantize", choices=["nf4", "none"], default="nf4")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--no_checkpointing", dest="checkpointing", action="store_false")
    args = parser.parse_args()

    trims = [0, 0.0]
    release = training.release_free_memory

    def timed_release(*a) -> None:
        t = time.perf_counter()
        release(*a)
        trims[0] += 1
        trims[1] += time.perf_counter() - t

    training.release_free_memory = timed_release
    model = load_base(Path(args.checkpoint_dir), args.quantize, torch.bfloat16)
    apply_lora(model, r=8, alpha=16, dropout=0.0, targets="all", dtype=torch.bfloat16)
    model.checkpoint_blocks = model.config.n_layer if args.checkpointing else 0
    train = training.TrainArgs(max_steps=2, micro_batch_size=args.batch, global_batch_size=args.batch,
                               max_seq_length=args.seq, activation_checkpointing=args.checkpointing)
    module = training.FinetuneModule(model, train, total_steps=2)
    model.train()
    for block in model.blocks:
        block.register_forward_hook(training._release_heap_around_block)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}

    def step() -> None:
        module.release_host_heap()
        (module.micro_loss_sum(batch) / ids.numel()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        module.release_host_heap()

    step()
    trims[:] = [0, 0.0]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    print(f"{Path(args.checkpoint_dir).name} {args.batch}x{args.seq} ckpt={'on' if args.checkpointing else 'off'} "
          f"{args.quantize}: wall {wall:.2f} s, "
          f"{trims[0]} heap releases taking {trims[1]:.3f} s ({100 * trims[1] / wall:.1f}%)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=45))


if __name__ == "__main__":
    main()
