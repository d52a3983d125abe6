"""`litqlora finetune --compile true`: regional compilation trains what eager trains, step for step, through the
real `finetune()` (NF4 and dense bases, LoRA dropout, activation checkpointing, the heap-release hooks), and
reports its warm-up apart from the steady throughput."""

import json

import pytest
import torch
from safetensors.torch import load_file

from lit_qlora.train.heap import HeapTrimmer
from lit_qlora.train.compile import compile_blocks, compile_seconds, is_compiled
from lit_qlora.train.datamodule import DataArgs
from lit_qlora.train.finetune import finetune
from lit_qlora.model.transformer import Transformer
from lit_qlora.train.args import LoRAArgs, TrainArgs
from lit_qlora.train.report import print_report

from helpers import assert_same_final, cli_run, metrics_rows, needs_gloo


def packed_data(tmp_path):
    rows = [{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."} for i in range(40)]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    # every training batch has the same shape; alpaca rows and the tied head adapted (fine_tune): the recipe the
    # tolerances below were measured with
    return DataArgs(json_path=path, val_split=0.2, packing=True, prompt_style="alpaca")


def fine_tune(checkpoint_dir, out_dir, data, quantize, precision, compile, monkeypatch):
    """A 3-step run with dropout and checkpointing; returns (metrics rows, summary, adapter, heap releases)."""
    releases = []
    # every offer of a heap release (HeapTrimmer decides whether to trim: that depends on the heap, not the hooks)
    monkeypatch.setattr(HeapTrimmer, "__call__", lambda self: releases.append(torch.is_grad_enabled()) or False)
    summary = finetune(checkpoint_dir=checkpoint_dir, out_dir=out_dir, quantize=quantize, precision=precision,
                       accelerator="cpu", lora=LoRAArgs(r=4, alpha=8, dropout=0.1, targets=["all", "lm_head"]),
                       data=data, compile=compile,
                       train=TrainArgs(micro_batch_size=2, global_batch_size=4, max_seq_length=64, lr=1e-2,
                                       warmup_steps=1, max_steps=3, activation_checkpointing=True))
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, summary, load_file(str(out_dir / "final" / "adapter.safetensors")), releases


# (quantize, precision, loss tolerance, adapter tolerance). In fp32 compiled steps compute what eager ones do up to
# summation order (measured: losses 2e-6, adapters 1e-6 apart). In bf16 the losses and gradient norms matched
# exactly, but Adam's update on a tiny gradient is about lr * its sign: a few elements whose bf16 gradient differs in
# its last bit move apart by ~lr (measured: the adapters up to 3% apart as a whole after 3 steps at lr 1e-2; with the
# fused q/k/v base matmul, one small adapter 9% apart).
CASES = [("nf4", "32-true", 1e-4, 1e-5), ("none", "bf16-true", 1e-3, 0.05)]


@pytest.mark.slow
@pytest.mark.parametrize("quantize, precision, tol, adapter_tol", CASES)
def test_compiled_steps_equal_eager_steps(tiny_llama_dir, tmp_path, quantize, precision, tol, adapter_tol,
                                          monkeypatch, capsys):
    data = packed_data(tmp_path)
    eager_rows, eager, eager_adapter, eager_releases = fine_tune(tiny_llama_dir, tmp_path / "eager", data, quantize,
                                                                 precision, False, monkeypatch)
    rows, summary, adapter, releases = fine_tune(tiny_llama_dir, tmp_path / "compiled", data, quantize, precision,
                                                 "force", monkeypatch)  # force: bf16 too on a CPU that emulates it
    # The same losses, gradient norms and adapters after 3 steps (dropout draws the same masks: its seeds come from
    # torch's generator, outside the graphs, and checkpointing's recompute restores it).
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in eager_rows], rel=tol)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in eager_rows], rel=tol)
    assert summary["val_loss"] == pytest.approx(eager["val_loss"], rel=tol)
    assert summary["initial_val_loss"] == pytest.approx(eager["initial_val_loss"], rel=tol)
    # All adapters together within adapter_tol; a small one (k_proj's B: 192 x 4) may move by a few sign flips more.
    diffs = {name: (adapter[name].float() - t.float()).norm() / t.float().norm() for name, t in eager_adapter.items()}
    total = sum((adapter[n].float() - t.float()).norm() ** 2 for n, t in eager_adapter.items()) ** 0.5
    assert total / sum(t.float().norm() ** 2 for t in eager_adapter.values()) ** 0.5 < adapter_tol
    assert max(diffs.values()) < 3 * adapter_tol, max(diffs, key=diffs.get)
    # The heap-release hooks still run around every compiled block, as often as in eager steps.
    assert releases == eager_releases and len(releases) > 0
    # Step 1 compiles (the validation before it compiled the no-grad graphs); at a fixed shape nothing recompiles.
    assert rows[0]["compile_seconds"] > 0 and [r["compile_seconds"] for r in rows[1:]] == [0, 0]
    assert "compile_seconds" not in eager_rows[0]
    assert summary["compile"] is True and summary["compile_seconds"] >= rows[0]["compile_seconds"]
    assert summary["warmup_steps"] == 1 and summary["first_step_seconds"] > rows[0]["compile_seconds"]
    assert eager["compile"] is False and eager["compile_seconds"] is None and eager["warmup_steps"] == 1
    state = json.loads((tmp_path / "compiled" / "checkpoints" / "step-000003" / "state.json").read_text())
    assert state["run"]["compile"] is True
    printed = capsys.readouterr().out
    assert "tokens/s (after 1 warm-up step)" in printed and "compile time" in printed


