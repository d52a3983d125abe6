"""NF4 dequantization on a GPU, one Llama-3.1-8B block's weights (bf16): torchao's `get_original_weight()`, our
PyTorch path in 16M-value slices (what ran before the Triton kernel) and the Triton kernel (nf4/triton.py); then,
at 4096 tokens (2x2048), the NF4 linear's forward and dX as dequantize + cuBLAS matmul (what NF4Linear runs) against
the fused kernels that never write the dense weight (nf4/triton_matmul.py, ``LIT_QLORA_NF4_FUSED=1``).

    python benchmarks/gpu/gpu_dequant.py [--repeats 20] [--tokens 4096]

Per weight shape: milliseconds per dequantization (CUDA events, median of --repeats after a warm-up) and the
effective bandwidth, counting the bytes a fused kernel must move (the codes and block scalers read, the bf16 written);
``fwd_*_ms`` / ``dx_*_ms``: milliseconds per forward product / input gradient, ``unfused`` (dequantize + matmul) and
``fused`` (the first call autotunes its tiles, before the timing). Every dequantization is checked equal to torchao's
first, the fused products close to the unfused ones (bf16 rounding).
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
from lit_qlora.nf4.triton_matmul import nf4_grad_input_fused, nf4_linear_fused

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


def matmul_rows(t, out: torch.Tensor, tokens: int, repeats: int) -> dict:
    """Forward (x @ W.T) and dX (g @ W) at ``tokens`` tokens: dequantize + matmul against the fused kernels."""
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(tokens, t.shape[1], device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.randn(tokens, t.shape[0], device="cuda", dtype=torch.bfloat16, generator=gen)
    paths = {"fwd_unfused": lambda: x @ kernel.dequantize(t, out=out).T, "fwd_fused": lambda: nf4_linear_fused(x, t),
             "dx_unfused": lambda: g @ kernel.dequantize(t, out=out), "dx_fused": lambda: nf4_grad_input_fused(g, t)}
    row = {}
    for kind in ("fwd", "dx"):
        want, got = paths[f"{kind}_unfused"]().float(), paths[f"{kind}_fused"]().float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
        for path in ("unfused", "fused"):
            row[f"{kind}_{path}_ms"] = round(timed(paths[f"{kind}_{path}"], repeats), 4)
        row[f"{kind}_fused_TFLOPs"] = round(2 * tokens * t.numel() / row[f"{kind}_fused_ms"] / 1e9, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the matmuls (default 2x2048)")
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
        row.update(matmul_rows(t, out, args.tokens, args.repeats))
        rows.append(row)
        print(json.dumps(row), flush=True)
    block = {p: round(sum(r[f"{p}_ms"] * (2 if "/" in r["weight"] else 1) for r in rows), 3)
             for p in ("torchao", "pytorch_sliced", "triton", "fwd_unfused", "fwd_fused", "dx_unfused", "dx_fused")}
    print(json.dumps({"one_block_ms": block, "tokens": args.tokens, "note": "q,o,k,v,gate,up,down once each"}))


if __name__ == "__main__":
    main()
