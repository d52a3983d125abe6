"""The decoder and its layers: the config (`config`: one dataclass for every family, read from and written to
config.json; `presets`: the common checkpoints' shapes), the Transformer (`transformer`), attention and its masks
(`attention`, `flex`: flex_attention compiled, `attention_mask`), RoPE (`rope`), q/k/v and gate/up fused into one
matmul (`fused_projections`), a mixture of experts' routed MLP (`moe`), the tiled MLP (`tiled_mlp`), offloaded
activation checkpoints (`offload`), the Hugging Face checkpoint layout (`hf_layout`) and sampling with the KV cache
(`sampling`). The names of the former lit_qlora/model.py keep their path here.
"""

from lit_qlora import public_names

__getattr__, __all__ = public_names(
    __name__, config="Config", presets="PRESETS preset",
    transformer="Transformer Block Attention MLP RMSNorm KVCache rms_norm apply_rope rotate_half")