def test_resuming_may_change_compile(tiny_llama_dir, tmp_path):
    """--compile is not part of the recipe: a run started eagerly continues compiled."""
    data, out = packed_data(tmp_path), tmp_path / "run"
    common = dict(checkpoint_dir=tiny_llama_dir, out_dir=out, quantize="none", accelerator="cpu",
                  lora=LoRAArgs(r=4, alpha=8, dropout=0.0), data=data)
    train = dict(micro_batch_size=2, global_batch_size=2, max_seq_length=64, save_interval=1)
    finetune(**common, train=TrainArgs(**train, max_steps=1))
    summary = finetune(**common, train=TrainArgs(**train, max_steps=2), resume="auto", compile=True)
    assert summary["steps"] == 2 and summary["resumed_from_step"] == 1 and summary["compile"] is True


def test_compile_blocks_keeps_names_and_is_idempotent():
    from lit_qlora.model.config import Config

    model = Transformer(Config(vocab_size=64, n_layer=2, n_embd=32, n_head=2, n_query_groups=1, intermediate_size=64))
    keys = list(model.state_dict())
    assert compile_blocks(model) == 2 and compile_blocks(model) == 0
    assert all(is_compiled(block) for block in model.blocks) and not is_compiled(model)
    assert list(model.state_dict()) == keys


def test_report_names_the_warm_up(capsys, tmp_path):
    summary = {"steps": 6, "train_loss": 1.0, "val_loss": 1.0, "initial_val_loss": 2.0, "tokens_per_sec": 150.0,
               "peak_rss_bytes": 2**30, "peak_rss_train_bytes": 2**30, "quantized_linears": 0, "total_linears": 1,
               "trainable_params": 1, "total_params": 2, "wall_seconds": 9.0}
    print_report({**summary, "warmup_steps": 1, "compile": False, "compile_seconds": None}, tmp_path)
    eager = capsys.readouterr().out
    assert "tokens/s (after step 1)" in eager and "compile" not in eager
    print_report({**summary, "warmup_steps": 2, "compile": True, "compile_seconds": 41.5, "first_step_seconds": 45.0},
                 tmp_path)
    compiled = capsys.readouterr().out
    assert "tokens/s (after 2 warm-up steps)  150.0" in compiled
    assert "compile time" in compiled and "41.5 s (first step 45.0 s)" in compiled


@pytest.mark.slow
@needs_gloo
def test_two_compiled_ddp_processes_equal_one_eager_process(tiny_llama_dir, one_process, tmp_path):
    """DDP wraps the compiled blocks and trains what one eager process trains (the one_process reference: the same
    global batch, NF4 layout and fp32)."""
    ref_dir, data = one_process
    out = tmp_path / "ddp"
    cli_run(tiny_llama_dir, out, data, "ddp", "--nf4_shards", "2", "--compile", "true")
    assert [r["loss"] for r in metrics_rows(out)] == pytest.approx([r["loss"] for r in metrics_rows(ref_dir)], rel=1e-5)
    assert_same_final(ref_dir, out)
    assert json.loads((out / "summary.json").read_text())["compile_seconds"] > 0


