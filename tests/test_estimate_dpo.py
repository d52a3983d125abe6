"""`litqlora estimate --method dpo`: `litqlora dpo`'s step traced (two sequences per pair, the reference's no-grad
forward), its prediction against a real preference step's measured peak, what the reference costs, and the command
reading a dpo recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lit_qlora.cli import main
from lit_qlora.estimate.command import estimate
from lit_qlora.methods.dpo.estimate import PreferenceStep
from lit_qlora.estimate.step import resident_tensors, trace_step
from lit_qlora.memory.trace import profiled_peak
from lit_qlora.model.config import Config, Quantize
from lit_qlora.methods.dpo.args import DPOArgs
from lit_qlora.methods.dpo.loss import Objective, answer_logps, pair_sums
from lit_qlora.methods.dpo.reference import reference_logps
from lit_qlora.train.args import LoRAArgs, TrainArgs
from helpers import TINY, config_only_dir, real_model

ROOT = Path(__file__).resolve().parents[1]
DPO_PRESET = ROOT / "config_hub/dpo/smollm2-135m/qlora.yaml"


def measured_preference_step(config: Config, quantize: str, lora: LoRAArgs, train: TrainArgs,
                             dpo: DPOArgs) -> tuple[int, int]:
    """A real PreferenceModule micro-batch step (the reference's forward, then answer_logps and pair_sums, backward,
    clipping, AdamW) on micro_batch_size rows of two answers each, every position trained, measured by
    torch.profiler's allocation events: (the step's peak, the reference pass's own peak above what was live)."""
    model, params, optimizer = real_model(config, quantize, lora, train)
    pairs = train.micro_batch_size
    length = train.max_seq_length
    ids = torch.randint(0, config.vocab_size, (pairs, 2 * length))
    # PairCollate's layout with no shared prompt: each row two answers, every position trained
    src = torch.arange(pairs * 2 * length)
    seq = (torch.arange(2 * length) >= length).long()[None, :] * pairs + torch.arange(pairs)[:, None]
    # without positions, as the estimate traces it (a CPU run's dense branch mask, B x 4L^2 bytes, is left out of
    # both: lit_qlora.methods.dpo.estimate says why)
    batch = {"input_ids": ids, "src": src,
             "tgt": ids.reshape(-1), "seq": seq.reshape(-1), "index": torch.arange(pairs)}
    objective = Objective(dpo.loss, dpo.beta)

    def step() -> None:
        reference = reference_logps(model, batch, None)
        logps, counts = answer_logps(model, batch)
        sums = pair_sums(objective, logps, counts, reference)
        (sums.pair_loss / pairs + sums.nll_sum / sums.chosen_tokens).backward()
        torch.nn.utils.clip_grad_norm_(params, train.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on
    peak = profiled_peak(step, resident_tensors(model, optimizer))
    return peak, profiled_peak(lambda: reference_logps(model, batch, None), [])  # (nothing counted as resident)


@pytest.mark.parametrize("quantize", ["nf4", "none"])
@pytest.mark.parametrize("checkpointing,dropout", [(True, 0.05), (False, 0.0)])
def test_the_dpo_prediction_is_within_5_percent_of_a_real_preference_steps_measured_peak(quantize, checkpointing,
                                                                                         dropout):
    config = Config.from_hf_config({**TINY, "hidden_size": 128, "intermediate_size": 256})
    lora = LoRAArgs(r=4, alpha=8, dropout=dropout)
    train = TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=128,
                      activation_checkpointing=checkpointing)
    step = PreferenceStep(DPOArgs())
    trace = trace_step(config, Quantize(quantize), "bf16-true", lora, train, device="cpu", objective=step)
    assert sum(trace.peak_by_category.values()) == trace.peak
    measured, reference_pass = measured_preference_step(config, quantize, lora, train, DPOArgs())
    assert abs(trace.peak / measured - 1) <= 0.05, (trace.peak, measured)
    assert abs(step.reference_pass_bytes / reference_pass - 1) <= 0.05, (step.reference_pass_bytes, reference_pass)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_pair_costs_more_than_a_sequence_and_the_reference_costs_no_weights(device):
    """At the same micro-batch and length, dpo's step (two sequences per pair) peaks above sft's; its weights are the
    same bytes (the reference is the base with the adapters off); cached, whose pass runs once before training, and
    ORPO, which has none, peak no higher than adapters_off, and alike."""
    config = Config.from_hf_config(TINY)
    args = (config, Quantize.NF4, "bf16-true", LoRAArgs(r=4, alpha=8),
            TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=64, activation_checkpointing=True))
    sft = trace_step(*args, device=device)
    steps = {name: PreferenceStep(dpo) for name, dpo in (("adapters_off", DPOArgs()),
                                                         ("cached", DPOArgs(reference="cached")),
                                                         ("orpo", DPOArgs(loss="orpo")))}
    traces = {name: trace_step(*args, device=device, objective=step) for name, step in steps.items()}
    assert traces["adapters_off"].peak > 1.5 * sft.peak
    assert traces["cached"].peak <= traces["adapters_off"].peak
    # (alike up to the two losses' own few temporaries, which can set the peak of so small a model)
    assert traces["orpo"].peak == pytest.approx(traces["cached"].peak, rel=0.01)
    for name in ("frozen base", "embeddings and norms", "LoRA weights", "optimizer state"):
        assert {t.peak_by_category[name] for t in traces.values()} == {sft.peak_by_category[name]}, name
    # cached's one pass, before the first step, also makes the NF4 scratch buffers adapters_off's later passes reuse
    assert steps["cached"].reference_pass_bytes >= steps["adapters_off"].reference_pass_bytes > 0
    assert steps["adapters_off"].reference_pass_op.endswith("(reference)")
    assert steps["orpo"].reference_pass_bytes is None


