"""NF4 dequantization as a PyTorch custom op, ``torch.ops.lit_qlora.nf4_dequantize``, so ``torch.compile`` traces
through the NF4 linear instead of breaking its graph at every projection.

The op takes an ``NF4Tensor``'s inner tensors (dynamo sees plain tensors) and returns the dense weight:

* CUDA: the Triton kernel (:mod:`lit_qlora.nf4.triton`), one launch for the whole weight;
* CPU: the C kernel (:mod:`lit_qlora.nf4.native`), or the PyTorch path where it is unavailable;
* fake/meta tensors: an empty tensor of the result's shape (its fake implementation), which is also how
  ``litqlora estimate`` and inductor's memory planning see the dense copy.

``recompute`` only names the call site (forward 0, backward 1): the two calls would otherwise be identical nodes of
the joint graph, and common-subexpression elimination would merge them into one dense weight kept from forward to
backward, the memory QLoRA exists to save.
"""

from __future__ import annotations

import torch

from lit_qlora.nf4.codec import NF4Fields, dequantize_into


@torch.library.custom_op("lit_qlora::nf4_dequantize", mutates_args=())
def nf4_dequantize(codes: torch.Tensor, qscalers: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor,
                   levels: torch.Tensor, block_size: int, scaler_block_size: int, rows: int, cols: int,
                   dtype: torch.dtype, recompute: int = 0) -> torch.Tensor:
    """The (rows, cols) dense weight in ``dtype`` of the NF4 tensor with these inner tensors (``levels``: its
    ``nf4`` table, in its storage dtype). Equal bit for bit to torchao's ``get_original_weight().to(dtype)``."""
    out = torch.empty(rows, cols, dtype=dtype, device=codes.device)
    fields = NF4Fields(codes, qscalers, factor, mean, levels, block_size, scaler_block_size)
    dequantize_into(fields, out.view(-1))
    return out


@nf4_dequantize.register_fake
def _(codes, qscalers, factor, mean, levels, block_size, scaler_block_size, rows, cols, dtype, recompute=0):
    return codes.new_empty(rows, cols, dtype=dtype)


def dequantize_op(weight, dtype: torch.dtype, recompute: int = 0) -> torch.Tensor:
    """``weight`` (an NF4Tensor, 2-D) dense through the custom op: what compiled code calls."""
    return torch.ops.lit_qlora.nf4_dequantize(
        weight.quantized_data, weight.quantized_scalers, weight.quantization_factor, weight.scaler_mean, weight.nf4,
        weight.block_size, weight.scaler_block_size, weight.shape[0], weight.shape[1], dtype, recompute)
