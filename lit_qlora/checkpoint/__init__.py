"""A model's files: Hugging Face checkpoint directories streamed in and out (`hf`), the tokenizer and its chat
template (`tokenizer`), the one model loader (`loading`: plain or NF4, a tensor-parallel shard, a fine-tune's adapter
on top) and `litqlora download` (`download`)."""
