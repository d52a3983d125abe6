"""The one loader, `load_model`: plain and NF4 bases, a fine-tune's adapter on its exact base, tensor-parallel
shards and layouts, and the typed quantize choice."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from lit_qlora.checkpoint.adapter import save_adapter
from lit_qlora.checkpoint.hf import save_hf_checkpoint
from lit_qlora.checkpoint.loading import load_model, resolve_quantize
from lit_qlora.export.hf import hf_tensor_specs
from lit_qlora.lora.layer import apply_lora, lora_state_dict, resolve_targets, tied_head
from lit_qlora.model.config import Config, Quantize
from lit_qlora.model.transformer import Transformer
from lit_qlora.nf4 import FrozenNF4Linear, base_linears, count_linears, dequantize_nf4, is_nf4, quantize_nf4
from lit_qlora.parallel.tensor_parallel import TensorParallelShard, tp_layout_weight

# Shapes that need non-default NF4 layouts: the MLP is 352 wide; the 320x256 head takes scaler blocks of 256 for
# one shard but 320 for two (nf4_world_size=2). Two kv groups, so tensor parallelism of 2 divides everything.
CONFIG = Config(vocab_size=320, n_layer=2, n_embd=256, n_head=4, n_query_groups=2, intermediate_size=352,
                max_seq_length=64, tie_embeddings=True)
LINEARS = 2 * 7  # seven projections per block (the tied head is the embedding: not a linear of its own)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    model.init_weights()
    out = tmp_path_factory.mktemp("base")
    return save_hf_checkpoint(out, CONFIG, hf_tensor_specs(model, torch.float32), dtype=torch.float32)


def stored(ckpt) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors; the tied head reads the embedding, as the model does."""
    weights = load_file(str(ckpt / "model.safetensors"))
    return {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}


def test_plain_base_holds_the_checkpoint_in_the_precision_dtype(ckpt):
    model = load_model(ckpt)  # quantize none, bf16-true
    assert not model.training
    assert count_linears(model) == (0, LINEARS)
    weights = stored(ckpt)
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16, name
        assert torch.equal(param, weights[name].bfloat16()), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the checkpoint
    fp32 = load_model(ckpt, "none", "32-true")
    assert all(torch.equal(p, weights[n]) for n, p in fp32.named_parameters())


def test_nf4_base_quantizes_every_linear_from_the_precision_dtype(ckpt):
    model = load_model(ckpt, "nf4", "bf16-true")
    assert count_linears(model) == (LINEARS, LINEARS)
    weights = stored(ckpt)
    for name, module in base_linears(model).items():
        assert type(module) is FrozenNF4Linear, name
        want = quantize_nf4(weights[f"{name}.weight"].bfloat16())
        assert torch.equal(module.weight.quantized_data, want.quantized_data), name
        assert torch.equal(dequantize_nf4(module.weight), dequantize_nf4(want)), name
    # Tied embeddings: the embedding stays bf16 and the head reads it (no NF4 copy); the config stays tied.
    assert torch.equal(model.model.embed_tokens.weight, weights["model.embed_tokens.weight"].bfloat16())
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.tie_embeddings
    # The save hook hands out dense weights (safetensors cannot store NF4).
    assert not is_nf4(model.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_quantize_choice_is_typed_and_accepts_its_strings(ckpt):
    assert Quantize("nf4") is Quantize.NF4 and Quantize("none") is Quantize.NONE
    assert str(Quantize.NF4) == "nf4" and json.dumps({"quantize": Quantize.NF4}) == '{"quantize": "nf4"}'
    with pytest.raises(ValueError):
        Quantize("int8")
    assert resolve_quantize(None) is Quantize.NONE
    assert resolve_quantize(None, {"quantize": "nf4"}) is Quantize.NF4
    assert resolve_quantize("none", {"quantize": "nf4"}) is Quantize.NONE  # an explicit choice wins
    by_enum, by_string = load_model(ckpt, Quantize.NF4), load_model(ckpt, "nf4")
    q_name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(by_enum.get_parameter(q_name).quantized_data, by_string.get_parameter(q_name).quantized_data)
    with pytest.raises(ValueError):
        load_model(ckpt, "int8")


def train_adapter(ckpt, quantize: str, out_dir, ignore_modules=(), nf4_world_size=1):
    """What `litqlora finetune` does to its base, in miniature: load, wrap in LoRA, take real optimizer steps,
    write the adapter with the keys finetune writes. Returns the trained model."""
    model = load_model(ckpt, quantize, "bf16-true", ignore_modules=ignore_modules,
                       nf4_world_size=nf4_world_size).train()
    apply_lora(model, r=4, alpha=8, dropout=0.0, targets="all", dtype=torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(bool(v.abs().sum() > 0) for k, v in lora_state_dict(model).items() if k.endswith("lora_B"))
    save_adapter(model, out_dir, {
        "r": 4, "alpha": 8, "dropout": 0.0, "targets": resolve_targets("all", tied_head(model)),
        "rslora": False, "quantize": quantize, "precision": "bf16-true", "base_dtype": "bfloat16",
        "lora_dtype": "bfloat16", "ignore_modules": list(ignore_modules), "nf4_world_size": nf4_world_size})
    return model.eval()


@pytest.mark.parametrize("quantize,ignore_modules,nf4_world_size,nf4_linears",
                         [("nf4", (), 1, LINEARS), ("nf4", ("model.layers.1.mlp",), 2, LINEARS - 3),
                          ("none", (), 1, 0)])
def test_adapter_gives_the_outputs_of_the_model_that_trained(ckpt, tmp_path, quantize, ignore_modules,
                                                              nf4_world_size, nf4_linears):
    trained = train_adapter(ckpt, quantize, tmp_path / "adapter", ignore_modules, nf4_world_size)
    loaded = load_model(ckpt, adapter_dir=tmp_path / "adapter")  # quantize, dtypes, layout: from the adapter
    assert not loaded.training
    assert count_linears(loaded) == (nf4_linears, LINEARS)
    if quantize == "nf4":
        name = "model.layers.0.mlp.up_proj.weight"
        weight, trained_weight = loaded.get_parameter(name), trained.get_parameter(name)
        assert weight.scaler_block_size == trained_weight.scaler_block_size
        assert torch.equal(weight.quantized_data, trained_weight.quantized_data)
    idx = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(idx), trained(idx))


def test_adapter_base_can_be_overridden_but_not_mixed_with_shards(ckpt, tmp_path):
    train_adapter(ckpt, "nf4", tmp_path / "adapter")
    plain = load_model(ckpt, "none", adapter_dir=tmp_path / "adapter")
    assert count_linears(plain) == (0, LINEARS)
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_model(ckpt, adapter_dir=tmp_path / "adapter", shard=TensorParallelShard(0, 2))
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_model(ckpt, adapter_dir=tmp_path / "adapter", nf4_world_size=2)


def test_a_fine_tunes_out_dir_is_taken_as_its_final_adapter(ckpt, tmp_path):
    out_dir = tmp_path / "run"
    trained = train_adapter(ckpt, "nf4", out_dir / "final")
    loaded = load_model(ckpt, adapter_dir=out_dir)  # the out_dir a user passes, not .../final
    idx = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(idx), trained(idx))


