"""Where a training step's time goes, side by side (issue 48 item 2): Chrome traces of one profiled step each
(torch.profiler's `export_chrome_trace`, recorded with record_shapes and the step inside a `step` annotation), their
kernels grouped, one table.

    python benchmarks/gpu/kernel_table.py ours-eager=a.json ours-compiled=b.json torchtune-compiled=c.json \\
        --out profile.json --md profile.md

Per trace: the step's wall time (the `step` annotation), the GPU's busy time (the union of its kernels, memcpys and
memsets) and what is left of the wall, the host-side gaps (the GPU idle between kernels: their sum, count and the
longest, each with the CPU op the host was in when it began). Every kernel gets one group by its name and the CPU op
that launched it (the kernel's "External id"): matmul, attention, nf4_dequant, norm_rope_act, lora, loss, copies,
optimizer, other. A matmul with an operand dimension of r, 2r or 3r (--lora_rank r, default 8: one adapter, or the
A's of a fused q/k/v stacked) is LoRA's, as is dropout.
A trace without GPU kernels (a CPU run: the kit's dry run) groups its CPU ops by self time the same way; its "busy"
time is then the time inside any op, and its gaps the host's Python between ops.
Standard library only: it reads traces written in any environment (torchtune's venv included).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Iterable, Optional

GROUPS = ("matmul", "attention", "nf4_dequant", "norm_rope_act", "lora", "loss", "copies", "optimizer", "other")
LORA_RANK = 8
GAP_US = 10.0  # idle stretches shorter than this are launch latency between back-to-back kernels, not gaps
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
              "aten::_scaled_mm", "aten::addmm_"}
RULES = [  # (group, pattern over "kernel name | launching op"), first match wins; matmul's LoRA split is apart
    ("optimizer", r"adam|multi_tensor_apply|_foreach|clip_grad"),
    ("nf4_dequant", r"nf4|bitwise_and|rshift|bitwise_right_shift|dequant"),
    ("loss", r"cross_entropy|nll_loss|log_softmax|logsumexp|chunkedoutputloss"),
    ("attention", r"flash|fmha|attention|flex|sdpa|cudnn_?.*mha|_efficient_attention"),
    ("lora", r"dropout|bernoulli|philox|lora"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_|ampere_|hopper_|splitkreduce|"
               r"aten::(mm|addmm|bmm|baddbmm|matmul|linear)\b"),
    ("norm_rope_act", r"norm|rsqrt|silu|sigmoid|gelu|rope|rotary|\bcos|\bsin|pow|mean|tanh|softmax|swiglu"),
    ("copies", r"memcpy|memset|copy|cat_|catarraybatched|fill|index_put|clone|contiguous|scatter|gather"),
]


def classify(name: str, op: str = "", dims: Optional[list] = None, rank: int = LORA_RANK) -> str:
    text = f"{name} | {op}".lower()
    for group, pattern in RULES:
        if re.search(pattern, text):
            if group == "matmul" and lora_shaped(dims, rank):
                return "lora"
            return group
    if op in MATMUL_OPS:
        return "lora" if lora_shaped(dims, rank) else "matmul"
    return "other"


def lora_shaped(dims: Optional[list], rank: int = LORA_RANK) -> bool:
    sizes = {d for shape in (dims or []) if isinstance(shape, list) for d in shape if isinstance(d, int)}
    return bool(sizes & {rank, 2 * rank, 3 * rank})


def load(path: Path) -> list[dict]:
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def _complete(events: Iterable[dict]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def self_timed(ops: list[dict]) -> list[dict]:
    """CPU ops as a CPU trace's kernels: each with its self time as `dur` (its own time without the ops inside it,
    per thread), so nested ops are counted once."""
    out, by_thread = [], {}
    for e in ops:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in events:
            mine = {**e, "dur": float(e["dur"]), "span": float(e["dur"])}
            while stack and stack[-1]["ts"] + stack[-1]["span"] <= e["ts"]:
                stack.pop()
            if stack:
                stack[-1]["dur"] -= e["dur"]
            stack.append(mine)
            out.append(mine)
    return out


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def op_at(ops: list[dict], ts: float) -> str:
    """The innermost CPU op running at `ts` (the host's work when the GPU went idle)."""
    inside = [e for e in ops if e["ts"] <= ts < e["ts"] + e["dur"]]
    return min(inside, key=lambda e: e["dur"])["name"] if inside else "-"


def summarize(events: list[dict], top: int = 12, rank: int = LORA_RANK) -> dict:
    events = _complete(events)
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    kernels = [e for e in events if e.get("cat") in DEVICE_CATS]
    device = "cuda" if kernels else "cpu"
    spans = [(k["ts"], k["ts"] + k["dur"]) for k in kernels or ops]
    if not kernels:
        kernels = self_timed(ops)
    steps = [e for e in events if e.get("cat") in ("user_annotation", "gpu_user_annotation") and e["name"] == "step"]
    if steps:
        start = min(e["ts"] for e in steps)
        end = max(e["ts"] + e["dur"] for e in steps)
    else:
        start = min(a for a, _ in spans)
        end = max(b for _, b in spans)
    wall = end - start
    by_id = {e["args"]["External id"]: e for e in ops if "External id" in e.get("args", {})}
    groups = {g: {"us": 0.0, "kernels": 0} for g in GROUPS}
    names: dict[tuple[str, str], dict] = {}
    for k in kernels:
        launcher = by_id.get(k.get("args", {}).get("External id")) if device == "cuda" else k
        op = launcher["name"] if launcher else ""
        dims = (launcher or {}).get("args", {}).get("Input Dims")
        group = classify(k["name"], op, dims, rank)
        groups[group]["us"] += k["dur"]
        groups[group]["kernels"] += 1
        entry = names.setdefault((k["name"], group), {"name": k["name"], "group": group, "us": 0.0, "calls": 0})
        entry["us"] += k["dur"]
        entry["calls"] += 1
    busy = union(spans)
    gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:]) if b_start - a_end >= GAP_US]
    busy_us = sum(b - a for a, b in busy)
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:5]
    return {
        "device": device, "wall_ms": wall / 1e3, "busy_ms": busy_us / 1e3,
        "idle_ms": max(wall - busy_us, 0.0) / 1e3, "kernels": len(kernels),
        "groups": {g: {"ms": v["us"] / 1e3, "share": v["us"] / wall if wall else None, "kernels": v["kernels"]}
                   for g, v in groups.items()},
        "top": [{"name": e["name"], "group": e["group"], "ms": e["us"] / 1e3, "calls": e["calls"]}
                for e in sorted(names.values(), key=lambda e: -e["us"])[:top]],
        "gaps": {"count": len(gaps), "ms": sum(b - a for a, b in gaps) / 1e3,
                 "longest": [{"ms": (b - a) / 1e3, "host_op": op_at(ops, a)} for a, b in longest]},
    }


