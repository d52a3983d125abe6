"""One stream, greedy, 128 new tokens: `litqlora generate`'s decoding against llama.cpp and transformers on the same
model and the same CPU (issue 56 items 4 and 5).

    make test-llama-cpp                          # once: llama-cpp-python built from source in .venv-llama-cpp
    python benchmarks/speed/decode_peers.py      # SmolLM2-135M, 128 new tokens, 2 rounds
    python benchmarks/speed/decode_peers.py --shape llama-1b --rounds 1   # a 1B Llama shape, random weights

Sides, each in a fresh process per round (the order rotates between rounds), all fed the same prompt's token ids
(the bundled SmolLM2's chat template around a 40-token request) and decoding exactly `--tokens` tokens (no stop ids):
- ours: the model `litqlora generate` loads (lit_qlora.deploy.choice.ModelChoice) with the NF4 base (the decode
  kernel, nf4/gemv.c, where nf4/linear.py routes it) and with the plain base, in the precision `auto` picks here
  (bf16 on a CPU with native bf16, else fp32) and in fp32;
- llama.cpp: llama-cpp-python from .venv-llama-cpp (`make test-llama-cpp`), on our own `export_gguf` of the same
  weights at q4_0 and q8_0, as many threads as ours;
- transformers: `generate` of the same checkpoint, greedy, in the same precision as ours.
Reported per side: tokens/s over the whole call (prefill included, as a user waits for them) and decode tokens/s
(after the first token), medians over rounds; ratios are of medians measured in the same run. The CPU's ISA flags
come first: the figures belong to that CPU. Run it on a quiet machine.

Results: benchmarks/speed/results/decode_peers[_SHAPE].{json,md}.
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from decode_timing import timed_generate, timed_tokens  # noqa: E402  (this folder is on sys.path: the script's own)
from nf4_decode import checkpoint, isa_flags  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle, in three paragraphs please."
LLAMA_CPP_PYTHON = ROOT / ".venv-llama-cpp" / "bin" / "python"
WORK = ROOT / "benchmarks" / "_work" / "decode_peers"
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
"""Llama 3.2 1B's shape with SmolLM2's 49,152-word vocabulary (so the bundled tokenizer serves it)."""


def child_ours(args: argparse.Namespace, ids: list[int]) -> dict:
    from lit_qlora.base.threads import govern_threads
    from lit_qlora.deploy.choice import ModelChoice
    from lit_qlora.model.sampling import generate

    choice = ModelChoice(checkpoint_dir=args.checkpoint_dir, quantize=args.quantize, precision=args.precision,
                         device="cpu")
    model = choice.load()
    govern_threads(model)  # as `litqlora generate` runs
    timed_tokens(generate(model, ids, 8), 8)  # warm-up: kernels built, caches touched
    return {**timed_tokens(generate(model, ids, args.tokens), args.tokens), "precision": choice.run_precision}


def child_transformers(args: argparse.Namespace, ids: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"bf16-true": torch.bfloat16, "32-true": torch.float32}[args.precision]
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint_dir, dtype=dtype).eval()
    prompt = torch.tensor([ids])

    def run(n: int) -> dict:
        return timed_generate(model, prompt, n)

    run(8)
    return {**run(args.tokens), "precision": args.precision}


def child_llama_cpp(args: argparse.Namespace, ids: list[int]) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(args.gguf), n_ctx=len(ids) + args.tokens + 8, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)

    def run(n: int) -> dict:
        llm.reset()
        return timed_tokens(llm.generate(ids, top_k=1, temp=0.0, reset=True), n)

    run(8)
    return {**run(args.tokens), "precision": args.gguf.stem.rsplit("-", 1)[-1]}


def child(args: argparse.Namespace) -> None:
    ids = json.loads(args.ids)
    result = {"ours": child_ours, "transformers": child_transformers, "llama_cpp": child_llama_cpp}[args.child](args,
                                                                                                               ids)
    print("RESULT " + json.dumps(result), flush=True)


def prepare(args: argparse.Namespace) -> tuple[Path, list[int], dict[str, Path]]:
    """The checkpoint, the prompt's ids and the GGUF files (written once under benchmarks/_work)."""
    from lit_qlora.data.inference import trained_tokenizer
    from lit_qlora.export.gguf import export_gguf_command

    base = checkpoint(Path(args.checkpoint_dir))
    path = base
    if args.shape == "llama-1b":
        path = WORK / "llama-1b"
        if not (path / "model.safetensors").exists():
            import shutil

            import torch
            from transformers import AutoModelForCausalLM, LlamaConfig

            torch.manual_seed(0)
            config = LlamaConfig(**{**LLAMA_1B, "vocab_size": json.loads((base / "config.json").read_text())["vocab_size"]})
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (base / name).exists():
                    shutil.copy(base / name, path / name)
    ids = trained_tokenizer(path, None).encode_prompt(PROMPT)
    ggufs = {}
    for dtype in args.gguf_types:
        out = WORK / f"{path.name}-{dtype}.gguf"
        if not out.exists():
            export_gguf_command(path, out, dtype=dtype, quantize="none")
        ggufs[dtype] = out
    return path, ids, ggufs