def test_an_unfinished_runs_out_dir_says_to_resume(ckpt, tmp_path):
    (tmp_path / "run" / "checkpoints" / "step-000010").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no final/: the run has not finished.*--resume auto"):
        load_model(ckpt, adapter_dir=tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="must be a fine-tune's out_dir or its final/ directory"):
        load_model(ckpt, adapter_dir=tmp_path / "elsewhere")


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_shard_keeps_this_ranks_part_quantized_on_its_own(ckpt, quantize):
    weights = stored(ckpt)
    model = load_model(ckpt, quantize, "bf16-true", shard=TensorParallelShard(1, 2))
    q = model.model.layers[0].self_attn.q_proj.weight  # column-parallel: rank 1 holds rows 128:256
    o = model.model.layers[0].self_attn.o_proj.weight  # row-parallel: rank 1 holds columns 128:256
    q_want = weights["model.layers.0.self_attn.q_proj.weight"].bfloat16()[128:]
    o_want = weights["model.layers.0.self_attn.o_proj.weight"].bfloat16()[:, 128:].contiguous()
    assert tuple(q.shape) == (128, 256) and tuple(o.shape) == (256, 128)
    if quantize == "nf4":
        assert torch.equal(dequantize_nf4(q), dequantize_nf4(quantize_nf4(q_want)))
        assert torch.equal(dequantize_nf4(o), dequantize_nf4(quantize_nf4(o_want)))
        assert count_linears(model) == (LINEARS, LINEARS)
    else:
        assert torch.equal(q, q_want) and torch.equal(o, o_want)
    with pytest.raises(ValueError, match="must divide"):
        load_model(ckpt, quantize, shard=TensorParallelShard(0, 3))


def test_tensor_parallel_layout_in_one_process(ckpt):
    """The base of a 2-rank tensor-parallel QLoRA run: split linears dense (each rank's shard's NF4 bits), the tied
    head the embedding as usual."""
    weights = stored(ckpt)
    model = load_model(ckpt, "nf4", "bf16-true", nf4_tensor_parallel=2)
    for name, style in (("model.layers.1.mlp.down_proj", "row"), ("model.layers.1.self_attn.k_proj", "column")):
        weight = model.get_parameter(f"{name}.weight")
        assert not is_nf4(weight)
        assert torch.equal(weight, tp_layout_weight(weights[f"{name}.weight"].bfloat16(), style, 2))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert count_linears(model) == (0, LINEARS)
