"""The `litqlora generate` command: a reply to one prompt, a sanity check of a checkpoint (the sampling itself:
lit_qlora.model.sampling)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal, Optional

from lit_qlora.checkpoint.download import DEFAULT_CHECKPOINT
from lit_qlora.base.errors import InvalidInput
from lit_qlora.base.hardware import PrecisionChoice

# The model stack (torch) is imported inside the functions, and annotations name its types as text: the CLI
# imports `generate_command` to build `--help` (lit_qlora.cli.commands says why and how).


def generate_command(
    prompt: str,
    checkpoint_dir: Path = DEFAULT_CHECKPOINT,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    seed: int = 1234,
    precision: PrecisionChoice = "auto",
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
        precision: Weights and compute dtype: auto (bf16 where the device computes it natively, else fp32 on a CPU
            and fp16 on a GPU), bf16-true, 16-mixed (fp16 for inference), 16-true (fp16) or 32-true (fp32).
        quantize: nf4 = NF4-quantize every linear as the checkpoint loads (QLoRA's base); none = keep the
            precision's dtype. With --adapter_dir it defaults to what the adapter was trained with, else none.
        adapter_dir: A fine-tune's out_dir (or its final/ directory): apply its LoRA adapter on top of the base.
        chat_template: Format the prompt as a chat turn: in the prompt style the adapter trained with (recorded
            beside it), else in the checkpoint's chat template when it has one. false: the text as it is.
        compare_base: With --adapter_dir: first answer with the base alone (the adapter switched off), then with
            the adapter, each on a labelled line: what the fine-tune changed.
    """
    if compare_base and adapter_dir is None:
        raise InvalidInput("--compare_base true compares the base with a fine-tune: give the fine-tune's "
                           "--adapter_dir.")
    from lit_qlora.checkpoint.hf import require_checkpoint
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.lora.layer import adapters_disabled
    from lit_qlora.nf4 import is_nf4
    from lit_qlora.data.inference import trained_tokenizer
    from lit_qlora.base.threads import govern_threads

    require_checkpoint(checkpoint_dir)
    tokenizer = trained_tokenizer(checkpoint_dir, adapter_dir)
    model = load_model(checkpoint_dir, quantize, precision, adapter_dir)
    govern_threads(model)  # generation shares the CPU with other processes (lit_qlora.base.threads)
    ids = tokenizer.encode_prompt(prompt) if chat_template else tokenizer.encode(prompt)

    def reply(label: str = "") -> str:
        sys.stdout.write(label)
        return stream_reply(model, tokenizer, ids, max_new_tokens, temperature, top_k, seed)

    if not compare_base:
        return reply()
    base_kind = "NF4" if any(is_nf4(p) for p in model.parameters()) else str(model.lm_head.weight.dtype).split(".")[-1]
    with adapters_disabled(model):
        reply(f"base model ({base_kind}, without the adapter):\n  ")
    return reply(f"fine-tuned (with the adapter from {adapter_dir}):\n  ")


def stream_reply(model: Transformer, tokenizer: Tokenizer, ids: list[int], max_new_tokens: int,  # noqa: F821
                 temperature: float, top_k: Optional[int], seed: int) -> str:
    """Print the reply to stdout as it is generated; returns it."""
    from lit_qlora.model.sampling import decoded_pieces, generate

    pieces = []
    for piece in decoded_pieces(tokenizer, generate(model, ids, max_new_tokens, temperature, top_k, tokenizer.eos_ids,
                                                    seed)):
        sys.stdout.write(piece)
        sys.stdout.flush()
        pieces.append(piece)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces)
