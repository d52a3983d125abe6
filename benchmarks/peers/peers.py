"""Our LoRA/QLoRA vs peer libraries at the presets' settings: tokens/s and whole-run peak RSS, one run per process.

    bash benchmarks/peers/peer_envs.sh                      # once: venvs for LitGPT and torchtune under benchmarks/_work/
    python benchmarks/peers/peers.py --checkpoint_dir /path/SmolLM2-135M-Instruct --peers peft litgpt torchtune
    python benchmarks/peers/peers.py --checkpoint_dir D --peers torchtune --quantize        # QLoRA vs torchtune QLoRA

Ours runs as users run it: `python -m lit_qlora.cli finetune` (`litqlora finetune`) in a child, on the dataset
shipped with lit-qlora packed to --seq tokens (`--data.packing true`), micro-batch = global batch = --batch, so a
step holds the peers' batch x seq tokens (less the packs' unfilled tails: SmolLM2 4x512 packs average 480 of 512
tokens, and only real tokens count in our tokens/s). Its tokens/s is the median of metrics.jsonl's per-step
tokens_per_sec after the first step; its peak RSS is summary.json's peak_rss_bytes, the whole process: load, both
validations, the steps and the final/ exports (peak_rss_train_bytes, load to the last step, is recorded beside
it). --compile true|false is passed to finetune only when given. The peers' parent draws their token batches once
(seed 0, steps x batch x seq, the checkpoint's vocabulary) and writes them to benchmarks/_work/, and every peer
child reads that file, so the peers train on the same tokens whatever their torch (ours trains on other tokens:
its first loss is not comparable with theirs).

Every side: the same Hugging Face checkpoint in bf16 (--dtype fp32: fp32, what `--precision auto` picks on an AVX2
CPU), LoRA r=8, alpha=16, dropout --dropout (default 0.05, the presets' value) on the adapters' input on q, k, v, o,
gate, up, down and lm_head, torch's fused AdamW (lr 1e-4, betas 0.9/0.95, no weight decay; ours keeps its 1-step warmup + cosine schedule, the peers a constant lr: neither
changes step time or memory), gradient clipping at 1.0, activation checkpointing per block unless
--no_checkpointing. Peers: every token a target, tokens/s excludes the first step, peak RSS is the child's VmHWM
(load included). The peers' first-step losses agree to ~4e-3 at any dropout: LoRA B starts at 0, so the dropout
masks do not reach the first forward. The sides alternate over --rounds.

- ours: `litqlora finetune --quantize none` (LoRA) or `nf4` (QLoRA, --quantize): Lightning Trainer +
  FinetuneModule (chunked CE), our LoRA dropout.
- peft: transformers + peft in this interpreter; the model's own CE over full logits; non-reentrant gradient
  checkpointing. With --quantize it is skipped: peft 4-bit needs bitsandbytes, which has no CPU path here.
- litgpt (venv-litgpt): `convert_hf_checkpoint` into benchmarks/_work/litgpt-* (a tied embedding becomes an
  untied lm_head copy), `litgpt.lora.GPT` built in a bf16-true Fabric and loaded as its finetune/lora.py does, its
  chunked CE (lm_head_chunk_size=128), blocks wrapped with torch's checkpoint_wrapper as its FSDP path does.
  Skipped with --quantize (its QLoRA is bitsandbytes-only).
- torchtune (venv-torchtune): `FullModelHFCheckpointer` (HF -> torchtune weights, all read before the model is
  built, as in its lora_finetune_single_device recipe), `lora_llama3` with the dims of config.json (llama3's
  builder, not llama2's: it takes rope_base; its output is untied, so a tied embedding is copied there),
  CEWithChunkedOutputLoss and `set_activation_checkpointing` as in that recipe; --quantize: quantize_base=True
  (the output/lm_head base stays bf16 there).

Results: benchmarks/peers/results/peers.{json,md} (--results_dir for scratch runs). A tiny checkpoint for a smoke run:
`python benchmarks/peers/peers.py --write_tiny DIR` (needs lit_qlora; LoRA B = 0, so every peer's first loss is the
base model's loss on the same batch and must agree; ours needs a tokenizer there, which DIR lacks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "memory"))
from train_memory import loadavg  # noqa: E402  (stdlib only: also importable in the peers' venvs)

HERE = Path(__file__).resolve().parent
WORK = HERE.parent / "_work"
PYTHONS = {"peft": sys.executable, "litgpt": str(WORK / "venv-litgpt/bin/python"),
           "torchtune": str(WORK / "venv-torchtune/bin/python")}
DISTS = {"ours": ["torch", "lightning", "torchao", "lit-qlora"], "peft": ["torch", "transformers", "peft"],
         "litgpt": ["torch", "litgpt", "lightning"], "torchtune": ["torch", "torchtune", "torchao"]}
SKIP_QUANTIZED = {"peft": "4-bit peft needs bitsandbytes, which has no CPU path here",
                  "litgpt": "LitGPT's QLoRA (--quantize bnb.nf4) needs bitsandbytes, which has no CPU path here"}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def vmhwm_bytes() -> int:
    """Peak RSS so far (VmHWM); read directly because the peers' venvs have no lit_qlora."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


