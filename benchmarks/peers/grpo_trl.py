"""`litqlora grpo` beside TRL's GRPOTrainer (with peft) on this CPU: tokens/s of whole steps (generation included)
and whole-process peak RSS, LoRA and QLoRA (issue 49 item 7; goal: >= 1.5x TRL's tokens/s at <= 0.5x its peak).

    bash benchmarks/peers/peer_envs.sh           # once: benchmarks/_work/venv-trl (TRL 1.16, peft, bitsandbytes)
    python benchmarks/peers/grpo_trl.py [--steps 6] [--rounds 1] [--modes lora qlora]

Both sides, the same settings: checkpoints/SmolLM2-135M-Instruct; LoRA r=8, alpha=16, dropout 0.05 on q, k, v, o,
gate, up, down; the first 32 prompts of lit_qlora/data/grpo_demo.jsonl (chat prompts, an `answer` column); 8
completions per prompt of at most 16 tokens at temperature 1; 16 completions a step (2 prompts) in micro-batches of
8; the dapo loss, group-scaled advantages, beta 0 (no reference pass), one update per batch of rollouts; lr 5e-4, no
warm-up; the rewards answer_match and format (weights 2 and 1) from lit_qlora/methods/grpo/builtin_rewards.py, which the
TRL child loads by its path (it needs only the standard library); bf16 where the CPU computes it natively, else fp32
(TRL: the model loaded in that dtype, bf16=True); no validation, checkpoints or exports; activation checkpointing off.
QLoRA: ours --quantize nf4, TRL BitsAndBytesConfig(nf4, double quant) (if bitsandbytes' 4-bit cannot run here, the
child says why).

tokens/s: prompt + completion tokens of every completion a step trains (the prompt counted once per completion, as
both sides feed it), over the steps after the first, divided by their wall time: ours from metrics.jsonl, TRL from
_generate_and_score_completions' masks and a TrainerCallback's on_step_begin..on_step_end (generation runs inside
the step on both sides). Completions differ (each side samples its own), so tokens/s, not seconds per step, is what
compares. Peak: VmHWM of each child when it ends. Results: benchmarks/peers/results/grpo_trl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dpo_trl import (CHILD_ENV, OURS_WRAPPER, TARGETS, TRL_PYTHON, cpu_info, default_precision,  # noqa: E402
                     vmhwm_bytes)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHECKPOINT = "checkpoints/SmolLM2-135M-Instruct"
PROMPTS = ROOT / "lit_qlora/data/grpo_demo.jsonl"
N_PROMPTS = 32
LORA = {"r": 8, "alpha": 16, "dropout": 0.05}
G, LR = 8, 5e-4
WEIGHTS = [2.0, 1.0]
MODES = {"lora": "none", "qlora": "nf4"}


def trl_child(args) -> None:
    import importlib.util

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("builtin_rewards", ROOT / "lit_qlora/methods/grpo/builtin_rewards.py")
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)

    def answer_match(completions, answer, **kwargs):
        return rewards.answer_match(completions, answer)

    def format(completions, **kwargs):  # noqa: A001  (the metric's name, as ours logs it)
        return rewards.format_reward(completions)

    bf16 = args.precision == "bf16-true"
    dtype = torch.bfloat16 if bf16 else torch.float32
    load = {"dtype": dtype}
    if args.mode == "qlora":
        try:
            from transformers import BitsAndBytesConfig

            load["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                             bnb_4bit_use_double_quant=True,
                                                             bnb_4bit_compute_dtype=dtype)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"unavailable": f"bitsandbytes 4-bit: {type(e).__name__}: {e}"[:500]}))
            return
    cuda = args.device == "cuda"
    if cuda:
        load["device_map"] = {"": 0}
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[: args.n_prompts]]
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint_dir, **load)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint_dir)
    config = dict(num_generations=G, max_completion_length=args.max_completion, temperature=1.0, beta=0.0,
                  loss_type="dapo", scale_rewards="group", reward_weights=WEIGHTS, num_iterations=1,
                  per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.global_batch // args.micro,
                  learning_rate=LR, warmup_steps=0, max_steps=args.steps, bf16=bf16, use_cpu=not cuda,
                  gradient_checkpointing=False,
                  disable_dropout=False, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                  seed=0, dataloader_num_workers=0)

    class Counting(GRPOTrainer):
        counted = 0

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.counted += int(out["prompt_mask"].sum()) + int(out["completion_mask"].sum())
            return out

    class Timer(TrainerCallback):
        def __init__(self):
            self.seconds, self.tokens, self._t0, self._n0 = [], [], 0.0, 0

        def on_step_begin(self, a, state, control, **kw):
            self._t0, self._n0 = time.perf_counter(), trainer.counted

        def on_step_end(self, a, state, control, **kw):
            self.seconds.append(time.perf_counter() - self._t0)
            self.tokens.append(trainer.counted - self._n0)

    timer = Timer()
    with tempfile.TemporaryDirectory(prefix="grpo-trl-") as out:
        trainer = Counting(model=model, reward_funcs=[answer_match, format], args=GRPOConfig(output_dir=out, **config),
                           train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                           peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                                  target_modules=TARGETS, task_type="CAUSAL_LM"),
                           callbacks=[timer])
        trainer.train()
    steady_s, steady_t = sum(timer.seconds[1:]), sum(timer.tokens[1:])
    print(json.dumps({"side": "trl", "mode": args.mode, "peak_rss_bytes": vmhwm_bytes(),
                      "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                      "tokens_per_sec": steady_t / steady_s if steady_s else None, "tokens_per_step": timer.tokens,
                      "step_seconds": [round(s, 3) for s in timer.seconds], "torch_threads": torch.get_num_threads(),
                      "config": {k: v for k, v in config.items()}}))


def run_ours(args, mode: str) -> dict:
    prompts = Path(tempfile.mkdtemp(prefix="grpo-prompts-")) / "prompts.jsonl"
    prompts.write_text("\n".join(PROMPTS.read_text().splitlines()[: args.n_prompts]) + "\n")
    with tempfile.TemporaryDirectory(prefix="grpo-ours-") as out:
        hwm, run_dir = Path(out) / "vmhwm", str(Path(out) / "run")
        argv = ["grpo", "--checkpoint_dir", args.checkpoint_dir, "--out_dir", run_dir, "--quantize", MODES[mode],
                "--precision", args.precision, "--lora.r", str(LORA["r"]), "--lora.alpha", str(LORA["alpha"]),
                "--lora.dropout", str(LORA["dropout"]), "--lora.targets", "[all]", "--train.max_steps", str(args.steps),
                "--train.micro_batch_size", str(args.micro), "--train.global_batch_size", str(args.global_batch),
                "--train.max_seq_length", str(args.max_seq_length), "--train.lr", str(LR), "--train.warmup_steps", "0",
                "--accelerator", args.device,
                "--grpo.num_generations", str(G), "--grpo.max_completion_length", str(args.max_completion),
                "--grpo.temperature", "1.0", "--grpo.beta", "0", "--grpo.loss_type", "dapo",
                "--grpo.rewards", "[answer_match, format]", "--grpo.reward_weights", str(WEIGHTS),
                "--data.path", str(prompts), "--data.val_split", "0", "--export.merged", "false",
                "--export.peft", "false", "--logger", "csv"]
        proc = subprocess.run([sys.executable, "-c", OURS_WRAPPER, str(hwm), *argv], capture_output=True, text=True,
                              cwd=ROOT, env={**os.environ, **CHILD_ENV})
        if proc.returncode:
            raise SystemExit(f"litqlora {shlex.join(argv)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        rows = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines() if x.strip()]
        rows = [r for r in rows if "tokens" in r]
        peak = int(hwm.read_text())
        summary = json.loads(Path(run_dir, "summary.json").read_text())
    seconds = [r["tokens"] / r["tokens_per_sec"] for r in rows]
    return {"side": "ours", "mode": mode, "peak_rss_bytes": peak,
            "peak_allocated_bytes": summary.get("peak_allocated_bytes") if args.device == "cuda" else None,
            "tokens_per_sec": sum(r["tokens"] for r in rows[1:]) / sum(seconds[1:]),
            "tokens_per_step": [r["tokens"] for r in rows], "step_seconds": [round(s, 3) for s in seconds],
            # generation's share of the steps after the first (metrics.jsonl's rollout_seconds)
            "rollout_share": sum(r.get("rollout_seconds", 0.0) for r in rows[1:]) / sum(seconds[1:]),
            "command": "litqlora " + shlex.join(argv).replace(run_dir, "OUT_DIR")}


def run_trl(args, mode: str) -> dict:
    if not Path(args.trl_python).is_file():
        return {"side": "trl", "mode": mode, "unavailable": f"{args.trl_python} missing (its venv: peer_envs.sh, or "
                                                             "benchmarks/gpu/gpu_peer_envs.sh on a GPU machine)"}
    cmd = [str(args.trl_python), str(HERE / "grpo_trl.py"), "--child", "--mode", mode, "--steps", str(args.steps),
           "--precision", args.precision, "--checkpoint_dir", args.checkpoint_dir, *shape_args(args)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # (the GPU kit's site: a torchao peft would find)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**env, **CHILD_ENV})
    if proc.returncode:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def shape_args(args) -> list[str]:
    return [x for name in ("device", "max_completion", "global_batch", "micro", "max_seq_length", "n_prompts")
            for x in (f"--{name}", str(getattr(args, name)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="lora")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--checkpoint_dir", default=CHECKPOINT)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "grpo_trl.json")
    # the shape (the CPU demo's by default); --device cuda: the GPU kit's call (benchmarks/gpu/check.py grpo_peers)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--max_completion", type=int, default=16)
    parser.add_argument("--global_batch", type=int, default=16, help="completions a step")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--max_seq_length", type=int, default=96)
    parser.add_argument("--n_prompts", type=int, default=N_PROMPTS)
    parser.add_argument("--trl_python", type=Path, default=TRL_PYTHON)
    args = parser.parse_args()
    cpu = cpu_info()
    args.precision = args.precision or ("bf16-true" if args.device == "cuda" else default_precision(cpu["isa"]))
    if args.child:
        return trl_child(args)
    runs = []
    for round_ in range(args.rounds):
        for mode in args.modes:
            for side in (run_ours, run_trl):
                row = {"round": round_, **side(args, mode)}
                runs.append(row)
                print(json.dumps({k: row.get(k) for k in ("round", "side", "mode", "tokens_per_sec",
                                                          "peak_rss_bytes", "rollout_share", "unavailable")}),
                      flush=True)
    ratios = {}
    for mode in args.modes:
        ours = [r for r in runs if r["side"] == "ours" and r["mode"] == mode]
        trl = [r for r in runs if r["side"] == "trl" and r["mode"] == mode and r.get("tokens_per_sec")]
        if ours and trl:
            speed = statistics.median(r["tokens_per_sec"] for r in ours) / statistics.median(
                r["tokens_per_sec"] for r in trl)
            memory = statistics.median(r["peak_rss_bytes"] for r in ours) / statistics.median(
                r["peak_rss_bytes"] for r in trl)
            ratios[mode] = {"tokens_per_sec_ratio": round(speed, 3), "peak_rss_ratio": round(memory, 3)}
            if args.device == "cuda":  # the GPU's peak of allocated bytes, whole runs (load included) on both sides
                ratios[mode]["peak_allocated_ratio"] = round(statistics.median(
                    r["peak_allocated_bytes"] for r in ours) / statistics.median(r["peak_allocated_bytes"] for r in trl), 3)
    record = {"command": "python benchmarks/peers/grpo_trl.py " + " ".join(sys.argv[1:]), "cpu": cpu,
              "device": args.device, "shape": dict(zip(shape_args(args)[::2], shape_args(args)[1::2])),
              "precision": args.precision, "goal": {"tokens_per_sec_ratio_min": 1.5, "peak_rss_ratio_max": 0.5},
              "ratios": ratios, "runs": runs}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
