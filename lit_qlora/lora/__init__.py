"""LoRA: the adapter layer over a frozen (bf16 or NF4) linear, applied to a model and merged back (`layer`), and its
dropout (`dropout`: on CPU a hash mask from a seed, fused with the down projection, in C kernels of its own: `native`,
kernels.c; replayed in backward on CUDA), and the terms of one input's adapters as one group (`grouped`, behind
LIT_QLORA_LORA_GROUPED=1), a mixture of experts' per-expert adapters (`experts`, grouped matmuls) and what every
adapter layer sets up alike (`rank`). An adapter's files (save_adapter, load_adapter, ...): lit_qlora.checkpoint."""

from lit_qlora import public_names

__getattr__, __all__ = public_names(
    __name__, layer="LoRALinear apply_lora lora_modules lora_state_dict adapters_disabled resolve_targets TARGETS "
                    "MERGE_CHUNK_ELEMS weight_rows row_chunks")
