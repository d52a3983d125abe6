"""Tensor parallelism on CPU (2 gloo processes): the numbers of one process, for LoRA and QLoRA."""

import pytest
import torch
import torch.distributed as dist

from lit_qlora.parallel.tensor_parallel import shard_tensor, tp_style

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


def test_layout_splits_rows_of_column_and_columns_of_row_parallel_weights():
    assert [tp_style(f"model.layers.0.{n}") for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj",
                                                         "mlp.down_proj")] == ["column", "row", "column", "row"]
    assert tp_style("lm_head") is None and tp_style("model.embed_tokens") is None
    w = torch.arange(24.0).view(4, 6)
    assert torch.equal(shard_tensor("model.layers.0.self_attn.k_proj.weight", w, 1, 2), w[2:])
    assert torch.equal(shard_tensor("model.layers.0.mlp.down_proj.weight", w, 1, 2), w[:, 3:])
    assert torch.equal(shard_tensor("model.layers.0.self_attn.q_proj.bias", w[0], 0, 2), w[0, :3])
    assert torch.equal(shard_tensor("model.layers.0.self_attn.o_proj.bias", w[0], 1, 2), w[0])  # added once
    assert torch.equal(shard_tensor("lm_head.weight", w, 1, 2), w)
    with pytest.raises(ValueError, match="not divisible"):
        shard_tensor("model.layers.0.mlp.up_proj.weight", w, 0, 3)


def test_tp_strategy_is_a_data_by_tensor_mesh():
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_qlora.parallel.distributed import build_strategy, nf4_shards_for

    strategy = build_strategy("tp", 4, tensor_parallel=2)
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 2)
    with pytest.raises(ValueError, match="must divide"):
        build_strategy("tp", 4, tensor_parallel=3)
    with pytest.raises(ValueError, match="needs --strategy tp"):
        build_strategy("fsdp", 4, tensor_parallel=2)
    assert nf4_shards_for("tp", 2) == 1
    with pytest.raises(ValueError, match="does not apply"):
        nf4_shards_for("tp", 2, requested=2)


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_tensor_parallel_equals_one_process(quantize, tiny_llama_dir, tmp_path):
    from helpers import assert_equals_one_process, spawn_ranks, tensor_parallel_worker

    results = spawn_ranks(tensor_parallel_worker, 2, str(tiny_llama_dir), quantize, str(tmp_path / "store"))
    assert_equals_one_process(results)


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("compile", ["false", "true"])
def test_finetune_tensor_parallel_equals_one_process(compile, tiny_llama_dir, tmp_path):
    """`--strategy tp --tensor_parallel 2` (LoRA, fp32 base), eager or with every block compiled: every step's loss,
    the gradient norm, the final adapter and the merged export equal a 1-process eager run's."""
    from helpers import STEPS, TRAIN, assert_same_final, cli_run, metrics_rows, small_data

    from lit_qlora.train.finetune import finetune
    from lit_qlora.train.args import LoRAArgs, TrainArgs

    data = small_data(tmp_path)
    ref_dir, out = tmp_path / "one", tmp_path / "tp"
    finetune(checkpoint_dir=tiny_llama_dir, out_dir=ref_dir, quantize="none", precision="32-true", accelerator="cpu",
             lora=LoRAArgs(r=4, alpha=8, dropout=0.0), data=data, train=TrainArgs(**TRAIN))
    cli_run(tiny_llama_dir, out, data, "tp", "--tensor_parallel", "2", "--quantize", "none", "--compile", compile)
    ref, got = metrics_rows(ref_dir), metrics_rows(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert got[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=1e-4)
    assert got[0]["tokens"] == ref[0]["tokens"]  # both ranks of the group saw the same samples, counted once
    assert_same_final(ref_dir, out)  # adapter gathered to full shapes, merged export


@pytest.mark.slow
@needs_gloo
def test_qlora_tensor_parallel_export_is_the_one_process_merge(tiny_llama_dir, tmp_path):
    """QLoRA under `--strategy tp`: the adapter config records the per-shard NF4 layout, and the merged export
    equals `litqlora merge` of the adapter in one process, which rebuilds that layout."""
    import json

    from safetensors.torch import load_file
    from helpers import cli_run, small_data

    from lit_qlora.export.hf import merge

    data = small_data(tmp_path)
    out = tmp_path / "tp"
    cli_run(tiny_llama_dir, out, data, "tp", "--tensor_parallel", "2", "--train.max_steps=2")
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["quantize"] == "nf4" and config["nf4_tensor_parallel"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quantized_linears"] == summary["total_linears"] == 14  # every rank's shards are NF4 (the tied head reads the embedding)
    merged = merge(tiny_llama_dir, out / "final", tmp_path / "merged")
    ma = load_file(str(merged / "model.safetensors"))
    mb = load_file(str(out / "final" / "merged" / "model.safetensors"))
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    # The per-shard NF4 layout is not the whole-tensor one: without it the merge would differ.
    config.pop("nf4_tensor_parallel")
    (out / "final" / "adapter_config.json").write_text(json.dumps(config))
    whole = load_file(str(merge(tiny_llama_dir, out / "final", tmp_path / "whole") / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(whole[key], mb[key])


@pytest.mark.slow
@needs_gloo
def test_compiled_qlora_tensor_parallel_trains_what_eager_does(tiny_llama_dir, tmp_path):
    """QLoRA under `--strategy tp` with every block compiled (the NF4 matmul runs eagerly inside the compiled
    block, on its shard): the same losses and final adapter as the eager tensor-parallel run."""
    from safetensors.torch import load_file
    from helpers import cli_run, metrics_rows, small_data

    data = small_data(tmp_path)
    runs = {}
    for compile in ("false", "true"):
        runs[compile] = tmp_path / compile
        cli_run(tiny_llama_dir, runs[compile], data, "tp", "--tensor_parallel", "2", "--compile", compile)
    eager, compiled = metrics_rows(runs["false"]), metrics_rows(runs["true"])
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=1e-5)
    a, b = (load_file(str(runs[c] / "final" / "adapter.safetensors")) for c in ("false", "true"))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert any(b[k].abs().max() > 1e-3 for k in b if k.endswith("lora_B"))  # it trained
