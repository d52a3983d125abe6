"""A model's files: safetensors streamed in and out and atomic writes (`files`), Hugging Face checkpoint directories
(`hf`), a fine-tune's adapter (`adapter`), the tokenizer and its chat template (`tokenizer`), the one model loader
(`loading`: plain or NF4, a tensor-parallel shard, a fine-tune's adapter on top) and `litqlora download`
(`download`)."""

from lit_qlora import public_names

__getattr__, __all__ = public_names(
    __name__, files="CheckpointError TensorSpec", hf="load_checkpoint save_hf_checkpoint",
    adapter="save_adapter load_adapter read_adapter_config", tokenizer="Tokenizer", loading="load_model")
