"""Peak RSS of streaming a ~1.1B checkpoint (TinyLlama shape, random weights) into the model, or (--model moe) a
mixture of experts of OLMoE's layout (1.3B parameters: 12 layers of 64 experts, hidden 1024, expert width 512, written
by transformers in the Hub's per-expert keys, in 1 GB shards).

    python benchmarks/memory/load_memory.py            # writes the checkpoint once under benchmarks/_work/, then measures
    python benchmarks/memory/load_memory.py --model moe --quantize nf4 none

Each measurement runs in a fresh child process (one configuration per process); peak RSS comes from the OS
(`resource.getrusage(RUSAGE_SELF).ru_maxrss` read inside the child after loading). Results go to
benchmarks/memory/results/load_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE.parent / "_work"
RESULTS = HERE / "results"


def write_tinyllama(path: Path) -> Path:
    """A random TinyLlama-1.1B-shaped Hugging Face directory in bf16 (written tensor by tensor)."""
    import torch

    from lit_qlora.checkpoint.hf import save_hf_checkpoint

    from lit_qlora.checkpoint.files import TensorSpec
    from lit_qlora.model.presets import preset
    from lit_qlora.model.transformer import Transformer

    if (path / "model.safetensors").is_file():
        return path
    config = preset("TinyLlama-1.1B")
    with torch.device("meta"):
        model = Transformer(config)
    gen = torch.Generator().manual_seed(0)

    def produce(shape):
        return lambda: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    specs = [TensorSpec(n, t.shape, torch.bfloat16, produce(t.shape)) for n, t in model.state_dict().items()]
    return save_hf_checkpoint(path, config, specs, dtype=torch.bfloat16)


MOE_SHAPE = dict(hidden_size=1024, intermediate_size=512, num_hidden_layers=12, num_attention_heads=16,
                 num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=32000,
                 max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def write_moe(path: Path) -> Path:
    """A random OLMoE-layout mixture of experts in bf16, written by transformers in the Hub's keys and 1 GB shards."""
    import torch
    import transformers

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("olmoe", **MOE_SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="1GB")
    return path


def predicted_load_bytes(checkpoint_dir: str, quantize: str) -> int:
    """What `litqlora estimate` predicts the load's host peak to be (estimate.json's load_host_bytes)."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        subprocess.run(["litqlora", "estimate", "--checkpoint_dir", checkpoint_dir, "--quantize", quantize,
                        "--precision", "bf16-true", "--device", "cpu", "--train.max_seq_length", "64",
                        "--out_dir", out], check=True, capture_output=True)
        return json.loads(Path(out, "estimate.json").read_text())["load_host_bytes"]


def child(checkpoint_dir: str, quantize: str) -> None:
    """Runs in its own process: load, then report peak RSS and the model's resident bytes."""
    import torch

    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.memory.accounting import module_bytes, peak_rss_bytes
    from lit_qlora.nf4 import nf4_backend

    nf4_backend()  # libraries imported and the NF4 kernel built: the baseline holds code, not weights
    base_rss = peak_rss_bytes()
    t0 = time.perf_counter()
    model = load_model(checkpoint_dir, quantize, "bf16-true")
    # safetensors may hand out memory-mapped tensors: touch every byte so the weights are really resident.
    # Touch in 1M-element pieces so the touching itself adds no transient.
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):  # not state_dict(): it dequantizes NF4
            if type(t) is torch.Tensor:
                for piece in t.reshape(-1).split(1 << 20):
                    piece.sum(dtype=torch.float32)
    seconds = time.perf_counter() - t0

    print(json.dumps({
        "quantize": quantize,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_before_load_bytes": base_rss,
        "model_bytes": module_bytes(model),
        "load_seconds": round(seconds, 2),
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", nargs="+", default=["none"], choices=["none", "nf4"])
    parser.add_argument("--model", choices=["tinyllama", "moe"], default="tinyllama")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)

    import torch

    if args.model == "moe":
        ckpt = write_moe(WORK / "olmoe-layout-1.3b-random")
    else:
        ckpt = write_tinyllama(WORK / "tinyllama-1.1b-random")
    file_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    # The interpreter with torch and the model code imported, nothing loaded: subtracted to isolate the load.
    rows = []
    for quantize in args.quantize:
        out = subprocess.run([sys.executable, __file__, "--child", str(ckpt), quantize], check=True,
                             capture_output=True, text=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        row["checkpoint_bytes"] = file_bytes
        row["load_rss_bytes"] = row["peak_rss_bytes"] - row["rss_before_load_bytes"]
        row["load_rss_over_model"] = round(row["load_rss_bytes"] / row["model_bytes"], 3)
        row["load_rss_over_checkpoint"] = round(row["load_rss_bytes"] / file_bytes, 3)
        row["predicted_load_bytes"] = predicted_load_bytes(str(ckpt), quantize)
        rows.append(row)
        print(json.dumps(row))

    RESULTS.mkdir(exist_ok=True)
    previous = {}
    stem = "load_memory" if args.model == "tinyllama" else f"load_memory_{args.model}"
    json_path = RESULTS / f"{stem}.json"
    if json_path.is_file():
        previous = {r["quantize"]: r for r in json.loads(json_path.read_text())["runs"]}
    previous.update({r["quantize"]: r for r in rows})
    record = {
        "benchmark": ("streaming load of a random TinyLlama-1.1B-shaped bf16 checkpoint" if args.model == "tinyllama"
                      else f"streaming load of a random OLMoE-layout mixture of experts in bf16 shards: {MOE_SHAPE}"),
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {torch.get_num_threads()} threads",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": (f"python benchmarks/memory/load_memory.py --model {args.model} --quantize "
                    + " ".join(args.quantize)),
        "runs": list(previous.values()),
    }
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    gib = 1024**3
    lines = [
        f"# Streaming load, {'TinyLlama-1.1B shape' if args.model == 'tinyllama' else 'an OLMoE-layout MoE (1.3B)'} "
        f"({record['date']}, {record['machine']}, torch {record['torch']})",
        "",
        f"Reproduce: `{record['command']}`. Load RSS = peak RSS of the child minus its RSS before loading (libraries already imported). Goal for nf4: RSS / model <= 1.3.",
        "",
        "| base | checkpoint (GiB) | model in memory (GiB) | load peak RSS (GiB) | estimate's load prediction (GiB) "
        "| RSS / model | RSS / checkpoint | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record["runs"]:
        predicted = f"{r['predicted_load_bytes'] / gib:.3f}" if "predicted_load_bytes" in r else "n/a"
        lines.append(
            f"| {r['quantize']} | {r['checkpoint_bytes'] / gib:.3f} | {r['model_bytes'] / gib:.3f} | "
            f"{r['load_rss_bytes'] / gib:.3f} | {predicted} | {r['load_rss_over_model']} | "
            f"{r['load_rss_over_checkpoint']} | {r['load_seconds']} |"
        )
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
