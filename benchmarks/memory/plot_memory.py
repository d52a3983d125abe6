"""The plot in tutorials/memory.md, drawn only from recorded results (no measuring here).

    python benchmarks/memory/plot_memory.py     # -> benchmarks/memory/results/memory.png

Left: where the whole-run peak goes for QLoRA and LoRA on the 1.1B shape (1x512, activation checkpointing on):
the resident parts counted by memory_breakdown.py, stacked, topped by the rest of train_memory.py's OS-measured
peak (the step's activations, logits and gradients in flight, plus heap the allocator holds). Right: peak RSS of
every recorded train_memory.py configuration.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROW = "tinyllama-1.1b-random 1x512 ckpt=on"
LABELS = {"nf4": "QLoRA", "none": "LoRA", "full": "full FT"}
PARTS = [  # (label, keys of memory_breakdown's "resident"), bottom to top
    ("libraries (torch, Lightning, ...)", None),
    ("frozen base linears", ["base_linear_weights"]),
    ("embeddings + norms", ["embeddings_and_norms"]),
    ("LoRA: weights, grads, AdamW", ["lora_adapters", "lora_gradients", "optimizer_state"]),
    ("NF4 dequantize scratch", ["nf4_dequant_scratch"]),
]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    breakdown = json.loads((RESULTS / "memory_breakdown.json").read_text())["rows"][ROW]["runs"]
    train = json.loads((RESULTS / "train_memory.json").read_text())["rows"]
    gib = 1024**3
    fig, (stack, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    colors = plt.get_cmap("tab10").colors
    for x, config in enumerate(["nf4", "none"]):
        run = breakdown[config]
        sizes = [run["rss_libraries_bytes"]] + [sum(run["resident"][k] for k in keys) for _, keys in PARTS[1:]]
        peak = train[f"{ROW} {config}"]["peak_rss_bytes"]
        sizes.append(peak - sum(sizes))
        bottom = 0.0
        for i, (size, label) in enumerate(zip(sizes, [p[0] for p in PARTS] + ["step transient + heap"])):
            stack.bar(x, size / gib, bottom=bottom, color=colors[i], label=label if x == 0 else None)
            bottom += size / gib
        stack.text(x, bottom, f"{peak / gib:.2f} GiB", ha="center", va="bottom")
    stack.set_xticks([0, 1], ["QLoRA", "LoRA"])
    stack.set_ylabel("whole-run peak RSS (GiB)")
    stack.set_title("1.1B shape, 1x512, checkpointing on")
    stack.set_ylim(0, 4.4)  # room for the legend above the bars
    stack.legend(fontsize=7, loc="upper left")

    rows = sorted(train.values(), key=lambda r: (r["checkpoint"], r["batch"], not r["checkpointing"], r["config"]))
    names = [f"{r['checkpoint'].split('-')[0]} {r['batch']}x{r['seq']} {'ckpt' if r['checkpointing'] else 'no ckpt'}"
             f" {LABELS[r['config']]}" for r in rows]
    bars.barh(range(len(rows)), [r["peak_rss_bytes"] / gib for r in rows],
              color=[{"nf4": colors[1], "none": colors[0], "full": colors[3]}[r["config"]] for r in rows])
    for i, r in enumerate(rows):
        bars.text(r["peak_rss_bytes"] / gib, i, f" {r['peak_rss_bytes'] / gib:.2f}", va="center", fontsize=7)
    bars.set_yticks(range(len(rows)), names, fontsize=7)
    bars.invert_yaxis()
    bars.set_xlabel("whole-run peak RSS (GiB), CPU")
    bars.set_title("every recorded configuration (train_memory.py)")
    fig.tight_layout()
    fig.savefig(RESULTS / "memory.png", dpi=110)
    print(RESULTS / "memory.png")


if __name__ == "__main__":
    main()
