"""Sampling with the KV cache, and the `litqlora generate` command (a sanity check of a checkpoint)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, Literal, Optional, Sequence

import torch

from lit_qlora.loading import load_model
from lit_qlora.lora import adapters_disabled
from lit_qlora.model import Transformer
from lit_qlora.nf4 import is_nf4
from lit_qlora.tokenizer import Tokenizer


def sample(logits: torch.Tensor, temperature: float, top_k: Optional[int], generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits).item())
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    stop_ids: Sequence[int] = (),
    seed: int = 1234,
) -> Iterator[int]:
    """Yield new token ids one by one; stops after `max_new_tokens` or at a stop id (which is not yielded)."""
    device = next(model.parameters()).device
    max_len = min(len(prompt) + max_new_tokens, model.config.max_seq_length)
    if len(prompt) >= max_len:
        raise ValueError(f"The prompt has {len(prompt)} tokens; the model's context is {model.config.max_seq_length}.")
    generator = torch.Generator(device=device).manual_seed(seed)
    model.set_kv_cache(batch_size=1, max_len=max_len, device=device)
    try:
        idx = torch.tensor([list(prompt)], device=device)
        input_pos = torch.arange(len(prompt), device=device)
        for _ in range(max_len - len(prompt)):
            logits = model(idx, input_pos=input_pos)[0, -1]
            token = sample(logits, temperature, top_k, generator)
            if token in stop_ids:
                return
            yield token
            idx = torch.tensor([[token]], device=device)
            input_pos = input_pos[-1:] + 1
    finally:
        model.clear_kv_cache()


DEFAULT_CHECKPOINT = Path("checkpoints/SmolLM2-135M-Instruct")


def generate_command(
    prompt: str,
    checkpoint_dir: Path = DEFAULT_CHECKPOINT,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    seed: int = 1234,
    precision: Literal["bf16-true", "16-true", "32-true"] = "bf16-true",
    quantize: Optional[Literal["nf4", "none"]] = None,
    adapter_dir: Optional[Path] = None,
    chat_template: bool = True,
    compare_base: bool = False,
) -> str:
    """Generate a reply to PROMPT with a checkpoint and print only the generated text.

    Args:
        prompt: The user's message.
        checkpoint_dir: Hugging Face model directory (config.json, safetensors, tokenizer.json).
        max_new_tokens: Upper bound on generated tokens.
        temperature: 0 is greedy decoding; above 0 samples.
        top_k: Sample among the k most likely tokens only.
        seed: Seed of the sampler (repeatable sampling).
        precision: Weights and compute dtype: bf16-true, 16-true (fp16) or 32-true (fp32).
        quantize: nf4 = NF4-quantize every linear as the checkpoint loads (QLoRA's base); none = keep the
            precision's dtype. With --adapter_dir it defaults to what the adapter was trained with, else none.
        adapter_dir: A fine-tune's out_dir (or its final/ directory): apply its LoRA adapter on top of the base.
        chat_template: Wrap the prompt in the checkpoint's chat template when it has one.
        compare_base: With --adapter_dir: first answer with the base alone (the adapter switched off), then with
            the adapter, each on a labelled line: what the fine-tune changed.
    """
    if compare_base and adapter_dir is None:
        raise ValueError("--compare_base true compares the base with a fine-tune: give the fine-tune's --adapter_dir.")
    tokenizer = Tokenizer(checkpoint_dir)
    model = load_model(checkpoint_dir, quantize, precision, adapter_dir)
    if chat_template and tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = tokenizer.encode(text, bos=False)
    else:
        ids = tokenizer.encode(prompt)

    def reply(label: str = "") -> str:
        sys.stdout.write(label)
        return stream_reply(model, tokenizer, ids, max_new_tokens, temperature, top_k, seed)

    if not compare_base:
        return reply()
    base_kind = "NF4" if any(is_nf4(p) for p in model.parameters()) else str(model.lm_head.weight.dtype).split(".")[-1]
    with adapters_disabled(model):
        reply(f"base model ({base_kind}, without the adapter):\n  ")
    return reply(f"fine-tuned (with the adapter from {adapter_dir}):\n  ")


def stream_reply(model: Transformer, tokenizer: Tokenizer, ids: list[int], max_new_tokens: int, temperature: float,
                 top_k: Optional[int], seed: int) -> str:
    """Print the reply to stdout as it is generated; returns it."""
    out: list[int] = []
    printed = ""
    for token in generate(model, ids, max_new_tokens, temperature, top_k, tokenizer.eos_ids, seed):
        out.append(token)
        # Decode the whole reply each time: multi-byte characters span tokens.
        text = tokenizer.decode(out)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    reply = tokenizer.decode(out)
    sys.stdout.write(reply[len(printed):] + "\n")
    sys.stdout.flush()
    return reply
