"""NF4 storage for frozen base weights: torchao ``NF4Tensor`` as the format, our own fast kernels.

Modules, lowest first (each imports only those above it):

* :mod:`~lit_qlora.nf4.reference`: the format (levels, thresholds, double quantization) and its PyTorch path;
* :mod:`~lit_qlora.nf4.layout`: block layouts that fit any real shape and FSDP2's dim-0 split;
* :mod:`~lit_qlora.nf4.native`: kernels.c, compiled on first use, self-tested, threaded (and whether the Triton
  kernel, :mod:`~lit_qlora.nf4.triton`, runs on CUDA);
* :mod:`~lit_qlora.nf4.codec`: :func:`quantize_nf4` / :func:`dequantize_nf4` (bit-identical to torchao);
* :mod:`~lit_qlora.nf4.gemv`: the decode kernel, a few rows of x times an NF4 weight without its dense copy (gemv.c);
* :mod:`~lit_qlora.nf4.ops`: the dequantize as a custom op, so ``torch.compile`` traces through it;
* :mod:`~lit_qlora.nf4.triton_matmul`: the linear's products with the dequantize fused in (``LIT_QLORA_NF4_FUSED=1``);
* :mod:`~lit_qlora.nf4.linear`: the NF4 linear (autograd function; a decode step's forward goes to the decode
  kernel) and the frozen NF4 module;
* :mod:`~lit_qlora.nf4.convert`: every base linear of a model to NF4.

Nothing here knows about LoRA: the adapter layer imports this package, never the reverse.
"""

from lit_qlora.base.quiet import quiet_third_party

quiet_third_party()  # before torchao loads: its import warns about kernels NF4 never uses

from lit_qlora.nf4.codec import clone_nf4, dequantize_nf4, is_nf4, nf4_nbytes, quantize_nf4  # noqa: E402
from lit_qlora.nf4.convert import (base_linears, count_linears, expert_linears, is_ignored, quantize_linears,  # noqa: E402
                                   quantize_weight)
from lit_qlora.nf4.layout import NF4Layout, block_aligned_rows, nf4_layout, row_slices  # noqa: E402
from lit_qlora.nf4.linear import FrozenNF4Linear, NF4Linear, frozen_linear, nf4_linear  # noqa: E402
from lit_qlora.nf4.native import nf4_backend  # noqa: E402
from lit_qlora.nf4.reference import NF4_LEVELS  # noqa: E402

__all__ = [
    "NF4_LEVELS",
    "NF4Layout",
    "nf4_layout",
    "block_aligned_rows",
    "row_slices",
    "quantize_nf4",
    "dequantize_nf4",
    "is_nf4",
    "clone_nf4",
    "nf4_nbytes",
    "nf4_backend",
    "NF4Linear",
    "nf4_linear",
    "frozen_linear",
    "FrozenNF4Linear",
    "quantize_weight",
    "quantize_linears",
    "count_linears",
    "base_linears",
    "expert_linears",
    "is_ignored",
]
