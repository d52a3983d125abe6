"""Parameter bytes each rank holds under DDP (replicated NF4 base) and FSDP2 (sharded NF4 base), 2 gloo ranks on CPU.

    python benchmarks/memory/distributed_memory.py [--checkpoint_dir DIR]   # default: the bundled SmolLM2-135M-Instruct

Each rank streams the checkpoint into an NF4 model (layout for 2 shards), adds LoRA (r=8, every linear) and counts
the bytes of the tensors it holds: parameters (an NF4 weight counts its codes, scales and factors; an FSDP2 shard
counts its local tensor). "ddp" is that model as loaded (DDP keeps it whole on every rank); "fsdp" is after
`shard_model`, FSDP2's state between forward passes. Activations, gradients and optimizer state are not included
(LoRA's are small). Results go to benchmarks/memory/results/distributed_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORLD = 2


def tensor_bytes(t: torch.Tensor) -> int:
    from lit_qlora.parallel.distributed import local_tensor

    t = local_tensor(t)
    if hasattr(t, "__tensor_flatten__"):  # NF4Tensor: its inner tensors
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def held(model: torch.nn.Module) -> dict[str, int]:
    from lit_qlora.nf4 import is_nf4

    params = list(model.parameters())
    return {"nf4_base": sum(tensor_bytes(p) for p in params if is_nf4(p)),
            "other_frozen": sum(tensor_bytes(p) for p in params if not is_nf4(p) and not p.requires_grad),
            "lora": sum(tensor_bytes(p) for p in params if p.requires_grad)}


def worker(rank: int, checkpoint_dir: str, init_file: str, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_qlora.parallel.distributed import shard_model
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.lora.layer import apply_lora

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model = apply_lora(load_model(checkpoint_dir, "nf4", "bf16-true", nf4_world_size=WORLD).train(), 8, 16.0,
                           dtype=torch.bfloat16)
        ddp = held(model)
        rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        shard_model(model, init_device_mesh("cpu", (WORLD,)))
        queue.put((rank, {"ddp": ddp, "fsdp": held(model), "peak_rss_after_load": rss_loaded}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_dir", type=Path, default=None)
    args = parser.parse_args()
    checkpoint_dir = args.checkpoint_dir
    if checkpoint_dir is None:
        from lit_qlora.checkpoint.download import DEFAULT_CHECKPOINT
        from lit_qlora.export.gguf_import import ensure_default_checkpoint

        ensure_default_checkpoint(DEFAULT_CHECKPOINT)
        checkpoint_dir = DEFAULT_CHECKPOINT
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, str(checkpoint_dir), f"{tmp}/store", queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    mib = 2**20
    record = {"date": str(date.today()), "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "checkpoint": str(checkpoint_dir), "world_size": WORLD,
              "ranks": {str(k): v for k, v in sorted(results.items())}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distributed_memory.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# Parameter bytes per rank, {WORLD} ranks ({record['date']}, torch {record['torch']}, "
             f"{Path(str(checkpoint_dir)).name})", "",
             "| rank | strategy | NF4 base MiB | other frozen MiB | LoRA MiB | total MiB |", "|---|---|---|---|---|---|"]
    for rank, r in sorted(results.items()):
        for strategy in ("ddp", "fsdp"):
            h = r[strategy]
            lines.append(f"| {rank} | {strategy} | {h['nf4_base'] / mib:.1f} | {h['other_frozen'] / mib:.1f} | "
                         f"{h['lora'] / mib:.2f} | {sum(h.values()) / mib:.1f} |")
    (RESULTS / "distributed_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
