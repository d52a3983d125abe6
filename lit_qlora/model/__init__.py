"""The decoder and its layers: the config (`config`), the Transformer (`transformer`), attention and its masks,
q/k/v and gate/up fused into one matmul, the tiled MLP, offloaded activation checkpoints, the Hugging Face
checkpoint layout, and sampling with the KV cache."""
