"""NF4 decode kernel on and off: one stream, greedy, `litqlora generate`'s decoding on the bundled SmolLM2-135M with the
NF4 base, in fp32 and bf16 (issue 56 item 1).

    python benchmarks/speed/nf4_decode.py                      # 128 new tokens, 5 rounds, fp32 and bf16
    python benchmarks/speed/nf4_decode.py --tokens 8 --rounds 1   # a smoke run

Each round generates with the kernel (lit_qlora/nf4/gemv.c) and then without it (``LIT_QLORA_NF4_GEMV=0``: every
NF4 weight dequantized, then a one-row matmul), alternating which goes first, on the same loaded model, and counts the
greedy tokens both give before the first that differs (the sums' order differs: in bf16 a last-bit difference can
flip a near tie, after which the texts part; the run's length stays the same, no stop tokens). Reported per precision: tokens/s (all new tokens over the whole call, prefill included, as a user
waits for them) and decode tokens/s (after the first token), their medians over rounds, and the median of the
per-round ratios with its range. The model's linears run the kernel where nf4/linear.py routes them (a head tied to
the embedding stays dense). The CPU's ISA flags (lscpu) and the kernel's build come first: the figures belong to
that CPU. Time it on a quiet machine; a busy one measures the other work.

The checkpoint is converted from the bundled GGUF (`litqlora convert_gguf smollm2`) when missing.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lit_qlora.checkpoint.download import DEFAULT_CHECKPOINT  # noqa: E402

PRECISIONS = {"fp32": "32-true", "bf16": "bf16-true"}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SWITCH = "LIT_QLORA_NF4_GEMV"
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
             "amx_bf16", "amx_tile")


def isa_flags() -> str:
    """The x86 vector flags of this CPU, as lscpu lists them (or /proc/cpuinfo without lscpu)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.lower().startswith("flags")), [])
    return f"{model}; flags: {' '.join(f for f in ISA_FLAGS if f in flags) or '(none listed)'}"


def checkpoint(path: Path) -> Path:
    if not (path / "config.json").exists():
        from lit_qlora.export.gguf_import import bundled_smollm2_path, convert_gguf

        print(f"converting the bundled SmolLM2 into {path}", flush=True)
        convert_gguf(bundled_smollm2_path(), path)
    return path


def timed_generate(model, ids: list[int], tokens: int, kernel: bool) -> tuple[list[int], float, float]:
    """The tokens, the whole call's seconds and the seconds after the first token, with the kernel on or off."""
    from lit_qlora.model.sampling import generate

    os.environ[SWITCH] = "1" if kernel else "0"
    out, first = [], None
    start = time.perf_counter()
    for token in generate(model, ids, tokens):  # no stop ids: every run decodes `tokens` tokens
        out.append(token)
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return out, end - start, end - first


def run_precision(name: str, args: argparse.Namespace) -> dict:
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.data.inference import trained_tokenizer
    from lit_qlora.nf4.linear import decode_applies
    from lit_qlora.base.threads import govern_threads

    model = load_model(args.checkpoint_dir, "nf4", PRECISIONS[name])
    govern_threads(model)  # as `litqlora generate` runs
    ids = trained_tokenizer(args.checkpoint_dir, None).encode_prompt(args.prompt)
    timed_generate(model, ids, min(8, args.tokens), True)  # warm-up: kernels built, caches touched
    timed_generate(model, ids, min(8, args.tokens), False)
    x = torch.zeros(1, 1, model.config.n_embd, dtype=model.model.embed_tokens.weight.dtype)
    os.environ[SWITCH] = "1"
    with torch.no_grad():
        routed = decode_applies(x, model.model.layers[0].self_attn.o_proj.weight)
    rows, agree = {True: [], False: []}, []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {kernel: timed_generate(model, ids, args.tokens, kernel) for kernel in order}
        same = [a == b for a, b in zip(got[True][0], got[False][0])] + [False]
        agree.append(same.index(False))  # tokens equal before the first that differs
        for kernel, (out, total, decode) in got.items():
            rows[kernel].append((len(out) / total, (len(out) - 1) / decode if len(out) > 1 else float("nan")))
    os.environ.pop(SWITCH, None)

    def med(kernel: bool, i: int) -> float:
        return statistics.median(row[i] for row in rows[kernel])

    ratios = [on[0] / off[0] for on, off in zip(rows[True], rows[False])]
    return {"precision": name, "prompt_tokens": len(ids), "new_tokens": args.tokens, "rounds": args.rounds,
            "kernel_routed": routed, "on_tok_s": med(True, 0), "off_tok_s": med(False, 0),
            "on_decode_tok_s": med(True, 1), "off_decode_tok_s": med(False, 1),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "same_tokens": min(agree)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint_dir", type=Path, default=ROOT / DEFAULT_CHECKPOINT)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    parser.add_argument("--rounds", type=int, default=5, help="A/B rounds per precision")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    args.checkpoint_dir = checkpoint(args.checkpoint_dir)

    from lit_qlora.nf4 import gemv

    lib = gemv.gemv_lib()
    print(f"CPU: {isa_flags()}")
    print(f"kernel build: {lib.isa if lib else 'unavailable: ' + str(gemv.gemv_error())}; torch threads "
          f"{torch.get_num_threads()}; torch {torch.__version__}, ATen {torch.backends.cpu.get_cpu_capability()}")
    results = []
    print(f"{'precision':9} {'on tok/s':>9} {'off tok/s':>9} {'on decode':>10} {'off decode':>10}  ratio (range)  "
          "same tokens")
    for name in args.precisions:
        row = run_precision(name, args)
        results.append(row)
        print(f"{name:9} {row['on_tok_s']:9.1f} {row['off_tok_s']:9.1f} {row['on_decode_tok_s']:10.1f} "
              f"{row['off_decode_tok_s']:10.1f}  {row['ratio_median']:.2f}x ({row['ratio_min']:.2f}-"
              f"{row['ratio_max']:.2f})  {row['same_tokens']}/{args.tokens}"
              f"{'' if row['kernel_routed'] else '  (kernel not routed)'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"cpu": isa_flags(), "kernel": lib.isa if lib else None, "rows": results},
                                        indent=2))


if __name__ == "__main__":
    main()
