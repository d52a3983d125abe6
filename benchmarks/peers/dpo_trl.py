"""`litqlora dpo` beside TRL's DPOTrainer (with peft) on this CPU: tokens/s and whole-process peak RSS, LoRA and QLoRA.

    bash benchmarks/peers/peer_envs.sh              # once: benchmarks/_work/venv-trl (TRL 1.16, peft, bitsandbytes)
    python benchmarks/peers/dpo_trl.py              # both modes, both sides, --steps 16, --rounds 2
    python benchmarks/peers/dpo_trl.py --quick      # 3 steps, 1 round, results to benchmarks/_work/dpo_trl-quick/
    python benchmarks/peers/dpo_trl.py --sides trl --modes qlora --quick      # one side / one mode only

Run it from the project's venv (ours runs in this interpreter; TRL in benchmarks/_work/venv-trl). Every run is a
child process of its own; the sides alternate (ours, TRL) within each mode and round, and the record is the median of
--rounds runs. Goal: ours >= 1.5x TRL's tokens/s at <= 0.7x its peak RSS.

Both sides, the same settings:
- the checkpoint checkpoints/SmolLM2-135M-Instruct (an HF directory; its tokenizer and chat template), LoRA r=8,
  alpha=16, dropout 0.05 on q, k, v, o, gate, up and down (the head is tied: neither side adapts it), AdamW at lr
  5e-5 with no warm-up, micro-batch 2 pairs, 2 micro-batches a step (4 pairs), sequences cut at 256 tokens, DPO
  sigmoid loss with beta 0.1, the reference = the same model with the adapter switched off, no validation, no
  checkpoints or exports, activation checkpointing off, data loaded in the training process;
- the same pairs: the first 64 rows of lit_qlora/data/preference_demo.jsonl (--pairs), explicit string rows
  {prompt, chosen, rejected}, copied to benchmarks/_work/dpo_pairs-64.jsonl. Ours reads them as they are (its
  --data.prompt_style auto renders the prompt as one user turn with the checkpoint's chat template); TRL gets them in
  its conversational form (prompt=[{"role": "user", ...}], chosen/rejected=[{"role": "assistant", ...}]), which it
  renders with the same template, to the same tokens but one: TRL's render of prompt+answer ends with the newline
  the template writes after the last <|im_end|>, which it keeps (and trains) and ours does not, so TRL's sequences
  are 1 token longer (the demo's 64 pairs: 8077 tokens for TRL, 7949 for ours, 1.6%). --steps 16 x 4 pairs is one
  pass over the 64 pairs, so the two sides' totals (the notes give both) differ by just that when both count alike;
- the same precision (--precision: bf16-true where lscpu lists avx512_bf16 or amx_bf16, else 32-true). TRL at
  bf16-true: the model is loaded in bf16 (its weights and matmuls are bf16, not autocast over fp32 weights) and
  DPOConfig(bf16=True), TRL's default, also runs the steps under CPU autocast; peft keeps the LoRA A/B in fp32 for a
  bf16 model (its autocast_adapter_dtype) and TRL casts them to bf16 for a 4-bit one. The child checks what runs: the
  dtype of the first q_proj's base weights and output, and whether autocast was on, as the notes say. At 32-true
  everything is fp32 and autocast is off;
- QLoRA: ours `--quantize nf4`; TRL BitsAndBytesConfig(load_in_4bit, nf4, double quant, compute dtype = the
  precision's: bf16 at bf16-true). If bitsandbytes' 4-bit cannot run on this CPU, the TRL child says why and the
  QLoRA row compares ours (nf4) with TRL's LoRA run, saying so;
- tokens/s: the non-padding tokens of prompt+chosen and prompt+rejected of every pair a step trains (ours: its
  metrics' per-step "tokens", summary.json's tokens_per_sec; TRL: the attention mask of every micro-batch, counted in
  training_step), over the steps after the first (warm-up), divided by their wall time (TRL: on_step_begin to
  on_step_end of a TrainerCallback, which leaves its batch fetching and logging out; ours: its step timer);
- peak memory: VmHWM of the child process when it ends (load, steps and all; the TRL child reads it after train()
  returns, ours a wrapper around `lit_qlora.cli.main` when main returns). Ours' summary.json peak_rss_bytes is
  recorded beside it.

TRL's DPOConfig defaults that would make its run differ from ours are set back: disable_dropout=False (TRL's default
True zeroes every nn.Dropout, the LoRA dropout included), gradient_checkpointing=False (its default is True),
bf16 as the precision says (its default is True).

Results: benchmarks/peers/results/dpo_trl.{json,md} (rows merged by mode, precision and steps; --results_dir for
scratch runs). `litqlora dpo` must exist (`litqlora dpo --help`); `--sides trl` checks the TRL side alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "memory"))
from train_memory import loadavg  # noqa: E402  (stdlib only: also importable in the TRL venv)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK = HERE.parent / "_work"
TRL_PYTHON = WORK / "venv-trl/bin/python"
CHECKPOINT = "checkpoints/SmolLM2-135M-Instruct"
PAIRS = "lit_qlora/data/preference_demo.jsonl"
N_PAIRS = 64
GOAL = {"tokens_per_sec_ratio_min": 1.5, "peak_rss_ratio_max": 0.7}
MODES = {"lora": "none", "qlora": "nf4"}  # mode -> ours' --quantize
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The shared recipe, in ours' flags' terms; TRL's DPOConfig below says the same in its own.
LORA = {"r": 8, "alpha": 16, "dropout": 0.05}
TRAIN = {"micro_batch_size": 2, "global_batch_size": 4, "max_seq_length": 256, "lr": 5e-5, "warmup_steps": 0}
BETA = 0.1
OURS_DISTS = ["torch", "lightning", "torchao", "lit-qlora"]
TRL_DISTS = ["torch", "trl", "peft", "transformers", "accelerate", "datasets", "bitsandbytes"]
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def vmhwm_bytes() -> int:
    """This process's peak RSS so far (VmHWM); read directly: the TRL venv has no lit_qlora."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def cpu_info() -> dict:
    """lscpu's model name and the ISA extensions that decide CPU bf16 speed."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = set(re.search(r"^Flags:\s*(.*)$", out, re.M).group(1).split()) if "Flags:" in out else set()
    model = re.search(r"^Model name:\s*(.*)$", out, re.M)
    return {"model": model.group(1).strip() if model else platform.processor() or "unknown",
            "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags],
            "cpus": os.cpu_count()}


def default_precision(isa: list[str]) -> str:
    return "bf16-true" if {"avx512_bf16", "amx_bf16"} & set(isa) else "32-true"


def sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()[:12]


# ------------------------------------------------------------------------------------------------------ TRL child

def trl_child(args) -> None:
    before = vmhwm_bytes()
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    bf16 = args.precision == "bf16-true"
    dtype = torch.bfloat16 if bf16 else torch.float32
    load_kwargs = {"dtype": dtype}
    quantization = "none"
    if args.mode == "qlora":
        try:  # bitsandbytes' 4-bit on this CPU: a tiny Linear4bit forward and backward, before anything is timed
            import bitsandbytes as bnb
            from transformers import BitsAndBytesConfig

            probe = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=dtype, quant_type="nf4",
                                      compress_statistics=True)
            probe.weight = bnb.nn.Params4bit(torch.randn(64, 64, dtype=dtype), requires_grad=False,
                                             quant_type="nf4", compress_statistics=True).to("cpu")
            x = torch.randn(2, 64, dtype=dtype, requires_grad=True)
            probe(x).float().sum().backward()
            if x.grad is None or not torch.isfinite(x.grad).all():
                raise RuntimeError("Linear4bit backward gave no finite input gradient")
        except Exception as e:  # noqa: BLE001  (any failure means: no TRL QLoRA on this CPU)
            print(json.dumps({"unavailable": f"bitsandbytes 4-bit on CPU: {type(e).__name__}: {e}"[:500]}))
            return
        load_kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype)
        quantization = f"bitsandbytes nf4, double quant, compute dtype {str(dtype).removeprefix('torch.')}"

    rows = [json.loads(line) for line in Path(args.pairs).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                  "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                  "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint_dir, **load_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint_dir)
    after_load = vmhwm_bytes()
    peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                             target_modules=TARGETS, task_type="CAUSAL_LM")
    config_kwargs = dict(
        beta=BETA, loss_type="sigmoid", per_device_train_batch_size=TRAIN["micro_batch_size"],
        gradient_accumulation_steps=TRAIN["global_batch_size"] // TRAIN["micro_batch_size"],
        learning_rate=TRAIN["lr"], warmup_steps=TRAIN["warmup_steps"], max_steps=args.steps,
        max_length=TRAIN["max_seq_length"], bf16=bf16, eval_strategy="no", save_strategy="no", logging_steps=1,
        gradient_checkpointing=False, disable_dropout=False, dataloader_num_workers=0, use_cpu=True,
        report_to="none", disable_tqdm=True, seed=0)

    class Timer(TrainerCallback):
        def __init__(self):
            self.seconds, self.tokens, self.losses, self._t0, self._tok0 = [], [], [], 0.0, 0

        def on_step_begin(self, a, state, control, **kw):
            self._tok0, self._t0 = trainer.counted_tokens, time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.seconds.append(time.perf_counter() - self._t0)
            self.tokens.append(trainer.counted_tokens - self._tok0)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(round(float(logs["loss"]), 4))

    class CountingDPOTrainer(DPOTrainer):
        """Counts each micro-batch's non-padding tokens (prompt+chosen and prompt+rejected rows, after the cut
        at max_length) as it trains it."""
        counted_tokens = 0

        def training_step(self, model, inputs, *rest, **kw):
            self.counted_tokens += int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *rest, **kw)

    timer = Timer()
    with tempfile.TemporaryDirectory(prefix="dpo-trl-") as out:
        config = DPOConfig(output_dir=out, **config_kwargs)
        trainer = CountingDPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                                     peft_config=peft_config, callbacks=[timer])
        # What the first adapted projection really computes in: its base weights, its output, autocast on or off.
        base = next(m for n, m in trainer.model.named_modules() if n.endswith("q_proj.base_layer"))
        seen: dict = {}

        def probe_hook(module, inputs, output):
            if not seen:
                seen.update(input=str(inputs[0].dtype), output=str(output.dtype),
                            autocast=torch.is_autocast_enabled("cpu"))

        handle = base.register_forward_hook(probe_hook)
        after_setup = vmhwm_bytes()
        load_before = loadavg()
        trainer.train()
        handle.remove()
        peak = vmhwm_bytes()
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    steady_s, steady_t = sum(timer.seconds[1:]), sum(timer.tokens[1:])
    print(json.dumps({
        "side": "trl", "mode": args.mode, "quantization": quantization, "peak_rss_bytes": peak,
        "rss_before_load_bytes": before, "peak_rss_after_load_bytes": after_load,
        "peak_rss_after_setup_bytes": after_setup, "torch_threads": torch.get_num_threads(),
        "tokens_per_sec": steady_t / steady_s if steady_s else None,
        "tokens_per_step": timer.tokens, "step_seconds": [round(s, 3) for s in timer.seconds],
        "losses": timer.losses, "total_tokens": sum(timer.tokens), "pairs_after_filter": len(trainer.train_dataset),
        "trainable_params": sum(p.numel() for p in trainable),
        "trainable_dtypes": sorted({str(p.dtype) for p in trainable}),
        "compute": {"q_proj_base_weight": str(base.weight.dtype), "q_proj_base_class": type(base).__name__,
                    "q_proj_input": seen.get("input"), "q_proj_output": seen.get("output"),
                    "autocast_cpu": seen.get("autocast"), "model_dtype": str(trainer.model.dtype)},
        "optimizer": type(trainer.optimizer).__name__, "optim": str(trainer.args.optim),
        "lr_scheduler": str(trainer.args.lr_scheduler_type),
        "dpo_config": {k: v for k, v in config_kwargs.items()},
        "loadavg_before": load_before, "loadavg_after": loadavg(),
    }))


# ----------------------------------------------------------------------------------------------------- ours child

# Runs `litqlora dpo` in this process and writes the process's VmHWM when main returns (or raises: it is read
# anyway, and the parent reports the failure from the exit code).
OURS_WRAPPER = """
import sys
from pathlib import Path
hwm_file, argv = sys.argv[1], sys.argv[2:]
try:
    from lit_qlora.cli import main
    main(argv)
