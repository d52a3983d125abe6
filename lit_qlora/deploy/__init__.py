"""After training: the merged Hugging Face model and the PEFT adapter (`export`), GGUF files for llama.cpp and Ollama
out and in (`gguf_export`, `gguf_import`; `gguf_families`: what differs per family there), and the model put to use:
`generate`, `chat`, and `serve` (an OpenAI-compatible server, `litserve_api`)."""
