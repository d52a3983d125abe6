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


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _step(model, idx):
    logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    return logits.detach(), loss.detach()


def _worker(rank: int, ckpt: str, quantize: str, init_file: str, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import lit_qlora.parallel.tensor_parallel as tp
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.lora.layer import apply_lora, lora_modules
    from lit_qlora.checkpoint.adapter import full_lora_state_dict
    from lit_qlora.nf4 import dequantize_nf4

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        group = mesh["tensor_parallel"].get_group()
        model = load_model(ckpt, quantize, "32-true", shard=tp.TensorParallelShard(rank, 2)).train()
        torch.manual_seed(100 + rank)  # another init per rank: parallelize must start all from rank 0's
        apply_lora(model, 4, 8.0, 0.0, HEAD_TOO, dtype=torch.float32)
        for m in lora_modules(model).values():
            torch.nn.init.normal_(m.lora_B, std=0.05)  # B = 0 would leave A without gradient
        tp.parallelize(model, mesh["tensor_parallel"])
        init = full_lora_state_dict(model)

        ref = load_model(ckpt, quantize, "32-true", nf4_tensor_parallel=2).train()  # NF4: every shard's own bits
        apply_lora(ref, 4, 8.0, 0.0, HEAD_TOO, dtype=torch.float32)
        ref.load_state_dict(init, strict=False)
        out = {"lora_params": len(init), "head_adapted": "lm_head" in lora_modules(ref)}

        # The base each rank trains against, put together, is the one-process base (bit for bit).
        layer = model.model.layers[1]
        for name in ("self_attn.k_proj", "mlp.down_proj"):
            local = layer.get_submodule(name).weight
            local = dequantize_nf4(local) if quantize == "nf4" else local.detach()
            whole = _gather(local, 0 if tp.tp_style(name) == "column" else 1, group)
            out[f"base_equal.{name}"] = torch.equal(whole, ref.model.layers[1].get_submodule(name).weight.detach())

        torch.manual_seed(0)
        idx = torch.randint(0, model.config.vocab_size, (2, 24))
        logits, loss = _step(model, idx)
        ref_logits, ref_loss = _step(ref, idx)
        out["logits_diff"] = (logits - ref_logits).abs().max().item()
        out["logits_scale"] = ref_logits.abs().max().item()
        out["loss"], out["ref_loss"] = loss.item(), ref_loss.item()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        out["grad_names_equal"] = sorted(grads) == sorted(ref_grads) and len(grads) == len(init)
        out["grad_rel_diff"] = max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item() for n in grads)
        out["min_grad_norm"] = min(g.norm().item() for g in ref_grads.values())
        # Replicated parameters get the same gradient on every rank.
        replicated = [p for p in model.parameters() if p.grad is not None and p.placements[0].is_replicate()]
        out["replicated_grad_spread"] = max((_gather(p.grad.to_local()[None], 0, group).diff(dim=0)).abs().max().item()
                                            for p in replicated)

        # One clipped AdamW step: the global gradient norm over mixed placements, then equal parameters.
        norms = []
        for net in (model, ref):
            params = [p for p in net.parameters() if p.requires_grad]
            norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
            norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
            torch.optim.AdamW(params, lr=1e-2, foreach=True).step()
        out["grad_norm"], out["ref_grad_norm"] = norms
        after, ref_after = full_lora_state_dict(model), {k: v for k, v in ref.state_dict().items() if "lora_" in k}
        out["param_diff_after_step"] = max((after[k] - ref_after[k]).abs().max().item() for k in after)
        # Merged weights of this rank's shard, put together, equal the one-process merge.
        diffs = []
        for name, m in lora_modules(model).items():
            merged = m.merged_weight(torch.float32)
            if m.style != "replicate":
                merged = _gather(merged, 0 if m.style == "column" else 1, group)
            diffs.append((merged - ref.get_submodule(name).merged_weight(torch.float32)).abs().max().item())
        out["merged_diff"] = max(diffs)

        # The same gradients without the group sum in column-parallel layers: they must come out wrong.
        model.zero_grad(set_to_none=True)
        tp.copy_to_group = lambda x, group: x
        ref.zero_grad(set_to_none=True)
        _step(model, idx)
        _step(ref, idx)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        out["unreduced_grad_rel_diff"] = max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item()
                                             for n in grads)
        queue.put((rank, out))
    except Exception as e:  # report, do not hang the parent
        import traceback

        queue.put((rank, {"error": traceback.format_exc() + f"{type(e).__name__}: {e}"}))
    finally:
        dist.destroy_process_group()


HEAD_TOO = ["all", "lm_head"]  # the tiny models tie their heads, which `all` leaves out: the head-parallel path too


def assert_equals_one_process(results: dict) -> None:
    """What `_worker` measured on two ranks of a 2-block model matches one process."""
    for rank in (0, 1):
        r = results[rank]
        assert "error" not in r, r.get("error")
        # q, k, v, o, gate, up, down x 2 layers + lm_head (unless tied: `all` leaves it out): A and B each
        assert r["lora_params"] == 2 * (14 + r["head_adapted"])
        assert r["base_equal.self_attn.k_proj"] and r["base_equal.mlp.down_proj"]
        assert r["logits_diff"] < 1e-5 * max(1.0, r["logits_scale"])
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
        assert r["grad_names_equal"] and r["min_grad_norm"] > 0
        assert r["grad_rel_diff"] < 1e-5
        assert r["replicated_grad_spread"] == 0.0
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
        # Adam: ~lr (1e-2) per element, tiny gradients amplified: an element whose gradient is near 0 moves by up to lr
        # on a rounding difference (1.35e-4 measured, in layer 0's q_proj lora_A, since the tied head computes with the
        # fp32 embedding instead of an NF4 copy; 1.4% of one step's update)
        assert r["param_diff_after_step"] < 3e-4
        # fp32 rounding: the one-process model runs q/k/v and gate/up fused (fused_projections), the ranks each
        # projection on its own, so sums run in another order (Qwen3 tied: 1.6e-6 measured)
        # (and the merged weights follow that element: 4.0e-5 measured in the same q_proj)
        assert r["merged_diff"] < 1e-4
        # Without the tensor-parallel sum A's (and the inputs') gradients miss the other rank's share.
        assert r["unreduced_grad_rel_diff"] > 1e-2
    assert results[0]["loss"] == results[1]["loss"]


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_tensor_parallel_equals_one_process(quantize, tiny_llama_dir, tmp_path):
    from helpers import spawn_ranks

    assert_equals_one_process(spawn_ranks(_worker, 2, str(tiny_llama_dir), quantize, str(tmp_path / "store")))


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