def test_new_batch_shapes_stop_recompiling_after_the_first_change():
    """An unpacked run's batches change length: the first change recompiles with dynamic lengths, later ones reuse it."""
    from lit_qlora.model.config import Config
    from lit_qlora.lora.layer import apply_lora
    from lit_qlora.train.loss import lm_loss_sum

    torch._dynamo.reset()  # forget the shapes earlier tests compiled the same code for
    torch.manual_seed(0)
    model = Transformer(Config(vocab_size=64, n_layer=2, n_embd=32, n_head=2, n_query_groups=1,
                               intermediate_size=64)).train()
    apply_lora(model, 4, 8, dropout=0.1)
    model.checkpoint_blocks = 2
    compile_blocks(model, backend="aot_eager")  # recompiling is dynamo's decision: inductor's C++ would add minutes
    spent = []
    for length in (16, 24, 20, 31, 9):
        before = compile_seconds()
        x = torch.randint(0, 64, (2, length))
        lm_loss_sum(model, x, x).backward()
        spent.append(compile_seconds() - before)
    assert spent[0] > 0 and spent[1] > 0 and spent[2:] == [0, 0, 0]


@pytest.mark.slow
@needs_gloo
def test_two_compiled_fsdp_processes_equal_one_eager_process(tiny_llama_dir, one_process, tmp_path):
    """FSDP2 over compiled blocks trains what one eager process trains. Compiled runs skip Lightning's no-op device
    moves; without the reshard those moves did (the root unit keeps the parameters a validation gathered), every
    step after the first diverged."""
    ref_dir, data = one_process
    out = tmp_path / "fsdp"
    cli_run(tiny_llama_dir, out, data, "fsdp", "--nf4_shards", "2", "--compile", "true")
    assert [r["loss"] for r in metrics_rows(out)] == pytest.approx([r["loss"] for r in metrics_rows(ref_dir)], rel=1e-5)
    assert_same_final(ref_dir, out)


def test_compile_on_a_cpu_that_emulates_the_precision_is_refused_with_the_why_and_force_overrides(
        tiny_llama_dir, tmp_path, monkeypatch):
    """The trap of an AVX2 CPU: bf16 emulated, and compiling that took minutes per step. Refused before anything runs;
    fp32 (what auto picks there) compiles."""
    from lit_qlora.base.errors import UserError
    from lit_qlora.train.spec import compile_choice

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})  # an AVX2-only CPU
    for cap in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # the suite may run under the cap
        monkeypatch.delenv(cap, raising=False)
    with pytest.raises(UserError) as refused:
        finetune(checkpoint_dir=tiny_llama_dir, out_dir=tmp_path / "run", accelerator="cpu", precision="bf16-true",
                 compile=True)
    message = str(refused.value)
    assert "--compile force" in message and "--precision auto (32-true here" in message and "emulated" in message
    assert "7 min 50 s" in message  # the measured why
    assert not (tmp_path / "run").exists()  # refused before anything was written
    assert compile_choice(True, "cpu", "32-true") is True
    assert compile_choice("force", "cpu", "bf16-true") is True and compile_choice(False, "cpu", "bf16-true") is False
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_bf16": True})
    assert compile_choice(True, "cpu", "bf16-true") is True  # native bf16


def test_compile_true_is_taken_on_a_gpu(monkeypatch):
    from lit_qlora.train.spec import compile_choice

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    assert compile_choice(True, "auto", "bf16-true") is True and compile_choice(True, "cuda", "16-mixed") is True


def test_the_compile_mode_setting_reaches_every_block(monkeypatch):
    """LIT_QLORA_COMPILE_MODE (issue 48 item 3's A/B switch: reduce-overhead's CUDA graphs against the default) is
    the mode each block is compiled with; unset, torch.compile's default; a mode torch.compile lacks is refused with
    the setting named."""
    from lit_qlora.base.errors import InvalidInput
    from lit_qlora.model.config import Config

    seen = []

    def recording_compile(fn, **kwargs):
        seen.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", recording_compile)
    config = Config(vocab_size=64, n_layer=2, n_embd=32, n_head=2, n_query_groups=1, intermediate_size=64)
    monkeypatch.setenv("LIT_QLORA_COMPILE_MODE", "reduce-overhead")
    assert compile_blocks(Transformer(config)) == 2 and seen == [{"backend": "inductor", "mode": "reduce-overhead"}] * 2
    monkeypatch.delenv("LIT_QLORA_COMPILE_MODE")
    assert compile_blocks(Transformer(config)) == 2 and seen[2:] == [{"backend": "inductor"}] * 2
    monkeypatch.setenv("LIT_QLORA_COMPILE_MODE", "fastest")
    with pytest.raises(InvalidInput, match="LIT_QLORA_COMPILE_MODE='fastest': this switch takes one of default, reduce-overhead"):
        compile_blocks(Transformer(config))