finally:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    Path(hwm_file).write_text(str(int(line.split()[1]) * 1024))
"""


def ours_argv(args, mode: str, out: str, val_path: Path | None) -> list[str]:
    argv = ["dpo", "--checkpoint_dir", args.checkpoint_dir, "--out_dir", out, "--quantize", MODES[mode],
            "--precision", args.precision, "--lora.r", str(LORA["r"]), "--lora.alpha", str(LORA["alpha"]),
            "--lora.dropout", str(LORA["dropout"]), "--lora.targets", "[all]", "--train.max_steps", str(args.steps)]
    argv += [x for k, v in TRAIN.items() for x in (f"--train.{k}", str(v))]
    argv += ["--dpo.beta", str(BETA), "--dpo.loss", "sigmoid", "--data.path", str(args.pairs_file)]
    argv += ["--data.val_path", str(val_path)] if val_path else ["--data.val_split", "0"]
    return argv + ["--export.merged", "false", "--export.peft", "false", "--logger", "csv"]


def run_ours(args, mode: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="dpo-ours-") as out:
        hwm = Path(out) / "vmhwm"
        run_dir = str(Path(out) / "run")
        argv = ours_argv(args, mode, run_dir, args.val_file)
        load_before = loadavg()
        proc = subprocess.run([sys.executable, "-c", OURS_WRAPPER, str(hwm), *argv], capture_output=True, text=True,
                              cwd=ROOT, env={**os.environ, **CHILD_ENV})
        if proc.returncode:
            raise SystemExit(f"litqlora {shlex.join(argv)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        summary = json.loads(Path(run_dir, "summary.json").read_text())
        metrics = Path(run_dir, "metrics.jsonl")
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
        rows = [r for r in rows if "tokens" in r]
        peak = int(hwm.read_text())
    seconds = [r["tokens"] / r["tokens_per_sec"] for r in rows]
    return {
        "side": "ours", "mode": mode, "quantization": MODES[mode], "peak_rss_bytes": peak,
        "summary_peak_rss_bytes": summary.get("peak_rss_bytes"),
        "tokens_per_sec": summary["tokens_per_sec"],
        # the same from metrics.jsonl, as the TRL side computes it: steps after the first, tokens / seconds
        "tokens_per_sec_from_metrics": sum(r["tokens"] for r in rows[1:]) / sum(seconds[1:]) if len(rows) > 1 else None,
        "tokens_per_step": [r["tokens"] for r in rows], "step_seconds": [round(s, 3) for s in seconds],
        "losses": [None if r.get("loss") is None else round(r["loss"], 4) for r in rows],
        "total_tokens": sum(r["tokens"] for r in rows),
        "trainable_params": summary.get("trainable_params"), "precision": summary.get("precision"),
        "precision_reason": summary.get("precision_reason"), "wall_seconds": summary.get("wall_seconds"),
        "command": "litqlora " + shlex.join(argv).replace(run_dir, "OUT_DIR").replace(str(ROOT) + "/", ""),
        "loadavg_before": load_before, "loadavg_after": loadavg(),
    }


def run_trl(args, mode: str) -> dict:
    cmd = [str(TRL_PYTHON), str(HERE / "dpo_trl.py"), "--child", "trl", "--mode", mode, "--steps", str(args.steps),
           "--precision", args.precision, "--checkpoint_dir", args.checkpoint_dir, "--pairs", str(args.pairs_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **CHILD_ENV})
    if proc.returncode:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["command"] = shlex.join(cmd).replace(str(ROOT) + "/", "")
    return result


# ------------------------------------------------------------------------------------------------------- parent

def versions(python: str, dists: list[str]) -> dict:
    code = ("import importlib.metadata as m, json, sys\n"
            "print(json.dumps({d: m.version(d) for d in sys.argv[1:]}))")
    return json.loads(subprocess.run([python, "-c", code, *dists], check=True, capture_output=True, text=True).stdout)


def prepare_pairs(args) -> None:
    """The first 64 rows (and, with --ours_val_pairs K, the K after them, ours' validation file) into _work/."""
    src = Path(args.pairs)
    if not src.is_file():
        raise SystemExit(f"{src} is missing: pass --pairs FILE (explicit string rows: prompt, chosen, rejected)")
    lines = [x for x in src.read_text().splitlines() if x.strip()]
    need = N_PAIRS + args.ours_val_pairs
    if len(lines) < need:
        raise SystemExit(f"{src} has {len(lines)} rows; this benchmark needs {need}")
    for line in lines[:N_PAIRS]:
        row = json.loads(line)
        if not all(isinstance(row.get(k), str) for k in ("prompt", "chosen", "rejected")):
            raise SystemExit(f"{src}: every row must hold string prompt, chosen and rejected: {line[:200]}")
    WORK.mkdir(parents=True, exist_ok=True)
    args.pairs_file = WORK / f"dpo_pairs-{N_PAIRS}.jsonl"
    args.pairs_file.write_text("\n".join(lines[:N_PAIRS]) + "\n")
    args.val_file = None
    if args.ours_val_pairs:
        args.val_file = WORK / f"dpo_pairs-val-{args.ours_val_pairs}.jsonl"
        args.val_file.write_text("\n".join(lines[N_PAIRS:need]) + "\n")


def ours_available() -> str | None:
    proc = subprocess.run([sys.executable, "-m", "lit_qlora.cli", "dpo", "--help"], capture_output=True, text=True,
                          cwd=ROOT)
    return None if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()[-500:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 16: one pass over the 64 pairs)")
    parser.add_argument("--rounds", type=int, help="runs per side and mode, alternating; medians (default 2)")
    parser.add_argument("--quick", action="store_true",
                        help="3 steps, 1 round, results to benchmarks/_work/dpo_trl-quick/ (a smoke run)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--sides", nargs="+", choices=["ours", "trl"], default=["ours", "trl"])
    parser.add_argument("--precision", choices=["bf16-true", "32-true"],
                        help="both sides' (default: bf16-true where lscpu lists avx512_bf16 or amx_bf16, else 32-true)")
    parser.add_argument("--checkpoint_dir", default=CHECKPOINT)
    parser.add_argument("--pairs", default=PAIRS, help=f"preference rows; the first {N_PAIRS} train")
    parser.add_argument("--ours_val_pairs", type=int, default=0,
                        help="give ours a validation file of this many rows (those after the 64) instead of "
                             "--data.val_split 0, should `litqlora dpo` refuse a run without validation")
    parser.add_argument("--results_dir", type=Path)
    parser.add_argument("--child", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return trl_child(args)

    args.steps = args.steps or (3 if args.quick else 16)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.results_dir = args.results_dir or (WORK / "dpo_trl-quick" if args.quick else HERE / "results")
    if args.steps < 2:
        parser.error("--steps must be >= 2: tokens/s leaves the first step out")
    cpu = cpu_info()
    args.precision = args.precision or default_precision(cpu["isa"])
    prepare_pairs(args)
    if "trl" in args.sides and not TRL_PYTHON.is_file():
        raise SystemExit(f"{TRL_PYTHON} is missing: run `bash benchmarks/peers/peer_envs.sh` first")
    if "ours" in args.sides and (why := ours_available()):
        raise SystemExit(f"`litqlora dpo --help` fails, so ours cannot run (try --sides trl):\n{why}")

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runs = {mode: {side: [] for side in args.sides} for mode in args.modes}
    for _ in range(args.rounds):
        for mode in args.modes:
            for side in args.sides:
                if (load := loadavg()[0]) > 0.5 * (cpu["cpus"] or 1):
                    print(f"warning: 1-minute load {load} on {cpu['cpus']} CPUs before {side} {mode}: other work "
                          "competes for the cores, and torch's threads slow down many times over then; the "
                          "figures are not a record", file=sys.stderr, flush=True)
                result = run_ours(args, mode) if side == "ours" else run_trl(args, mode)
                runs[mode][side].append(result)
                print(mode, side, json.dumps(result), flush=True)
    record_results(args, cpu, started, runs)


def median_of(rs: list[dict], key: str):
    values = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(values) if values else None


def record_results(args, cpu: dict, started: str, runs: dict) -> None:
    path = args.results_dir / "dpo_trl.json"
    record = json.loads(path.read_text()) if path.is_file() else {"rows": {}}
    record.update(goal=GOAL, cpu=cpu, python=platform.python_version(), machine=platform.machine())
    ours_v = versions(sys.executable, OURS_DISTS) if "ours" in args.sides else None
    trl_v = versions(str(TRL_PYTHON), TRL_DISTS) if "trl" in args.sides else None
    for mode, sides in runs.items():
        row = {"mode": mode, "checkpoint": Path(args.checkpoint_dir).name, "precision": args.precision,
               "steps": args.steps, "rounds": args.rounds, "started": started, "cpu_isa": cpu["isa"],
               "pairs": {"source": args.pairs, "rows": N_PAIRS, "sha1": sha1(args.pairs_file)},
               "ours_val_pairs": args.ours_val_pairs,
               "command": shlex.join(["python", "benchmarks/peers/dpo_trl.py", "--steps", str(args.steps), "--rounds",
                                      str(args.rounds), "--precision", args.precision, "--modes", mode, "--sides",
                                      *args.sides] + (["--pairs", args.pairs] if args.pairs != PAIRS else [])
                                     + (["--ours_val_pairs", str(args.ours_val_pairs)] if args.ours_val_pairs else [])),
               "runs": sides, "versions": {"ours": ours_v, "trl": trl_v}, "medians": {}}
        trl_runs = sides.get("trl", [])
        if trl_runs and "unavailable" in trl_runs[0]:
            # No TRL QLoRA here: compare ours' QLoRA with TRL's LoRA run (from this invocation or the record).
            row["trl_unavailable"] = trl_runs[0]["unavailable"]
            lora = runs.get("lora", {}).get("trl") or record["rows"].get(
                row_key(args, "lora"), {}).get("runs", {}).get("trl", [])
            row["trl_compared"] = "TRL LoRA (bf16/fp32 weights): its QLoRA could not run" if lora else None
            trl_runs = lora
        for side, rs in (("ours", sides.get("ours", [])), ("trl", trl_runs)):
            if rs:
                row["medians"][side] = {k: median_of(rs, k) for k in ("tokens_per_sec", "peak_rss_bytes")}
        m = row["medians"]
        if "ours" in m and "trl" in m:
            row["tokens_per_sec_ours_over_trl"] = round(m["ours"]["tokens_per_sec"] / m["trl"]["tokens_per_sec"], 3)
            row["peak_rss_ours_over_trl"] = round(m["ours"]["peak_rss_bytes"] / m["trl"]["peak_rss_bytes"], 3)
            row["goal_met"] = (row["tokens_per_sec_ours_over_trl"] >= GOAL["tokens_per_sec_ratio_min"]
                               and row["peak_rss_ours_over_trl"] <= GOAL["peak_rss_ratio_max"])
        record["rows"][row_key(args, mode)] = row
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    (args.results_dir / "dpo_trl.md").write_text(markdown(record))
    print(f"wrote {path} and dpo_trl.md")


def row_key(args, mode: str) -> str:
    return f"{Path(args.checkpoint_dir).name} {mode} {args.precision} steps={args.steps}"


def markdown(record: dict) -> str:
    gib = 1024 ** 3
    cpu = record["cpu"]
    lines = ["# `litqlora dpo` vs TRL DPOTrainer + peft, LoRA and QLoRA on CPU", "",
             f"CPU: {cpu['model']}, {cpu['cpus']} CPUs, lscpu ISA: {' '.join(cpu['isa']) or 'none of note'}; "
             f"Python {record['python']}. **Goal: ours >= {GOAL['tokens_per_sec_ratio_min']}x TRL's tokens/s at "
             f"<= {GOAL['peak_rss_ratio_max']}x its peak RSS.** Same checkpoint, pairs (64), LoRA (r 8, alpha 16, "
             "dropout 0.05, q/k/v/o/gate/up/down), batch (2 pairs x 2 micro-batches), max length 256, DPO sigmoid "
             "beta 0.1, precision; tokens/s = non-padding prompt+chosen and prompt+rejected tokens over the steps "
             "after the first; peak RSS = the child process's VmHWM when it ends. Medians of the runs; ratios are "
             "ours / TRL. How each side runs: benchmarks/peers/dpo_trl.py's docstring.", "",
             "| checkpoint | mode | precision | steps x rounds | side | quantize | tokens/s | peak RSS GiB "
             "| tok/s ours/TRL | peak ours/TRL | goal | pass | first loss | total tokens | loadavg 1 min | started |",
             "|---|---|---|---|---|---|---:|---:|---:|---:|---|---|---|---:|---|---|"]
    notes = []
    for key, r in record["rows"].items():
        m = r["medians"]
        for side in ("ours", "trl"):
            rs = r["runs"].get(side) or []
            if side == "trl" and r.get("trl_unavailable"):
                compared = r.get("trl_compared") or "nothing (no TRL LoRA run recorded)"
                lines.append(f"| {r['checkpoint']} | {r['mode']} | {r['precision']} | {r['steps']} x {r['rounds']} "
                             f"| TRL | nf4 unavailable: {r['trl_unavailable'][:120]}; compared with {compared} "
                             f"| | | | | | | | | | {r['started']} |")
                continue
            if not rs:
                continue
            ratio = side == "ours" and "tokens_per_sec_ours_over_trl" in r
            goal = (f">= {GOAL['tokens_per_sec_ratio_min']}x tok/s, <= {GOAL['peak_rss_ratio_max']}x peak"
                    if ratio else "")
            tps = m[side]["tokens_per_sec"]
            lines.append(
                f"| {r['checkpoint']} | {r['mode']} | {r['precision']} | {r['steps']} x {r['rounds']} "
                f"| {'ours' if side == 'ours' else 'TRL'} | {rs[0]['quantization']} "
                f"| {tps:.1f} | {m[side]['peak_rss_bytes'] / gib:.2f} "
                f"| {r['tokens_per_sec_ours_over_trl'] if ratio else ''} "
                f"| {r['peak_rss_ours_over_trl'] if ratio else ''} "
                f"| {goal} | {('pass' if r['goal_met'] else 'fail') if ratio else ''} "
                f"| {rs[0]['losses'][0] if rs[0]['losses'] else ''} | {rs[0]['total_tokens']} "
                f"| {' '.join(str(x['loadavg_before'][0]) for x in rs)} | {r['started']} |")
        trl0 = (r["runs"].get("trl") or [{}])[0]
        ours0 = (r["runs"].get("ours") or [{}])[0]
        v = r["versions"]
        note = [f"- **{key}** (pairs {r['pairs']['source']}, first {r['pairs']['rows']} rows, sha1 "
                f"{r['pairs']['sha1']}): reproduce with `{r['command']}`."]
        if ours0:
            note.append(f"  - ours: `{ours0['command']}`" + (f" (validation: a file of {r['ours_val_pairs']} pairs "
                        "instead of --data.val_split 0, which it refused)" if r.get("ours_val_pairs") else "")
                        + f"; precision {ours0.get('precision')} ({ours0.get('precision_reason')}); trainable "
                        f"{ours0.get('trainable_params')}; summary.json peak_rss_bytes "
                        f"{(ours0.get('summary_peak_rss_bytes') or 0) / gib:.2f} GiB; tokens/s from metrics.jsonl "
                        f"{ours0.get('tokens_per_sec_from_metrics')}; versions {v.get('ours')}.")
        if trl0 and "unavailable" not in trl0:
            c = trl0["compute"]
            note.append(f"  - TRL: `{trl0['command']}`; DPOConfig {json.dumps(trl0['dpo_config'])}; "
                        f"q_proj base {c['q_proj_base_class']} weights {c['q_proj_base_weight']}, input "
                        f"{c['q_proj_input']} -> output {c['q_proj_output']}, CPU autocast "
                        f"{'on' if c['autocast_cpu'] else 'off'}; trainable {trl0['trainable_params']} "
                        f"({', '.join(trl0['trainable_dtypes'])}); {trl0['optimizer']} ({trl0['optim']}), "
                        f"{trl0['lr_scheduler']} schedule; {trl0['pairs_after_filter']} pairs after its length "
                        f"filter; {trl0.get('torch_threads')} torch threads; VmHWM after load "
                        f"{trl0.get('peak_rss_after_load_bytes', 0) / gib:.2f} GiB, after DPOTrainer() "
                        f"{trl0.get('peak_rss_after_setup_bytes', 0) / gib:.2f} GiB; versions {v.get('trl')}.")
        elif r.get("trl_unavailable"):
            note.append(f"  - TRL QLoRA could not run: {r['trl_unavailable']}")
        if ours0 and trl0.get("total_tokens") and r["steps"] * 4 % 64 == 0:
            note.append(f"  - total tokens over the run (whole passes over the 64 pairs: they differ only by TRL's "
                        f"extra newline token after each sequence's last <|im_end|>, 2 a pair, when both count "
                        f"alike): ours {ours0['total_tokens']}, TRL {trl0['total_tokens']}.")
        notes.extend(note)
    return "\n".join(lines + ["", "Notes:", ""] + notes) + "\n"


if __name__ == "__main__":
    main()
