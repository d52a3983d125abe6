"""`litqlora estimate`: the fake-tensor step's prediction against a real step's measured peak, the command's files
and errors, and the largest micro-batch that fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lit_qlora.cli import main
from lit_qlora.model.config import Config, Quantize
from lit_qlora.estimate.step import resident_tensors, trace_step
from lit_qlora.estimate.command import estimate, resolve_config
from lit_qlora.memory.trace import CATEGORIES, profiled_peak
from lit_qlora.nf4 import linear, reference
from lit_qlora.train.args import LoRAArgs, TrainArgs
from lit_qlora.train.loss import lm_loss_sum

from helpers import TINY, config_only_dir, real_model

ROOT = Path(__file__).resolve().parents[1]



def measured_peak(config: Config, quantize: str, lora: LoRAArgs, train: TrainArgs) -> int:
    """The real step, as a fine-tune runs it, measured by torch.profiler's allocation events."""
    model, params, optimizer = real_model(config, quantize, lora, train)
    ids = torch.randint(0, config.vocab_size, (train.micro_batch_size, train.max_seq_length))

    def step() -> None:
        (lm_loss_sum(model, ids, ids) / ids.numel()).backward()
        torch.nn.utils.clip_grad_norm_(params, train.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on, as in every step after a run's first
    return profiled_peak(step, resident_tensors(model, optimizer))


@pytest.mark.parametrize("quantize", ["nf4", "none"])
@pytest.mark.parametrize("checkpointing,dropout", [(True, 0.05), (False, 0.0)])
def test_the_prediction_is_within_5_percent_of_a_real_steps_measured_peak(quantize, checkpointing, dropout):
    # Small, but not so small that the CPU kernels' own few-KiB buffers (which fake kernels do not allocate) matter.
    config = Config.from_hf_config({**TINY, "hidden_size": 128, "intermediate_size": 256})
    lora = LoRAArgs(r=4, alpha=8, dropout=dropout)
    train = TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=128, activation_checkpointing=checkpointing)
    trace = trace_step(config, Quantize(quantize), "bf16-true", lora, train, device="cpu")
    assert sum(trace.peak_by_category.values()) == trace.peak
    measured = measured_peak(config, quantize, lora, train)  # (runs after the fake step: nothing fake was left behind)
    assert abs(trace.peak / measured - 1) <= 0.05, (trace.peak, measured)
    assert (trace.peak_by_category["NF4 dequantize scratch"] > 0) == (quantize == "nf4")


def test_the_fake_step_leaves_no_fake_tensor_in_the_nf4_caches():
    trace_step(Config.from_hf_config(TINY), Quantize.NF4, "bf16-true", LoRAArgs(r=4, alpha=8),
               TrainArgs(micro_batch_size=1, global_batch_size=1, max_seq_length=32), device="cuda")
    cached = list(reference._TABLE_CACHE.values()) + list((getattr(linear._scratch, "buffers", None) or {}).values())
    assert not [t for t in cached if type(t).__name__ == "FakeTensor"]


def test_cuda_and_more_ranks_change_the_prediction_the_way_a_gpu_and_fsdp_would():
    config = Config.from_hf_config(TINY)
    args = (config, Quantize.NF4, "bf16-true", LoRAArgs(r=4, alpha=8),
            TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=64))
    cpu, cuda = trace_step(*args, device="cpu"), trace_step(*args, device="cuda")
    # The CPU keeps one dense scratch slice for NF4 matmuls; a GPU allocates one per call and rounds to 512 bytes.
    assert cuda.peak != cpu.peak and cuda.peak % 512 == 0
    from lit_qlora.estimate.step import parallel_bytes

    fsdp = parallel_bytes(cpu.peak_by_category, config, "fsdp", 4, 1)
    assert fsdp["optimizer state"] == cpu.peak_by_category["optimizer state"] // 4
    assert fsdp["activations"] == cpu.peak_by_category["activations"]


