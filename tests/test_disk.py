"""Runs that do not die at the finish line: the free disk space a run's outputs need is checked before training
(sizes predicted from the base's shapes equal what a run writes), `--export.merged false` / `--export.peft false`
skip those exports, and an export that fails anyway keeps the trained adapter and names the commands that finish
it."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from lit_qlora.export import hf as export_module
from lit_qlora.train.final import ExportFailed
from lit_qlora.train.finetune import finetune
from lit_qlora.train import disk
from lit_qlora.train.args import ExportArgs, LoRAArgs, TrainArgs
from lit_qlora.train.disk import DiskSpaceError, output_sizes

from helpers import small_data

Usage = namedtuple("Usage", "total used free")
LORA = LoRAArgs(r=4, alpha=8, dropout=0.0)
TRAIN = dict(micro_batch_size=2, global_batch_size=4, max_seq_length=64, lr=1e-2, warmup_steps=1, max_steps=2,
             save_interval=1, keep_last=1)


def run(checkpoint_dir, out_dir, data, export=ExportArgs(), **kw):
    return finetune(checkpoint_dir=checkpoint_dir, out_dir=out_dir, precision="32-true", accelerator="cpu", lora=LORA,
                    data=data, train=TrainArgs(**TRAIN), export=export, **kw)


def file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def test_the_predicted_sizes_are_what_a_run_writes(tiny_llama_dir, tmp_path):
    out = tmp_path / "run"
    run(tiny_llama_dir, out, small_data(tmp_path), ExportArgs(gguf="q8_0"))
    sizes = output_sizes(tiny_llama_dir, LORA, TrainArgs(**TRAIN), ExportArgs(gguf="q8_0"), 4)
    final = out / "final"
    merged = (final / "merged" / "model.safetensors").stat().st_size
    assert sizes.merged <= merged <= sizes.merged * 1.01  # the header's few kB on top
    peft = (final / "peft" / "adapter_model.safetensors").stat().st_size
    assert sizes.peft <= peft <= sizes.peft * 1.05 + 16_000  # its JSON header names every tensor
    gguf = (final / "model-q8_0.gguf").stat().st_size
    assert 0.9 * sizes.gguf <= gguf <= 1.1 * sizes.gguf + 3e6  # norms in f32 and the tokenizer's metadata
    adapter = (final / "adapter.safetensors").stat().st_size
    checkpoint = file_bytes(sorted((out / "checkpoints").iterdir())[-1])
    # final/'s adapter, plus keep_last + 1 checkpoints of the adapter and its two AdamW moments
    assert sizes.adapters <= adapter + 2 * checkpoint
    assert sizes.adapters >= 0.8 * (adapter + 2 * checkpoint)
    assert output_sizes(tiny_llama_dir, LORA, TrainArgs(**TRAIN), ExportArgs(merged=False), 4).merged == 0


def test_a_run_whose_outputs_do_not_fit_is_refused_before_anything_is_loaded(tiny_llama_dir, tmp_path, monkeypatch):
    sizes = output_sizes(tiny_llama_dir, LORA, TrainArgs(**TRAIN), ExportArgs(), 4)
    free = sizes.total - sizes.merged  # room for everything but the merged model
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - free, free))
    loaded = []
    import lit_qlora.train.run as run_module

    real_load = run_module.load_model
    monkeypatch.setattr(run_module, "load_model", lambda *a, **kw: loaded.append(a) or real_load(*a, **kw))
    out = tmp_path / "run"
    with pytest.raises(DiskSpaceError) as refused:
        run(tiny_llama_dir, out, small_data(tmp_path))
    message = str(refused.value)
    assert not loaded and not (out / "checkpoints").exists() and not (out / "final").exists()
    assert str(out) in message and "--export.merged false" in message and "litqlora merge" in message
    assert disk.size_text(sizes.merged) in message and disk.size_text(free) in message
    # without the merged model it fits: the run trains and writes everything else
    run(tiny_llama_dir, out, small_data(tmp_path), ExportArgs(merged=False))
    final = out / "final"
    assert loaded and sorted(p.name for p in final.iterdir()) == ["adapter.safetensors", "adapter_config.json", "peft"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_without_peft_or_merged_final_holds_the_adapter_alone(tiny_llama_dir, tmp_path):
    out = tmp_path / "run"
    run(tiny_llama_dir, out, small_data(tmp_path), ExportArgs(merged=False, peft=False))
    assert sorted(p.name for p in (out / "final").iterdir()) == ["adapter.safetensors", "adapter_config.json"]


def test_a_failed_export_keeps_the_adapter_and_names_the_commands_that_finish_it(tiny_llama_dir, tmp_path,
                                                                                monkeypatch):
    import lit_qlora.checkpoint.hf as checkpoint

    real_save = checkpoint.save_hf_checkpoint

    def disk_full(out_dir, *args, **kwargs):  # a partial file, then the disk is full
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "model.safetensors").write_bytes(b"\0" * 4096)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_hf_checkpoint", disk_full)
    out = tmp_path / "run"
    with pytest.raises(ExportFailed) as failed:
        run(tiny_llama_dir, out, small_data(tmp_path), ExportArgs(gguf="f32"))
    message = str(failed.value)
    final = out / "final"
    assert sorted(p.name for p in final.iterdir()) == ["adapter.safetensors", "adapter_config.json"]
    assert not list(out.glob(".final.tmp*")) and not (out / "summary.json").exists()
    assert "No space left on device" in message and str(final) in message
    for command in (f"litqlora merge --checkpoint_dir {tiny_llama_dir} --adapter_dir {final} --out_dir {final / 'merged'}",
                    f"litqlora export_peft --checkpoint_dir {tiny_llama_dir} --adapter_dir {final}",
                    f"litqlora export_gguf --checkpoint_dir {tiny_llama_dir} --adapter_dir {final} --out "
                    f"{final / 'model-f32.gguf'} --dtype f32", "--resume auto"):
        assert command in message, command
    # the kept adapter is the trained one: the named merge command finishes the export from it
    monkeypatch.setattr(checkpoint, "save_hf_checkpoint", real_save)
    merged = export_module.merge(tiny_llama_dir, final, tmp_path / "merged")
    assert (merged / "model.safetensors").stat().st_size > 4096
    # and --resume auto exports again from the last checkpoint, without training
    summary = run(tiny_llama_dir, out, small_data(tmp_path), ExportArgs(gguf="f32"), resume="auto")
    assert summary["steps"] == 2 and summary["resumed_from_step"] == 2
    assert (final / "merged" / "model.safetensors").is_file() and (final / "model-f32.gguf").is_file()
    assert file_bytes(final / "merged") == file_bytes(merged)
    shutil.rmtree(tmp_path / "merged")
