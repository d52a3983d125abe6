"""The fine-tuned model put to use: `generate`, `chat`, and `serve` (an OpenAI-compatible server, `litserve_api`).
Its files (merged model, PEFT adapter, GGUF out and in) are lit_qlora.export's."""