def test_command_writes_estimate_json_and_finds_the_largest_micro_batch(tmp_path, capsys):
    model_dir = config_only_dir(tmp_path)  # config.json only: no weights needed
    common = dict(checkpoint_dir=str(model_dir), device="cpu", out_dir=tmp_path / "out",
                  lora=LoRAArgs(r=4, alpha=8, dropout=0.0))
    peaks = {b: estimate(**common, train=TrainArgs(micro_batch_size=b, global_batch_size=b, max_seq_length=64,
                                                   activation_checkpointing=True))["peak_bytes"] for b in (1, 2, 3, 4)}
    assert peaks[1] < peaks[2] < peaks[3] < peaks[4]
    budget = (peaks[3] + peaks[4]) // 2
    main(["estimate", "--checkpoint_dir", str(model_dir), "--device", "cpu", "--out_dir", str(tmp_path / "cli"),
          "--lora.r", "4", "--lora.alpha", "8", "--lora.dropout", "0", "--train.micro_batch_size", "1",
          "--train.global_batch_size", "1", "--train.max_seq_length", "64",
          "--train.activation_checkpointing", "true", "--device_memory", f"{budget}B"])
    result = json.loads((tmp_path / "cli" / "estimate.json").read_text())
    assert {"peak_bytes", "by_category", "world_size", "strategy", "max_micro_batch_size", "device"} <= set(result)
    assert result["peak_bytes"] == peaks[1] == sum(result["by_category"].values())
    assert list(result["by_category"]) == list(CATEGORIES)
    assert (result["device"], result["world_size"], result["max_micro_batch_size"]) == ("cpu", 1, 3)
    assert result["max_micro_batch_size_by_checkpointing"]["off"] < 3  # without checkpointing less fits
    printed = capsys.readouterr().out
    assert "Predicted peak cpu memory" in printed and "largest micro-batch 3 with activation checkpointing" in printed
    # the search says what it does while it does it (minutes at 8B): one line per traced size
    assert "Searching the largest micro-batch that fits" in printed
    traced = [line for line in printed.splitlines() if line.startswith("  traced micro-batch ")]
    assert traced[0].startswith("  traced micro-batch 1, checkpointing True: peak ") and 3 <= len(traced) <= 10


def test_device_memory_units_mean_what_they_say_and_the_bytes_are_echoed(tmp_path, capsys):
    from lit_qlora.estimate.cards import CARDS, device_memory, parse_bytes

    assert parse_bytes("24GB") == 24 * 10**9 and parse_bytes("24 GiB") == 24 << 30 and parse_bytes("24G") == 24 << 30
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1500000000") == parse_bytes("1500000000B") == 1_500_000_000
    estimate(checkpoint_dir=str(config_only_dir(tmp_path)), device="cpu", out_dir=tmp_path / "o", device_memory="1GB",
             train=TrainArgs(micro_batch_size=1, global_batch_size=1, max_seq_length=64))
    out = capsys.readouterr().out
    assert "Device memory: 1GB = 1,000,000,000 bytes (0.93 GiB); GB read as 10^9 bytes" in out and "rtx4090" in out
    # a card by name: nvidia-smi's total (the fit leaves the CUDA context's share aside, as for any budget)
    assert device_memory("rtx4090")[0] == 24_564 << 20 and device_memory("RTX4090")[0] == 24_564 << 20
    assert device_memory("h200")[0] == CARDS["h200"] << 20 and "CUDA context" in device_memory("t4")[1]
    assert device_memory("24GiB") == (24 << 30, "Device memory: 24GiB = 25,769,803,776 bytes (24.00 GiB)")
    with pytest.raises(ValueError, match="is not a size or a card"):
        device_memory("rtx9090")


def test_the_length_searchs_offload_line_names_auto_not_a_flag_the_user_never_passed(tmp_path, capsys):
    common = dict(checkpoint_dir=str(config_only_dir(tmp_path)), device="cuda", lora=LoRAArgs(r=4, alpha=8, dropout=0.0))
    budget = estimate(**common, out_dir=tmp_path / "fixed", train=TrainArgs(
        micro_batch_size=1, global_batch_size=1, max_seq_length=3000, activation_checkpointing=True))["peak_bytes"]
    result = estimate(**common, out_dir=tmp_path / "auto", device_memory=f"{budget * 2}B", train=TrainArgs(
        micro_batch_size=1, global_batch_size=1, max_seq_length="auto", activation_checkpointing=True))
    assert result["offload_reason"].startswith("auto: the longest-context search traces with it on")
    printed = capsys.readouterr().out
    assert "Offloaded activation checkpoints: on (auto: " in printed and "--train.offload_activations true" not in printed


