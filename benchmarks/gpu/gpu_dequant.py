"""NF4 dequantization on a GPU, one Llama-3.1-8B block's weights (bf16): torchao's `get_original_weight()`, our
PyTorch path in 16M-value slices (what ran before the Triton kernel) and the Triton kernel (nf4/triton.py).

    python benchmarks/gpu/gpu_dequant.py [--repeats 20]

Per weight shape: milliseconds per dequantization (CUDA events, median of --repeats after a warm-up) and the
effective bandwidth, counting the bytes a fused kernel must move (the codes and block scalers read, the bf16 written).
Every path's output is checked equal to torchao's first.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from lit_qlora.nf4 import quantize_nf4
from lit_qlora.nf4 import triton as kernel
from lit_qlora.nf4.codec import block_scales
from lit_qlora.nf4.reference import GPU_CHUNK_ELEMS, dequantize_eager

SHAPES = {"q_proj/o_proj": (4096, 4096), "k_proj/v_proj": (1024, 4096), "gate_proj/up_proj": (14336, 4096),
          "down_proj": (4096, 14336)}


def sliced_pytorch(t, out: torch.Tensor) -> torch.Tensor:
    """The pre-kernel CUDA path: the PyTorch ops over slices of at most 16M values (8M bytes of codes)."""
    flat, step = out.view(-1), GPU_CHUNK_ELEMS // 2
    scales, per_block = block_scales(t), t.block_size // 2
    for a in range(0, t.quantized_data.numel(), step):
        b = min(t.quantized_data.numel(), a + step)
        dequantize_eager(t.quantized_data[a:b], scales[a // per_block : b // per_block], t.nf4, flat[2 * a : 2 * b])
    return out


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for name, shape in SHAPES.items():
        t = quantize_nf4(torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02)
        want = t.get_original_weight()
        out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        paths = {"torchao": t.get_original_weight, "pytorch_sliced": lambda t=t, out=out: sliced_pytorch(t, out),
                 "triton": lambda t=t, out=out: kernel.dequantize(t, out=out)}
        moved = t.numel() * (0.5 + 2) + t.quantized_scalers.numel()
        row = {"weight": name, "shape": list(shape), "device": torch.cuda.get_device_name()}
        for path, fn in paths.items():
            assert torch.equal(fn(), want), path
            ms = timed(fn, args.repeats)
            row[f"{path}_ms"] = round(ms, 4)
            row[f"{path}_GBps"] = round(moved / ms / 1e6, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    block = {p: round(sum(r[f"{p}_ms"] * (2 if "/" in r["weight"] else 1) for r in rows), 3)
             for p in ("torchao", "pytorch_sliced", "triton")}
    print(json.dumps({"one_block_ms": block, "note": "q,o,k,v,gate,up,down once each"}))


if __name__ == "__main__":
    main()
