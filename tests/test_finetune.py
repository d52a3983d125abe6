"""`litqlora finetune` end to end on a tiny model: artifacts, accumulation; and the real SmolLM2. Resume after kill -9
and signals: test_reliability.py."""

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lit_qlora.train.datamodule import DataArgs
from lit_qlora.train.finetune import finetune

from helpers import metrics_rows, small_data, tensorboard_events, tensorboard_scalars, tiny_finetune
from lit_qlora.train.args import LoRAArgs, TrainArgs
from lit_qlora.train.module import lr_multiplier

ROOT = Path(__file__).resolve().parents[1]



def test_tiny_run_writes_every_artifact(tiny_llama_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("LIT_QLORA_NF4_SCRATCH", "1")  # the default, set: recorded all the same
    monkeypatch.setenv("LIT_QLORA_API_KEY", "a-secret")
    summary = tiny_finetune(tiny_llama_dir, out, small_data(tmp_path), save_interval=2, activation_checkpointing=1)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {"step", "loss", "lr", "tokens_per_sec", "peak_memory_bytes"} <= set(rows[0])
    assert all(r["tokens_per_sec"] > 0 and r["peak_memory_bytes"] > 0 for r in rows)
    assert rows[0]["lr"] == pytest.approx(1e-2) and rows[2]["lr"] < rows[1]["lr"]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["steps"] == summary["steps"] == 3
    for key in ("steps", "train_loss", "val_loss", "tokens_per_sec", "wall_seconds", "peak_rss_bytes",
                "quantized_linears", "total_linears", "trainable_params", "total_params"):
        assert on_disk[key] is not None, key
    assert on_disk["switches"] == {"LIT_QLORA_API_KEY": "set", "LIT_QLORA_NF4_SCRATCH": "1"}  # never the key
    assert on_disk["quantized_linears"] == on_disk["total_linears"] == 14  # the tied head reads the embedding
    assert 0 < on_disk["peak_rss_train_bytes"] <= on_disk["peak_rss_bytes"]  # through training, and the whole run
    assert on_disk["trainable_params"] < on_disk["total_params"]
    assert list((out / "logs").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    final = out / "final"
    assert [p.name for p in final.glob("*.safetensors")] == ["adapter.safetensors"]
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["quantize"] == "nf4"
    assert (final / "merged" / "model.safetensors").is_file() and (final / "merged" / "tokenizer.json").is_file()
    assert (final / "peft" / "adapter_model.safetensors").is_file()
    transformers = pytest.importorskip("transformers")
    merged = transformers.AutoModelForCausalLM.from_pretrained(final / "merged")
    assert merged.config.num_hidden_layers == 2



# metrics.jsonl's keys -> the TensorBoard tags a user reads them under.
TENSORBOARD_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                    "tokens_per_sec": "train/tokens_per_sec", "tokens": "train/tokens",
                    "peak_memory_bytes": "memory/peak_bytes"}



def assert_logged(events, expected):
    """`events` holds each step of `expected` ({step: value}) once, in order, with its value (as float32)."""
    assert [step for step, _ in events] == list(expected)
    assert [value for _, value in events] == pytest.approx(list(expected.values()), rel=1e-6)


@pytest.fixture(scope="module")
def resumed_run(tiny_llama_dir, tmp_path_factory):
    """A 5-step run (metrics every 2 steps, a checkpoint every step) and, as if it had been killed after step 3, its
    resume with --resume auto: the first run's logs/ as it left them, both runs' rows and summaries, and what the
    resumed run printed on stderr."""
    tmp = tmp_path_factory.mktemp("resumed")
    out, data = tmp / "run", small_data(tmp)
    kw = dict(max_steps=5, log_interval=2, save_interval=1, keep_last=5)
    first = tiny_finetune(tiny_llama_dir, out, data, **kw)
    first_rows = metrics_rows(out)
    shutil.copytree(out / "logs", tmp / "first-logs")
    for step in (4, 5):
        shutil.rmtree(out / "checkpoints" / f"step-{step:06d}")
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):  # the progress bar writes to sys.stderr as it is when setup() runs
        resumed = tiny_finetune(tiny_llama_dir, out, data, resume="auto", **kw)
    return SimpleNamespace(out=out, first=first, first_rows=first_rows, first_logs=tmp / "first-logs",
                           resumed=resumed, resumed_rows=metrics_rows(out), printed=printed.getvalue())