def run_side(cmd: list[str]) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint_dir", default="checkpoints/SmolLM2-135M-Instruct")
    parser.add_argument("--shape", choices=("smollm2", "llama-1b"), default="smollm2")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--gguf_types", nargs="+", default=["q4_0", "q8_0"])
    parser.add_argument("--results_dir", type=Path, default=HERE / "results")
    parser.add_argument("--child", choices=("ours", "transformers", "llama_cpp"))
    parser.add_argument("--ids")
    parser.add_argument("--quantize")
    parser.add_argument("--precision")
    parser.add_argument("--gguf", type=Path)
    args = parser.parse_args()
    if args.child:
        return child(args)

    from lit_qlora.base.precision import resolved

    path, ids, ggufs = prepare(args)
    auto = resolved("auto", "cpu")
    me = [sys.executable, __file__, "--ids", json.dumps(ids), "--tokens", str(args.tokens), "--threads",
          str(args.threads), "--checkpoint_dir", str(path)]
    sides = {f"ours nf4 {auto}": [*me, "--child", "ours", "--quantize", "nf4", "--precision", auto],
             f"ours plain {auto}": [*me, "--child", "ours", "--quantize", "none", "--precision", auto],
             f"transformers {auto}": [*me, "--child", "transformers", "--precision", auto]}
    if auto != "32-true":
        sides["ours nf4 32-true"] = [*me, "--child", "ours", "--quantize", "nf4", "--precision", "32-true"]
    if LLAMA_CPP_PYTHON.exists():
        for dtype, gguf in ggufs.items():
            sides[f"llama.cpp {dtype}"] = [str(LLAMA_CPP_PYTHON), *me[1:], "--child", "llama_cpp", "--gguf", str(gguf)]
    else:
        print(f"{LLAMA_CPP_PYTHON} is missing: `make test-llama-cpp` builds it; llama.cpp's sides are left out")
    print(f"CPU: {isa_flags()}", flush=True)
    rows: dict[str, list[dict]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            result = run_side(sides[name])
            rows[name].append(result)
            print(f"round {r}: {name}: {args.tokens / result['seconds']:.1f} tok/s "
                  f"(decode {(args.tokens - 1) / result['decode_seconds']:.1f})", flush=True)
    summary = {name: {"tokens_per_sec": statistics.median(args.tokens / x["seconds"] for x in runs),
                      "decode_tokens_per_sec": statistics.median((args.tokens - 1) / x["decode_seconds"] for x in runs),
                      "precision": runs[0]["precision"], "first_tokens": runs[0]["tokens"][:16]}
               for name, runs in rows.items()}
    ours = summary[f"ours nf4 {auto}"]["tokens_per_sec"]
    ratios = {f"ours nf4 {auto} / {name}": round(ours / s["tokens_per_sec"], 3)
              for name, s in summary.items() if not name.startswith(f"ours nf4 {auto}")}
    record = {"cpu": isa_flags(), "shape": args.shape, "tokens": args.tokens, "rounds": args.rounds,
              "threads": args.threads, "prompt_tokens": len(ids), "summary": summary, "ratios": ratios,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": "python benchmarks/speed/decode_peers.py " + " ".join(sys.argv[1:])}
    stem = "decode_peers" + ("" if args.shape == "smollm2" else f"_{args.shape}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# One stream, greedy, {args.tokens} new tokens: ours vs llama.cpp and transformers ({args.shape})", "",
             f"CPU: {record['cpu']}; {args.threads} threads; prompt {len(ids)} tokens; {args.rounds} rounds, "
             f"medians; started {record['started']}.", "",
             "| side | tokens/s | decode tokens/s |", "|---|---:|---:|"]
    lines += [f"| {name} | {s['tokens_per_sec']:.1f} | {s['decode_tokens_per_sec']:.1f} |" for name, s in summary.items()]
    lines += ["", "| ratio (tokens/s) | value |", "|---|---:|"]
    lines += [f"| {name} | {value} |" for name, value in ratios.items()]
    lines += ["", f"Reproduce: `{record['command']}`"]
    (args.results_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
