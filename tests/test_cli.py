"""The `litqlora` command line as a user runs it: subprocesses, exit codes, stdout/stderr."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest


def litqlora(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "lit_qlora.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def test_help_comes_from_docstrings():
    out = litqlora("generate", "--help")
    assert out.returncode == 0
    assert "Greedy" in out.stdout or "greedy" in out.stdout
    assert "--checkpoint_dir" in out.stdout and "--max_new_tokens" in out.stdout


def test_finetune_help_documents_nested_options():
    out = litqlora("finetune", "--help")
    assert out.returncode == 0
    assert "Peak learning rate" in out.stdout  # TrainArgs.lr's attribute docstring
    assert "--data.json_path" in out.stdout and "--lora.r" in out.stdout and "--resume" in out.stdout


def test_download_offline_is_one_clear_line(tmp_path):
    out = litqlora("download", "HuggingFaceTB/SmolLM2-135M-Instruct", "--out_dir", tmp_path / "d",
                   env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "offline" in lines[0] and "convert_gguf" in lines[0]


def test_version_and_lightnings_names_and_misplaced_flags_are_understood():
    from importlib.metadata import version

    out = litqlora("--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"litqlora {version('lit-qlora')}")
    out = litqlora("finetune", "--lr", "1e-3")
    assert out.returncode == 2 and "unknown option `--lr`; did you mean `--train.lr`?" in out.stderr
    for given, nearest in (("64-true", "32-true"), ("64", "32-true"), ("fp16", "16-mixed"), ("bf16-mixd", "bf16-mixed")):
        out = litqlora("finetune", "--precision", given)
        assert out.returncode == 2 and f"got '{given}'. The nearest lit-qlora takes: '{nearest}'." in out.stderr


def test_lightnings_short_precision_names_mean_what_they_mean_there():
    from lit_qlora.base.precision import choose_precision

    for short, full in (("bf16", "bf16-mixed"), ("16", "16-mixed"), ("32", "32-true")):
        chosen, why = choose_precision(short, "cpu")
        assert chosen == full and "Lightning's short name" in why
    assert choose_precision("bf16-mixed", "cpu") == ("bf16-mixed", "given with --precision")


NOISE = ("Failed to load", "_pytree", "Generating train split", "UserWarning")


def test_a_run_prints_nothing_of_other_libraries_unless_debugging(tiny_llama_dir, tmp_path):
    """torchao's import warnings, torch's pytree deprecation and the datasets library's progress bar stay out of a
    CSV fine-tune's output, and our own warnings are one line each; --debug true shows the libraries' lines."""
    rows = "instruction,output\n" + "".join(f"Add {i} and 1.,It is {i + 1}.\n" for i in range(8))
    (tmp_path / "rows.csv").write_text(rows)
    args = ["finetune", "--checkpoint_dir", tiny_llama_dir, "--data.path", tmp_path / "rows.csv", "--precision",
            "32-true", "--train.max_steps", "1", "--train.micro_batch_size", "2", "--train.global_batch_size", "2",
            "--train.max_seq_length", "8", "--export.merged", "false", "--export.peft", "false"]
    out = litqlora(*args, "--out_dir", tmp_path / "quiet")
    assert out.returncode == 0, out.stderr
    assert not [line for line in (out.stdout + out.stderr).splitlines() if any(n in line for n in NOISE)]
    assert "litqlora: warning: " in out.stderr and "truncated" in out.stderr  # ours, one line (max_seq_length 8)
    debug = litqlora(*args, "--out_dir", tmp_path / "debug", "--debug", "true")
    assert debug.returncode == 0 and "_pytree" in debug.stderr  # (the CSV's split is cached by now: no bar)
    # a process the CLI did not start (LitServe spawns its workers) is quiet from lit_qlora.nf4's import on
    code = "import lit_qlora.nf4"
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "LITQLORA_DEBUG": "1"})
    assert quiet.stderr == "" and "_pytree" in loud.stderr


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    out = litqlora("generate", "--checkpoint_dir", tmp_path / "nope", "--prompt", "hi")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert "nope" in out.stderr


def test_debug_shows_the_traceback(tmp_path):
    out = litqlora("generate", "--checkpoint_dir", tmp_path / "nope", "--prompt", "hi", "--debug")
    assert out.returncode != 0 and "Traceback" in out.stderr


@pytest.mark.parametrize("flag, traceback", [(["--debug", "true"], True), (["--debug=true"], True),
                                             (["--debug", "false"], False), (["--debug=false"], False)])
def test_debug_takes_the_values_its_help_advertises(tmp_path, flag, traceback):
    out = litqlora("finetune", "--checkpoint_dir", tmp_path / "no" / "such", *flag)
    assert out.returncode == 1, out.stderr
    assert "unrecognized arguments" not in out.stderr
    assert ("Traceback" in out.stderr) is traceback
    assert "no/such does not exist" in out.stderr


def test_every_command_documents_debug_and_its_own_config():
    top = litqlora("--help")
    assert top.returncode == 0
    assert "see --recipe" not in top.stdout and "recipe" not in top.stdout.split("subcommands:")[0]
    for command in ("finetune", "generate", "merge", "evaluate"):
        out = litqlora(command, "--help")
        assert "--debug [{true,false}]" in out.stdout, command
        assert "--recipe" not in out.stdout and "fine-tune recipe" not in out.stdout, command
    assert "A `litqlora finetune` recipe" in litqlora("compare", "--help").stdout


HEAVY = ("lightning", "transformers", "matplotlib", "scipy", "torchmetrics", "lm_eval.evaluator")
# Installed, so torchmetrics imports them, but a fine-tune never calls them (lit_qlora.train.lean_imports).
UNUSED_BY_FINETUNE = {"transformers", "matplotlib", "scipy"}


# What answering --help or an argument error must not import: seconds of start-up (torch, torchao) or more.
STARTUP_HEAVY = ("torch", "torchao", "numpy", "lightning", "lm_eval", "transformers", "matplotlib", "scipy",
                 "huggingface_hub", "safetensors", "tokenizers", "gguf")
COMMANDS = ("finetune", "dpo", "grpo", "kto", "estimate", "download", "convert_gguf", "generate", "chat", "serve", "merge",
            "export_peft", "export_gguf", "evaluate", "compare")


def modules_loaded_by(*argv: str, before: str = "", watch: tuple[str, ...] = (*HEAVY, "torch")) -> set[str]:
    """Which of `watch` (HEAVY and torch unless told) are in sys.modules once `litqlora ARGV` has run (in a fresh
    interpreter that runs `before` first)."""
    code = (f"import sys\n{before}\nfrom lit_qlora.cli import main\ntry:\n    main(sys.argv[1:])\n"
            f"except SystemExit:\n    pass\nprint('LOADED', *sorted(m for m in {watch!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, timeout=600)
    line = [line for line in out.stdout.splitlines() if line.startswith("LOADED")]
    assert line, out.stderr
    return set(line[0].split()[1:])


def test_the_lean_start_up_checks_cover_every_command():
    from lit_qlora.cli import commands

    assert set(COMMANDS) == set(commands())


@pytest.mark.parametrize("argv", [["--help"], *([command, "--help"] for command in COMMANDS),
                                  [], ["finetun"], ["finetune", "--no_such_option", "1"], ["generate"],
                                  ["estimate", "--train.lr", "fast"], ["compare", "--config", "no/such.yaml"]],
                         ids=lambda argv: " ".join(argv) or "no-command")
def test_help_and_argument_errors_import_neither_torch_nor_the_training_stack(argv):
    """`litqlora --help` answers in a fraction of a second (3 s with torch on a fast machine, 16 s on a busy one)."""
    assert modules_loaded_by(*argv, watch=STARTUP_HEAVY) == set()


def test_a_checked_user_error_does_not_import_the_training_stack():
    """A fine-tune's own checks (here: a checkpoint directory that does not exist) fail before Lightning loads."""
    assert modules_loaded_by("finetune", "--checkpoint_dir", "no/such") - {"torch"} == set()