def test_tensorboard_gets_the_metrics_jsonl_rows_and_val_loss_at_the_runs_steps_in_one_event_file(resumed_run):
    rows, first = resumed_run.first_rows, resumed_run.first
    assert [r["step"] for r in rows] == [2, 4]
    assert len(list(resumed_run.first_logs.glob("events.out.tfevents.*"))) == 1  # validate, fit, validate: one file
    tb = tensorboard_scalars(resumed_run.first_logs)
    assert set(tb) == {*TENSORBOARD_TAGS.values(), "val/loss"}
    assert tb["train/loss"] == [(r["step"], r["loss"]) for r in rows]  # fp32 losses: TensorBoard holds them exactly
    for key, tag in TENSORBOARD_TAGS.items():
        assert_logged(tb[tag], {r["step"]: r[key] for r in rows})
    assert_logged(tb["val/loss"], {0: first["initial_val_loss"], 5: first["val_loss"]})


def test_a_resume_adds_one_event_file_and_tensorboard_shows_each_step_once(resumed_run):
    """Killed after step 3, the resumed run logs step 4 again (and, at the run's steps, not 3 + 2): TensorBoard shows
    the resumed run's step 4 and final validation only, like metrics.jsonl."""
    out, rows, resumed = resumed_run.out, resumed_run.resumed_rows, resumed_run.resumed
    same = ("step", "loss", "lr", "grad_norm", "tokens")  # exact resume; only the timing and memory differ
    assert [{k: r[k] for k in same} for r in rows] == [{k: r[k] for k in same} for r in resumed_run.first_rows]
    assert rows[1]["tokens_per_sec"] != resumed_run.first_rows[1]["tokens_per_sec"]  # step 4 was trained again
    assert len(list((out / "logs").glob("events.out.tfevents.*"))) == 2
    tb = tensorboard_scalars(out / "logs")
    assert set(tb) == {*TENSORBOARD_TAGS.values(), "val/loss"}
    for key, tag in TENSORBOARD_TAGS.items():
        assert_logged(tb[tag], {r["step"]: r[key] for r in rows})
    # A resume does not validate before training: its summary keeps the run's first validation, from the checkpoint.
    assert resumed["initial_val_loss"] == resumed_run.first["initial_val_loss"] is not None
    assert_logged(tb["val/loss"], {0: resumed_run.first["initial_val_loss"], 5: resumed["val_loss"]})


def test_hparams_yaml_and_tensorboards_hparams_tab_hold_the_runs_settings(resumed_run):
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    logs = resumed_run.out / "logs"
    saved = json.loads((resumed_run.out / "checkpoints" / "step-000005" / "state.json").read_text())["run"]
    settings = yaml.safe_load((logs / "hparams.yaml").read_text())
    assert settings["seed"] == 1337 and settings["quantize"] == "nf4" and settings["precision"] == "bf16-true"
    assert (settings["lora.r"], settings["lora.alpha"], settings["train.lr"], settings["train.max_steps"]) == (4, 8, 1e-2, 5)
    for group in ("lora", "train", "data"):
        assert {k: settings[f"{group}.{k}"] for k in saved[group]} == saved[group]
    assert settings["checkpoint_dir"] == saved["checkpoint_dir"] and settings["world_size"] == 1

    content = tensorboard_events(logs).PluginTagToContent("hparams")
    experiment = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"train/loss", "val/loss"}
    shown = HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info.hparams
    assert shown["seed"].number_value == 1337 and shown["lora.r"].number_value == 4
    assert shown["train.lr"].number_value == pytest.approx(1e-2) and shown["quantize"].string_value == "nf4"
    assert json.loads(shown["lora.targets"].string_value) == settings["lora.targets"]
    assert shown["lora.rslora"].string_value == "false"


def test_the_progress_counts_the_steps_before_a_resume(resumed_run):
    lines = resumed_run.printed.splitlines()
    row4 = resumed_run.resumed_rows[1]
    assert [line.split(",")[0] for line in lines] == ["Training 4/5 steps", "Training 5/5 steps",
                                                      "Validation at step 5/5: loss " + f"{resumed_run.resumed['val_loss']:.4f}"]
    assert f"loss {row4['loss']:.4f}, {row4['tokens_per_sec']:,.0f} tokens/s" in lines[0]
    assert f"loss {resumed_run.resumed['train_loss']:.4f}" in lines[1]