def test_the_trace_names_the_ops_behind_other_temporaries_and_the_peak():
    """AllocationTrace keeps, at the peak, the live "other temporaries" bytes by the op (and step phase) that
    allocated them, and the op that set the peak; other_temporaries names the largest three and sums the rest."""
    from lit_qlora.estimate.step import other_temporaries
    from lit_qlora.memory.trace import AllocationTrace

    phase = ["forward"]
    trace = AllocationTrace(lambda t: "activations" if t.dim() == 2 else "other temporaries", context=lambda: phase[0])
    with trace:
        x = torch.ones(64, 64)  # activations: 16 KiB
        a, b = torch.ones(1000), torch.zeros(500)  # other: ones 4000 B, zeros 2000 B
        phase[0] = "backward"
        c, d = torch.arange(250.0), torch.full((100,), 2.0)  # arange 1000 B, full 400 B: the peak is set by full
        del a  # after the peak: what was live then is what counts
        torch.ones(10)
    assert trace.peak_op == "full (backward)"
    assert trace.peak_other_by_origin == {"ones (forward)": 4000, "zeros (forward)": 2000, "arange (backward)": 1000,
                                          "full (backward)": 400}
    parts = {"other temporaries": trace.peak_by_category["other temporaries"]}
    assert other_temporaries(trace, parts) == {"ones (forward)": 4000, "zeros (forward)": 2000,
                                               "arange (backward)": 1000, "everything else": 400}
    fsdp = other_temporaries(trace, {"other temporaries": 7400 + 512})
    assert fsdp["FSDP's gathered block and the prefetched next one"] == 512
    del x, b, c, d


def test_the_estimate_reports_what_the_peak_is_made_of(tmp_path, capsys):
    """The estimate's breakdown of "other temporaries" adds up to the category; it names the op and phase that set
    the peak, on screen and in estimate.json."""
    result = estimate(checkpoint_dir=str(config_only_dir(tmp_path)), device="cpu", out_dir=tmp_path / "o",
                      lora=LoRAArgs(r=4, alpha=8, dropout=0.0),
                      train=TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=128))
    parts = result["other_temporaries_by_op"]
    assert len(parts) <= 4 and sum(parts.values()) == result["by_category"]["other temporaries"]
    assert result["peak_operation"].split(" (")[1].rstrip(")") in ("forward", "backward", "optimizer",
                                                                     "backward, recomputing a checkpointed block")
    assert f"The peak is reached at: {result['peak_operation']}" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "estimate.json").read_text())["peak_operation"] == result["peak_operation"]


def test_a_recipe_whose_checkpoint_is_not_downloaded_falls_back_to_its_preset_and_says_so():
    config, source = resolve_config("checkpoints/meta-llama/Llama-2-7b-hf")
    assert config.name == "Llama-2-7b" and "not downloaded" in source
    with pytest.raises(SystemExit) as e:  # every key of a finetune recipe is an estimate option
        main(["estimate", "--config", str(ROOT / "config_hub/finetune/llama-2-7b/qlora.yaml"), "--print_config"])
    assert e.value.code == 0


@pytest.mark.parametrize("argv,message", [
    (["--checkpoint_dir", "Llama-9-900b"], "no config.json there and no preset of that name"),
    (["--device_memory", "lots"], "is not a size"),
    (["--train.micro_batch_size", "3", "--train.global_batch_size", "4"], "multiple of train.micro_batch_size"),
    (["--strategy", "tp", "--devices", "2", "--tensor_parallel", "1"], "--tensor_parallel >= 2"),
    (["--devices", "0"], "--devices must be at least 1, got 0"),
    (["--train.max_seq_length", "1"], "--train.max_seq_length must be at least 2, got 1"),
    (["--method", "dpo", "--strategy", "tp", "--devices", "2", "--tensor_parallel", "2"], "not tp"),
    (["--dpo.beta", "0"], "--dpo.beta must be > 0"),
])
def test_bad_input_is_one_clear_line_and_exit_1(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--checkpoint_dir", str(config_only_dir(tmp_path)), "--out_dir", str(tmp_path / "o"), *argv])
    assert e.value.code == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / "estimate.json").exists()


def test_a_card_too_small_for_one_sequence_says_what_to_do(tmp_path, capsys):
    result = estimate(checkpoint_dir=str(config_only_dir(tmp_path)), device="cpu", out_dir=tmp_path / "o",
                      device_memory="64KiB", train=TrainArgs(micro_batch_size=1, global_batch_size=1,
                                                             max_seq_length=64))
    assert result["max_micro_batch_size"] == 0
    assert "Not even micro-batch 1 fits" in capsys.readouterr().out