# --dtype: each side's compute dtype, as its own API names it
TORCH_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}
PRECISION = {"bf16": "bf16-true", "fp32": "32-true"}


def hf_config(args) -> dict:
    return json.loads((Path(args.checkpoint_dir) / "config.json").read_text())


def peft_model(args, seq: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint_dir, dtype=getattr(torch, TORCH_DTYPE[args.dtype]))
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=args.dropout, target_modules=HF_TARGETS))
    return model, lambda ids: model(input_ids=ids, labels=ids).loss, "LoRA on every linear incl. lm_head"


def litgpt_convert(args) -> Path:
    """LitGPT's own HF -> LitGPT conversion, cached per checkpoint; run before the timed children (one-time cost)."""
    import litgpt.config
    from litgpt.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    src = Path(args.checkpoint_dir).resolve()
    out = WORK / f"litgpt-{src.name}-{hashlib.sha1(str(src).encode()).hexdigest()[:8]}-{args.dtype}"
    if (out / "lit_model.pth").is_file():
        return out
    # convert_hf_checkpoint looks the architecture up by name; our random/tiny dirs have none, so register a Llama
    # entry with config.json's dims (the same fields LitGPT's own SmolLM2/TinyLlama entries set).
    hf = hf_config(args)
    litgpt.config.name_to_config[out.name] = dict(
        name=out.name, hf_config=dict(org="local", name=out.name), block_size=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"], padded_vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"], n_embd=hf["hidden_size"], n_query_groups=hf["num_key_value_heads"],
        head_size=hf.get("head_dim"), rotary_percentage=1.0, parallel_residual=False, bias=False,
        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=hf["intermediate_size"],
        rope_base=hf.get("rope_theta", 10000.0), norm_eps=hf["rms_norm_eps"])
    tmp = out.with_name(out.name + ".tmp")  # renamed when complete, so a killed conversion is never reused
    tmp.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*.safetensors*"):  # the converter writes next to its inputs: link them, not copy
        (tmp / f.name).unlink(missing_ok=True)
        (tmp / f.name).symlink_to(f)
    convert_hf_checkpoint(tmp, model_name=out.name, dtype=TORCH_DTYPE[args.dtype])
    tmp.rename(out)
    return out


def litgpt_model(args, seq: int):
    import lightning as L
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
    from litgpt.utils import chunked_cross_entropy, load_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.nn import ModuleList

    out = litgpt_convert(args)
    config = Config.from_file(out / "model_config.yaml", lora_r=8, lora_alpha=16, lora_dropout=args.dropout,
                              lora_query=True, lora_key=True, lora_value=True, lora_projection=True, lora_mlp=True,
                              lora_head=True)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=PRECISION[args.dtype])
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    mark_only_lora_as_trainable(model)
    load_checkpoint(fabric, model, out / "lit_model.pth", strict=False)
    if args.checkpointing:
        model.transformer.h = ModuleList(checkpoint_wrapper(b, preserve_rng_state=False) for b in model.transformer.h)
    model.max_seq_length = seq
    model = fabric.setup_module(model)

    def loss_of(ids):
        logits = model(ids, lm_head_chunk_size=128)
        logits[-1] = logits[-1][..., :-1, :]
        return chunked_cross_entropy(logits, ids[..., 1:])

    note = "LoRA on fused qkv (q, k, v), proj, MLP and lm_head"
    if hf_config(args).get("tie_word_embeddings"):
        note += "; the converter copies the tied embedding into an untied lm_head"
    return model, loss_of, note


