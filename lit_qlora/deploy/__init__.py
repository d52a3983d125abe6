"""After training: GGUF export for llama.cpp and Ollama."""
