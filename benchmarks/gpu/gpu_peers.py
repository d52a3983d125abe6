"""The peers' LoRA/QLoRA on one CUDA GPU (issue 28 item 4), each run one process in the peer's own venv.

    WHEELS=.devcarry/peers bash benchmarks/gpu/gpu_peer_envs.sh     # once per machine (online: without WHEELS)
    python benchmarks/gpu/gpu_peers.py --out gpu_peers.json [--time_budget 540] [--eager] [--ours]
    python benchmarks/gpu/gpu_peers.py --runs --ours                 # ours alone, on the same checkpoint
    python benchmarks/gpu/gpu_peers.py --device cpu --preset tiny --seq 64 --steps 3   # smoke test
This process writes the checkpoint with lit_qlora (from this tree; it needs torchao 0.18 importable).

Every run: a random bf16 HF checkpoint of --preset's shape (gpu_suite.write_random_checkpoint, shared with
gpu_suite.py under --work; tiny: peers.py's write_tiny), the same token batches (drawn once here, seed
0, steps x batch x seq in the vocabulary, one file for every child; every token a target), LoRA r 8 / alpha 16 /
dropout 0.05 on q, k, v, o, gate, up, down and lm_head where the peer adapts it (the row's `adapts`), activation
checkpointing per block, bf16, micro-batch 2 x 2048, torch's fused AdamW on the adapters (lr 1e-4, betas 0.9/0.95,
no weight decay), gradient clipping at 1.0 (ours' default; torchtune's configs leave it off).
- torchtune (qlora-compile, lora-compile; -eager with --eager): lora_finetune_single_device's steps for llama3_1, in
  its order: FullModelHFCheckpointer, qlora_llama3_1_8b / lora_llama3_1_8b built on the device in bf16 (other dims:
  lora_llama3_1 / lora_llama3 from config.json), adapters trainable, training.compile_model, set_activation_
  checkpointing, load_state_dict (QLoRA: the blocks' linears quantized to NF4 there; output stays bf16),
  CEWithChunkedOutputLoss (training.compile_loss), its label shift, (loss x tokens).backward() and scale_grads.
- peft-bnb (qlora; bitsandbytes in its venv, transformers and peft the base's): from_pretrained with
  BitsAndBytesConfig(nf4, double quant, bf16 compute) on the GPU (lm_head stays bf16), gradient_checkpointing_enable
  (use_reentrant False; --peft_prepare kbit: prepare_model_for_kbit_training, which also upcasts every non-4-bit
  weight to fp32), get_peft_model (fp32 adapters: peft's autocast_adapter_dtype), the model's own loss. Variant lora:
  a bf16 base, no bitsandbytes (a cross-check).
- unsloth (qlora, where its venv installed): FastLanguageModel in 4 bits, LoRA on the 7 projections.
- ours (--ours, after the peers): `litqlora finetune` via gpu_suite.run, same checkpoint, its packed synthetic rows;
  its training peak runs from load to the last step.
Per row: tokens/s = median over the steps after the first (the first step's seconds apart: compile, warm-up);
torch.cuda max_memory_allocated/reserved from a reset before the first step (train) and for the whole process;
VmHWM; GPU; versions; losses (LoRA B = 0: the first is the base model's on the same batch; the peers' must agree to
bf16/NF4 rounding). Runs go in order; one that would start after --time_budget s (from this script's start) is `not
run: time budget`; a child is killed after --child_timeout or at the budget's end (finished steps stay in the row).
Children run without PYTHONPATH (a torchao there would shadow the torchtune venv's 0.15).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PYTHONS = {p: HERE.parent / f"_work/gpu-venv-{v}/bin/python" for p, v in
           (("torchtune", "torchtune"), ("peft-bnb", "bnb"), ("unsloth", "unsloth"))}
DEFAULT_RUNS = ["torchtune:qlora-compile", "peft-bnb:qlora", "torchtune:lora-compile", "unsloth:qlora"]
VARIANTS = {"torchtune": ["qlora-compile", "lora-compile", "qlora-eager", "lora-eager"],
            "peft-bnb": ["qlora", "lora"], "unsloth": ["qlora"]}
DISTS = {"torchtune": ["torch", "torchtune", "torchao", "datasets"],
         "peft-bnb": ["torch", "transformers", "peft", "bitsandbytes", "accelerate"],
         "unsloth": ["torch", "unsloth", "unsloth_zoo", "transformers", "peft", "bitsandbytes"],
         "ours": ["torch", "lightning", "torchao", "lit-qlora"]}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
LLAMA31_8B = dict(vocab_size=128256, num_layers=32, num_heads=32, num_kv_heads=8, embed_dim=4096,
                  max_seq_len=131072, intermediate_dim=14336, norm_eps=1e-5, rope_base=500000)
TAG = "GPU_PEERS "  # prefixes the child's JSON lines on stdout


class NotRun(Exception):
    """The peer cannot run here; the row says why."""


def dist_versions(names: list[str]) -> dict:
    import importlib.metadata as md

    def version(name):  # the first on sys.path, as imports find it
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {n: version(n) for n in names}


def hf_config(ckpt) -> dict:
    return json.loads((Path(ckpt) / "config.json").read_text())


# ---- children: stdlib, torch and the peer's own libraries only (no lit_qlora in the peers' venvs) ----

def datasets_or_stub() -> str | None:
    """`import torchtune` imports `datasets` for its dataset builders only; where that fails (the carried wheel may
    not suit the GPU image's pyarrow), a stub stands in, and the row's note says so."""
    try:
        import datasets  # noqa: F401
    except Exception as e:  # noqa: BLE001
        stub, dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        stub.load_dataset, dist.split_dataset_by_node, stub.distributed = None, None, dist
        sys.modules.update({"datasets": stub, "datasets.distributed": dist})
        return f"datasets stubbed ({type(e).__name__}: {e})"


def torchtune_model(args, device, quantize: bool, compiled: bool):
    import torch

    stubbed = datasets_or_stub()
    from torchtune import modules, training
    from torchtune.models import llama3, llama3_1
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.modules.peft import (get_adapter_params, set_trainable_params,
                                        validate_missing_and_unexpected_for_lora)
    from torchtune.training import FullModelHFCheckpointer

    hf = hf_config(args.checkpoint_dir)
    state = None
    if not args.random_init:  # (--random_init, a profile: the weights as the builders initialize them, no load)
        files = sorted(p.name for p in Path(args.checkpoint_dir).glob("*.safetensors"))
        state = FullModelHFCheckpointer(checkpoint_dir=str(args.checkpoint_dir), checkpoint_files=files,
                                        model_type="LLAMA3", output_dir=str(Path(args.batches).parent / "torchtune-out"),
                                        ).load_checkpoint()[training.MODEL_KEY]
    attn = ["q_proj", "k_proj", "v_proj", "output_proj"]
    lora = dict(lora_attn_modules=attn, apply_lora_to_mlp=True, apply_lora_to_output=True, lora_rank=8,
                lora_alpha=16, lora_dropout=args.dropout)
    dims = dict(vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                num_kv_heads=hf["num_key_value_heads"], embed_dim=hf["hidden_size"],
                max_seq_len=hf["max_position_embeddings"], intermediate_dim=hf["intermediate_size"],
                norm_eps=hf["rms_norm_eps"], rope_base=int(hf.get("rope_theta", 10000)))
    scaling = hf.get("rope_scaling") or {}
    with training.set_default_dtype(torch.bfloat16), device:  # the recipe's _setup_model, step by step
        if scaling.get("rope_type") == "llama3" and dims == LLAMA31_8B and scaling.get("factor") == 8:
            builder = "qlora_llama3_1_8b" if quantize else "lora_llama3_1_8b"
            model = getattr(llama3_1, builder)(**lora)
        elif scaling.get("rope_type") == "llama3":
            builder = "lora_llama3_1 with config.json's dims"
            model = llama3_1.lora_llama3_1(**dims, scale_factor=int(scaling["factor"]), **lora, quantize_base=quantize)
        else:
            builder = "lora_llama3 with config.json's dims"
            model = llama3.lora_llama3(**dims, **lora, quantize_base=quantize)
    set_trainable_params(model, get_adapter_params(model))
    if compiled:
        training.compile_model(model, verbose=False)
    training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    if state is not None:
        if "output.weight" not in state:  # a tied checkpoint: torchtune's llama3 output is untied
            state["output.weight"] = state["tok_embeddings.weight"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        validate_missing_and_unexpected_for_lora(attn, True, True, missing, unexpected, None, None)
        del state
    loss_fn = CEWithChunkedOutputLoss()
    if compiled:
        loss_fn = training.compile_loss(loss_fn, verbose=False)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    ignore = torch.full((args.batch, 1), loss_fn.ignore_index, device=device)

    def step(ids):  # the recipe's _loss_step and token-count scaling, one micro-batch per step
        labels = torch.hstack((ids[..., 1:], ignore[: ids.shape[0]]))
        tokens = (ids != loss_fn.ignore_index).sum()
        loss = loss_fn(model(ids), labels)
        (loss * tokens).backward()
        training.scale_grads(model, 1 / tokens)
        return loss.detach()

    base = "NF4 base on the blocks' linears, output's base bf16" if quantize else "bf16 base"
    return (model, step, f"LoRA on q, k, v, output_proj, w1/w2/w3 (MLP), output (lm_head); {base}",
            f"builder {builder}" + (f"; {stubbed}" if stubbed else ""))


def hf_step(model):
    def step(ids):  # the model's own loss over full logits (it shifts the labels itself)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    return step


def peft_model(args, device, quantize: bool, compiled: bool):
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw = {"device_map": {"": device.index or 0}} if device.type == "cuda" else {}
    if quantize:
        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_use_double_quant=True,
                                                       bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint_dir, dtype=torch.bfloat16, **kw)
    model.config.use_cache = False
    gc, kbit = {"use_reentrant": False}, args.peft_prepare == "kbit" and quantize
    if kbit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                gradient_checkpointing_kwargs=gc)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=args.dropout, target_modules=HF_TARGETS,
                                             task_type="CAUSAL_LM"))
    base = ("bitsandbytes NF4 (double quant) on the blocks' linears, lm_head " + ("fp32" if kbit else "bf16")
            if quantize else "bf16 base")
    return (model, hf_step(model), f"LoRA on q, k, v, o, gate, up, down, lm_head; {base}",
            "prepared by " + ("prepare_model_for_kbit_training" if kbit else "gradient_checkpointing_enable"))


def unsloth_model(args, device, quantize: bool, compiled: bool):
    try:
        import unsloth  # noqa: F401 - before transformers, as unsloth requires
        from unsloth import FastLanguageModel
    except Exception as e:  # noqa: BLE001
        raise NotRun(f"unsloth does not import ({type(e).__name__}: {str(e)[:200]})") from e
    import torch

    model, _ = FastLanguageModel.from_pretrained(str(args.checkpoint_dir), max_seq_length=args.seq,
                                                 dtype=torch.bfloat16, load_in_4bit=quantize)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, lora_dropout=args.dropout,
                                             target_modules=HF_TARGETS[:-1], use_gradient_checkpointing=True)
    return model, hf_step(model), "LoRA on q, k, v, o, gate, up, down (no lm_head); 4-bit base", "FastLanguageModel"


def child(args) -> None:
    import torch
    from safetensors.torch import load_file

    def emit(**kw):
        print(TAG + json.dumps(kw), flush=True)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    peaks = (lambda: (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())) if cuda else (
        lambda: (None, None))
    batches = load_file(args.batches)["input_ids"]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    build = {"torchtune": torchtune_model, "peft-bnb": peft_model, "unsloth": unsloth_model}[args.child]
    try:
        model, step, adapts, note = build(args, device, args.variant.startswith("qlora"), "compile" in args.variant)
    except NotRun as e:
        return emit(not_run=str(e), versions=dist_versions(DISTS[args.child]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    load_seconds, load = time.perf_counter() - t0, peaks()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds, losses = [], []
    for i, ids in enumerate(batches):
        t = time.perf_counter()
        loss = step(ids.to(device))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t)
        emit(step=i, seconds=round(seconds[-1], 3), loss=losses[-1])
    if args.profile:  # one more step, profiled (issue 48 item 2): its Chrome trace for kernel_table.py
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities, record_shapes=True) as prof:
            with record_function("step"):
                step(batches[-1].to(device))
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
        prof.export_chrome_trace(args.profile)
        emit(profiled=args.profile)
    train, tokens = peaks(), batches[0].numel()
    vmhwm = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    emit(result={
        "adapts": adapts, "note": note, "tokens_per_sec": round(statistics.median(tokens / s for s in seconds[1:]), 1),
        "first_step_seconds": round(seconds[0], 2), "step_seconds": [round(s, 3) for s in seconds], "losses": losses,
        "load_seconds": round(load_seconds, 1), "peak_allocated_train_bytes": train[0],
        "peak_reserved_train_bytes": train[1], "peak_allocated_bytes": max(load[0], train[0]) if cuda else None,
        "peak_reserved_bytes": max(load[1], train[1]) if cuda else None, "peak_rss_bytes": int(vmhwm.split()[1]) * 1024,
        "trainable_params": sum(p.numel() for p in params), "trainable_dtypes": sorted({str(p.dtype) for p in params}),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "versions": dist_versions(DISTS[args.child]), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")})


# ---- parent ----

def write_batches(ckpt: Path, work: Path, steps: int, batch: int, seq: int) -> Path:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    path = work / f"batches-{ckpt.name}-{steps}x{batch}x{seq}.safetensors"
    save_file({"input_ids": torch.randint(0, hf_config(ckpt)["vocab_size"], (steps, batch, seq), generator=gen)},
              str(path))
    return path


def run_child(cmd: list[str], timeout: float, why: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group: a timeout ends compile workers too
    try:
        out, err = proc.communicate(timeout=timeout)
        status = f"error: exit {proc.returncode}" if proc.returncode else None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        status = f"error: killed after {timeout:.0f} s ({why})"
    lines = []
    for x in (x for x in out.splitlines() if x.startswith(TAG)):
        try:
            lines.append(json.loads(x[len(TAG):]))
        except ValueError:  # a line cut by the kill
            pass
    row = next((x["result"] for x in lines if "result" in x), {})
    if lines and "not_run" in lines[-1]:
        row = {"status": "not run: " + lines[-1]["not_run"], "versions": lines[-1]["versions"]}
    elif not row or status:
        row.update(status=status or "error: no result", steps_done=[x for x in lines if "step" in x],
                   log_tail=err[-3000:])
    return row | {"wall_seconds": round(time.perf_counter() - started, 1)}


def run_ours(args, ckpt: Path, quantize: str) -> dict:
    import gpu_suite

    data = gpu_suite.write_dataset(args.work / "data.json")
    r = gpu_suite.run(ckpt, data, args.work / f"out-peers-{ckpt.name}-{quantize}-{args.ours_compile}", quantize,
                      args.batch, args.seq, args.steps, args.ours_compile, True)
    if r["rc"]:
        return {"status": "error: litqlora finetune failed", "log_tail": r["error"], "wall_seconds": r["wall_seconds"]}
    peaks = {k: r.get(k) for k in ("peak_allocated_train_bytes", "peak_reserved_train_bytes", "peak_allocated_bytes",
                                   "peak_reserved_bytes", "compile_seconds")}
    return {"adapts": "LoRA on q, k, v, o, gate, up, down, lm_head (litqlora's default)", "note": "litqlora finetune",
            "tokens_per_sec": r["steady_tokens_per_sec"], "losses": r["losses"], "wall_seconds": r["wall_seconds"],
            "first_step_seconds": round(args.batch * args.seq / r["first_step_tokens_per_sec"], 2), **peaks,
            "versions": dist_versions(DISTS["ours"])}


def table(results: dict) -> str:
    def gib(n) -> str:
        return f"{n / 2**30:.2f}" if isinstance(n, (int, float)) else "-"

    lines = [f"{results['device']}, torch {results['torch']}, {results['checkpoint']}, {results['batch']}x"
             f"{results['seq']}, {results['steps']} steps", "", "| peer | variant | tok/s (steps 2+) | first step s | "
             "peak allocated GiB (train / whole) | peak reserved GiB (train / whole) | first loss | wall s | adapts |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results["rows"]:
        head = f"| {r['peer']} | {r['variant']} |"
        if "tokens_per_sec" not in r:
            lines.append(f"{head} {r['status']} | | | | | {r.get('wall_seconds', '')} | |")
            continue
        lines.append(f"{head} {r['tokens_per_sec']} | {r['first_step_seconds']} | "
                     f"{gib(r['peak_allocated_train_bytes'])} / {gib(r['peak_allocated_bytes'])} | "
                     f"{gib(r['peak_reserved_train_bytes'])} / {gib(r['peak_reserved_bytes'])} | {r['losses'][0]} | "
                     f"{r['wall_seconds']} | {r['adapts']} |")
    notes = [f"- {r['peer']} {r['variant']}: {r.get('versions')}; {r.get('note', '')} {r.get('status', '')}"
             for r in results["rows"]]
    return "\n".join(lines + ["", "Versions and notes:", *notes]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="*", default=DEFAULT_RUNS, help=f"peer:variant, in order; {VARIANTS}")
    parser.add_argument("--eager", action="store_true", help="append torchtune:qlora-eager torchtune:lora-eager")
    parser.add_argument("--ours", action="store_true", help="then `litqlora finetune` nf4 and none (gpu_suite.run)")
    parser.add_argument("--ours_compile", choices=["true", "false"], help="ours: finetune --compile, when given")
    parser.add_argument("--preset", default="Llama-3.1-8B", help="a lit_qlora preset, or tiny (smoke tests)")
    parser.add_argument("--checkpoint_dir", type=Path, help="an existing HF checkpoint instead of --preset's")
    parser.add_argument("--tokenizer_dir", type=Path, default=ROOT / ".devcarry/kit/smol")
    parser.add_argument("--device", default="cuda")
    for name, default in (("batch", 2), ("seq", 2048), ("steps", 6)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--peft_prepare", choices=["gc", "kbit"], default="gc")
    parser.add_argument("--profile_dir", type=Path, help="each peer profiles one more step: DIR/PEER-VARIANT.json")
    parser.add_argument("--random_init", action="store_true",
                        help="torchtune: no checkpoint load, its builders' random weights (a profile needs no 16 GB "
                             "checkpoint; only config.json is written)")
    parser.add_argument("--time_budget", type=float, default=float("inf"), help="seconds; later runs are not started")
    parser.add_argument("--child_timeout", type=float, default=240, help="seconds; also cut at the budget's end")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_suite"), help="checkpoints and batches")
    parser.add_argument("--out", type=Path, default=Path("gpu_peers.json"), help="and the table beside it (.md)")
    for hidden in ("--child", "--variant", "--batches", "--profile"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.steps < 2 or (args.ours and args.device != "cuda"):
        parser.error("--steps >= 2 (tokens/s excludes the first step); --ours needs --device cuda")
    runs = [r.split(":") for r in args.runs + (["torchtune:qlora-eager", "torchtune:lora-eager"] if args.eager else [])]
    if bad := [":".join(r) for r in runs if len(r) != 2 or r[1] not in VARIANTS.get(r[0], [])]:
        parser.error(f"unknown runs {bad}; known: {VARIANTS}")
    runs += [("ours", "qlora"), ("ours", "lora")] if args.ours else []
    deadline = time.monotonic() + args.time_budget
    sys.path.insert(0, str(ROOT))  # lit_qlora for the checkpoint writers, without an install
    sys.path.insert(0, str(HERE.parent / "peers"))
    import gpu_suite
    import peers
    import torch

    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.checkpoint_dir:
        ckpt = args.checkpoint_dir
    elif args.preset == "tiny":  # peers.py's: 2 layers x 256, SmolLM2's numerics, vocabulary 512, no tokenizer
        ckpt = args.work / "tiny"
        if not (ckpt / "model.safetensors").is_file():
            peers.write_tiny(ckpt)
    elif args.random_init:  # config.json alone: torchtune builds the shape itself
        from lit_qlora.model.presets import preset

        ckpt = args.work / f"{args.preset.lower()}-config"
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "config.json").write_text(json.dumps(preset(args.preset).to_hf_config()))
    else:
        ckpt = gpu_suite.write_random_checkpoint(args.preset, args.work / args.preset.lower(), args.tokenizer_dir)
    batches = write_batches(Path(ckpt), args.work, args.steps, args.batch, args.seq)
    ready = round(time.perf_counter() - t0, 1)
    print(f"checkpoint {ckpt} and batches ready in {ready} s", flush=True)
    cuda = args.device == "cuda" and torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()  # the checkpoint writer's cached blocks: the children need the memory
    results = {"device": torch.cuda.get_device_name() if cuda else args.device, "torch": torch.__version__,
               "checkpoint": str(ckpt), "batch": args.batch, "seq": args.seq, "steps": args.steps,
               "checkpoint_seconds": ready, "command": " ".join(sys.argv), "rows": []}
    for peer, variant in runs:
        python, left = PYTHONS.get(peer), deadline - time.monotonic()
        if left <= 0:
            row = {"status": f"not run: time budget ({args.time_budget:.0f} s) spent"}
        elif peer == "ours":
            row = run_ours(args, Path(ckpt), "nf4" if variant == "qlora" else "none")
        elif not python.is_file():
            row = {"status": f"not run: {python.parent.parent.name} missing (gpu_peer_envs.sh did not install "
                             f"{peer}{': no wheel offline' if peer == 'unsloth' else ''})"}
        else:
            cmd = [str(python), __file__, "--child", peer, "--variant", variant, "--checkpoint_dir", str(ckpt),
                   "--batches", str(batches), "--device", args.device, "--batch", str(args.batch), "--seq",
                   str(args.seq), "--dropout", str(args.dropout), "--peft_prepare", args.peft_prepare]
            cmd += ["--random_init"] if args.random_init else []
            if args.profile_dir:
                args.profile_dir.mkdir(parents=True, exist_ok=True)
                cmd += ["--profile", str(args.profile_dir / f"{peer}-{variant}.json")]
            row = run_child(cmd, min(args.child_timeout, left),
                            "--child_timeout" if args.child_timeout <= left else "the time budget's end")
        results["rows"].append({"peer": peer, "variant": variant, **row})
        print(json.dumps(results["rows"][-1]), flush=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(md := table(results))
    print("\n" + md)


if __name__ == "__main__":
    main()
