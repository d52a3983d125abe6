"""`litqlora compare`: the LoRA baseline against QLoRA, same recipe and seed, judged on truthfulqa_mc2.

Five stages, each its own `litqlora` process (so each one's peak memory is its own, and a crash loses only
that stage): fine-tune LoRA (bf16 base), fine-tune QLoRA (NF4 base), then evaluate the base and both merged
checkpoints. Every stage writes its results under OUT_DIR; running the same command again skips the stages
that finished and resumes a fine-tune that was killed from its last checkpoint.

OUT_DIR/
  recipe.yaml                 the resolved fine-tune recipe both runs use (quantize and out_dir set per run)
  compare.json                the settings the stages ran with (a rerun with other settings is refused)
  lora/, qlora/               `litqlora finetune` outputs (summary.json, metrics.jsonl, final/merged, logs/)
  eval/base|lora|qlora/       `litqlora evaluate` outputs (results.json, samples_truthfulqa_mc2.jsonl)
  logs/STAGE.log, STAGE.json  each stage's console output; its command, exit code and the machine's load
  report.md, report.json, report.png
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

import yaml
from jsonargparse import ArgumentError, ArgumentParser

from lit_qlora.base.errors import InvalidInput, MissingFile, UserError
from lit_qlora.eval import SAMPLE_DATA_FILE
from lit_qlora.eval.truthfulqa import check_truthfulqa_file
from lit_qlora.base.precision import PrecisionChoice
from lit_qlora.train.args import TrainArgs, flatten

# The fine-tune, the checkpoint code and the report (each imports torch) are imported where used: the CLI imports
# `compare` to build `--help` (lit_qlora.cli.commands says why and how).

TASK = "truthfulqa_mc2"
RUNS = {"lora": "none", "qlora": "nf4"}
"""Fine-tune runs and the base quantization each trains on."""
BUILTIN_RECIPE = {"train": {"max_steps": 20, "micro_batch_size": 4, "global_batch_size": 8, "max_seq_length": 256,
                            "lr": 1e-3, "warmup_steps": 2, "save_interval": 10},
                  "lora": {"r": 8, "alpha": 16, "dropout": 0.05, "targets": ["all"]}}
"""The built-in SmolLM2 recipe (config_hub/finetune/smollm2-135m/*.yaml; a test keeps them equal) on top of
`litqlora finetune`'s defaults: bundled SmolLM2-135M-Instruct, shipped dataset, bf16-true, seed 1337."""


class StageFailed(UserError):
    """A stage's own `litqlora` process failed; its output (message or traceback) is in the stage's log."""


def finetune_parser() -> ArgumentParser:
    from lit_qlora.train.spec import RunSpec

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action="config")
    RunSpec.add_arguments(parser)
    return parser


def flag_args(prefix: str, values: dict[str, Any]) -> list[str]:
    """--prefix.key value pairs; values as JSON, which jsonargparse reads back as YAML."""
    out = []
    for key, value in values.items():
        out += [f"--{prefix}.{key}", value if isinstance(value, str) else json.dumps(value)]
    return out


def resolve_recipe(recipe: Optional[Path], train: Optional[dict[str, Any]], checkpoint_dir: Optional[Path]) -> str:
    """The fine-tune recipe as YAML: `recipe` (or the built-in one), then the --train.* overrides and
    --checkpoint_dir. Checked by `litqlora finetune`'s own parser, so a bad key fails here, before any run."""
    known = {f.name for f in fields(TrainArgs)}
    unknown = sorted(set(train or {}) - known)
    if unknown:
        raise InvalidInput(f"--train.{unknown[0]} is not a training setting. Known: {', '.join(sorted(known))}.")
    if recipe is not None:
        if not Path(recipe).is_file():
            raise MissingFile(f"--config {recipe} does not exist (a fine-tune recipe YAML, e.g. "
                              "config_hub/finetune/smollm2-135m/lora.yaml).")
        args = ["--config", str(recipe)]
    else:
        args = [arg for key, values in BUILTIN_RECIPE.items() for arg in flag_args(key, values)]
    args += flag_args("train", train or {})
    if checkpoint_dir is not None:
        args += ["--checkpoint_dir", str(checkpoint_dir)]
    parser = finetune_parser()
    try:
        cfg = parser.parse_args(args)
    except (ArgumentError, SystemExit) as e:
        source = f"--config {recipe}" if recipe else "the built-in recipe"
        raise InvalidInput(f"{source} with the --train overrides is not a valid fine-tune recipe: {e}") from None
    for key in ("config", "out_dir", "quantize", "resume", "overwrite", "debug"):  # set per run by compare
        cfg.pop(key, None)
    return parser.dump(cfg)


def run_stage(name: str, argv: list[str], out_dir: Path) -> None:
    """Run `litqlora ARGV` in a child process, echoing its output and keeping a copy in logs/NAME.log."""
    from lit_qlora.checkpoint.files import atomic_write_text

    log_path = out_dir / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "lit_qlora.cli", *argv]
    print(f"\n[compare] {name}: litqlora {' '.join(argv)}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    load_before = os.getloadavg()[0]
    with open(log_path, "wb") as log, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                        env=env) as proc:
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(65536):
            log.write(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
    # Other jobs on the machine slow a stage down: the report shows the load each stage ran under.
    atomic_write_text(log_path.with_suffix(".json"), json.dumps(
        {"command": argv, "exit_code": proc.returncode, "load_average_1min": [load_before, os.getloadavg()[0]],
         "cpu_count": os.cpu_count()}) + "\n")
    if proc.returncode:
        raise StageFailed(f"compare: stage {name!r} failed (exit {proc.returncode}); its output is in {log_path}. "
                           "Fix the cause and run the same command again: finished stages are kept and a "
                           "fine-tune resumes from its last checkpoint.")


def same_recipe(before: str, now: str) -> bool:
    """Equal recipes, where a setting only one side names (a finetune option added since) is at its default."""
    a, b = flatten(yaml.safe_load(before) or {}), flatten(yaml.safe_load(now) or {})
    parser = finetune_parser()
    defaults = flatten(yaml.safe_load(parser.dump(parser.get_defaults())) or {})
    return all(a.get(k, defaults.get(k)) == b.get(k, defaults.get(k)) for k in a.keys() | b.keys())


def check_settings(out_dir: Path, settings: dict[str, Any]) -> None:
    """Refuse to mix runs of another recipe into OUT_DIR; evaluation settings may change (evals rerun)."""
    from lit_qlora.checkpoint.files import atomic_write_text

    path = out_dir / "compare.json"
    if path.is_file():
        before = json.loads(path.read_text())
        if not same_recipe(before.get("recipe", ""), settings["recipe"]) and any((out_dir / run).exists() for run in RUNS):
            raise InvalidInput(f"{out_dir} holds a comparison fine-tuned with another recipe (see "
                               f"{out_dir}/recipe.yaml). Use a new --out_dir, or delete that directory to start over.")
        if before.get("eval") != settings["eval"]:
            for name in ("base", *RUNS):
                (out_dir / "eval" / name / "results.json").unlink(missing_ok=True)
    atomic_write_text(path, json.dumps(settings, indent=2) + "\n")
    atomic_write_text(out_dir / "recipe.yaml", settings["recipe"])


def compare(
    checkpoint_dir: Optional[Path] = None,
    out_dir: Path = Path("out/compare"),
    recipe: Optional[Path] = None,
    train: Optional[dict[str, Any]] = None,
    data_file: Optional[Path] = None,
    limit: Optional[float] = None,
    eval_precision: PrecisionChoice = "32-true",
    eval_batch_size: int = 8,
) -> dict[str, Any]:
    """LoRA baseline vs QLoRA: same recipe and seed, truthfulqa_mc2 of the base and both merged models.

    Fine-tunes both, evaluates the base and both merged checkpoints, and writes OUT_DIR/report.md,
    report.json and report.png.

    Rerunning the same command skips finished stages and resumes an interrupted fine-tune.

    Args:
        checkpoint_dir: Base model (Hugging Face directory); default: the recipe's, else the bundled SmolLM2.
        out_dir: Where both runs, their evaluations and the report go.
        recipe: A `litqlora finetune` recipe YAML, given as --config (e.g.
            config_hub/finetune/smollm2-135m/lora.yaml; its quantize and out_dir are ignored). Default: the
            built-in SmolLM2 recipe on the shipped dataset.
        train: Overrides of the recipe's training settings, as --train.max_steps 50 --train.lr 2e-4 ...
        data_file: TruthfulQA multiple-choice rows (JSON, JSONL or Parquet) for truthfulqa_mc2; default: the
            shipped 20-question sample (eval/data/truthfulqa_mc_sample.jsonl).
        limit: Evaluate only the first N questions (below 1: that fraction).
        eval_precision: Evaluation dtype. 32-true keeps batch-shape rounding out of a small comparison (auto:
            what suits the device, as for evaluate).
        eval_batch_size: Sequences per forward pass in evaluation.
    """
    out_dir = Path(out_dir)
    data_file = Path(data_file) if data_file is not None else SAMPLE_DATA_FILE
    check_truthfulqa_file(data_file)
    if limit is not None and limit <= 0:
        raise InvalidInput(f"--limit must be positive, got {limit}")
    if eval_batch_size < 1:  # checked here, not hours later in the evaluation stages
        raise InvalidInput(f"--eval_batch_size must be at least 1, got {eval_batch_size}")
    recipe_yaml = resolve_recipe(recipe, train, checkpoint_dir)
    base_dir = Path(yaml.safe_load(recipe_yaml)["checkpoint_dir"])
    from lit_qlora.export.gguf_import import ensure_default_checkpoint  # the settings are checked: now the stack may load

    ensure_default_checkpoint(base_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eval_settings = {"task": TASK, "data_file": str(data_file.resolve()), "limit": limit,
                     "precision": eval_precision, "batch_size": eval_batch_size}
    check_settings(out_dir, {"recipe": recipe_yaml, "eval": eval_settings})

    for run, quantize in RUNS.items():
        if not (out_dir / run / "summary.json").is_file():
            run_stage(f"finetune-{run}", ["finetune", "--config", str(out_dir / "recipe.yaml"), "--quantize", quantize,
                                          "--out_dir", str(out_dir / run), "--resume", "auto"], out_dir)
    evaluated = {"base": base_dir, **{run: out_dir / run / "final" / "merged" for run in RUNS}}
    for name, model_dir in evaluated.items():
        if not (out_dir / "eval" / name / "results.json").is_file():
            argv = ["evaluate", "--checkpoint_dir", str(model_dir), "--tasks", TASK, "--data_file", str(data_file),
                    "--precision", eval_precision, "--batch_size", str(eval_batch_size),
                    "--out_dir", str(out_dir / "eval" / name)]
            run_stage(f"evaluate-{name}", argv + (["--limit", str(limit)] if limit is not None else []), out_dir)
    from lit_qlora.eval.report import write_report

    report = write_report(out_dir, evaluated)
    print(f"\n{(out_dir / 'report.md').read_text()}\nWrote {out_dir}/report.md, report.json and report.png")
    return report
