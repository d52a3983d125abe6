"""A model's files: safetensors streamed in and out and atomic writes (`files`), Hugging Face checkpoint directories
(`hf`), a fine-tune's adapter (`adapter`), the tokenizer and its chat template (`tokenizer`), the one model loader
(`loading`: plain or NF4, a tensor-parallel shard, a fine-tune's adapter on top) and `litqlora download`
(`download`). The names of the former lit_qlora/checkpoint.py keep their path here.
"""

from lit_qlora import public_names

__getattr__, __all__ = public_names(
    __name__,
    files="CheckpointError TensorSpec read_safetensors_header iter_safetensors write_safetensors atomic_write_text "
          "replace_dir remove_path fsync_dir",
    hf="load_checkpoint save_hf_checkpoint copy_tokenizer_files hf_layout_specs weight_files iter_tensors set_tensor "
       "load_pickled_weights TOKENIZER_FILES",
    adapter="save_adapter load_adapter read_adapter_config find_adapter_dir full_lora_state_dict ADAPTER_WEIGHTS "
            "ADAPTER_CONFIG",
    tokenizer="Tokenizer", loading="load_model")
