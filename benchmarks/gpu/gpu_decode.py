"""One stream, greedy, 128 new tokens on a CUDA GPU: our NF4 decode (the few-row Triton kernel, nf4/triton_rows.py)
against bitsandbytes' 4-bit (its matrix-vector kernel) and against our bf16 base (issue 56 item 5's GPU goal).

    python benchmarks/gpu/gpu_decode.py --checkpoint_dir CKPT --bnb_python benchmarks/_work/gpu-venv-bnb/bin/python

Sides, each a fresh process per round (the order rotates between rounds), all fed the same 40 prompt ids and
decoding exactly `--tokens` tokens (no stop ids), in bf16:
- `ours nf4`: the model `litqlora generate` loads (ModelChoice, `--quantize nf4`), decoding through the few-row kernel;
- `ours nf4 dequant`: the same with `LIT_QLORA_NF4_GEMV=0` (each weight dequantized whole, then cuBLAS): the kernel's
  own effect;
- `ours bf16`: `--quantize none`;
- `bnb 4-bit`: transformers' `generate` on the same checkpoint loaded with bitsandbytes' NF4 (double-quantized, bf16
  compute), in the bitsandbytes venv the kit builds (`gpu_peer_envs.sh`); left out where that python is missing or
  the device is not CUDA.
Reported per side: tokens/s of the whole call (prefill included) and of the decode (after the first token), the
peak allocated bytes, medians over rounds; ratios of medians from the same run. Result: `--out` (JSON) and a table
on stdout. The children import only torch and their side's own libraries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speed"))  # no PYTHONPATH in the bnb venv
from decode_timing import timed_generate, timed_tokens  # noqa: E402  (stdlib only at import)

PROMPT_TOKENS = 40


def prompt_ids(checkpoint_dir: str) -> list[int]:
    """40 ids spread over the vocabulary (random weights: any ids serve; the same for every side)."""
    vocab = json.loads((Path(checkpoint_dir) / "config.json").read_text())["vocab_size"]
    return [(1 + 7919 * i) % vocab for i in range(PROMPT_TOKENS)]


def child_ours(args: argparse.Namespace, ids: list[int], sync) -> dict:
    from lit_qlora.deploy.choice import ModelChoice
    from lit_qlora.model.sampling import generate

    model = ModelChoice(checkpoint_dir=args.checkpoint_dir, quantize=args.quantize, precision="bf16-true",
                        device=args.device).load()
    timed_tokens(generate(model, ids, 8), 8, sync)  # warm-up: kernels compiled and autotuned, caches touched
    return timed_tokens(generate(model, ids, args.tokens), args.tokens, sync)


def child_bnb(args: argparse.Namespace, ids: list[int], sync) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint_dir, dtype=torch.bfloat16, device_map=args.device,
                                                 quantization_config=quant).eval()
    prompt = torch.tensor([ids], device=args.device)
    def run(n: int) -> dict:
        return timed_generate(model, prompt, n, sync)

    run(8)
    return run(args.tokens)


def child(args: argparse.Namespace) -> None:
    import torch

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = {"ours": child_ours, "bnb": child_bnb}[args.child](args, prompt_ids(args.checkpoint_dir), sync)
    result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
    print("RESULT " + json.dumps(result), flush=True)


def run_side(cmd: list[str], env: dict[str, str], timeout: float) -> dict:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s"}
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode or line is None:
        return {"error": (done.stderr or done.stdout)[-1500:]}
    return json.loads(line.removeprefix("RESULT "))


def sides(args: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str]]]:
    me = [__file__, "--checkpoint_dir", args.checkpoint_dir, "--device", args.device, "--tokens", str(args.tokens)]
    env = dict(os.environ)
    out = {"ours nf4": ([sys.executable, *me, "--child", "ours", "--quantize", "nf4"], env),
           "ours nf4 dequant": ([sys.executable, *me, "--child", "ours", "--quantize", "nf4"],
                                dict(env, LIT_QLORA_NF4_GEMV="0")),
           "ours bf16": ([sys.executable, *me, "--child", "ours", "--quantize", "none"], env)}
    if args.bnb_python and Path(args.bnb_python).exists() and args.device.startswith("cuda"):
        bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # the venv's own packages, not the kit's
        out["bnb 4-bit"] = ([args.bnb_python, *me, "--child", "bnb"], bare)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bnb_python")
    parser.add_argument("--time_budget", type=float, default=480, help="no round starts after this many seconds")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=("ours", "bnb"))
    parser.add_argument("--quantize")
    args = parser.parse_args()
    if args.child:
        return child(args)
    started = time.monotonic()
    todo = sides(args)
    names = list(todo)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        if r and time.monotonic() - started > args.time_budget / 2:
            break  # a second round only where the first took under half the budget
        for name in names[r % len(names):] + names[:r % len(names)]:
            cmd, env = todo[name]
            result = run_side(cmd, env, max(60.0, args.time_budget - (time.monotonic() - started)))
            runs[name].append(result)
            rate = f"{args.tokens / result['seconds']:.1f} tok/s" if "seconds" in result else result["error"][-300:]
            print(f"round {r}: {name}: {rate}", flush=True)
    summary = {}
    for name, results in runs.items():
        ok = [x for x in results if "seconds" in x]
        if not ok:
            summary[name] = {"error": results[0]["error"] if results else "not run"}
            continue
        summary[name] = {"tokens_per_sec": statistics.median(args.tokens / x["seconds"] for x in ok),
                         "decode_tokens_per_sec": statistics.median((args.tokens - 1) / x["decode_seconds"] for x in ok),
                         "peak_allocated_bytes": max((x["peak_allocated_bytes"] or 0) for x in ok), "rounds": len(ok),
                         "first_tokens": ok[0]["tokens"][:12]}
    ours = summary["ours nf4"].get("tokens_per_sec")
    ratios = {f"ours nf4 / {name}": round(ours / s["tokens_per_sec"], 3) for name, s in summary.items()
              if ours and name != "ours nf4" and s.get("tokens_per_sec")}
    record = {"device": args.device, "tokens": args.tokens, "prompt_tokens": PROMPT_TOKENS, "summary": summary,
              "ratios": ratios, "command": "python benchmarks/gpu/gpu_decode.py " + " ".join(sys.argv[1:])}
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    lines = ["| side | tokens/s | decode tokens/s | peak allocated GiB |", "|---|---:|---:|---:|"]
    for name, s in summary.items():
        if "error" in s:
            lines.append(f"| {name} | error: {s['error'][-120:]!r} | | |")
        else:
            lines.append(f"| {name} | {s['tokens_per_sec']:.1f} | {s['decode_tokens_per_sec']:.1f} | "
                         f"{(s['peak_allocated_bytes'] or 0) / 2**30:.2f} |")
    lines += [f"- {name}: {value}" for name, value in ratios.items()]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
