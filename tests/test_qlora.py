"""QLoRA core: NF4 precision plugin (Fabric and Trainer), LoRA layers, merge and PEFT export."""

import json

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lit_qlora.checkpoint.hf import save_hf_checkpoint
from lit_qlora.model.config import Config
from lit_qlora.export.hf import export_peft, hf_tensor_specs, merge
from lit_qlora.checkpoint.loading import load_model
from lit_qlora.lora.layer import LoRALinear, apply_lora, lora_state_dict
from lit_qlora.checkpoint.adapter import save_adapter
from lit_qlora.memory.accounting import tensor_bytes
from lit_qlora.model.transformer import Transformer
from lit_qlora.nf4 import base_linears, count_linears, dequantize_nf4, is_nf4, quantize_nf4
from lit_qlora.train.precision import NF4Precision

# Shapes chosen so layers need non-default NF4 layouts (k/v: 64x256 = 16384 / 64 = 256 blocks; up: 352 rows).
TINY = Config(vocab_size=320, n_layer=2, n_embd=256, n_head=4, n_query_groups=1, intermediate_size=352,
              max_seq_length=128, tie_embeddings=True)


def tiny_model(config=TINY, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = Transformer(config)
    model.init_weights()
    return model.to(dtype)


def randomize_lora(model, seed=1):
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_(0, 0.05)


def test_fabric_setup_quantizes_every_linear():
    model = apply_lora(tiny_model(), r=4, alpha=8, targets=["q", "v"])
    plugin = NF4Precision("bf16-true")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
    model = fabric.setup(model)
    quantized, total = count_linears(model)
    assert total == 2 * 7  # seven projections per block; the tied lm_head is the embedding's weight
    assert quantized == total == plugin.quantized_linears == plugin.total_linears
    module = model.module if hasattr(model, "module") else model
    # Tied embeddings: the embedding stays high precision and the head reads it (no NF4 copy).
    assert module.model.embed_tokens.weight.dtype == torch.bfloat16
    assert module.config.tie_embeddings and module.lm_head.weight is module.model.embed_tokens.weight
    for m in module.modules():
        if isinstance(m, LoRALinear):
            assert not is_nf4(m.lora_A) and m.lora_A.dtype == torch.bfloat16


def test_ignore_modules_keep_high_precision():
    model = tiny_model()
    plugin = NF4Precision("bf16-true", ignore_modules=["lm_head", "model.layers.1.mlp"])
    plugin.convert_module(model)
    assert (plugin.quantized_linears, plugin.total_linears) == (14 - 3, 14)  # (the tied head is the embedding)
    assert model.lm_head.weight.dtype == torch.bfloat16 and not is_nf4(model.lm_head.weight)


def test_trainer_fit_trains_lora_on_nf4():
    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = apply_lora(tiny_model(), r=4, alpha=8, targets="all")

        def training_step(self, batch, _):
            logits = self.model(batch[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    module = Module()
    before = {k: v.clone() for k, v in lora_state_dict(module.model).items()}
    data = torch.utils.data.DataLoader(torch.randint(0, 320, (8, 17)), batch_size=4)
    plugin = NF4Precision("bf16-true")
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    assert plugin.quantized_linears == plugin.total_linears == 14  # the tied head reads the embedding
    assert all(is_nf4(m.weight) for m in base_linears(module.model).values())
    after = lora_state_dict(module.model)
    assert all(not torch.equal(after[k], before[k]) for k in after if k.endswith("lora_B"))


def test_resident_bytes_per_quantized_parameter():
    config = TINY.replace(n_embd=512, intermediate_size=1376, vocab_size=2048, n_layer=1, n_query_groups=2)
    model = tiny_model(config)
    NF4Precision("bf16-true").convert_module(model)
    linears = [m.weight for m in base_linears(model).values()]
    assert all(is_nf4(w) for w in linears)
    per_param = sum(tensor_bytes(w) for w in linears) / sum(w.numel() for w in linears)
    assert per_param <= 0.52, per_param


@pytest.mark.parametrize("precision,dtype,tol", [("bf16-true", torch.bfloat16, 0.0), ("16-true", torch.float16, 0.0),
                                                 ("32-true", torch.float32, 0.0)])
def test_zero_b_equals_dequantized_base_and_grads_reach_only_lora(precision, dtype, tol):
    model = apply_lora(tiny_model(), r=4, alpha=8, targets="all")
    NF4Precision(precision).convert_module(model)
    # Reference: the same model with every NF4 weight replaced by its dequantized values, no LoRA.
    reference = Transformer(model.config).to(dtype)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            src = model.get_parameter(name)
            p.copy_(dequantize_nf4(src) if is_nf4(src) else src)
    idx = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        assert (model(idx).float() - reference(idx).float()).abs().max() <= tol
    model.train()
    logits = model(idx)
    assert logits.dtype == dtype
    loss = F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.requires_grad and p.grad is not None, name
        else:
            assert p.grad is None, name
    # B = 0 gives A no gradient at first; B must get one.
    assert all(m.lora_B.grad.abs().sum() > 0 for m in model.modules() if isinstance(m, LoRALinear))


def write_base(tmp_path, model):
    specs = hf_tensor_specs(model, torch.float32)
    return save_hf_checkpoint(tmp_path / "base", model.config, specs, dtype=torch.float32)


def trained_adapter(tmp_path, base_dir, quantize, targets="all"):
    config = Config.from_checkpoint(base_dir)
    model = load_model(base_dir, quantize)
    apply_lora(model, r=4, alpha=8, targets=targets, dtype=torch.bfloat16)
    randomize_lora(model)
    adapter_dir = save_adapter(model, tmp_path / f"adapter-{quantize}", {
        "r": 4, "alpha": 8, "targets": targets if isinstance(targets, list) else [targets], "rslora": False,
        "quantize": quantize, "base_dtype": "bfloat16", "lora_dtype": "bfloat16", "base_model": config.name})
    return model.eval(), adapter_dir


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_merged_export_equals_unmerged_model(tmp_path, quantize):
    transformers = pytest.importorskip("transformers")
    base_dir = write_base(tmp_path, tiny_model())
    model, adapter_dir = trained_adapter(tmp_path, base_dir, quantize, ["all", "lm_head"])  # the tied head, named
    merged_dir = merge(base_dir, adapter_dir, tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.bfloat16).eval()
    cfg = json.loads((merged_dir / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False  # the head was adapted
    idx = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        ours, theirs = model(idx).float(), hf(idx).logits.float()
    # bf16 tolerance: merged weights are rounded to bf16 once, the unmerged path rounds activations instead.
    assert (ours - theirs).abs().max() <= 0.05 * ours.abs().max()
    assert torch.allclose(ours.softmax(-1), theirs.softmax(-1), atol=2e-2)


def test_merge_into_nf4_base_differs_from_original_base(tmp_path):
    base_dir = write_base(tmp_path, tiny_model())
    _, adapter_dir = trained_adapter(tmp_path, base_dir, "nf4", targets=["q"])
    from safetensors.torch import load_file

    nf4 = load_file(str(merge(base_dir, adapter_dir, tmp_path / "m1") / "model.safetensors"))
    plain = load_file(str(merge(base_dir, adapter_dir, tmp_path / "m2", quantize="none") / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(nf4[key], plain[key])
    # quantize=none: the original bf16 weight plus the delta; untargeted layers are the base unchanged.
    assert torch.equal(plain["model.layers.0.mlp.up_proj.weight"],
                       load_file(str(base_dir / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"].bfloat16())


def test_peft_export_matches_merged_on_dequantized_base(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base_dir = write_base(tmp_path, tiny_model())
    _, adapter_dir = trained_adapter(tmp_path, base_dir, "nf4", targets=["q", "k", "v", "o", "gate", "up", "down"])
    out = export_peft(base_dir, adapter_dir, tmp_path / "peft", with_dequantized_base=True)
    merged_dir = merge(base_dir, adapter_dir, tmp_path / "merged")
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, out).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    idx = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        a, b = with_adapter(idx).logits, merged(idx).logits
    assert (a - b).abs().max() <= 0.02 * a.abs().max()
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and set(cfg["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_merge_and_export_peft_through_the_cli(tmp_path):
    from lit_qlora.cli import main

    base_dir = write_base(tmp_path, tiny_model())
    _, adapter_dir = trained_adapter(tmp_path, base_dir, "nf4", targets=["q", "down"])
    main(["merge", "--checkpoint_dir", str(base_dir), "--adapter_dir", str(adapter_dir),
          "--out_dir", str(tmp_path / "merged")])
    main(["export_peft", "--checkpoint_dir", str(base_dir), "--adapter_dir", str(adapter_dir),
          "--out_dir", str(tmp_path / "peft")])
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "peft" / "base").exists()
    with pytest.raises(SystemExit) as e:
        main(["merge", "--checkpoint_dir", str(base_dir), "--adapter_dir", str(tmp_path / "none"),
              "--out_dir", str(tmp_path / "m")])
    assert e.value.code == 1


def test_loading_a_state_dict_requantizes_in_place():
    model = tiny_model()
    NF4Precision("bf16-true").convert_module(model)
    saved = model.state_dict()  # the save hook exposes NF4 weights as plain bf16 tensors
    key = "model.layers.0.mlp.up_proj.weight"
    assert not is_nf4(saved[key]) and saved[key].dtype == torch.bfloat16
    new = tiny_model(seed=5).to(torch.bfloat16).state_dict()
    model.load_state_dict(new)
    weight = model.get_parameter(key)
    assert is_nf4(weight)
    assert torch.equal(dequantize_nf4(weight), dequantize_nf4(quantize_nf4(new[key])))


@pytest.mark.parametrize("training", [False, True])
def test_adapters_disabled_computes_the_base_alone(training):
    """Under adapters_disabled (the DPO reference) a LoRA layer returns its base output as it is: its adapter is not
    run at all (a NaN adapter does not reach the output, which out + 0 * adapter would)."""
    from lit_qlora.lora.layer import adapters_disabled

    torch.manual_seed(0)
    base = torch.nn.Linear(16, 8)
    layer = LoRALinear(base, r=4, alpha=8, dropout=0.1, dtype=torch.float32).train(training)
    with torch.no_grad():
        layer.lora_B.fill_(float("nan"))
    x = torch.randn(3, 16)
    with adapters_disabled(layer):
        out = layer(x)
    assert torch.equal(out, F.linear(x, base.weight, base.bias))
    assert torch.isnan(layer(x)).all()  # outside: the adapter again
