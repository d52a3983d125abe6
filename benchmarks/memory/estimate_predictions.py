"""`litqlora estimate` predictions for GPU recipes, beside their published anchors (issue 17).

    python benchmarks/memory/estimate_predictions.py

Each row is the estimate of a config_hub recipe (its LoRA settings) at the anchor's micro-batch and sequence length,
on the CUDA path (`--device cuda`): predicted torch.cuda.max_memory_allocated per rank. FSDP rows come from the
same one-rank trace (lit_qlora.estimate.parallel_bytes). Results: benchmarks/memory/results/estimate_predictions.{json,md}.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE / "results"
GiB = 1 << 30

# torchtune's Llama 3.1 8B (Q)LoRA recipes: r 8, alpha 16, no dropout, q, v, output projection and the MLP.
TORCHTUNE = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": ["q", "v", "o", "gate", "up", "down"]}
# (recipe, LoRA overrides, micro-batch, sequence, FSDP rank counts, the anchor's figure)
ROWS = [
    ("llama-2-7b/qlora.yaml", {}, 2, 512, (), "torchtune's QLoRA PR: 5.77 GB peak allocated (goal <= 4.5 GiB)"),
    ("llama-2-7b/lora.yaml", {}, 2, 512, (), "torchtune's QLoRA PR: LoRA ~16 GB"),
    ("llama-3.1-8b/qlora.yaml", {}, 2, 2048, (2, 8), "torchtune: 7.4 GiB (goal <= 6.5 GiB)"),
    ("llama-3.1-8b/qlora.yaml", TORCHTUNE, 2, 2048, (), "torchtune: 7.4 GiB, at these LoRA settings"),
    ("llama-3.1-8b/lora.yaml", {}, 2, 2048, (), ""),
]


def main() -> None:
    from lit_qlora.model.config import Quantize
    from lit_qlora.estimate.step import parallel_bytes, trace_step
    from lit_qlora.estimate.command import resolve_config
    from lit_qlora.train.args import LoRAArgs, TrainArgs

    rows = []
    for recipe, overrides, batch, seq, fsdp, anchor in ROWS:
        spec = yaml.safe_load((ROOT / "config_hub" / "finetune" / recipe).read_text())
        spec["lora"].update(overrides)
        config, _ = resolve_config(spec["checkpoint_dir"])
        lora = LoRAArgs(**spec["lora"])
        train = replace(TrainArgs(**{k: v for k, v in spec["train"].items()}), micro_batch_size=batch,
                        global_batch_size=batch, max_seq_length=seq, activation_checkpointing=True)
        started = time.perf_counter()
        trace = trace_step(config, Quantize(spec["quantize"]), spec["precision"], lora, train, device="cuda")
        seconds = time.perf_counter() - started
        for ranks in (1, *fsdp):
            parts = parallel_bytes(trace.peak_by_category, config, "fsdp" if ranks > 1 else "auto", ranks, 1)
            rows.append({"recipe": recipe, "model": config.name, "quantize": spec["quantize"], "micro_batch_size": batch,
                         "max_seq_length": seq, "ranks": ranks, "lora": spec["lora"], "peak_bytes": sum(parts.values()),
                         "by_category": parts, "anchor": anchor if ranks == 1 else "", "estimate_seconds": round(seconds)})
            print(f"{recipe} {batch}x{seq} ranks={ranks}: {sum(parts.values()) / GiB:.2f} GiB", flush=True)
    (RESULTS / "estimate_predictions.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    lines = ["# `litqlora estimate --device cuda` for GPU recipes", "",
             "Predicted peak allocated bytes per rank (activation checkpointing on; the recipe's LoRA settings). "
             "Reproduce: `python benchmarks/memory/estimate_predictions.py`.", "",
             "| recipe | LoRA | micro-batch x seq | ranks (FSDP) | predicted GiB | frozen base | activations | anchor |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lora = f"r {r['lora']['r']}, dropout {r['lora']['dropout']}, {','.join(r['lora']['targets'])}"
        lines.append(f"| {r['recipe']} | {lora} | {r['micro_batch_size']} x {r['max_seq_length']} | {r['ranks']} | "
                     f"{r['peak_bytes'] / GiB:.2f} | {r['by_category']['frozen base'] / GiB:.2f} | "
                     f"{r['by_category']['activations'] / GiB:.2f} | {r['anchor']} |")
    (RESULTS / "estimate_predictions.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