def test_a_run_prints_its_steps_losses_and_tokens_per_sec_and_nothing_of_lightnings(tiny_llama_dir, tmp_path):
    """`litqlora finetune` with its output captured (not a terminal): one line per validation and per logged step on
    stderr, the report on stdout; no Lightning status lines, warnings, `v_num` or "max_epochs reached"."""
    data, out = small_data(tmp_path), tmp_path / "run"
    args = ["finetune", "--checkpoint_dir", tiny_llama_dir, "--out_dir", out, "--data.json_path", data.json_path,
            "--data.val_split", 0.25, "--train.max_steps", 3, "--train.global_batch_size", 4,
            "--train.micro_batch_size", 2, "--train.max_seq_length", 64, "--lora.r", 4]
    proc = subprocess.run([sys.executable, "-m", "lit_qlora.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows, summary = metrics_rows(out), json.loads((out / "summary.json").read_text())
    expected = [f"Validation at step 0/3: loss {summary['initial_val_loss']:.4f}"]
    expected += [rf"Training {r['step']}/3 steps, \d\d:\d\d<\d\d:\d\d, loss {r['loss']:.4f}, "
                 rf"{r['tokens_per_sec']:,.0f} tokens/s" for r in rows]
    expected += [f"Validation at step 3/3: loss {summary['val_loss']:.4f}"]
    lines = proc.stderr.splitlines()
    assert len(lines) == len(expected) == 5, proc.stderr
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    # stdout: the precision chosen and why, first, what the data holds, then the report (which repeats the precision)
    # (the prompt style and the LoRA targets, where the checkpoint ties its head, are said too)
    assert re.match(rf"Precision: {summary['precision']} \(auto: [^\n]+\)\n"
                    rf"Prompt style: chat_template \(auto: [^\n]+\)\n"
                    rf"Data: {re.escape(str(data.json_path))}: 24 alpaca rows \(detected from their columns\)\n"
                    rf"LoRA targets: q, k, v, o, gate, up, down \(lm_head is tied [^\n]+\)\n"
                    rf"\nRun finished: {re.escape(str(out))}\n", proc.stdout), proc.stdout
    assert re.search(rf"\n  precision +{summary['precision']}\n", proc.stdout)
    for noise in ("max_epochs", "v_num", "it/s", "GPU available", "TPU available", "Warning"):
        assert noise not in proc.stdout + proc.stderr, noise


def test_piped_validations_follow_the_step_they_validate(tiny_llama_dir, tmp_path):
    """Not a terminal, with --train.eval_interval: each step's line comes before the validation that follows it."""
    data, out = small_data(tmp_path), tmp_path / "run"
    args = ["finetune", "--checkpoint_dir", tiny_llama_dir, "--out_dir", out, "--data.json_path", data.json_path,
            "--data.val_split", 0.25, "--train.max_steps", 4, "--train.eval_interval", 2, "--train.global_batch_size",
            4, "--train.micro_batch_size", 2, "--train.max_seq_length", 64, "--lora.r", 4]
    proc = subprocess.run([sys.executable, "-m", "lit_qlora.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split(":")[0].split(",")[0] for line in proc.stderr.splitlines()
             if line.startswith(("Training", "Validation at"))]
    steps = [line.replace(" steps", "") for line in lines]
    for k in (2, 4):  # the periodic validations come after their step's line
        assert steps.index(f"Training {k}/4") < steps.index(f"Validation at step {k}/4"), lines
    assert steps[0] == "Validation at step 0/4" and steps[-1] == "Validation at step 4/4", lines


def terminal_screen(output: bytes, width: int) -> list[str]:
    """The lines a terminal of `width` columns shows after `output`: carriage returns, line feeds, cursor-up, erase
    to end of line and wrapping, the control sequences tqdm and Python's printing use."""
    lines, row, col = [[]], 0, 0
    for count, command, cr, lf, char in re.findall(r"\x1b\[(\d*)([A-Za-z])|(\r)|(\n)|(.)",
                                                   output.decode(errors="replace"), re.S):
        if command == "A":
            row = max(0, row - int(count or 1))
        elif command == "K":
            del lines[row][col:]
        elif cr:
            col = 0
        elif lf:
            row += 1
        elif char:
            if col == width:  # the cursor sits past the last column until the next character wraps it
                row, col = row + 1, 0
            lines.extend([] for _ in range(row + 1 - len(lines)))
            line = lines[row]
            line.extend(" " for _ in range(col + 1 - len(line)))
            line[col] = char
            col += 1
        lines.extend([] for _ in range(row + 1 - len(lines)))
    return ["".join(line).rstrip() for line in lines if "".join(line).strip()]


def test_a_terminal_shows_the_bar_once_and_lines_in_step_order(tiny_llama_dir, tmp_path):
    """On a terminal (a real pty, 100 columns): the finished bar's line stays once, the validations' lines sit in
    step order around it, and nothing else redraws a line that stays."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    data, out = small_data(tmp_path), tmp_path / "run"
    args = ["finetune", "--checkpoint_dir", tiny_llama_dir, "--out_dir", out, "--data.json_path", data.json_path,
            "--data.val_split", 0.25, "--train.max_steps", 4, "--train.eval_interval", 2, "--train.global_batch_size",
            4, "--train.micro_batch_size", 2, "--train.max_seq_length", 64, "--lora.r", 4, "--export.merged", "false",
            "--export.peft", "false"]
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "lit_qlora.cli", *map(str, args)], stdin=terminal,
                            stdout=terminal, stderr=terminal, close_fds=True)
    os.close(terminal)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: every holder of the terminal's end has closed it
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    assert proc.wait(timeout=600) == 0, output.decode(errors="replace")[-3000:]
    screen = terminal_screen(output, 100)
    steps = [line.split(":")[0].split(" |")[0].replace(" steps", "") for line in screen
             if line.startswith(("Training", "Validation at"))]
    assert steps == ["Validation at step 0/4", "Validation at step 2/4", "Training 4/4",
                     "Validation at step 4/4"], screen
    assert re.fullmatch(r"Training 4/4 steps \|█+\| \d\d:\d\d<00:00, loss \d+\.\d{4}, [\d,]+ tokens/s", screen[
        [i for i, line in enumerate(screen) if line.startswith("Training")][0]]), screen
    assert len(screen) == len(set(screen)), screen  # no line left behind twice by a redraw


def test_a_terminal_that_reports_no_size_gets_an_80_column_bar(monkeypatch):
    """A 0x0 pty (`script`, some IDE consoles): tqdm, asked to follow its width, would draw nothing at all."""
    import os

    from lit_qlora.train.progress import FALLBACK_COLUMNS, StepProgressBar

    class Pty(io.StringIO):
        def isatty(self):
            return True

        def fileno(self):
            return 99

    bar = StepProgressBar(1, stream=Pty())
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    assert bar._width() == {"ncols": FALLBACK_COLUMNS}
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((120, 40)))
    assert bar._width() == {"dynamic_ncols": True}


def test_the_progress_bar_is_ours_with_or_without_rich(tiny_llama_dir, tmp_path, monkeypatch):
    """Lightning adds RichProgressBar when `rich` is installed and TQDMProgressBar otherwise; a fine-tune shows its
    own bar either way. On a terminal it is a tqdm bar of optimizer steps with the loss and tokens/s."""
    pytest.importorskip("rich")
    import lightning as L
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.callbacks.progress import ProgressBar
    from lightning.pytorch.trainer.connectors import callback_connector

    from lit_qlora.train.run import fit, setup
    from lit_qlora.train.progress import StepProgressBar
    from lit_qlora.train.spec import RunSpec

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    data = small_data(tmp_path)
    for rich in (False, True):
        monkeypatch.setattr(callback_connector, "_RICH_AVAILABLE", rich)
        lightnings = L.Trainer(logger=False, enable_checkpointing=False).progress_bar_callback
        assert type(lightnings) is (RichProgressBar if rich else TQDMProgressBar)
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        run_ = setup(RunSpec(checkpoint_dir=tiny_llama_dir, out_dir=tmp_path / f"rich-{rich}", quantize="nf4",
                     precision="bf16-true", seed=1337, accelerator="cpu", devices=1, num_nodes=1, strategy="auto",
                     tensor_parallel=1, nf4_shards=None, resume=False, lora=LoRAArgs(r=4, alpha=8, dropout=0.0),
                     train=TrainArgs(micro_batch_size=2, global_batch_size=4, max_seq_length=64, max_steps=2),
                     data=data, ignore_modules=None))
        assert type(run_.trainer.progress_bar_callback) is StepProgressBar
        assert [c for c in run_.trainer.callbacks if isinstance(c, ProgressBar)] == [run_.trainer.progress_bar_callback]
    summary = fit(run_)
    shown = terminal.getvalue()
    assert "\rValidation:" in shown  # a transient bar over the validation batches
    # The training bar as it is left on screen (in ASCII: a StringIO declares no encoding tqdm could draw blocks in).
    last = [frame for frame in re.split(r"[\r\n]", shown) if frame.startswith("Training")][-1]
    assert re.fullmatch(rf"Training 2/2 steps \|[█#]+\| \d\d:\d\d<00:00, loss {summary['train_loss']:.4f}, "
                        r"[\d,]+ tokens/s", last), last
    assert f"Validation at step 2/2: loss {summary['val_loss']:.4f}\n" in shown


def test_accumulated_step_equals_one_large_batch(tiny_llama_dir, tmp_path):
    data = small_data(tmp_path)
    common = dict(quantize="none", precision="32-true", max_steps=1, global_batch_size=4)
    tiny_finetune(tiny_llama_dir, tmp_path / "a", data, micro_batch_size=1, **common)  # 4 micro-batches
    tiny_finetune(tiny_llama_dir, tmp_path / "b", data, micro_batch_size=4, **common)  # 1 batch of 4
    a = load_file(str(tmp_path / "a" / "final" / "adapter.safetensors"))
    b = load_file(str(tmp_path / "b" / "final" / "adapter.safetensors"))
    assert a.keys() == b.keys()
    # Updates are ~lr = 1e-2; four micro-batches sum in another order than one batch: the largest difference measured
    # was 0.97e-6 with AVX-512 kernels and 1.05e-6 with AVX2 ones (lm_head's B), a relative 1e-4 of the update.
    assert all(torch.allclose(a[k], b[k], atol=2e-6) for k in a)
    assert any(not torch.equal(a[k], torch.zeros_like(a[k])) for k in a if k.endswith("lora_B"))
    loss_a = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    loss_b = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert loss_a == pytest.approx(loss_b, rel=1e-5)


def test_cpu_step_offers_heap_release_around_blocks_before_backward_and_after_the_update(tiny_llama_dir, tmp_path,
                                                                                      monkeypatch):
    import lit_qlora.train.callbacks as callbacks

    checks = []

    class Recording(callbacks.HeapTrimmer):
        def __call__(self) -> bool:
            checks.append(torch.is_grad_enabled())
            return super().__call__()

    monkeypatch.setattr(callbacks, "HeapTrimmer", Recording)
    validation, offer = [], callbacks.HeapRelease.on_validation_batch_end
    monkeypatch.setattr(callbacks.HeapRelease, "on_validation_batch_end",
                        lambda self, *args, **kwargs: validation.append(1) or offer(self, *args, **kwargs))
    tiny_finetune(tiny_llama_dir, tmp_path / "run", small_data(tmp_path), max_steps=2)  # 2 micro-batches per step
    n_layer = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    # Per micro-batch: after each block's forward and before its backward, and before the backward starts; once
    # after each optimizer step.
    # And once after each validation batch, the first validation (before any training step) included.
    assert len(checks) - len(validation) == 2 * (2 * (2 * n_layer + 1) + 1)
    assert len(validation) >= 2 and len(validation) % 2 == 0  # the first and the last validation, alike
    assert checks[: len(validation) // 2] == [False] * (len(validation) // 2)  # the first: grad disabled


def test_lr_schedule_warms_up_then_decays_to_zero():
    assert lr_multiplier(0, 4, 20) == pytest.approx(0.25)
    assert lr_multiplier(3, 4, 20) == pytest.approx(1.0)
    assert lr_multiplier(12, 4, 20) == pytest.approx(0.5)
    assert lr_multiplier(20, 4, 20) == pytest.approx(0.0, abs=1e-12)


def test_global_batch_must_divide():
    with pytest.raises(ValueError, match="multiple of train.micro_batch_size"):
        TrainArgs(micro_batch_size=3, global_batch_size=16).accumulation(1)


@pytest.mark.parametrize("preset", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "config_hub").rglob("*.yaml")))
def test_every_preset_parses(preset, capsys):
    from lit_qlora.cli import main

    command = preset.split("/")[1]  # config_hub/finetune/... and config_hub/dpo/...: the command that reads it
    with pytest.raises(SystemExit) as e:
        main([command, "--config", str(ROOT / preset), "--print_config"])
    assert e.value.code == 0
    printed = capsys.readouterr().out
    assert "lora:" in printed and "train:" in printed


@pytest.mark.slow
def test_real_smollm2_qlora_lowers_validation_loss(smollm2_dir, tmp_path):
    data = DataArgs(val_split=0.05)  # the shipped demo set
    summary = finetune(checkpoint_dir=smollm2_dir, out_dir=tmp_path / "smol", accelerator="cpu",
                       lora=LoRAArgs(r=8, alpha=16, dropout=0.0),
                       train=TrainArgs(max_steps=3, micro_batch_size=4, global_batch_size=8, max_seq_length=128,
                                       lr=1e-3, warmup_steps=1), data=data)
    assert summary["quantized_linears"] == summary["total_linears"] == 210  # the tied head reads the embedding
    assert summary["val_loss"] < summary["initial_val_loss"] - 0.05
