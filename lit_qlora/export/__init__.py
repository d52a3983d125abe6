"""A fine-tune's files for other tools, below training (train/final.py writes final/ through them): the merged
Hugging Face model and the PEFT adapter (`hf`), GGUF files for llama.cpp and Ollama out and in (`gguf`,
`gguf_import`; `gguf_families`: what differs per family there; `gguf_tokenizer`), and the verbs `merge`,
`export_peft`, `export_gguf` and `convert_gguf`."""