@pytest.mark.parametrize("curve,answer", [("linear", 40), ("convex", None)])
def test_the_batch_search_is_bounded_and_answers_a_size_that_fits(curve, answer):
    """An 8B trace takes about a minute: the search traces at most 5 sizes per setting, and its answer is a traced
    size that fits (a convex curve, as fragmentation at large batches would make, is corrected, not overshot)."""
    from lit_qlora.estimate.search import largest_batches

    calls = []

    def predict(size, checkpointing):
        calls.append((size, checkpointing))
        per = 10 if checkpointing else 300
        extra = 0 if curve == "linear" else size * size // 3
        return 1000 + per * size + extra, {}

    budget = 1000 + 10 * 40 + 5  # linear: 40 fits with checkpointing, 41 does not; 1 fits without
    result = largest_batches(predict, budget, "cpu")
    sizes = result["max_micro_batch_size_by_checkpointing"]
    assert all(sum(1 for _, c in calls if c is setting) <= 5 for setting in (True, False))
    assert sizes["off"] == 1 and not result["activation_checkpointing_needed"]
    if answer is not None:
        assert sizes["on"] == answer
    else:  # the true largest is 22 (1000 + 220 + 161 <= 1405 < 1000 + 230 + 176)
        assert sizes["on"] == 22 and (22, True) in calls


def test_a_batch_at_the_search_limit_is_reported_as_a_lower_bound():
    """Issue 55 item 8: "largest micro-batch 256" was the search's cap, not a size found to be the largest."""
    from lit_qlora.estimate.command import render_batch_search
    from lit_qlora.estimate.search import largest_batches

    result = largest_batches(lambda size, checkpointing: (size * (1 if checkpointing else 10), {}), 1000, "cpu")
    assert result["max_micro_batch_size_by_checkpointing"] == {"on": 256, "off": 100}
    assert result["micro_batch_search_limit"] == 256
    result.update(device_memory_bytes=1000, method="sft")
    (line,) = [line for line in render_batch_search(result) if line]
    assert line.endswith("largest micro-batch 256 or more (the search stops at 256) with activation checkpointing, "
                         "100 without")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_tracing_two_loss_chunks_per_loss_predicts_what_tracing_all_of_them_does(monkeypatch, device):
    """The estimate traces each loss's first chunks only (an 8B step has thousands, each costing fake ops): the peak
    and its categories equal those of a trace through every chunk."""
    from lit_qlora.estimate import step as estimate_module
    from lit_qlora.train import loss

    for name in ("LOGITS_CHUNK_ELEMS", "CUDA_LOGITS_CHUNK_ELEMS"):
        monkeypatch.setattr(loss, name, 512 * 16)  # 16 tokens a chunk: 8 chunks per 2 x 64 batch
    monkeypatch.setattr(loss, "CHUNK_TOKENS_FLOOR", 1)
    config = Config.from_hf_config(TINY)
    train = TrainArgs(micro_batch_size=2, global_batch_size=4, max_seq_length=64, activation_checkpointing=True)
    real, heads = loss.head_ce_sum, []
    monkeypatch.setattr(loss, "head_ce_sum", lambda *args: heads.append(1) or real(*args))
    traces, head_calls = [], []
    for chunks in (estimate_module.TRACED_LOSS_CHUNKS, 10**6):
        monkeypatch.setattr(estimate_module, "TRACED_LOSS_CHUNKS", chunks)
        heads.clear()
        traces.append(trace_step(config, Quantize("none"), "bf16-true", LoRAArgs(r=4, alpha=8), train, device))
        head_calls.append(len(heads))
    assert head_calls == [2 * 4, 8 * 4]  # 2 or 8 chunks per loss, 2 micro-batches x 2 steps
    assert traces[0].peak == traces[1].peak and traces[0].peak_by_category == traces[1].peak_by_category


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_tracing_the_first_tiles_predicts_what_tracing_all_of_them_does(monkeypatch, device):
    """Past a tile's length the MLP and the loss run in tiles, and the estimate traces each one's first tiles only
    (a 100k-token 8B step has thousands): the peak and its categories equal those of a trace through every tile."""
    from lit_qlora.estimate import step as estimate_module
    from lit_qlora.model import tiled_mlp
    from lit_qlora.train import tiled_loss

    monkeypatch.setattr(tiled_mlp, "MLP_TILE_ELEMS", 128 * 16)  # 16-token MLP tiles: 8 per 128-token row
    monkeypatch.setattr(tiled_loss, "LOSS_TILE_TOKENS", 16)
    config = Config.from_hf_config(TINY)
    train = TrainArgs(micro_batch_size=1, global_batch_size=1, max_seq_length=128, activation_checkpointing=True)
    starts = []
    for module in (tiled_mlp, tiled_loss):
        real_starts = module.tile_starts
        monkeypatch.setattr(module, "tile_starts", lambda n, t, real=real_starts: starts.append(n) or real(n, t))
    traces = []
    for chunks in (estimate_module.TRACED_LOSS_CHUNKS, 10**6):
        monkeypatch.setattr(estimate_module, "TRACED_LOSS_CHUNKS", chunks)
        traces.append(trace_step(config, Quantize("nf4"), "bf16-true", LoRAArgs(r=4, alpha=8), train, device))
    assert traces[0].peak == traces[1].peak and traces[0].peak_by_category == traces[1].peak_by_category