def torchtune_model(args, seq: int):
    import torch
    from torchtune import modules, training
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.modules.peft import get_adapter_params, set_trainable_params
    from torchtune.training import FullModelHFCheckpointer

    hf = hf_config(args)
    files = sorted(p.name for p in Path(args.checkpoint_dir).glob("*.safetensors"))
    state = FullModelHFCheckpointer(checkpoint_dir=args.checkpoint_dir, checkpoint_files=files, model_type="LLAMA3",
                                    output_dir=str(WORK / "torchtune-out")).load_checkpoint()[training.MODEL_KEY]
    note = "LoRA on q, k, v, output_proj, MLP and output (lm_head)"
    if "output.weight" not in state:  # a tied checkpoint: lora_llama3 has an untied output
        state["output.weight"] = state["tok_embeddings.weight"]
        note += "; tied embedding copied into an untied output"
    if args.quantize:
        note += "; output (lm_head) base stays bf16: torchtune quantizes only the blocks' linears"
    with training.set_default_dtype(getattr(torch, TORCH_DTYPE[args.dtype])), torch.device("cpu"):
        model = lora_llama3(
            ["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, apply_lora_to_output=True,
            vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            num_kv_heads=hf["num_key_value_heads"], embed_dim=hf["hidden_size"],
            max_seq_len=hf["max_position_embeddings"], intermediate_dim=hf["intermediate_size"],
            norm_eps=hf["rms_norm_eps"], rope_base=hf.get("rope_theta", 10000.0), lora_rank=8, lora_alpha=16,
            lora_dropout=args.dropout, quantize_base=args.quantize)
    set_trainable_params(model, get_adapter_params(model))
    if args.checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any("lora" not in k for k in missing):
        raise RuntimeError(f"torchtune weights did not map: missing {missing}, unexpected {unexpected}")
    del state
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)

    def loss_of(ids):  # the recipe's shift: labels move left by one and the last position is ignored
        pad = torch.full((ids.shape[0], 1), loss_fn.ignore_index, dtype=ids.dtype)
        return loss_fn(model(ids), torch.hstack((ids[..., 1:], pad)))

    return model, loss_of, note


