"""DDP and FSDP2 through Lightning on CPU (2 gloo processes): the same numbers as one process on the same global batch,
with one gradient reduction per optimizer step however many micro-batches it accumulates."""

import json
import shutil
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from lit_qlora.parallel.distributed import build_strategy, nf4_shards_for

# tests/ is on sys.path (pytest's rootdir-relative import); the one_process fixture is conftest's
from helpers import STEPS, assert_same_final, cli_run, metrics_rows, needs_gloo, small_data



def test_fsdp_means_fsdp2_over_every_rank():
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = build_strategy("fsdp", 4)
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 1)
    assert build_strategy("ddp", 4) == "ddp"
    with pytest.raises(ValueError, match="not supported"):
        build_strategy("deepspeed", 2)


def test_nf4_layout_shards_only_for_fsdp():
    assert nf4_shards_for("ddp", 8) == 1 and nf4_shards_for("auto", 1) == 1
    assert nf4_shards_for("fsdp", 8) == 8
    assert nf4_shards_for("auto", 1, requested=4) == 4 and nf4_shards_for("fsdp", 2, requested=4) == 4
    with pytest.raises(ValueError, match="multiple of devices"):
        nf4_shards_for("fsdp", 4, requested=2)



@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_equal_one_process_reducing_gradients_once_per_step(strategy, tiny_llama_dir, one_process,
                                                                          tmp_path):
    ref_dir, data = one_process
    out = tmp_path / strategy
    cli_run(tiny_llama_dir, out, data, strategy, "--nf4_shards", "2", count_dir=tmp_path / "counts")
    # Each rank accumulates 2 micro-batches per step; only the last one's backward reduces: every DDP bucket is
    # all-reduced, every FSDP unit with an adapter (2 blocks, + the root where it holds lm_head's: the tiny model ties
    # its head, which `all` leaves out) reduce-scattered, once a step.
    units = 2 + ("lm_head" in json.loads((out / "final" / "adapter_config.json").read_text())["targets"])
    for rank in range(2):
        calls = Counter((tmp_path / "counts" / f"rank{rank}.txt").read_text().splitlines())
        if strategy == "ddp":
            assert calls and set(calls.values()) == {STEPS} and all(c.startswith("ddp bucket") for c in calls), calls
        else:
            assert calls == {"fsdp reduce-scatter": units * STEPS}, calls
    ref, got = metrics_rows(ref_dir), metrics_rows(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # written once (rank 0), not once per rank
    # The token-weighted loss of the whole global batch, reduced across ranks.
    assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-6)
    # Gradients equal one process's: DDP/FSDP average over ranks, so unscaled they would be half as large.
    assert got[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=1e-4)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert_same_final(ref_dir, out)
    assert (out / "final" / "peft" / "adapter_model.safetensors").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quantized_linears"] == summary["total_linears"] == 14  # FSDP's DTensor shards count as NF4 (the tied head reads the embedding)
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["nf4_world_size"] == 2


@pytest.mark.slow
@needs_gloo
def test_fsdp_resume_auto_reaches_the_uninterrupted_adapter(tiny_llama_dir, tmp_path):
    data = small_data(tmp_path)
    out = tmp_path / "fsdp"
    cli_run(tiny_llama_dir, out, data, "fsdp", "--train.max_steps=4", "--train.save_interval=2")
    full = load_file(str(out / "final" / "adapter.safetensors"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    # Turn it into a run killed after step 2 (its step-4 checkpoint and export never written), then resume it.
    shutil.rmtree(out / "checkpoints" / "step-000004")
    shutil.rmtree(out / "final")
    proc = cli_run(tiny_llama_dir, out, data, "fsdp", "--train.max_steps=4", "--train.save_interval=2",
                   "--resume", "auto")
    assert "Resuming from" in proc.stdout
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2
    resumed = load_file(str(out / "final" / "adapter.safetensors"))
    assert max((full[k] - resumed[k]).abs().max().item() for k in full) < 1e-6
    assert [r["step"] for r in metrics_rows(out)] == [1, 2, 3, 4]


def _init_worker(rank: int, init_file: str, queue) -> None:
    """Each rank seeds differently on purpose: FSDP2 must still start every rank from rank 0's adapter, and DDP
    must neither alter the NF4 base nor leave ranks with different adapters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lit_qlora.model.config import Config
    from lit_qlora.parallel.distributed import keep_frozen_out_of_ddp, shard_model
    from lit_qlora.lora.layer import apply_lora, lora_state_dict
    from lit_qlora.checkpoint.adapter import full_lora_state_dict
    from lit_qlora.model.transformer import Transformer
    from lit_qlora.nf4 import dequantize_nf4, quantize_linears

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        config = Config(name="t", vocab_size=256, n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_dim=16,
                        intermediate_size=128, max_seq_length=32)

        def build(seed):
            torch.manual_seed(0)  # the same base everywhere
            model = Transformer(config).to(torch.bfloat16)
            model.init_weights()
            quantize_linears(model, world_size=2)
            torch.manual_seed(seed)  # a different adapter init per rank
            return apply_lora(model, 4, 8.0, dtype=torch.bfloat16)

        out = {}
        model = build(100 + rank)
        out["own_init"] = {k: v.clone() for k, v in lora_state_dict(model).items()}
        shard_model(model, init_device_mesh("cpu", (2,)))
        out["fsdp"] = full_lora_state_dict(model)
        out["fsdp_local_rows"] = model.model.layers[0].mlp.up_proj.weight.to_local().shape[0]

        model = build(200 + rank)
        base = dequantize_nf4(model.lm_head.weight).clone()
        wrapper = torch.nn.Module()
        wrapper.model = model
        keep_frozen_out_of_ddp(wrapper)
        DistributedDataParallel(wrapper)  # broadcasts rank 0's (trainable) state at construction
        out["ddp"] = {k: v.clone() for k, v in lora_state_dict(model).items()}
        out["ddp_base_unchanged"] = torch.equal(dequantize_nf4(model.lm_head.weight), base)
        # Plain lists: tensors would travel as shared memory that dies with this process.
        queue.put((rank, {k: ({n: t.float().tolist() for n, t in v.items()} if isinstance(v, dict) else v)
                          for k, v in out.items()}))
    except Exception as e:  # report, do not hang the parent
        queue.put((rank, {"error": f"{type(e).__name__}: {e}"}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@needs_gloo
def test_lora_starts_identical_on_every_rank(tmp_path):
    from helpers import spawn_ranks

    results = spawn_ranks(_init_worker, 2, str(tmp_path / "store"))
    r0, r1 = results[0], results[1]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    own0, own1 = r0["own_init"], r1["own_init"]
    assert any(own0[k] != own1[k] for k in own0)  # the ranks really did start apart
    assert all(r0["fsdp"][k] == own0[k] and r1["fsdp"][k] == own0[k] for k in own0)
    assert all(r0["ddp"][k] == r1["ddp"][k] for k in own0)
    assert r0["ddp_base_unchanged"] and r1["ddp_base_unchanged"]
    assert r0["fsdp_local_rows"] == r1["fsdp_local_rows"] == 64  # up_proj (128 x 64): half the rows per rank
