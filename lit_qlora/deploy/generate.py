"""The `litqlora generate` command: a reply to one prompt, a sanity check of a checkpoint (the sampling itself:
lit_qlora.model.sampling)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

from lit_qlora.base.errors import InvalidInput
from lit_qlora.deploy.choice import ModelChoice

# The model stack (torch) is imported inside the functions, and annotations name its types as text: the CLI
# imports `generate_command` to build `--help` (lit_qlora.cli.commands says why and how).


@dataclass(kw_only=True)
class GenerateSpec(ModelChoice):
    """`litqlora generate`'s options: the model (ModelChoice) and the reply."""

    prompt: str
    """The user's message."""
    max_new_tokens: int = 128
    """Upper bound on generated tokens."""
    temperature: float = 0.0
    """0 is greedy decoding; above 0 samples."""
    top_k: Optional[int] = None
    """Sample among the k most likely tokens only."""
    seed: int = 1234
    """Seed of the sampler (repeatable sampling)."""
    chat_template: bool = True
    """Format the prompt as a chat turn: in the prompt style the adapter trained with (recorded beside it), else in
    the checkpoint's chat template when it has one. false: the text as it is."""
    compare_base: bool = False
    """With --adapter_dir: first answer with the base alone (the adapter switched off), then with the adapter, each
    on a labelled line: what the fine-tune changed."""


def generate_command(spec: Optional[GenerateSpec] = None, **settings: Any) -> str:
    """Generate a reply to PROMPT with a checkpoint and print only the generated text.

    Takes a GenerateSpec, or its fields as keywords (`generate_command(prompt=..., adapter_dir=...)`).
    """
    spec = GenerateSpec.of(spec, settings)
    if spec.compare_base and spec.adapter_dir is None:
        raise InvalidInput("--compare_base true compares the base with a fine-tune: give the fine-tune's "
                           "--adapter_dir.")
    from lit_qlora.lora.layer import adapters_disabled
    from lit_qlora.nf4 import is_nf4
    from lit_qlora.base.threads import govern_threads

    spec.check()
    tokenizer = spec.tokenizer()
    model = spec.load()
    govern_threads(model)  # generation shares the CPU with other processes (lit_qlora.base.threads)
    ids = tokenizer.encode_prompt(spec.prompt) if spec.chat_template else tokenizer.encode(spec.prompt)

    def reply(label: str = "") -> str:
        sys.stdout.write(label)
        return stream_reply(model, tokenizer, ids, spec.max_new_tokens, spec.temperature, spec.top_k, spec.seed)

    if not spec.compare_base:
        return reply()
    base_kind = "NF4" if any(is_nf4(p) for p in model.parameters()) else str(model.lm_head.weight.dtype).split(".")[-1]
    with adapters_disabled(model):
        reply(f"base model ({base_kind}, without the adapter):\n  ")
    return reply(f"fine-tuned (with the adapter from {spec.adapter_dir}):\n  ")


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
