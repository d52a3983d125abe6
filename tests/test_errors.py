"""Bad input to every command: one short paragraph on stderr naming the file / key / row and what to do, a
non-zero exit, no traceback. Run in-process through `lit_qlora.cli.main`, as `litqlora ...` runs it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_qlora.cli import main
from lit_qlora.train.module import FinetuneModule

ROWS = [{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."} for i in range(24)]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, tiny_llama_dir):
    """Every broken input of the battery, written once."""
    import gguf

    from lit_qlora.checkpoint.hf import copy_tokenizer_files, load_checkpoint, save_hf_checkpoint
    from lit_qlora.model.config import Config
    from lit_qlora.export.hf import hf_tensor_specs
    from lit_qlora.export.gguf_import import bundled_smollm2_path
    from lit_qlora.lora.layer import apply_lora
    from lit_qlora.checkpoint.adapter import save_adapter
    from lit_qlora.model.transformer import Transformer

    d = tmp_path_factory.mktemp("bad")
    text = json.dumps(ROWS)
    (d / "truncated.json").write_text(text[: len(text) // 2])
    (d / "truncated.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS)[:-12])
    holes = [dict(r) for r in ROWS]
    del holes[3]["output"], holes[7]["instruction"]
    (d / "holes.json").write_text(json.dumps(holes))
    (d / "empty.jsonl").write_text("\n\n")
    (d / "latin1.jsonl").write_bytes(json.dumps({"instruction": "caf\u00e9", "output": "x"}, ensure_ascii=False)
                                     .encode("latin-1"))
    (d / "good.json").write_text(text)
    (d / "typo.yaml").write_text(f"checkpoint_dir: {tiny_llama_dir}\ntrain:\n  max_step: 3\n")
    (d / "broken.yaml").write_text("train:\n  lr: [0.1\n")
    (d / "list.yaml").write_text("- lr\n- 0.1\n")
    (d / "bad_value.yaml").write_text("train:\n  lr: fast\n")
    (d / "wrong_shape.jsonl").write_text(json.dumps({"question": "Is it?", "answer": "yes"}) + "\n")

    (d / "no_weights").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (d / "no_weights" / name).write_bytes((tiny_llama_dir / name).read_bytes())
    (d / "bad_config").mkdir()
    (d / "bad_config" / "config.json").write_text('{"hidden_size": 64,')
    (d / "pickle_bin").mkdir()
    (d / "pickle_bin" / "config.json").write_bytes((tiny_llama_dir / "config.json").read_bytes())
    torch.save({"model.norm.weight": Planted()}, d / "pickle_bin" / "pytorch_model.bin")

    model = apply_lora(load_checkpoint(tiny_llama_dir, dtype=torch.float32), r=4, alpha=8)
    adapter_config = {"r": 4, "alpha": 8, "targets": ["all"], "quantize": "none", "base_dtype": "float32",
                      "lora_dtype": "float32", "base_model": str(tiny_llama_dir)}
    save_adapter(model, d / "adapter", adapter_config)
    save_adapter(model, d / "adapter_r8", {**adapter_config, "r": 8})  # config and tensors disagree
    save_adapter(model, d / "adapter_qv", {**adapter_config, "targets": ["q", "v"]})
    small = Config.from_checkpoint(tiny_llama_dir).replace(n_embd=32, n_head=2, n_query_groups=1, head_dim=16,
                                                            intermediate_size=64)
    save_hf_checkpoint(d / "other_base", small, hf_tensor_specs(Transformer(small), torch.float32),
                       dtype=torch.float32)
    copy_tokenizer_files(tiny_llama_dir, d / "other_base")

    (d / "truncated.gguf").write_bytes(bundled_smollm2_path().read_bytes()[: 2 << 20])
    (d / "text.gguf").write_text("not a model")
    writer = gguf.GGUFWriter(d / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return SimpleNamespace(dir=d, base=tiny_llama_dir)


class Planted:
    def __reduce__(self):  # would run `print` if anything unpickled it
        return (print, ("unpickled!",))


def finetune_args(c, *extra):
    return ["finetune", "--checkpoint_dir", c.base, "--out_dir", c.dir / "out", "--accelerator", "cpu",
            "--train.max_steps", "2", "--train.max_seq_length", "64", "--train.micro_batch_size", "2",
            "--train.global_batch_size", "4", "--data.json_path", c.dir / "good.json", *extra]


def raise_in_step(error):
    def step(self, batch, batch_idx):
        raise error
    return step


def nan_loss(self, batch):
    return self.model.forward_hidden(batch["input_ids"]).sum() * float("nan")


# (id, argv from ctx, words the message must hold, FinetuneModule attribute to replace)
CASES = [
    ("truncated-json", lambda c: finetune_args(c, "--data.json_path", c.dir / "truncated.json"),
     ["truncated.json", "not valid JSON", "line 1"], None),
    ("truncated-jsonl", lambda c: finetune_args(c, "--data.json_path", c.dir / "truncated.jsonl"),
     ["truncated.jsonl", "line 24", "invalid JSON"], None),
    ("missing-fields", lambda c: finetune_args(c, "--data.json_path", c.dir / "holes.json"),
     ["holes.json", "row 4: missing `output`", "row 8: missing `instruction`", "Fix or remove"], None),
    ("empty-dataset", lambda c: finetune_args(c, "--data.json_path", c.dir / "empty.jsonl"),
     ["empty.jsonl", "holds no rows"], None),
    ("not-utf8", lambda c: finetune_args(c, "--data.json_path", c.dir / "latin1.jsonl"),
     ["latin1.jsonl", "not UTF-8", "iconv"], None),
    ("yaml-typo", lambda c: ["finetune", "--config", c.dir / "typo.yaml"],
     ["unknown option `train.max_step`", "typo.yaml", "did you mean `train.max_steps`"], None),
    ("flag-typo", lambda c: finetune_args(c, "--lora.rnk", "4"),
     ["unknown option `--lora.rnk`", "did you mean `--lora.r`"], None),
    ("flag-abbreviation", lambda c: finetune_args(c, "--train.max_step", "3"),
     ["unknown option `--train.max_step`", "did you mean `--train.max_steps`"], None),
    ("bad-value", lambda c: finetune_args(c, "--train.activation_checkpointing", "maybe"),
     ["--train.activation_checkpointing", "expected bool or int", "'maybe'"], None),
    ("unknown-command", lambda c: ["finetun"], ["unknown command 'finetun'", "Did you mean `finetune`"], None),
    ("no-command", lambda c: [], ["no command given", "'finetune', 'dpo', 'grpo', 'kto', 'estimate'"], None),
    ("bad-choice", lambda c: finetune_args(c, "--precision", "bf17"),
     ["--precision: expected one of 'auto', 'bf16-true', 'bf16-mixed', '16-mixed', '16-true', '32-true', 'bf16', "
      "'16', '32', got 'bf17'. The nearest lit-qlora takes: 'bf16'."], None),
    ("no-value", lambda c: finetune_args(c, "--resume"), ["--resume: expected bool, 'auto' or Path, got no value"],
     None),
    ("missing-required", lambda c: ["generate", "--checkpoint_dir", c.base], ["generate: --prompt is required"],
     None),
    ("yaml-syntax", lambda c: ["finetune", "--config", c.dir / "broken.yaml"],
     ["broken.yaml is not a valid YAML mapping of options", "line 2, column 7"], None),
    ("yaml-not-mapping", lambda c: ["finetune", "--config", c.dir / "list.yaml"],
     ["list.yaml is not a valid YAML mapping of options: it holds a list"], None),
    ("yaml-bad-value", lambda c: ["finetune", "--config", c.dir / "bad_value.yaml"],
     ["`train.lr` in", "bad_value.yaml: expected float, got 'fast'"], None),
    ("missing-config", lambda c: ["finetune", "--config", c.dir / "nowhere.yaml"],
     ["--config", "nowhere.yaml does not exist"], None),
    ("missing-checkpoint", lambda c: ["generate", "--checkpoint_dir", c.dir / "nowhere", "--prompt", "hi"],
     ["nowhere does not exist", "litqlora download"], None),
    ("no-weights", lambda c: ["generate", "--checkpoint_dir", c.dir / "no_weights", "--prompt", "hi"],
     ["no_weights has no weights", "model.safetensors"], None),
    ("corrupt-config", lambda c: ["merge", "--checkpoint_dir", c.dir / "bad_config", "--adapter_dir",
                                  c.dir / "adapter", "--out_dir", c.dir / "m"],
     ["bad_config/config.json is not valid JSON"], None),
    ("pickled-bin", lambda c: ["merge", "--checkpoint_dir", c.dir / "pickle_bin", "--adapter_dir", c.dir / "adapter",
                               "--out_dir", c.dir / "m"],
     ["pytorch_model.bin was refused", "pickled object", "weights_only=True"], None),
    ("missing-resume-dir", lambda c: finetune_args(c, "--resume", c.dir / "nowhere"),
     ["nowhere/state.json does not exist", "or `auto`"], None),
    ("missing-adapter", lambda c: ["merge", "--checkpoint_dir", c.base, "--adapter_dir", c.dir / "nowhere",
                                   "--out_dir", c.dir / "m"],
     ["Adapter directory", "nowhere does not exist"], None),
    ("adapter-rank", lambda c: ["generate", "--checkpoint_dir", c.base, "--adapter_dir", c.dir / "adapter_r8",
                                "--prompt", "hi"],
     ["adapter_r8/adapter.safetensors", "rank 4", "r=8"], None),
    ("adapter-targets", lambda c: ["merge", "--checkpoint_dir", c.base, "--adapter_dir", c.dir / "adapter_qv",
                                   "--out_dir", c.dir / "m"],
     ["adapter_qv/adapter.safetensors", "k_proj", "other targets"], None),
    ("adapter-shapes", lambda c: ["export_peft", "--checkpoint_dir", c.dir / "other_base", "--adapter_dir",
                                  c.dir / "adapter", "--out_dir", c.dir / "p"],
     ["adapter/adapter.safetensors", "base model of another size", "tiny-llama"], None),
    ("evaluate-data-shape", lambda c: ["evaluate", "--checkpoint_dir", c.base, "--tasks", "truthfulqa_mc2",
                                       "--data_file", c.dir / "wrong_shape.jsonl", "--out_dir", c.dir / "ev"],
     ["wrong_shape.jsonl", "row 1", "mc1_targets"], None),
    ("evaluate-unknown-task", lambda c: ["evaluate", "--checkpoint_dir", c.base, "--tasks", "truthfulqa_mc3",
                                         "--out_dir", c.dir / "ev"],
     ["Unknown lm-eval task(s): 'truthfulqa_mc3'", "did you mean", "truthfulqa_mc2"], None),
    ("compare-train-typo", lambda c: ["compare", "--checkpoint_dir", c.base, "--train.max_stepz", "3",
                                      "--out_dir", c.dir / "cmp"],
     ["--train.max_stepz is not a training setting", "max_steps"], None),
    ("compare-eval-batch-size", lambda c: ["compare", "--checkpoint_dir", c.base, "--eval_batch_size", "0",
                                           "--out_dir", c.dir / "cmp"],
     ["--eval_batch_size must be at least 1, got 0"], None),
    ("nf4-shards-zero", lambda c: finetune_args(c, "--nf4_shards", "0"), ["--nf4_shards must be at least 1, got 0"],
     None),
    ("compare-missing-recipe", lambda c: ["compare", "--config", c.dir / "nowhere.yaml", "--out_dir", c.dir / "cmp"],
     ["nowhere.yaml does not exist", "recipe"], None),
    ("compare-bad-data-file", lambda c: ["compare", "--checkpoint_dir", c.base, "--data_file",
                                         c.dir / "wrong_shape.jsonl", "--out_dir", c.dir / "cmp"],
     ["wrong_shape.jsonl", "row 1", "mc1_targets"], None),
    ("corrupt-gguf", lambda c: ["convert_gguf", c.dir / "truncated.gguf", "--out_dir", c.dir / "g"],
     ["truncated.gguf is not a valid GGUF file", "Re-download"], None),
    ("not-gguf", lambda c: ["convert_gguf", c.dir / "text.gguf", "--out_dir", c.dir / "g"],
     ["text.gguf is not a valid GGUF file", "magic"], None),
    ("unsupported-gguf", lambda c: ["convert_gguf", c.dir / "gpt2.gguf", "--out_dir", c.dir / "g"],
     ["gpt2.gguf", "architecture 'gpt2' is not supported", "litqlora download"], None),
    ("gpu-oom", lambda c: finetune_args(c),
     ["Out of GPU memory at optimizer step 1", "micro_batch_size=2", "--train.micro_batch_size",
      "--train.max_seq_length", "--train.activation_checkpointing"],
     ("training_step", raise_in_step(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")))),
    ("cpu-oom", lambda c: finetune_args(c), ["Out of CPU memory at optimizer step 1", "--train.max_seq_length"],
     ("training_step", raise_in_step(MemoryError()))),
    ("nonfinite-loss", lambda c: finetune_args(c),
     ["The loss became nan at optimizer step 1", "--train.on_nonfinite skip"], ("micro_loss_sum", nan_loss)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_paragraph(case, ctx, capsys, monkeypatch):
    _, argv, words, patch = case
    if patch:
        monkeypatch.setattr(FinetuneModule, *patch)
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv(ctx)])
    err = capsys.readouterr().err
    assert exit_info.value.code not in (0, None)
    assert "Traceback" not in err and "usage:" not in err
    assert err.count("litqlora: error:") == 1
    paragraph = err[err.index("litqlora: error:"):].strip()
    assert "\n" not in paragraph and len(paragraph) < 800, paragraph
    for word in words:
        assert word in paragraph, (word, paragraph)
    assert not (ctx.dir / "m").exists() and not (ctx.dir / "g").exists()  # nothing half-written


def test_debug_in_the_yaml_shows_the_traceback(ctx, tmp_path, capsys):
    config = tmp_path / "debug.yaml"
    config.write_text(f"checkpoint_dir: {ctx.dir / 'nowhere'}\ndebug: true\n")
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        main(["finetune", "--config", str(config)])


USAGE = [  # argv from ctx, the message (same as in CASES)
    (lambda c: ["finetun"], "unknown command 'finetun'"),
    (lambda c: finetune_args(c, "--lora.rnk", "4"), "unknown option `--lora.rnk`; did you mean `--lora.r`?"),
    (lambda c: ["finetune", "--config", c.dir / "typo.yaml"], "did you mean `train.max_steps`?"),
    (lambda c: finetune_args(c, "--train.activation_checkpointing", "maybe"), "expected bool or int, got 'maybe'"),
    (lambda c: ["generate", "--checkpoint_dir", c.base], "--prompt is required"),
    (lambda c: ["finetune", "--config", c.dir / "list.yaml"], "it holds a list"),
]


@pytest.mark.parametrize("argv, message", USAGE)
def test_usage_errors_come_from_the_input_not_from_jsonargparse_wording(argv, message, ctx, capsys, monkeypatch):
    """The explanation does not depend on what jsonargparse's message says: reworded, the same one comes out."""
    import lit_qlora.cli as cli
    from jsonargparse import ArgumentError

    def reworded_parser(*args, **kwargs):
        parser = real_build_parser(*args, **kwargs)
        parse_args = parser.parse_args

        def parse(argv):
            try:
                return parse_args(argv)
            except ArgumentError:
                raise ArgumentError(None, "jsonargparse put it in other words") from None

        parser.parse_args = parse
        return parser

    real_build_parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", reworded_parser)
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv(ctx)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert message in err and "other words" not in err


