"""What a head tied to the embedding costs in a QLoRA model, before and after it read the embedding itself (issue 47).

Before, QLoRA gave a tied head its own NF4 copy of the embedding (vocab x n_embd at ~0.56 bytes a value); now the head
computes with the embedding's high-precision weight, which the model holds anyway. This builds each model's QLoRA base
with random weights (lit_qlora.checkpoint.loading.random_base: the modules, dtypes and NF4 layout `load_model` gives)
and measures its resident bytes (NF4 by its packed storage), then the NF4 copy the head used to have.

    python benchmarks/memory/tied_head.py     # writes benchmarks/memory/results/tied_head.{json,md}
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from lit_qlora.checkpoint.loading import random_base
from lit_qlora.memory.accounting import module_bytes, tensor_bytes
from lit_qlora.model.presets import PRESETS
from lit_qlora.nf4 import quantize_weight

RESULTS = Path(__file__).with_name("results")
MODELS = ("SmolLM2-135M", "Gemma-2-2B")
MiB = 1 << 20


def measure(name: str) -> dict:
    config = PRESETS[name]
    assert config.tie_embeddings, name
    start = time.perf_counter()
    model = random_base(config, "nf4", torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the head reads the embedding
    now = module_bytes(model)
    copy = tensor_bytes(quantize_weight(model.model.embed_tokens.weight.detach()))
    return {"model": name, "vocab_size": config.vocab_size, "n_embd": config.n_embd,
            "qlora_base_bytes_before": now + copy, "qlora_base_bytes_now": now, "saved_bytes": copy,
            "saved_share": copy / (now + copy), "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    rows = [measure(name) for name in MODELS]
    RESULTS.mkdir(exist_ok=True)
    record = {"command": "python benchmarks/memory/tied_head.py", "cpu": platform.processor() or platform.machine(),
              "rows": rows}
    (RESULTS / "tied_head.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = ["# A tied head in QLoRA: the embedding itself, not an NF4 copy", "",
             "Resident bytes of the QLoRA base (bf16 embedding, NF4 linears, random weights in `load_model`'s layout), "
             "before (the head's own NF4 copy of the embedding) and now. `python benchmarks/memory/tied_head.py`.", "",
             "The before column adds the head's NF4 copy to today's base; the code before the change measured the "
             "SmolLM2 base at 120.2 MiB (d2f4b4f's `random_base`), the same.", "",
             "| model | vocab x n_embd | base before (MiB) | base now (MiB) | saved (MiB) | saved |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['vocab_size']:,} x {r['n_embd']:,} | {r['qlora_base_bytes_before'] / MiB:,.1f} | "
                     f"{r['qlora_base_bytes_now'] / MiB:,.1f} | {r['saved_bytes'] / MiB:,.1f} | "
                     f"{100 * r['saved_share']:.1f}% |")
    (RESULTS / "tied_head.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
