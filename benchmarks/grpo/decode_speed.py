"""`--grpo.compile_decode` against the eager decode, the rollouts as `litqlora grpo` samples them (issue 49 item 3).

    python benchmarks/grpo/decode_speed.py [--rounds 5] [--precision auto] [--quantize nf4 none]

SmolLM2-135M-Instruct (checkpoints/), its LoRA adapter as GRPO starts it (every linear, r 8), eval mode; groups of
--group completions of --tokens tokens each (no stop token: every row decodes to the cap, so both sides do the same
work) of the demo task's prompts (lit_qlora/data/grpo_demo.jsonl). Per quantize setting: the compiled decoder warms up
(its one compilation, timed apart), then eager and compiled groups alternate over --rounds rounds, each round the same
prompts and seeds on both sides; reported: decode tokens/s of each, the median of the per-round ratios with their
range, and whether both drew the same completions (in bf16 inductor's fused kernels round differently, and a
sampled token can then differ; tests/test_grpo.py checks the traced graph gives the eager groups in fp32). On a GPU the compiled step also replays as a CUDA graph; this
script runs wherever the model runs (--device). Results: benchmarks/grpo/results/decode_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from demo import cpu_flags  # (this folder is on sys.path: the script's own)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", type=Path, default=ROOT / "checkpoints" / "SmolLM2-135M-Instruct")
    parser.add_argument("--quantize", nargs="+", default=["nf4", "none"])
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4, help="groups per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache_len", type=int, default=96, help="the compiled cache's length (the run's max_seq_length)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "decode_speed.json")
    args = parser.parse_args()
    import torch

    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.base.precision import resolved
    from lit_qlora.checkpoint.tokenizer import Tokenizer
    from lit_qlora.data.files import GRPO_DEMO_DATASET
    from lit_qlora.methods.grpo.rollout import Decoder, sample_group
    from lit_qlora.lora.layer import apply_lora

    tokenizer = Tokenizer(args.checkpoint_dir)
    rows = [json.loads(line) for line in GRPO_DEMO_DATASET.read_text().splitlines()[: args.prompts]]
    prompts = [tokenizer.encode_prompt(r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"])
               for r in rows]
    record = {"command": "python benchmarks/grpo/decode_speed.py " + " ".join(sys.argv[1:]), "cpu": cpu_flags(),
              "cores": os.cpu_count(), "torch": torch.__version__, "device": args.device, "group": args.group,
              "tokens": args.tokens, "prompts": args.prompts, "rounds": args.rounds, "rows": []}
    for quantize in args.quantize:
        model = load_model(args.checkpoint_dir, quantize, resolved(args.precision, torch.device(args.device).type),
                           device=args.device)
        apply_lora(model, r=8, alpha=16, dropout=0.05, targets="all")
        model.eval()
        decoder = Decoder(cache_len=args.cache_len)

        def groups(dec, model=model) -> tuple[float, list]:
            started, drawn = time.perf_counter(), []
            for i, prompt in enumerate(prompts):
                g = sample_group(model, prompt, args.group, args.tokens, 1.0, None, 1.0, [],
                                 torch.Generator(device=args.device).manual_seed(i), dec)
                drawn.append(g.completions)
            return time.perf_counter() - started, drawn

        t0 = time.perf_counter()
        groups(decoder)  # the one compilation (and the C kernels' first use on both sides)
        warmup = time.perf_counter() - t0
        groups(Decoder())
        eager_s, compiled_s, same = [], [], True
        for _ in range(args.rounds):
            e, drawn_e = groups(Decoder())
            c, drawn_c = groups(decoder)
            eager_s.append(e)
            compiled_s.append(c)
            same &= drawn_e == drawn_c
        tokens = args.prompts * args.group * args.tokens
        ratios = [e / c for e, c in zip(eager_s, compiled_s)]
        row = {"quantize": quantize, "precision": str(next(model.parameters()).dtype).removeprefix("torch."),
               "eager_tokens_per_sec": round(tokens / statistics.median(eager_s), 1),
               "compiled_tokens_per_sec": round(tokens / statistics.median(compiled_s), 1),
               "speedup_median": round(statistics.median(ratios), 3), "speedup_range": [round(min(ratios), 3),
                                                                                     round(max(ratios), 3)],
               "same_completions": same, "compile_seconds": round(warmup, 1), "threads": torch.get_num_threads()}
        record["rows"].append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    lines = ["# The rollouts' decode: compiled (`--grpo.compile_decode true`) against eager", "",
             f"`{record['command']}`; {record['device']}, CPU {record['cpu']}, {record['cores']} cores, torch "
             f"{record['torch']}. Groups of {args.group} completions x {args.tokens} tokens, {args.prompts} prompts a "
             f"round, {args.rounds} rounds alternating eager and compiled.", "",
             "| base | dtype | eager tok/s | compiled tok/s | compiled / eager (median of rounds) | range | same completions | "
             "compile s |", "|---|---|---:|---:|---:|---:|---|---:|"]
    for r in record["rows"]:
        lines.append(f"| {r['quantize']} | {r['precision']} | {r['eager_tokens_per_sec']} | {r['compiled_tokens_per_sec']} | "
                     f"**{r['speedup_median']}** | {r['speedup_range']} | {r['same_completions']} | "
                     f"{r['compile_seconds']} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