def peer_child(args) -> None:
    import torch
    from safetensors.torch import load_file

    if args.prepare:
        return print(json.dumps({"prepared": str(PREPARE[args.child](args))}))
    batches = load_file(args.batches)["input_ids"]
    before = vmhwm_bytes()
    torch.manual_seed(0)
    model, loss_of, note = globals()[f"{args.child}_model"](args, batches.shape[-1])
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)  # as ours
    load_before = loadavg()
    seconds, losses = [], []
    for ids in batches:
        t0 = time.perf_counter()
        loss = loss_of(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        losses.append(round(loss.item(), 4))
    print(json.dumps({
        "config": args.child, "peak_rss_bytes": vmhwm_bytes(), "rss_before_load_bytes": before,
        "tokens_per_sec": batches[0].numel() * (len(seconds) - 1) / sum(seconds[1:]) if len(seconds) > 1 else None,
        "step_seconds": [round(s, 2) for s in seconds], "losses": losses,
        "trainable_params": sum(p.numel() for p in params), "trainable_dtypes": sorted({str(p.dtype) for p in params}),
        "note": note,
        "loadavg_before": load_before, "loadavg_after": loadavg(),
    }))


PREPARE = {"litgpt": litgpt_convert}


def ours_child(args) -> None:
    """`litqlora finetune` on the shipped dataset packed to --seq tokens; numbers from its metrics.jsonl and
    summary.json (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="peers-ours-") as out:
        cmd = [sys.executable, "-m", "lit_qlora.cli", "finetune", "--checkpoint_dir", args.checkpoint_dir,
               "--quantize", "nf4" if args.quantize else "none", "--out_dir", out, "--train.max_steps", str(args.steps),
               "--train.micro_batch_size", str(args.batch), "--train.global_batch_size", str(args.batch),
               "--train.max_seq_length", str(args.seq), "--data.packing", "true", "--lora.dropout", str(args.dropout),
               "--train.activation_checkpointing", str(args.checkpointing).lower(), "--train.warmup_steps", "1",
               "--train.lr", "1e-4", "--lora.r", "8", "--lora.alpha", "16", "--precision", PRECISION[args.dtype]]
        cmd += ["--compile", args.compile] if args.compile else []
        load_before = loadavg()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines() if line.strip()]
        summary = json.loads(Path(out, "summary.json").read_text())
    print(json.dumps({
        "config": "nf4" if args.quantize else "none", "peak_rss_bytes": summary["peak_rss_bytes"],
        "peak_rss_train_bytes": summary["peak_rss_train_bytes"],
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in rows[1:]),
        "tokens_per_step": [r["tokens"] for r in rows],
        "step_seconds": [round(r["tokens"] / r["tokens_per_sec"], 2) for r in rows],
        "losses": [round(r["loss"], 4) for r in rows], "trainable_params": summary["trainable_params"],
        "wall_seconds": round(summary["wall_seconds"], 1), "command": " ".join(cmd[1:]).replace(out, "TMP"),
        "loadavg_before": load_before, "loadavg_after": loadavg(),
    }))


def write_tiny(path: Path) -> None:
    """2 layers, width 256, vocab 512, tied embeddings, SmolLM2's numerics; weights ~N(0, 0.1) (norms ~1) so the
    base loss depends on every weight. Widths satisfy torchao's NF4 block sizes (64 x 256 per weight)."""
    import torch

    from lit_qlora.checkpoint.hf import save_hf_checkpoint

    from lit_qlora.checkpoint.files import TensorSpec
    from lit_qlora.model.presets import preset
    from lit_qlora.model.transformer import Transformer

    config = preset("SmolLM2-135M").replace(name="tiny", vocab_size=512, n_layer=2, n_embd=256, n_head=4,
                                                      n_query_groups=2, head_dim=64, intermediate_size=512)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in Transformer(config).state_dict().items() if n != "lm_head.weight"}
    gen = torch.Generator().manual_seed(0)

    def produce(name):
        return lambda: (float(name.endswith("norm.weight")) + torch.randn(shapes[name], generator=gen) * 0.1).bfloat16()

    save_hf_checkpoint(path, config, [TensorSpec(n, s, torch.bfloat16, produce(n)) for n, s in shapes.items()])


def versions(side: str) -> dict:
    code = "import importlib.metadata as m, json, sys; print(json.dumps({d: m.version(d) for d in sys.argv[1:]}))"
    python = sys.executable if side == "ours" else PYTHONS[side]
    return json.loads(subprocess.run([python, "-c", code, *DISTS[side]], check=True, capture_output=True,
                                     text=True).stdout)


def write_batches(args) -> Path:
    """steps x batch x seq tokens, drawn per step exactly as train_memory.py draws its own (seed 0)."""
    import torch
    from safetensors.torch import save_file

    vocab = hf_config(args)["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randint(0, vocab, (args.batch, args.seq), generator=gen) for _ in range(args.steps)])
    path = WORK / f"batches-{Path(args.checkpoint_dir).name}-{args.steps}x{args.batch}x{args.seq}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": ids}, str(path))
    return path


