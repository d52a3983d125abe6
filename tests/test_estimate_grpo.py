"""`litqlora estimate --method grpo`: the rollouts' KV cache is the bytes the model's own cache allocates; the peak
is the larger of the training step (GRPO's own micro-batch traced, under the SFT trace at the same rows) and the
sampling phase; a large group makes sampling the peak; with beta the kept log-probabilities' no-grad pass is traced;
a real `litqlora grpo` run's measured peaks equal the predictions; a grpo preset reads as such."""

from __future__ import annotations

import json

import pytest
import torch

from lit_qlora.cli import main
from lit_qlora.estimate.command import estimate
from lit_qlora.methods.grpo.estimate import DECODE_BYTES_PER_LOGIT, PERSISTENT, kv_cache_bytes
from lit_qlora.methods.grpo.args import GRPOArgs
from lit_qlora.model.config import Config
from lit_qlora.model.transformer import Transformer
from lit_qlora.train.args import TrainArgs
from helpers import config_only_dir


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


def test_the_peak_is_the_larger_phase_and_training_is_grpos_own_step(tmp_path):
    result = run(tmp_path, num_generations=4)
    sft = estimate(checkpoint_dir=str(tmp_path / "model"), out_dir=tmp_path / "sft", device="cpu",
                   precision="bf16-true", train=TrainArgs(micro_batch_size=4, global_batch_size=8, max_seq_length=64))
    g = result["grpo"]
    assert g["training_peak_bytes"] == sum(result["by_category"].values())
    # GRPO's own loss, not SFT's: the head on the completion tokens (63 a row here) in one chunk of log-probabilities
    # (2^24 logits), whose fp32 copies outweigh SFT's smaller loss chunks on this tiny model (the old SFT "bound" was
    # 12% under it); the blocks see the same rows
    assert result["by_category"]["logits/loss chunks"] > sft["by_category"]["logits/loss chunks"] > 0
    assert g["training_peak_bytes"] > sft["peak_bytes"]
    for name in ("frozen base", "LoRA weights", "gradients", "optimizer state"):
        assert result["by_category"][name] == sft["by_category"][name], name
    config = Config.from_checkpoint(tmp_path / "model")
    assert g["kv_cache_bytes"] == kv_cache_bytes(config, 4, 64, 2)
    assert g["decode_logits_bytes"] == 4 * config.vocab_size * (DECODE_BYTES_PER_LOGIT + 2)  # + the bf16 head's own
    assert g["persistent_bytes"] == sum(result["by_category"][k] for k in PERSISTENT)
    assert g["fixed_logps_pass_bytes"] == 0  # beta 0 and one update per batch: no kept log-probabilities
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


def test_with_beta_the_kept_log_probabilities_pass_is_traced(tmp_path):
    g = run(tmp_path, num_generations=2, beta=0.04)["grpo"]
    assert g["reference_pass"] is True and g["fixed_logps_pass_bytes"] > g["kv_cache_bytes"] + g["decode_logits_bytes"]
    assert g["sampling_peak_bytes"] == g["persistent_bytes"] + g["fixed_logps_pass_bytes"]