def test_an_unexplained_rejection_shows_jsonargparse_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--no_such_global_option"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert err.startswith("litqlora: error: ") and "\n" not in err and "--no_such_global_option" in err


def test_options_and_types_as_a_user_reads_them():
    from typing import Literal, Optional, Union

    from lit_qlora.cli import commands
    from lit_qlora.cli.usage import Options, describe

    assert describe(Union[bool, int]) == "bool or int"
    assert describe(Union[bool, Literal["auto"], Path]) == "bool, 'auto' or Path"
    assert describe(Optional[float]) == "float or null"
    assert describe(Literal["nf4", "none"]) == "one of 'nf4', 'none'"
    assert describe(Optional[list[str]]) == "list[str] or null"
    table = commands()
    finetune, compare = Options.of(table["finetune"]), Options.of(table["compare"])
    assert finetune.knows("train.max_steps") and finetune.knows("train") and not finetune.knows("train.max_stepz")
    assert not finetune.knows("train.lr.x") and finetune.knows("print_config")
    assert compare.knows("train.max_stepz")  # compare's --train is a dict: compare checks its keys itself
    assert Options.of(table["generate"]).required == ("prompt",)


def failing_command(error):
    def fail() -> None:
        """Fail with the error the test chose."""
        raise error
    return fail