def run(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir")
    parser.add_argument("--peers", nargs="+", default=["peft", "litgpt", "torchtune"], choices=list(PYTHONS))
    parser.add_argument("--quantize", action="store_true", help="ours QLoRA (NF4) vs the peers' QLoRA")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no_checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--dtype", choices=list(PRECISION), default="bf16",
                        help="every side's compute dtype: bf16, or fp32 (what --precision auto picks on an AVX2 CPU)")
    parser.add_argument("--dropout", type=float, default=0.05, help="LoRA dropout on every side (presets: 0.05)")
    parser.add_argument("--compile", choices=["true", "false"], help="ours: passed to `finetune --compile` when given")
    parser.add_argument("--results_dir", type=Path, default=HERE / "results")
    parser.add_argument("--write_tiny", type=Path, help="write a tiny random checkpoint there and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_tiny:
        return write_tiny(args.write_tiny)
    if args.child:
        return ours_child(args) if args.child == "ours" else peer_child(args)
    if not args.checkpoint_dir or args.steps < 2:
        parser.error("--checkpoint_dir is required, and --steps >= 2 (tokens/s excludes the first step)")

    common = ["--checkpoint_dir", args.checkpoint_dir, "--dropout", str(args.dropout), "--dtype", args.dtype]
    common += [] if args.checkpointing else ["--no_checkpointing"]
    ours = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    ours += ["--compile", args.compile] if args.compile else []
    sides = {"ours": [sys.executable, str(HERE / "peers.py"), *common, *ours, "--child", "ours"]}
    sides["ours"] += ["--quantize"] if args.quantize else []
    common += ["--batches", str(write_batches(args))]
    skipped = {p: SKIP_QUANTIZED[p] for p in args.peers if args.quantize and p in SKIP_QUANTIZED}
    for peer in args.peers:
        if peer not in skipped:
            if not Path(PYTHONS[peer]).is_file():
                raise SystemExit(f"{PYTHONS[peer]} is missing: run `bash benchmarks/peers/peer_envs.sh` first")
            sides[peer] = [PYTHONS[peer], str(HERE / "peers.py"), *common, "--child", peer]
            sides[peer] += ["--quantize"] if args.quantize else []
    for peer in PREPARE.keys() & sides.keys():
        run(sides[peer] + ["--prepare"])
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for _ in range(args.rounds if len(sides) > 1 else 0):  # ours alone compares with nothing
        for side, cmd in sides.items():
            runs[side].append(run(cmd))
            print(side, json.dumps(runs[side][-1]), flush=True)
    record_results(args, started, runs, skipped)


def record_results(args, started: str, runs: dict[str, list[dict]], skipped: dict[str, str]) -> None:
    import torch

    med = {s: {k: statistics.median(r[k] for r in rs) for k in ("peak_rss_bytes", "peak_rss_train_bytes",
                                                                 "tokens_per_sec") if k in rs[0]}
           for s, rs in runs.items() if rs}
    command = " ".join(["python benchmarks/peers/peers.py --checkpoint_dir", args.checkpoint_dir, "--peers", *args.peers,
                        "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--rounds",
                        str(args.rounds), "--dropout", str(args.dropout), "--dtype", args.dtype]
                       + (["--quantize"] if args.quantize else [])
                       + ([] if args.checkpointing else ["--no_checkpointing"])
                       + (["--compile", args.compile] if args.compile else []))
    path = args.results_dir / "peers.json"
    record = json.loads(path.read_text()) if path.is_file() else {"rows": {}}
    record.update({"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {torch.get_num_threads()} "
                              "torch threads (CPU)", "python": platform.python_version()})
    mode = "QLoRA" if args.quantize else "LoRA"
    ours_versions = versions("ours") if med else None
    for peer in args.peers:
        row = {"checkpoint": Path(args.checkpoint_dir).name, "batch": args.batch, "seq": args.seq,
               "checkpointing": args.checkpointing, "dropout": args.dropout, "compile": args.compile, "mode": mode,
               "peer": peer, "ours_via": "litqlora finetune", "started": started, "command": command}
        if peer in skipped:
            row["skipped"] = skipped[peer]
        else:
            m = {"ours": med["ours"], peer: med[peer]}
            row.update(medians=m, runs={"ours": runs["ours"], peer: runs[peer]},
                       versions={"ours": ours_versions, peer: versions(peer)},
                       tokens_per_sec_ours_over_peer=round(m["ours"]["tokens_per_sec"] / m[peer]["tokens_per_sec"], 3),
                       peak_rss_ours_over_peer=round(m["ours"]["peak_rss_bytes"] / m[peer]["peak_rss_bytes"], 3))
        key = (f"{row['checkpoint']} {args.batch}x{args.seq} ckpt={'on' if args.checkpointing else 'off'} "
               f"dropout={args.dropout} compile={args.compile or '-'} {peer} {mode}")
        record["rows"][key] = row
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    (args.results_dir / "peers.md").write_text(markdown(record))


def markdown(record: dict) -> str:
    gib = 1024**3
    lines = [f"# Ours vs peer libraries, LoRA and QLoRA ({record['machine']}, Python {record['python']})", "",
             "Same checkpoint, LoRA rank/targets/dropout, micro-batch, sequence length and checkpointing; medians of "
             "alternating runs, one process each; peak RSS = whole run (VmHWM). Ours runs `litqlora finetune` on the "
             "shipped dataset packed to S tokens (its peak: the whole process, validations and exports included); the "
             "peers read one file of random token batches (rows with dropout 0 are older runs of an in-process child "
             "of ours on those batches). **Goal: ours >= 1.5x the peer's tokens/s at <= 0.8x its peak RSS.** Ratios "
             "are ours / peer. The peers' first-step losses must agree (same weights and batch, LoRA B = 0, so "
             "dropout does not reach the first forward). Versions and notes below the table.",
             "", "| checkpoint | BxS | act. ckpt | dropout | compile | mode | peer | tok/s ours / peer | ratio "
             "| peak GiB ours / peer "
             "| ratio | goal met | first loss ours / peer | trainable ours / peer "
             "| loadavg 1 min (ours, peer; each run) | started | reproduce |",
             "|---|---|---|---|---|---|---|---:|---:|---:|---:|---|---|---|---|---|---|"]
    notes = []
    for key, r in record["rows"].items():
        head = (f"| {r['checkpoint']} | {r['batch']}x{r['seq']} | {'on' if r['checkpointing'] else 'off'} | "
                f"{r.get('dropout', 0.0)} | {r.get('compile') or '-'} | {r['mode']} | {r['peer']} |")
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']} | | | | | | | | {r['started']} | `{r['command']}` |")
            continue
        o, p = r["runs"]["ours"], r["runs"][r["peer"]]
        mo, mp = r["medians"]["ours"], r["medians"][r["peer"]]
        met = r["tokens_per_sec_ours_over_peer"] >= 1.5 and r["peak_rss_ours_over_peer"] <= 0.8
        lines.append(f"{head} {mo['tokens_per_sec']:.1f} / {mp['tokens_per_sec']:.1f} | "
                     f"{r['tokens_per_sec_ours_over_peer']} | {mo['peak_rss_bytes'] / gib:.2f} / "
                     f"{mp['peak_rss_bytes'] / gib:.2f} | {r['peak_rss_ours_over_peer']} | {'yes' if met else 'no'} | "
                     f"{o[0]['losses'][0]} / {p[0]['losses'][0]} | {o[0]['trainable_params']:,} / "
                     f"{p[0]['trainable_params']:,} | {' '.join(str(x['loadavg_before'][0]) for x in o)}; "
                     f"{' '.join(str(x['loadavg_before'][0]) for x in p)} | {r['started']} | `{r['command']}` |")
        train_peak = (f" Ours' peak through its last step: {mo['peak_rss_train_bytes'] / gib:.2f} GiB; "
                      f"`{o[0]['command']}`." if "peak_rss_train_bytes" in mo else "")
        notes.append(f"- {key}: ours {r['versions']['ours']}; {r['peer']} {r['versions'][r['peer']]}. "
                     f"{r['peer']}: {p[0]['note']}; trainable dtypes {', '.join(p[0]['trainable_dtypes'])}."
                     + train_peak)
    return "\n".join(lines + ["", "Versions and notes:", ""] + notes) + "\n"


if __name__ == "__main__":
    main()