def test_a_real_runs_measured_peaks_are_the_predictions(tiny_llama_dir, tmp_path, monkeypatch):
    """`litqlora grpo` on the tiny model (random weights: every completion runs to the cap; prompts of one length),
    its second batch of rollouts and its last step measured (profiled allocations over the live tensors), against
    `litqlora estimate --method grpo` at the rows' real length: the measurement of benchmarks/grpo/estimate_accuracy.py
    (SmolLM2's shape: 1.000 of the peak, 0.997-1.000 of the sampling)."""
    from lit_qlora.estimate.step import resident_tensors
    from lit_qlora.methods.grpo.module import GRPOModule
    from lit_qlora.memory.trace import profiled_peak

    rows = [{"prompt": [{"role": "user", "content": f"Compute {a} + {a + 11}."}], "answer": str(2 * a + 11)}
            for a in range(10, 42)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    measured, calls = {}, []
    real_rollouts, real_step = GRPOModule.make_rollouts, GRPOModule.training_step

    def alive(module):
        r = module.rollouts
        kept = [] if r is None else [*r.sequences, r.stopped, r.per_function, r.rewards, r.advantages,
                                     *(r.old_logps or []), *(r.ref_logps or [])]
        return resident_tensors(module.model, module.trainer.optimizers[0]) + kept

    def make_rollouts(self, prompts, step):
        calls.append(step)
        if len(calls) != 2:
            return real_rollouts(self, prompts, step)
        out = {}
        measured["sampling"] = profiled_peak(lambda: out.update(r=real_rollouts(self, prompts, step)), alive(self))
        measured["rows"] = {(len(s), c) for s, c in zip(out["r"].sequences, out["r"].completion_lengths)}
        return out["r"]

    def training_step(self, micro_batches, batch_idx):
        if self.step != 3:
            return real_step(self, micro_batches, batch_idx)
        out = {}
        measured["step"] = profiled_peak(lambda: out.update(loss=real_step(self, micro_batches, batch_idx)),
                                         alive(self))
        return out["loss"]

    monkeypatch.setattr(GRPOModule, "make_rollouts", make_rollouts)
    monkeypatch.setattr(GRPOModule, "training_step", training_step)
    # This thread's reused scratch buffers as a fresh process has them: another test's bf16 model (same worker)
    # leaves buffers that this fp32 run would otherwise replace inside a measured step.
    from lit_qlora.nf4 import gemv, linear

    monkeypatch.setattr(linear._scratch, "buffers", {}, raising=False)
    monkeypatch.delattr(gemv._scratch, "buf", raising=False)
    common = ["--checkpoint_dir", str(tiny_llama_dir), "--quantize", "nf4", "--precision", "32-true",
              "--lora.r", "4", "--lora.alpha", "8", "--lora.dropout", "0.05", "--data.path", str(data),
              "--data.val_split", "0.1", "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
              "--train.max_steps", "4", "--grpo.num_generations", "4", "--grpo.max_completion_length", "12",
              "--grpo.beta", "0.04", "--grpo.num_iterations", "2"]
    main(["grpo", *common, "--train.max_seq_length", "64", "--accelerator", "cpu", "--out_dir", str(tmp_path / "run"),
          "--export.merged", "false", "--export.peft", "false"])
    assert len(measured["rows"]) == 1, measured["rows"]  # every row as long as the others, completions at the cap
    (length, completion), = measured["rows"]
    assert completion == 12
    main(["estimate", *common, "--train.max_seq_length", str(length), "--method", "grpo", "--device", "cpu",
          "--out_dir", str(tmp_path / "est")])
    est = json.loads((tmp_path / "est" / "estimate.json").read_text())
    g = est["grpo"]
    assert g["sampling_peak_bytes"] == pytest.approx(measured["sampling"], rel=0.02)
    assert est["peak_bytes"] == pytest.approx(max(measured["step"], measured["sampling"]), rel=0.01)


def test_a_grpo_preset_reads_as_grpo(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    main(["estimate", "--config", "config_hub/grpo/smollm2-135m/qlora.yaml", "--checkpoint_dir", "SmolLM2-135M",
          "--out_dir", str(tmp_path / "est")])
    result = json.loads((tmp_path / "est" / "estimate.json").read_text())
    assert result["method"] == "grpo" and result["grpo"]["num_generations"] == 8
    assert result["micro_batch_size"] == 8 and result["max_seq_length"] == 96
    assert "Method grpo: 8 completions per prompt" in capsys.readouterr().out


def test_the_compiled_decode_keeps_its_cache_through_training_on_a_gpu(tmp_path):
    """--grpo.compile_decode on CUDA keeps the group's KV cache (and validation's single row's) between groups for
    its CUDA graphs: the training phase holds it too; on the CPU nothing is kept."""
    model_dir = config_only_dir(tmp_path)

    def on(device, **grpo):
        out = tmp_path / f"{device}-{len(grpo)}"
        return estimate(checkpoint_dir=str(model_dir), out_dir=out, device=device,
                        precision="bf16-true", train=TrainArgs(micro_batch_size=4, global_batch_size=8,
                                                               max_seq_length=64),
                        method="grpo", grpo=GRPOArgs(num_generations=4, **grpo))["grpo"]

    eager, compiled = on("cuda"), on("cuda", compile_decode=True)
    config = Config.from_checkpoint(model_dir)
    kept = kv_cache_bytes(config, 5, 64, 2)
    assert compiled["kept_kv_cache_bytes"] == kept and eager["kept_kv_cache_bytes"] == 0
    assert compiled["training_peak_bytes"] == eager["training_peak_bytes"] + kept
    assert compiled["sampling_peak_bytes"] == eager["sampling_peak_bytes"] + kv_cache_bytes(config, 1, 64, 2)
    assert on("cpu", compile_decode=True)["kept_kv_cache_bytes"] == 0