@pytest.mark.parametrize("curve", ["linear", "concave", "convex"])
def test_the_length_search_is_bounded_and_answers_the_longest_length_that_fits(curve):
    """Peak memory against length is a line, bent where tiling starts (concave) or by fragmentation (convex): the
    search traces at most 6 lengths and answers the longest multiple of 256 that fits, or one step short of it."""
    from lit_qlora.estimate.search import LENGTH_STEP, longest_context

    def predict(length):
        calls.append(length)
        base = 5_000_000_000 + 100_000 * length
        if curve == "concave":
            return base - 40_000 * max(0, length - 60_000)
        return base + (length // 1000) ** 2 * 3000 if curve == "convex" else base

    for budget in (8, 24, 80):
        calls = []
        result = longest_context(predict, budget << 30, "cpu")
        best = result["max_seq_length"]
        true_best = max(n for n in range(0, 4_000_000, LENGTH_STEP) if predict(n) <= budget << 30)
        calls.clear()
        assert len(result["traced_peaks"]) <= 6 and str(best) in result["traced_peaks"]
        assert predict(best) <= budget << 30 and true_best - LENGTH_STEP <= best <= true_best, (budget, best)


@pytest.mark.parametrize("method,batch", [("sft", "1"), ("dpo", "1 pairs (2 sequences)")])
def test_auto_length_finds_the_longest_sequence_a_budget_holds(tmp_path, capsys, method, batch):
    """--train.max_seq_length auto with --device_memory: the answer fits the budget and the next 256 tokens do not
    (a dpo step's pairs alike); auto needs a budget, and a fine-tune refuses it."""
    from lit_qlora.base.errors import UserError
    from lit_qlora.train.finetune import finetune

    # An untied (NF4) head, whose loss runs over vocabulary slices: with this 512-token vocabulary a tied head's dense
    # loss takes 8k tokens a chunk, so its logits, not the activations, would set the peak up to the tiled loss.
    model_dir = config_only_dir(tmp_path, tie_word_embeddings=False)
    common = dict(checkpoint_dir=str(model_dir), device="cpu", lora=LoRAArgs(r=4, alpha=8, dropout=0.0), method=method)
    train = TrainArgs(micro_batch_size=1, global_batch_size=1, max_seq_length=3000, activation_checkpointing=True)
    budget = estimate(**common, out_dir=tmp_path / "fixed", train=train)["peak_bytes"]
    result = estimate(**common, out_dir=tmp_path / "auto", device_memory=f"{budget}B",
                      train=TrainArgs(micro_batch_size=1, global_batch_size=1, max_seq_length="auto",
                                      activation_checkpointing=True))
    assert result["max_seq_length"] == 2816 and result["peak_bytes"] <= budget  # 3072 > 3000 tokens do not fit
    assert json.loads((tmp_path / "auto" / "estimate.json").read_text())["max_seq_length"] == 2816
    assert f"the longest sequence that fits micro-batch {batch} is 2816 tokens" in capsys.readouterr().out
    assert result["offload_reason"] == "auto: not on CUDA"  # (a CPU target: nothing was forced on for the search)
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--checkpoint_dir", str(model_dir), "--out_dir", str(tmp_path / "o"),
              "--train.max_seq_length", "auto"])
    assert e.value.code == 1 and "give the card's memory too" in capsys.readouterr().err
    with pytest.raises(UserError, match="needs a number of tokens.*max_seq_length auto --device_memory"):
        finetune(checkpoint_dir=model_dir, out_dir=tmp_path / "ft", train=TrainArgs(max_seq_length="auto"))


def test_every_name_the_estimate_patches_still_exists_in_its_module():
    """The estimate replaces or sets aside names of other layers while it traces (PATCH_POINTS): a rename there must
    fail here, not leave the estimate patching a name nobody reads. And it reaches no name the table does not list."""
    import importlib

    from lit_qlora.estimate.step import PATCH_POINTS, _patched
    from lit_qlora.train import loss

    missing = []
    for module_name, names in PATCH_POINTS.items():
        module = importlib.import_module(module_name)
        for name in names:
            owner = module
            for part in name.split("."):  # Class.attribute
                if not hasattr(owner, part):
                    missing.append(f"{module_name}.{name}")
                    break
                owner = getattr(owner, part)
    assert missing == []
    with pytest.raises(RuntimeError, match="PATCH_POINTS"):
        with _patched(loss, "lm_loss_sum", None):
            pass
    assert callable(loss.lm_loss_sum)

