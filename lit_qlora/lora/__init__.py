"""LoRA: the adapter layer over a frozen (bf16 or NF4) linear, applied to a model and merged back (`layer`), and its
dropout (`dropout`: on CPU a hash mask from a seed, fused with the down projection; replayed in backward on CUDA)."""
