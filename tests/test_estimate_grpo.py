"""`litqlora estimate --method grpo`: the rollouts' KV cache is the bytes the model's own cache allocates; the peak
is the larger of the training step (the SFT trace at micro_batch_size completions) and the sampling phase; a large
group makes sampling the peak, and a grpo preset reads as such."""

from __future__ import annotations

import json

import pytest
import torch

from lit_qlora.cli import main
from lit_qlora.estimate.command import estimate
from lit_qlora.estimate.grpo import DECODE_BYTES_PER_LOGIT, PERSISTENT, kv_cache_bytes
from lit_qlora.grpo.args import GRPOArgs
from lit_qlora.model.config import Config
from lit_qlora.model.transformer import Transformer
from lit_qlora.train.args import TrainArgs
from test_estimate import config_only_dir


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kv_cache_term_is_what_the_models_cache_allocates(tmp_path, dtype):
    config = Config.from_checkpoint(config_only_dir(tmp_path))
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
    model.set_kv_cache(batch_size=8, max_len=96, device="meta", dtype=dtype)
    allocated = sum(b.numel() * b.element_size() for block in model.model.layers
                    for b in block.self_attn.kv_cache.buffers())
    assert kv_cache_bytes(config, 8, 96, dtype.itemsize) == allocated > 0


def run(tmp_path, **grpo):
    return estimate(checkpoint_dir=str(config_only_dir(tmp_path)), out_dir=tmp_path / "out", device="cpu",
                    precision="bf16-true", train=TrainArgs(micro_batch_size=4, global_batch_size=8,
                                                           max_seq_length=64),
                    method="grpo", grpo=GRPOArgs(**grpo))


def test_the_peak_is_the_larger_phase_and_training_is_the_sft_trace(tmp_path):
    result = run(tmp_path, num_generations=4)
    sft = estimate(checkpoint_dir=str(tmp_path / "model"), out_dir=tmp_path / "sft", device="cpu",
                   precision="bf16-true", train=TrainArgs(micro_batch_size=4, global_batch_size=8, max_seq_length=64))
    g = result["grpo"]
    assert g["training_peak_bytes"] == sft["peak_bytes"] == sum(result["by_category"].values())
    config = Config.from_checkpoint(tmp_path / "model")
    assert g["kv_cache_bytes"] == kv_cache_bytes(config, 4, 64, 2)
    assert g["decode_logits_bytes"] == 4 * config.vocab_size * DECODE_BYTES_PER_LOGIT
    assert g["persistent_bytes"] == sum(result["by_category"][k] for k in PERSISTENT)
    assert g["sampling_peak_bytes"] == g["persistent_bytes"] + g["kv_cache_bytes"] + g["decode_logits_bytes"]
    assert result["peak_bytes"] == max(g["training_peak_bytes"], g["sampling_peak_bytes"])
    assert g["sets_the_peak"] == "training" and g["reference_pass"] is False
    saved = json.loads((tmp_path / "out" / "estimate.json").read_text())
    assert saved["method"] == "grpo" and saved["grpo"] == g


def test_a_large_group_makes_sampling_the_peak(tmp_path, capsys):
    result = run(tmp_path, num_generations=1024, beta=0.04)
    g = result["grpo"]
    assert g["sets_the_peak"] == "sampling" and result["peak_bytes"] == g["sampling_peak_bytes"]
    assert g["sampling_peak_bytes"] > g["training_peak_bytes"] and g["reference_pass"] is True
    out = capsys.readouterr().out
    assert "Method grpo: 1024 completions per prompt" in out and "the peak is set by sampling" in out


def test_a_grpo_preset_reads_as_grpo(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    main(["estimate", "--config", "config_hub/grpo/smollm2-135m/qlora.yaml", "--checkpoint_dir", "SmolLM2-135M",
          "--out_dir", str(tmp_path / "est")])
    result = json.loads((tmp_path / "est" / "estimate.json").read_text())
    assert result["method"] == "grpo" and result["grpo"]["num_generations"] == 8
    assert result["micro_batch_size"] == 8 and result["max_seq_length"] == 96
    assert "Method grpo: 8 completions per prompt" in capsys.readouterr().out
