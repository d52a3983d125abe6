"""`--precision 16-mixed` (GPUs without bf16: T4, V100), run on the CPU: an fp16 base and fp16 compute, fp32 adapters
and AdamW state, dynamic loss scaling whose overflowing steps are skipped (and the scale lowered), and an exact resume
that carries the loss scale."""

import json

import pytest
import torch
from safetensors.torch import load_file

from lit_qlora.train.run import fit, setup
from lit_qlora.train.spec import RunSpec
from lit_qlora.train.args import DataArgs, LoRAArgs, TrainArgs

MIXED_TRAIN = dict(micro_batch_size=2, global_batch_size=4, max_seq_length=64, lr=1e-2, warmup_steps=1)


def data_args(tmp_path, n=24):
    rows = [{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."} for i in range(n)]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    return DataArgs(json_path=path, val_split=0.25)


def build(tiny_llama_dir, out_dir, data, precision="16-mixed", quantize="nf4", resume=False, **train_kw):
    return setup(RunSpec(checkpoint_dir=tiny_llama_dir, out_dir=out_dir, quantize=quantize, precision=precision, seed=7,
                 accelerator="cpu", devices=1, num_nodes=1, strategy="auto", tensor_parallel=1, nf4_shards=None,
                 resume=resume, lora=LoRAArgs(r=4, alpha=8, dropout=0.0), train=TrainArgs(**{**MIXED_TRAIN, **train_kw}),
                 data=data, ignore_modules=None))


@pytest.mark.parametrize("precision, compute, scale", [("16-mixed", torch.float16, 65536.0),
                                                      ("bf16-mixed", torch.bfloat16, None)])
@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_16_mixed_keeps_adapters_and_adamw_in_fp32_and_computes_in_fp16(tiny_llama_dir, tmp_path, quantize, precision,
                                                                       compute, scale):
    """And bf16-mixed (Lightning's meaning: fp32 adapters and AdamW state) computes in bf16, without loss scaling."""
    run = build(tiny_llama_dir, tmp_path / "run", data_args(tmp_path), precision=precision, quantize=quantize,
                max_steps=2)
    seen = {}

    def record(module, args, output):
        seen.setdefault(id(module), (args[0].dtype, output.dtype))

    model = run.module.model
    block = model.blocks[0]
    hooks = [block.self_attn.o_proj.register_forward_hook(record), block.mlp.down_proj.register_forward_hook(record)]
    summary = fit(run)
    for h in hooks:
        h.remove()
    assert summary["precision"] == precision
    assert len(seen) == 2 and all(v == (compute, compute) for v in seen.values()), seen  # fp16 (bf16) matmuls
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert lora and all(p.dtype == torch.float32 for p in lora.values())
    from lit_qlora.nf4 import is_nf4

    assert any(is_nf4(p) for p in frozen.values()) == (quantize == "nf4")
    assert all(p.dtype == compute for p in frozen.values() if not is_nf4(p))  # embeddings, norms, dense base
    optimizer = run.trainer.optimizers[0]
    moments = [s["exp_avg"] for s in optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    assert run.trainer.precision_plugin.loss_scale() == scale  # no overflow in two healthy steps
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] is not None and "skipped" not in r for r in rows)
    assert any(bool((p != 0).any()) for n, p in lora.items() if "lora_B" in n)  # the adapters trained
    final = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert (final["precision"], final["base_dtype"], final["lora_dtype"]) == (precision, str(compute)[6:], "float32")
    assert all(t.dtype == torch.float32 for t in load_file(tmp_path / "run" / "final" / "adapter.safetensors").values())


def test_16_mixed_losses_follow_fp32(tiny_llama_dir, tmp_path):
    """Same seed and data: 16-mixed's losses are fp32's within fp16 rounding (no loss-scale or dtype mistake)."""
    losses = {}
    for precision in ("16-mixed", "32-true"):
        out = tmp_path / precision
        fit(build(tiny_llama_dir, out, data_args(tmp_path), precision=precision, max_steps=3))
        losses[precision] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses["16-mixed"] == pytest.approx(losses["32-true"], rel=2e-2)


def test_an_overflowing_step_is_skipped_and_the_scale_halved_not_a_stop(tiny_llama_dir, tmp_path, monkeypatch):
    """With a loss scale no fp16 gradient survives, each step overflows: the update is skipped and counted, the
    scale halves, and the run goes on (on_nonfinite=stop is for a diverging loss, not for loss scaling)."""
    real_init = torch.amp.GradScaler.__init__
    monkeypatch.setattr(torch.amp.GradScaler, "__init__",
                        lambda self, device="cuda", **kw: real_init(self, device, **{**kw, "init_scale": 2.0 ** 60}))
    out = tmp_path / "run"
    run = build(tiny_llama_dir, out, data_args(tmp_path), max_steps=2, save_interval=1)
    fit(run)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["loss"] is None and "overflowed fp16 at loss scale" in r["skipped"] for r in rows)
    assert run.trainer.precision_plugin.loss_scale() == 2.0 ** 58
    b = [p for n, p in run.module.model.named_parameters() if "lora_B" in n]
    assert all(bool((p == 0).all()) for p in b)  # no update was applied
    state = json.loads((out / "checkpoints" / "step-000001" / "state.json").read_text())
    assert state["loss_scale"]["scale"] == 2.0 ** 59


def test_a_resumed_16_mixed_run_continues_with_the_saved_loss_scale(tiny_llama_dir, tmp_path, monkeypatch):
    """Two steps, then a resume for two more, equals four steps in one go: adapters bit for bit, and the scale."""
    real_init = torch.amp.GradScaler.__init__
    # A small growth interval so the scale changes within the run (and a resume that forgot it would differ).
    monkeypatch.setattr(torch.amp.GradScaler, "__init__",
                        lambda self, device="cuda", **kw: real_init(self, device, **{**kw, "growth_interval": 1}))
    data = data_args(tmp_path)
    straight = build(tiny_llama_dir, tmp_path / "straight", data, max_steps=4, save_interval=2)
    fit(straight)
    resumed = build(tiny_llama_dir, tmp_path / "resumed", data, max_steps=4,
                    resume=tmp_path / "straight" / "checkpoints" / "step-000002")
    fit(resumed)
    scale = straight.trainer.precision_plugin.loss_scale()
    assert scale == resumed.trainer.precision_plugin.loss_scale() == 65536.0 * 2 ** 4
    a = load_file(tmp_path / "straight" / "final" / "adapter.safetensors")
    b = load_file(tmp_path / "resumed" / "final" / "adapter.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