def table(summaries: dict[str, dict]) -> str:
    labels = list(summaries)
    head = "| group | " + " | ".join(f"{x} ms (share)" for x in labels) + " |"
    lines = [head, "|---|" + "---:|" * len(labels)]
    for g in GROUPS:
        cells = [f"{s['groups'][g]['ms']:.1f} ({s['groups'][g]['share']:.1%})" if s["groups"][g]["share"] is not None
                 else "-" for s in summaries.values()]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    for key, what in (("busy_ms", "device busy"), ("idle_ms", "device idle (host-side)"), ("wall_ms", "step wall")):
        lines.append(f"| **{what}** | " + " | ".join(f"{s[key]:.1f}" for s in summaries.values()) + " |")
    lines.append("| gaps >= %g us (count, ms) | " % GAP_US
                 + " | ".join(f"{s['gaps']['count']}, {s['gaps']['ms']:.1f}" for s in summaries.values()) + " |")
    for label, s in summaries.items():
        lines += ["", f"**{label}** ({s['device']}, {s['kernels']} kernels): top kernels by total time", "",
                  "| kernel | group | ms | calls | share of step |", "|---|---|---:|---:|---:|"]
        for e in s["top"]:
            share = e["ms"] / s["wall_ms"] if s["wall_ms"] else 0
            lines.append(f"| `{e['name'][:90]}` | {e['group']} | {e['ms']:.2f} | {e['calls']} | {share:.1%} |")
        if s["gaps"]["longest"]:
            lines.append("\nLongest gaps: " + "; ".join(f"{g['ms']:.2f} ms in `{g['host_op'][:60]}`"
                                                       for g in s["gaps"]["longest"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="LABEL=trace.json")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--lora_rank", type=int, default=LORA_RANK)
    args = parser.parse_args()
    summaries = {}
    for item in args.traces:
        label, _, path = item.partition("=")
        summaries[label] = summarize(load(Path(path)), rank=args.lora_rank)
    md = table(summaries)
    if args.out:
        args.out.write_text(json.dumps(summaries, indent=2) + "\n")
    if args.md:
        args.md.write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