def test_the_starting_adapter_as_reference_costs_a_copy_of_the_lora_weights_in_its_pass():
    config = Config.from_hf_config(TINY)
    passes = []
    for init_adapter in (None, Path("out/sft/final")):  # (not read: the estimate needs no files)
        step = PreferenceStep(DPOArgs())
        trace = trace_step(config, Quantize.NF4, "bf16-true", LoRAArgs(r=4, alpha=8), TrainArgs(
            micro_batch_size=1, global_batch_size=1, max_seq_length=64, init_adapter=init_adapter), "cpu",
            objective=step)
        passes.append(step.reference_pass_bytes)
    assert passes[1] - passes[0] == trace.peak_by_category["LoRA weights"]


def test_a_dpo_recipe_is_estimated_as_dpo_and_says_what_the_reference_costs(tmp_path, capsys):
    """The dpo preset (a `dpo:` section, no method key) is read as a dpo step; --method sft reads it as sft; the
    report and estimate.json name the method, the pairs' sequences and the reference's cost."""
    model_dir = config_only_dir(tmp_path)
    common = ["estimate", "--config", str(DPO_PRESET), "--checkpoint_dir", str(model_dir), "--device", "cpu",
              "--train.micro_batch_size", "2", "--train.global_batch_size", "2", "--train.max_seq_length", "64",
              "--data.format", "explicit"]
    main([*common, "--out_dir", str(tmp_path / "dpo")])
    main([*common, "--out_dir", str(tmp_path / "sft"), "--method", "sft"])
    dpo, sft = (json.loads((tmp_path / name / "estimate.json").read_text()) for name in ("dpo", "sft"))
    assert (dpo["method"], sft["method"], dpo["micro_batch_size"]) == ("dpo", "sft", 2) and "dpo" not in sft
    assert dpo["peak_bytes"] > sft["peak_bytes"]
    section = dpo["dpo"]
    assert (section["loss"], section["reference"], section["sequences_per_micro_batch"]) == ("sigmoid", "adapters_off",
                                                                                             4)
    assert section["reference_model"] == "the same base, adapters off: +0 bytes of weights"
    assert section["reference_pass"] == "every step" and section["reference_pass_bytes"] > 0
    assert section["answer_tokens"] == "every position (the worst case, as for sft)"
    printed = capsys.readouterr().out
    assert "dpo, micro-batch 2 pairs (4 sequences) x 64 tokens" in printed
    assert "reference: the same base, adapters off: +0 bytes of weights" in printed
    assert "its pass, a no-grad forward of the 4 sequences in every step, peaks at" in printed
    main([*common, "--out_dir", str(tmp_path / "orpo"), "--dpo.loss", "orpo"])
    orpo = json.loads((tmp_path / "orpo" / "estimate.json").read_text())["dpo"]
    assert (orpo["reference"], orpo["reference_pass"], orpo["reference_pass_bytes"]) == (None, None, None)
    assert "reference: none: ORPO is reference-free" in capsys.readouterr().out


def test_the_batch_search_counts_pairs(tmp_path, capsys):
    model_dir = config_only_dir(tmp_path)
    common = dict(checkpoint_dir=str(model_dir), device="cpu", lora=LoRAArgs(r=4, alpha=8, dropout=0.0), method="dpo")

    def train(pairs):
        return TrainArgs(micro_batch_size=pairs, global_batch_size=pairs, max_seq_length=64,
                         activation_checkpointing=True)

    peaks = {b: estimate(**common, out_dir=tmp_path / str(b), train=train(b))["peak_bytes"] for b in (3, 4)}
    result = estimate(**common, out_dir=tmp_path / "search", train=train(1),
                      device_memory=f"{(peaks[3] + peaks[4]) // 2}B")
    assert result["max_micro_batch_size"] == 3 and result["method"] == "dpo"
    assert "largest micro-batch 3 pairs with activation checkpointing" in capsys.readouterr().out