def test_a_fine_tune_trains_without_transformers_matplotlib_or_scipy(tiny_llama_dir, tmp_path):
    """A real fine-tune (Lightning Trainer, NF4, TensorBoard log, a resumable checkpoint, final/ exports) imports
    torch, Lightning and torchmetrics, and none of the libraries it never calls."""
    rows = [{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."} for i in range(8)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    out = tmp_path / "run"
    loaded = modules_loaded_by("finetune", "--checkpoint_dir", tiny_llama_dir, "--out_dir", out, "--accelerator", "cpu",
                               "--data.json_path", tmp_path / "rows.json", "--data.val_split", 0.25,
                               "--train.max_steps", 1, "--train.global_batch_size", 2, "--train.micro_batch_size", 2,
                               "--train.max_seq_length", 64, "--train.save_interval", 1, "--lora.r", 4)
    assert json.loads((out / "summary.json").read_text())["steps"] == 1  # it trained and exported
    assert (out / "final").is_dir() and list((out / "logs").glob("events.out.tfevents.*"))
    assert loaded == {"torch", "lightning", "torchmetrics"}


def test_without_the_guard_lightning_imports_what_a_fine_tune_never_calls(tiny_llama_dir, tmp_path):
    """The check above can fail: with lean_imports a no-op, a fine-tune that gets past its argument checks loads
    transformers, matplotlib and scipy with Lightning (where they are installed, as with the test extra)."""
    missing = sorted(name for name in UNUSED_BY_FINETUNE if importlib.util.find_spec(name) is None)
    if missing:
        pytest.skip(f"not installed: {missing}")
    no_guard = "import contextlib, lit_qlora.train.lean_imports as g\ng.lean_imports = contextlib.nullcontext"
    # a real checkpoint (the argument checks read it) and a step count the run refuses once Lightning is in
    loaded = modules_loaded_by("finetune", "--checkpoint_dir", tiny_llama_dir, "--out_dir", tmp_path / "run",
                               "--accelerator", "cpu", "--train.max_steps", 0, before=no_guard)
    assert {"lightning", "torchmetrics", *UNUSED_BY_FINETUNE} <= loaded


@pytest.mark.slow
def test_generate_answers_paris(smollm2_dir):
    out = litqlora("generate", "--checkpoint_dir", smollm2_dir, "--prompt", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    # Only the reply: no prompt echo, no template tokens.
    assert "<|im_start|>" not in out.stdout and "What is the capital" not in out.stdout


@pytest.mark.slow
def test_generate_with_nf4_base_answers_paris(smollm2_dir):
    out = litqlora("generate", "--checkpoint_dir", smollm2_dir, "--prompt", "What is the capital of France?",
                   "--quantize", "nf4", "--max_new_tokens", "24")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "Failed to load" not in out.stderr  # torchao's CUDA-kernel noise is silenced


# A command table of one command that raises the error it is asked for, run as `litqlora fail --kind KIND`.
FAILING_COMMAND = """
import sys

import torch

import lit_qlora.cli as cli
from lit_qlora.checkpoint.download import DownloadError
from lit_qlora.base.errors import UserError

ERRORS = {"bug": RuntimeError("boom: an invariant broke"), "user": UserError("the file is wrong; fix it"),
          "download": DownloadError("offline; copy a model here"), "oom": torch.OutOfMemoryError("CUDA out of memory")}


def fail(kind: str = "bug") -> None:
    \"\"\"Fail with one kind of error.\"\"\"
    raise ERRORS[kind]


cli.commands = lambda: {"fail": fail}
cli.main(sys.argv[1:])
"""


def test_a_runtime_error_is_a_bug_and_keeps_its_traceback():
    out = subprocess.run([sys.executable, "-c", FAILING_COMMAND, "fail", "--kind", "bug"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "RuntimeError: boom: an invariant broke" in out.stderr
    assert "litqlora: error:" not in out.stderr


@pytest.mark.parametrize("kind, message", [("user", "the file is wrong; fix it"),
                                           ("download", "offline; copy a model here"),  # a typed RuntimeError
                                           ("oom", "CUDA out of memory")])
def test_a_user_error_is_one_line_without_traceback(kind, message):
    out = subprocess.run([sys.executable, "-c", FAILING_COMMAND, "fail", "--kind", kind], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 1
    assert out.stderr.strip() == f"litqlora: error: {message}"


def test_compare_base_prints_the_base_reply_then_the_fine_tuned_one(tiny_llama_dir, tmp_path, capsys):
    import torch

    from lit_qlora.deploy.generate import generate_command
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.lora.layer import apply_lora, lora_modules
    from lit_qlora.checkpoint.adapter import save_adapter

    model = load_model(tiny_llama_dir, "nf4")
    apply_lora(model, r=4, alpha=8, dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in lora_modules(model).values():
            layer.lora_B.normal_(0, 0.5)  # an adapter that changes the reply
    out_dir = tmp_path / "run"
    save_adapter(model, out_dir / "final", {"r": 4, "alpha": 8, "targets": ["all"], "quantize": "nf4",
                                            "base_dtype": "bfloat16", "lora_dtype": "bfloat16"})
    ask = dict(prompt="What is the capital of Austria?", checkpoint_dir=tiny_llama_dir, max_new_tokens=10)
    base = generate_command(**ask, quantize="nf4")
    tuned = generate_command(**ask, adapter_dir=out_dir)
    assert base != tuned
    capsys.readouterr()
    assert generate_command(**ask, adapter_dir=out_dir, compare_base=True) == tuned
    assert capsys.readouterr().out == (f"base model (NF4, without the adapter):\n  {base}\n"
                                       f"fine-tuned (with the adapter from {out_dir}):\n  {tuned}\n")
    with pytest.raises(ValueError, match="--adapter_dir"):
        generate_command(**ask, compare_base=True)


@pytest.mark.slow
def test_the_demo_recipe_fine_tunes_and_compares_answers_to_a_held_out_question(smollm2_dir, tmp_path, capsys):
    """`make demo`'s recipe and question, 3 steps of its 20 (the whole demo is `make demo`'s, minutes on a fast CPU
    and most of an hour on a slow one): the question is a validation row (never trained on), the NF4 base does not
    answer it, and the demo prints its answer without and with the adapter."""
    import re
    from pathlib import Path

    import yaml

    from lit_qlora.cli import main
    from lit_qlora.train.datamodule import split_rows
    from lit_qlora.data.files import DEMO_DATASET
    from lit_qlora.data.sft import load_json_rows
    from lit_qlora.deploy.generate import generate_command

    root = Path(__file__).resolve().parents[1]
    preset = root / "config_hub" / "finetune" / "smollm2-135m" / "qlora.yaml"
    question = re.search(r'--prompt "([^"]+)"', (root / "Makefile").read_text()).group(1)
    recipe = yaml.safe_load(preset.read_text())
    train, val = split_rows(load_json_rows(DEMO_DATASET), recipe["data"]["val_split"], recipe["seed"])
    assert question in [r["instruction"] for r in val] and question not in [r["instruction"] for r in train]

    main(["finetune", "--config", str(preset), "--checkpoint_dir", str(smollm2_dir), "--out_dir", str(tmp_path),
          "--train.max_steps", "3"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["val_loss"] < summary["initial_val_loss"]
    capsys.readouterr()
    generate_command(prompt=question, checkpoint_dir=smollm2_dir, adapter_dir=tmp_path, compare_base=True)
    base, tuned = capsys.readouterr().out.split("fine-tuned (with the adapter")
    assert base.startswith("base model (NF4, without the adapter):\n  ")
    assert tuned.startswith(f" from {tmp_path}):\n  ")
    assert tuned.split("):\n", 1)[1].strip() not in ("", base.split(":\n", 1)[1].strip())  # the adapter changed it
