"""An A/B question answered on a GPU (issue 48 item 1): variants of `litqlora finetune` interleaved A B A B ... over
rounds, each round's tokens/s ratio against the first variant, and their median with its range.

    python benchmarks/gpu/gpu_ab.py --ckpt DIR --tokenizer_dir DIR --work DIR --out ab.json \\
        --variant qlora "--quantize nf4" --variant lora "--quantize none" [--rounds 3] [--steps 24]
    python benchmarks/gpu/gpu_ab.py ... --variant split "LIT_QLORA_NF4_FUSED=0" --variant fused "LIT_QLORA_NF4_FUSED=1"

A variant is a name and what it changes: leading NAME=VALUE words are environment settings (the LIT_QLORA_* switches
of the kernels under test), the rest are `litqlora finetune` options that go after the common ones (they win). Every
run is one `litqlora finetune` process (gpu_suite.run: the users' command, packed synthetic rows, dropout 0.05,
checkpointing) on the same checkpoint; each records every step's seconds, and its figure is the median tokens/s of the
steps after the warm-up (--warmup). A round runs every variant once, in the order given; a round is started only if
the time left (--time_budget, from this script's start) covers the longest round so far, so the result holds whole
rounds. The ratio of each variant to the first, per round, is the figure that decides; its range says whether the
difference is larger than the machine's noise (two identical 8B rows once differed by 22%).

--accelerator cpu --micro 2 --seq 64 with a tiny checkpoint is the kit's dry run of this call. --verb grpo asks the
same of `litqlora grpo` (a step's tokens/s counts its generation; --micro completions a step, one micro-batch).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import time
from pathlib import Path

import gpu_suite
import timing

ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def parse_variant(name: str, spec: str) -> dict:
    """{"name", "env", "args"} from a variant's NAME=VALUE settings and finetune options."""
    words = shlex.split(spec)
    env = {}
    while words and ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if any(ENV_WORD.match(w) for w in words):
        raise ValueError(f"variant {name}: environment settings go before the finetune options ({spec!r})")
    return {"name": name, "env": env, "args": words}


def summarize(variants: list[dict], runs: list[dict]) -> dict:
    """Per variant: its rounds' figures and peaks; per variant after the first: the per-round ratios' median and
    range (timing.ab_ratios)."""
    rounds: dict[int, dict[str, float]] = {}
    for r in runs:
        if r.get("steady_tokens_per_sec"):
            rounds.setdefault(r["round"], {})[r["variant"]] = r["steady_tokens_per_sec"]
    complete = [rounds[k] for k in sorted(rounds) if len(rounds[k]) == len(variants)]
    per_variant = {}
    for v in variants:
        mine = [r for r in runs if r["variant"] == v["name"]]
        rates = [r["steady_tokens_per_sec"] for r in mine if r.get("steady_tokens_per_sec")]
        peaks = [r["peak_allocated_train_bytes"] for r in mine if r.get("peak_allocated_train_bytes")]
        per_variant[v["name"]] = {"env": v["env"], "args": v["args"], "tokens_per_sec_by_round": rates,
                                  "median_tokens_per_sec": statistics.median(rates) if rates else None,
                                  "peak_allocated_train_bytes": max(peaks) if peaks else None,
                                  "failed": [r.get("error", "")[-400:] for r in mine if r.get("rc")]}
    return {"baseline": variants[0]["name"], "complete_rounds": len(complete), "variants": per_variant,
            "ratios": timing.ab_ratios(complete, variants[0]["name"])}


def table(result: dict) -> str:
    """The A/B table: each run's median with its spread and step times, then the ratios."""
    lines = ["| round | variant | tok/s (median of timed steps) | [min, max] | rel IQR | first step s | step seconds |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for r in result["runs"]:
        s = r.get("tokens_per_sec_spread") or {}
        steps = r.get("step_seconds") or []
        first = f"{steps[0]:.2f}" if steps else "-"
        lines.append(f"| {r['round']} | {r['variant']} | {r.get('steady_tokens_per_sec') or 'error'} | "
                     f"{'[%s, %s]' % (s['min'], s['max']) if s else '-'} | {s.get('rel_iqr', '-')} | {first} | "
                     f"{' '.join(f'{x:.3f}' for x in steps) or r.get('error', '')[-120:]} |")
    summary = result["summary"]
    for name, ratio in summary["ratios"].items():
        lines.append(f"\n{name} / {summary['baseline']}: median of {ratio['rounds']} per-round ratios "
                     f"**{ratio['median']:.3f}** [{ratio['min']:.3f}, {ratio['max']:.3f}] "
                     f"({', '.join(f'{x:.3f}' for x in ratio['ratios'])})")
    if not summary["ratios"]:
        lines.append(f"\nno complete round ({summary['complete_rounds']}): no ratio")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "SPEC"), required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=timing.WARMUP_STEPS)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--accelerator", default="cuda")
    parser.add_argument("--verb", choices=["finetune", "grpo"], default="finetune",
                        help="grpo: `litqlora grpo` on its bundled prompts, --micro completions a step")
    parser.add_argument("--finetune_args", default="", help="options every variant gets: '--export.merged false'")
    parser.add_argument("--time_budget", type=float, default=1e9, help="seconds: no round starts that may not end")
    args = parser.parse_args()
    started = time.monotonic()
    variants = [parse_variant(n, s) for n, s in args.variant]
    if len({v["name"] for v in variants}) != len(variants) or len(variants) < 2:
        parser.error("--variant: at least two, each with its own name")
    data = args.work / "data.json"
    if not data.is_file():
        gpu_suite.write_dataset(data)
    result = {"verb": args.verb, "ckpt": str(args.ckpt), "micro_batch": args.micro, "seq": args.seq, "steps": args.steps,
              "warmup": args.warmup, "variants": variants, "runs": []}
    longest = 0.0
    for k in range(args.rounds):
        left = args.time_budget - (time.monotonic() - started)
        if k and left < longest * 1.1:
            result["stopped"] = f"round {k} not started: {left:.0f} s left, a round took up to {longest:.0f} s"
            break
        round_start = time.monotonic()
        for v in variants:
            out_dir = args.work / f"out-ab-{v['name']}"
            row = gpu_suite.run(args.ckpt, data, out_dir, "nf4", args.micro, args.seq, args.steps, None, True,
                                extra=[*shlex.split(args.finetune_args), *v["args"]], env=v["env"],
                                accelerator=args.accelerator, warmup=args.warmup, verb=args.verb)
            row.pop("quantize", None)  # the suite's default; a variant's --quantize is in its args
            row.update(round=k, variant=v["name"])
            result["runs"].append(row)
            print(json.dumps({key: row.get(key) for key in ("round", "variant", "steady_tokens_per_sec", "rc",
                                                             "wall_seconds")}), flush=True)
            result["summary"] = summarize(variants, result["runs"])
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        longest = max(longest, time.monotonic() - round_start)
    result["summary"] = summarize(variants, result["runs"])
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(json.dumps({"ab_summary": result["summary"]["ratios"], "complete_rounds":
                      result["summary"]["complete_rounds"]}), flush=True)


if __name__ == "__main__":
    main()
