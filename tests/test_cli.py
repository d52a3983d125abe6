"""The `litqlora` command line as a user runs it: subprocesses, exit codes, stdout/stderr."""

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


def modules_loaded_by(*argv: str) -> set[str]:
    """Which of HEAVY the CLI imported for `litqlora ARGV` (in a fresh interpreter)."""
    code = ("import sys\nfrom lit_qlora.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print('LOADED', *sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    line = [line for line in out.stdout.splitlines() if line.startswith("LOADED")]
    assert line, out.stderr
    return set(line[0].split()[1:])


@pytest.mark.parametrize("argv", [["--help"], ["finetune", "--help"], ["generate", "--help"], ["compare", "--help"],
                                  ["finetune", "--no_such_option", "1"], ["finetune", "--checkpoint_dir", "no/such"],
                                  ["finetun"]])
def test_help_and_argument_errors_do_not_import_the_training_stack(argv):
    assert modules_loaded_by(*argv) == set()


def test_the_training_stack_is_what_the_check_sees(tmp_path):
    """The check above can fail: a fine-tune that gets past its argument checks imports Lightning."""
    assert "lightning" in modules_loaded_by("finetune", "--checkpoint_dir", str(tmp_path))


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
from lit_qlora.download import DownloadError
from lit_qlora.errors import UserError

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

    from lit_qlora.generate import generate_command
    from lit_qlora.loading import load_model
    from lit_qlora.lora import apply_lora, lora_modules, save_adapter

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
def test_the_demo_shows_the_fine_tune_answering_a_held_out_question(smollm2_dir, tmp_path, capsys):
    """`make demo`'s recipe and question: the question is a validation row (never trained on); the NF4 base does
    not answer it, the fine-tuned model does."""
    import re
    from pathlib import Path

    import yaml

    from lit_qlora.cli import main
    from lit_qlora.data.module import split_rows
    from lit_qlora.data.sft import DEMO_DATASET, load_json_rows
    from lit_qlora.generate import generate_command

    root = Path(__file__).resolve().parents[1]
    preset = root / "config_hub" / "finetune" / "smollm2-135m" / "qlora.yaml"
    question = re.search(r'--prompt "([^"]+)"', (root / "Makefile").read_text()).group(1)
    recipe = yaml.safe_load(preset.read_text())
    train, val = split_rows(load_json_rows(DEMO_DATASET), recipe["data"]["val_split"], recipe["seed"])
    assert question in [r["instruction"] for r in val] and question not in [r["instruction"] for r in train]

    main(["finetune", "--config", str(preset), "--checkpoint_dir", str(smollm2_dir), "--out_dir", str(tmp_path)])
    capsys.readouterr()
    generate_command(question, checkpoint_dir=smollm2_dir, adapter_dir=tmp_path, compare_base=True)
    base, tuned = capsys.readouterr().out.split("fine-tuned (with the adapter")
    assert "Vienna" not in base and "The capital of Austria is Vienna." in tuned