@pytest.mark.parametrize("kind", ["UserError", "InvalidInput", "MissingFile", "NonFinite", "CheckpointError"])
def test_a_user_error_from_a_command_is_one_paragraph_and_exit_1(kind, monkeypatch, capsys):
    import lit_qlora.cli as cli
    import lit_qlora.base.errors as errors
    from lit_qlora.checkpoint.files import CheckpointError
    from lit_qlora.base.errors import NonFinite

    error_type = {"NonFinite": NonFinite, "CheckpointError": CheckpointError}.get(kind) or getattr(errors, kind)
    assert issubclass(error_type, errors.UserError)
    monkeypatch.setattr(cli, "commands", lambda: {"fail": failing_command(error_type("x.json is wrong; fix it"))})
    with pytest.raises(SystemExit) as exit_info:
        main(["fail"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "litqlora: error: x.json is wrong; fix it\n"


@pytest.mark.parametrize("error", [ValueError("an invariant broke"), FileNotFoundError("an internal file"),
                                   FloatingPointError("nan inside"), KeyError("no such key")],
                         ids=lambda e: type(e).__name__)
def test_a_bare_builtin_error_from_a_command_is_a_bug_with_its_traceback(error, monkeypatch, capsys):
    """Only a UserError is the user's: a ValueError (or FileNotFoundError, ...) that no check of ours turned into
    one is a bug. It is re-raised (the interpreter prints its traceback) after one line asking for a report."""
    import lit_qlora.cli as cli

    monkeypatch.setattr(cli, "commands", lambda: {"fail": failing_command(error)})
    with pytest.raises(type(error)) as raised:
        main(["fail"])
    assert raised.value is error
    err = capsys.readouterr().err
    assert "litqlora: error:" not in err
    assert err.count("\n") == 1 and "a bug in lit-qlora" in err and "report" in err and "litqlora fail" in err, err


# Raises of bare built-in errors left in lit_qlora/ and eval/, at most this many per file. Each is a check of an
# internal invariant (a caller's bug, not the user's input) or caught at once by our own code; a check of the
# user's flags, files, rows or machine raises a UserError (lit_qlora.base.errors).
BUILTIN_RAISES = {
    "eval/lm.py": 2,  # rolling_windows' max_length argument; an lm-eval request without context
    "eval/tasks/utils.py": 1,  # as many log-likelihoods as labels
    "lit_qlora/checkpoint/files.py": 3,  # two caught at once (-> CheckpointError); TensorSpec's arguments
    "lit_qlora/nf4/gemv.py": 1,  # the isa= argument tests use to force a build
    "lit_qlora/checkpoint/loading.py": 2,  # load_model's arguments: a resolved precision; no layout with an adapter
    "lit_qlora/methods/grpo/loss.py": 1,  # a loss_type the settings' check already refused
    "lit_qlora/methods/grpo/rewards.py": 2,  # score's own arguments of uneven lengths (a caller's bug, not a user's)
    "lit_qlora/methods/grpo/rollout.py": 1,  # a prompt past the compiled decode's cache (the data module leaves such out)
    "lit_qlora/model/attention_mask.py": 1,
    "lit_qlora/model/transformer.py": 4,  # forward's arguments (input_pos, packed positions, explicit masks)
    "lit_qlora/model/decode_step.py": 2,  # DecodeStep's tokens and positions against its cache (a caller's bug)
    "lit_qlora/nf4/codec.py": 2,  # the out= tensor
    "lit_qlora/nf4/layout.py": 9,  # arguments of the layout helpers (a user's shapes and shards raise InvalidInput)
    "lit_qlora/nf4/native.py": 1,  # PermissionError, caught at once: a per-user temp directory instead
    "lit_qlora/nf4/triton.py": 1,
    "lit_qlora/parallel/tensor_parallel.py": 1,  # parallelize before load_model(shard=...)
    "lit_qlora/train/precision.py": 1,  # NF4Precision's argument (the CLI resolves --precision first)
    "lit_qlora/train/sampler.py": 1,  # the rank
}


def test_user_input_checks_raise_user_errors_not_bare_builtins():
    import re

    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"\braise (ValueError|FileNotFoundError|NotADirectoryError|PermissionError|"
                         r"FloatingPointError)\b")
    found = {}
    for folder in ("lit_qlora", "eval"):
        for path in sorted((root / folder).rglob("*.py")):
            count = len(pattern.findall(path.read_text(encoding="utf-8")))
            if count:
                found[path.relative_to(root).as_posix()] = count
    over = {path: n for path, n in found.items() if n > BUILTIN_RAISES.get(path, 0)}
    assert not over, (f"raise a UserError subclass (lit_qlora.base.errors) for checks of user input; list internal "
                      f"invariants in BUILTIN_RAISES: {over}")


BROKEN_CHECKPOINT_COMMANDS = {
    "finetune": ["--out_dir", "{out}"],
    "dpo": ["--out_dir", "{out}"],
    "estimate": ["--out_dir", "{out}"],
    "generate": ["--prompt", "hi"],
    "chat": [],
    "serve": [],
    "merge": ["--adapter_dir", "{out}", "--out_dir", "{out}"],
    "export_peft": ["--adapter_dir", "{out}", "--out_dir", "{out}"],
    "export_gguf": ["--out", "{out}/m.gguf"],
    "evaluate": ["--tasks", "truthfulqa_mc2"],
}


@pytest.mark.parametrize("command", list(BROKEN_CHECKPOINT_COMMANDS))
def test_every_verb_checks_a_checkpoint_folder_before_reading_it(command, tmp_path, capsys):
    """A config.json without the model's fields (and no weights): one paragraph naming the file and the fields, exit 1,
    from every verb, before anything reads the folder (the disk check, the loader, a server's worker)."""
    from lit_qlora.cli import main

    broken = tmp_path / "ckpt"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    argv = [command, "--checkpoint_dir", str(broken),
            *(a.format(out=tmp_path / "out") for a in BROKEN_CHECKPOINT_COMMANDS[command])]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 1, err
    assert err.count("\n") == 1 and err.startswith("litqlora: error: ") and "Traceback" not in err
    assert f"{broken / 'config.json'} lacks vocab_size, hidden_size, num_hidden_layers" in err


def test_a_checkpoint_without_weights_or_tokenizer_is_named_before_loading(tiny_llama_dir, tmp_path):
    import shutil

    from lit_qlora.checkpoint.hf import require_checkpoint
    from lit_qlora.base.errors import UserError

    require_checkpoint(tiny_llama_dir)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_llama_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors*"))
    with pytest.raises(UserError, match="has no weights"):
        require_checkpoint(no_weights)
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_llama_dir, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer.json"))
    with pytest.raises(UserError, match="has no tokenizer.json"):
        require_checkpoint(no_tokenizer)
    require_checkpoint(no_tokenizer, tokenizer=False)  # merge and export_peft copy tokenizer files where they exist


def test_a_grpo_preset_run_before_its_sft_names_the_preset_that_writes_its_starting_adapter(tiny_llama_dir, tmp_path,
                                                                                         monkeypatch, capsys):
    """Issue 55 item 8: the GRPO preset's --train.init_adapter is what its SFT preset writes. Run first, it said
    "--adapter_dir must be ...", a flag the user never gave; now it names --train.init_adapter and the command to run."""
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "config_hub").symlink_to(Path(__file__).resolve().parents[1] / "config_hub")
    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--config", "config_hub/grpo/smollm2-135m/qlora.yaml", "--checkpoint_dir", str(tiny_llama_dir)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and "\n" not in err, err
    assert err.startswith("litqlora: error: Adapter directory out/grpo/smollm2-135m-sft/final does not exist: "
                          "--train.init_adapter must be a fine-tune's out_dir"), err
    assert err.endswith("This run starts from the adapter that `litqlora finetune --config "
                        "config_hub/grpo/smollm2-135m/sft.yaml` writes there: run that first, then this command "
                        "again."), err
    assert not (tmp_path / "out").exists()
