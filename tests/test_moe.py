"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE) against transformers and peft, on tiny random checkpoints that
transformers itself writes in the Hub's key layout: logits and greedy tokens, NF4 experts stacked per block with the
router kept in high precision, LoRA on every expert computed as grouped matmuls (loss and gradients equal to peft's
`target_parameters` on transformers), and the merged export back in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lit_qlora.checkpoint.loading import load_model  # noqa: E402
from lit_qlora.export.hf import merge  # noqa: E402
from lit_qlora.lora.experts import LoRAExpertLinear  # noqa: E402
from lit_qlora.lora.layer import adapters_disabled, apply_lora, lora_modules  # noqa: E402
from lit_qlora.model.config import Config  # noqa: E402
from lit_qlora.model.sampling import generate  # noqa: E402
from lit_qlora.nf4 import count_linears, dequantize_nf4, is_nf4  # noqa: E402
from lit_qlora.nf4.grouped import ExpertLinear, grouped_mm, grouped_weight_grad  # noqa: E402

from helpers import MOE_FAMILIES as FAMILIES  # noqa: E402
from helpers import tokens, write_tiny_moe  # noqa: E402

VOCAB = 256

def moe_tokens(shape: tuple[int, ...], seed: int = 2) -> torch.Tensor:
    return tokens(shape, seed, vocab=VOCAB)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(request.param)
    write_tiny_moe(request.param, out)
    return request.param, out


def test_checkpoint_is_in_the_hubs_per_expert_layout_and_reads_as_a_mixture(family):
    model_type, path = family
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    expert = {"mixtral": "block_sparse_moe.experts.7.w2.weight", "gpt_oss": "mlp.experts.gate_up_proj_bias"}.get(
        model_type, "mlp.experts.7.down_proj.weight")  # gpt-oss: stacked and transposed, gate and up interleaved
    assert f"model.layers.1.{expert}" in keys
    config = Config.from_checkpoint(path)
    assert (config.n_experts, config.n_experts_per_token) == (8, FAMILIES[model_type]["num_experts_per_tok"])
    assert config.norm_topk_prob == (model_type in ("qwen3_moe", "mixtral"))
    assert config.router_topk_softmax == config.attn_sinks == config.expert_bias == (model_type == "gpt_oss")
    assert config.moe_intermediate_size == (32 if model_type == "qwen3_moe" else 96)


def test_logits_and_greedy_tokens_equal_transformers(family):
    model_type, path = family
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, "none", "32-true")
    idx = moe_tokens((2, 24))
    prompt = [5, 17, 200, 42, 7]
    with torch.no_grad():
        diff = (ours(idx) - reference(idx).logits).abs().max().item()
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
    assert diff <= 1e-5
    assert list(generate(ours, prompt, 16)) == expected  # the KV cache: one token at a time through the router


def test_nf4_stacks_every_experts_projections_and_keeps_the_router_precise(family):
    model_type, path = family
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path, "nf4", "32-true")
    per_block = 4 + 3 * 8  # q, k, v, o and every expert's gate, up and down
    assert count_linears(model) == (2 * per_block + 1,) * 2
    moe = model.model.layers[0].mlp
    assert not is_nf4(moe.gate.weight) and moe.gate.weight.dtype == torch.float32
    experts = moe.experts.gate_proj
    assert is_nf4(experts.weight) and tuple(experts.weight.shape) == (8 * experts.out_features, 64)
    # NF4 exact: transformers computing with our dequantized weights gives our logits.
    state = dict(model.named_parameters())
    hf_state = reference.state_dict()
    with torch.no_grad():
        for i in range(2):
            ours = model.model.layers[i].mlp.experts
            gate, up, down = [dequantize_nf4(getattr(ours, p).weight).view(8, -1, getattr(ours, p).in_features)
                              for p in ("gate_proj", "up_proj", "down_proj")]
            if model_type == "gpt_oss":  # (E, in, out), gate and up in alternate columns
                gate_up, down = torch.stack([gate, up], dim=2).reshape(8, -1, 64).transpose(1, 2), down.transpose(1, 2)
            else:
                gate_up = torch.cat([gate, up], dim=1)
            hf_state[f"model.layers.{i}.mlp.experts.gate_up_proj"].copy_(gate_up)
            hf_state[f"model.layers.{i}.mlp.experts.down_proj"].copy_(down)
            for proj in "qkvo":
                name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
                hf_state[name].copy_(dequantize_nf4(state[name]))
        hf_state["lm_head.weight"].copy_(dequantize_nf4(state["lm_head.weight"]))
    idx = moe_tokens((2, 16))
    with torch.no_grad():
        assert (model(idx) - reference(idx).logits).abs().max().item() <= 1e-5


def test_the_router_load_counts_every_tokens_top_k(family):
    model_type, path = family
    model = load_model(path, "none", "32-true")
    with torch.no_grad():
        model(moe_tokens((3, 10)))
    k = FAMILIES[model_type]["num_experts_per_tok"]
    for block in model.model.layers:
        assert block.mlp.load.shape == (8,) and block.mlp.load.sum().item() == 3 * 10 * k
        assert (block.mlp.load > 0).sum() >= 2  # more than one expert is used


def _peft_keys(adapters: dict) -> dict[str, torch.Tensor]:
    """{peft's parameter name: tensor} for adapters laid out as peft holds them."""
    return {f"base_model.model.{name}.{leaf}.default.weight": t for name, pair in adapters.items()
            for leaf, t in zip(("lora_A", "lora_B"), pair)}


def test_one_training_step_equals_transformers_with_peft_target_parameters(family, tmp_path):
    """Loss and every adapter gradient (attention and all experts) equal peft's on transformers, our adapters in
    peft's layout as `export_peft` writes them (experts through `target_parameters`)."""
    from lit_qlora.export.hf import peft_adapters, peft_config

    model_type, path = family
    model = load_model(path, "none", "32-true")
    apply_lora(model, r=4, alpha=8, dtype=torch.float32, targets=["q", "v", "experts"])
    torch.manual_seed(3)
    with torch.no_grad():
        for layer in lora_modules(model).values():
            layer.lora_B.normal_(0, 0.1)
    adapters, ranks, alphas = peft_adapters(model, 8, False)
    config = peft_config({"r": 4, "alpha": 8, "module_names": list(adapters)}, str(path))
    config.update(rank_pattern=ranks, alpha_pattern=alphas)
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    keep = {k: config[k] for k in ("r", "lora_alpha", "target_modules", "target_parameters", "rank_pattern",
                                   "alpha_pattern")}
    with_adapter = peft.get_peft_model(reference, peft.LoraConfig(**keep))
    own = dict(with_adapter.named_parameters())
    expected = _peft_keys(adapters)
    assert set(expected) == {n for n in own if "lora_" in n}
    with torch.no_grad():
        for name, t in expected.items():
            assert own[name].shape == t.shape, name
            own[name].copy_(t)
    idx = moe_tokens((2, 12))
    ours_loss = torch.nn.functional.cross_entropy(model.train()(idx)[:, :-1].reshape(-1, VOCAB),
                                                  idx[:, 1:].reshape(-1))
    theirs_loss = with_adapter.train()(idx, labels=idx).loss
    assert abs(ours_loss.item() - theirs_loss.item()) <= 1e-5
    ours_loss.backward()
    theirs_loss.backward()
    grads = _peft_keys(peft_adapters(model, 8, False, lambda m: (m.lora_A.grad, m.lora_B.grad))[0])
    placed = _peft_keys(peft_adapters(model, 8, False, lambda m: (torch.ones_like(m.lora_A),
                                                                  torch.ones_like(m.lora_B)))[0])
    for name, grad in grads.items():  # where our layout puts a value (not peft's zero off-diagonal blocks)
        mask = placed[name].bool()
        assert torch.allclose(own[name].grad[mask], grad[mask], atol=1e-6, rtol=1e-4), name
    assert len(grads) == 2 * 2 * 4  # A and B of q, v, gate_up and down, in two blocks


def test_grouped_lora_equals_one_expert_at_a_time():
    """LoRAExpertLinear over sorted rows: each row through its own expert's W + scale * B A, values and gradients."""
    torch.manual_seed(0)
    base = ExpertLinear(5, 12, 6)
    torch.nn.init.normal_(base.weight)
    layer = LoRAExpertLinear(base, r=3, alpha=6)
    torch.nn.init.normal_(layer.lora_B)
    counts = torch.tensor([2, 0, 4, 1, 3])
    x = torch.randn(10, 12, requires_grad=True)
    y = layer(x, counts)
    rows = torch.repeat_interleave(torch.arange(5), counts)
    w = base.weight[rows] + 2.0 * layer.lora_B[rows] @ layer.lora_A[rows]
    expected = torch.einsum("ti,toi->to", x, w)
    assert torch.allclose(y, expected, atol=1e-5)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, layer.lora_A, layer.lora_B), g)
    want = torch.autograd.grad(expected, (x, layer.lora_A, layer.lora_B), g)
    for got, ref in zip(grads, want):
        assert torch.allclose(got, ref, atol=1e-5)
    assert torch.equal(grads[1][1], torch.zeros(3, 12))  # an expert that got no rows gets no gradient


@pytest.mark.parametrize("empty", [False, True])
def test_nf4_experts_in_chunks_equal_one_grouped_matmul(empty, monkeypatch):
    """An NF4 projection whose dense experts exceed EXPERT_CHUNK_BYTES goes through the grouped matmul a few experts at
    a time (gpt-oss's 0.5 GiB of bf16 experts stayed beside the step's peak): outputs and input gradients equal the
    one-call path's, also where experts get no rows (only the active ones are dequantized, then chunked)."""
    from lit_qlora.nf4 import grouped
    from lit_qlora.nf4.convert import quantize_weight

    torch.manual_seed(0)
    layer = ExpertLinear(6, 64, 128)
    layer.weight = torch.nn.Parameter(quantize_weight(torch.randn(6, 128, 64)), requires_grad=False)
    counts = torch.tensor([3, 0, 5, 2, 0, 4]) if empty else torch.tensor([3, 1, 5, 2, 2, 4])
    x = torch.randn(int(counts.sum()), 64, requires_grad=True)
    g = torch.randn(x.size(0), 128)
    whole = layer(x, counts)
    (grad_whole,) = torch.autograd.grad(whole, x, g)
    calls = []
    dequantize = grouped.dequantize_experts
    monkeypatch.setattr(grouped, "dequantize_experts", lambda w, n, e, d: calls.append(len(e)) or dequantize(w, n, e, d))
    monkeypatch.setattr(grouped, "EXPERT_CHUNK_BYTES", 2 * 128 * 64 * 4)  # two fp32 experts a chunk
    chunked = layer(x, counts)
    (grad_chunked,) = torch.autograd.grad(chunked, x, g)
    assert calls == ([2, 2] if empty else [2, 2, 2]) * 2  # forward, then backward
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_chunked, grad_whole, rtol=0, atol=1e-6)
    rows = torch.repeat_interleave(torch.arange(6), counts)
    dense = dequantize_nf4(layer.weight, torch.float32).view(6, 128, 64)
    torch.testing.assert_close(chunked, torch.einsum("ti,toi->to", x, dense[rows]), rtol=1e-5, atol=1e-5)


def test_grouped_mm_pads_unaligned_widths_without_changing_values():
    """bf16 operands whose widths are not 16-byte multiples (rank 3, 12 features) are padded, not refused."""
    torch.manual_seed(0)
    a = torch.randn(7, 12, dtype=torch.bfloat16)
    b = torch.randn(3, 12, 3, dtype=torch.bfloat16)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)
    y, _, grad_b = _products_and_gradients(a, b, offsets, torch.ones(7, 3, dtype=torch.bfloat16))
    ref = torch.cat([a[:2].float() @ b[0].float(), a[2:].float() @ b[2].float()])
    assert torch.allclose(y.float(), ref, atol=0.1, rtol=0.02)
    assert torch.allclose(grad_b[1].float(), torch.zeros(12, 3)) and grad_b[2].abs().sum() > 0


def _products_and_gradients(a, b, offsets, g):
    """grouped_mm's product and, for the upstream gradient g, the gradients of a and b (as _ExpertMatmul makes a
    LoRA factor's)."""
    return grouped_mm(a, b, offsets), grouped_mm(g, b.transpose(1, 2), offsets), grouped_weight_grad(a, g, offsets)


@pytest.mark.parametrize("skewed", [False, True])
def test_bf16_grouped_products_pad_each_expert_and_keep_the_per_expert_values(skewed):
    """bf16 on the CPU: rows padded per expert (one batched matmul where the counts are close, each expert's own
    multiple of PAD_ROWS where one expert takes most rows); forward, input and weight gradients equal one matmul per
    expert in fp32 within bf16 rounding; an input changed in place between two calls is read again."""
    from lit_qlora.nf4 import grouped

    torch.manual_seed(0)
    experts, rows, k, n = 8, 300, 64, 24
    weights = torch.tensor([40.0] + [1.0] * 7) if skewed else torch.ones(experts)
    counts = torch.bincount(torch.multinomial(weights, rows, replacement=True), minlength=experts)
    offsets = grouped.group_offsets(counts)
    place, width, padded_offsets = grouped._rows_layout(offsets, experts)
    assert (width is None) == skewed and place.unique().numel() == rows
    a = torch.randn(rows, k, dtype=torch.bfloat16)
    b = torch.randn(experts, k, n, dtype=torch.bfloat16)
    g = torch.randn(rows, n, dtype=torch.bfloat16)
    y, grad_a, grad_b = _products_and_gradients(a, b, offsets, g)
    spans = list(zip([0, *offsets.tolist()[:-1]], offsets.tolist()))
    ref_y = torch.cat([a[s:e].float() @ b[i].float() for i, (s, e) in enumerate(spans)])
    ref_ga = torch.cat([g[s:e].float() @ b[i].float().T for i, (s, e) in enumerate(spans)])
    ref_gb = torch.stack([a[s:e].float().T @ g[s:e].float() for s, e in spans])
    for got, ref in ((y, ref_y), (grad_a, ref_ga), (grad_b, ref_gb)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
    with torch.no_grad():
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        first = grouped.grouped_mm(x, b, offsets)
        x.add_(1.0)  # the kept padded copy of x is stale now
        again = grouped.grouped_mm(x, b, offsets)
    assert not torch.equal(first, again)
    torch.testing.assert_close(again.float(), torch.cat([x[s:e].float() @ b[i].detach().float()
                                                         for i, (s, e) in enumerate(spans)]), rtol=2**-7, atol=0.1)


def test_merged_export_loads_in_transformers_with_our_logits(family, tmp_path):
    model_type, path = family
    from helpers import random_adapter

    model = load_model(path, "nf4", "32-true")
    adapter = random_adapter(model, tmp_path / "a", "nf4")
    assert {type(m) for m in lora_modules(model).values()} >= {LoRAExpertLinear}
    idx = moe_tokens((2, 12))
    with torch.no_grad():
        ours = model.eval()(idx)
        again = load_model(path, adapter_dir=adapter, precision="32-true")(idx)
    assert torch.equal(ours, again)  # the adapter file holds every expert's A and B
    merged_dir = merge(path, adapter, tmp_path / "m")
    with safe_open(str(merged_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(safe_open(str(path / "model.safetensors"), "pt").keys())  # the Hub's names
    assert json.loads((merged_dir / "config.json").read_text())["model_type"] == model_type
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs, untouched = merged(idx).logits, base(idx).logits
    assert (theirs - ours).abs().max() <= 0.03 * ours.abs().max()  # the merged file is bf16
    assert (untouched - ours).abs().max() > 5 * (theirs - ours).abs().max()  # the adapters mattered


def test_the_auxiliary_loss_equals_transformers_while_the_router_trains(family):
    """With `router` a LoRA target (B at zero: the same routing), a training forward's load-balancing term is
    transformers' router_aux_loss_coef x aux_loss; with the router frozen there is none."""
    from lit_qlora.model.moe import auxiliary_loss

    model_type, path = family
    model = load_model(path, "none", "32-true")
    idx = moe_tokens((2, 10))
    apply_lora(model, r=4, alpha=8, dtype=torch.float32, targets=["q"])
    model.train()(idx)
    assert auxiliary_loss(model) is None  # the router does not train
    apply_lora(model, r=4, alpha=8, dtype=torch.float32, targets=["q", "router"])
    assert not is_nf4(model.model.layers[0].mlp.gate.weight)
    model.train()(idx)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = reference(idx, output_router_logits=True)
    assert torch.allclose(auxiliary_loss(model), reference.config.router_aux_loss_coef * out.aux_loss, atol=1e-6)


def test_qlora_finetune_logs_the_router_load_and_exports_what_transformers_and_peft_load(smollm2_dir, tmp_path):
    """`litqlora finetune` on an NF4 mixture of experts: every expert projection NF4, adapters on attention and
    every expert, the router's load per layer in metrics.jsonl, and final/ whose merged model and PEFT adapter load
    in transformers and peft with the trained model's outputs."""
    from helpers import finetune_sums

    write_tiny_moe("qwen3_moe", tmp_path / "hf", vocab_size=49152, tokenizer_dir=smollm2_dir)
    summary = finetune_sums(tmp_path / "hf", tmp_path, max_steps=5, dropout=0.05)
    out = tmp_path / "run"
    assert summary["quantized_linears"] == summary["total_linears"] == 2 * (4 + 3 * 8) + 1
    assert summary["val_loss"] < summary["initial_val_loss"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["router/max_load"] >= 1.0 >= row["router/min_load"] >= 0.0  # 1.0: an even share
        assert row["router/max_load"] == max(row["router/layer0_max_load"], row["router/layer1_max_load"])
    final = out / "final"
    trained = load_model(tmp_path / "hf", adapter_dir=final, precision="32-true")
    assert sum(isinstance(m, LoRAExpertLinear) for m in trained.modules()) == 2 * 3
    idx = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(4))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        ours = trained(idx)
        untouched = base(idx).logits
        with_adapter = peft.PeftModel.from_pretrained(base, final / "peft").eval()
        from_peft = with_adapter(idx).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(final / "merged", dtype=torch.float32).eval()
        from_merged = merged(idx).logits
        with adapters_disabled(trained):
            ours_base = trained(idx)
    assert (from_merged - ours).abs().max() <= 0.03 * ours.abs().max()
    # peft computes on the original weights, ours on dequant(NF4(W)): what the adapter changes must agree.
    theirs_change, our_change = (from_peft - untouched).flatten(), (ours - ours_base).flatten()
    assert our_change.abs().max() > 0.01
    assert torch.nn.functional.cosine_similarity(theirs_change, our_change, dim=0) > 0.95


def test_estimate_counts_the_nf4_experts_and_their_adapters(family, tmp_path, monkeypatch):
    """`litqlora estimate` traces a mixture of experts' step on fake tensors (every expert dequantized: the most a
    step can take): the frozen base is the NF4 experts' bytes and more, and adapters on experts multiply the LoRA
    weights by the number of experts."""
    from lit_qlora.cli import main
    from lit_qlora.nf4 import nf4_nbytes

    model_type, path = family
    monkeypatch.chdir(tmp_path)
    by_targets = {}
    for targets in ("[q,k,v,o]", "[q,k,v,o,experts]"):
        out = tmp_path / targets.strip("[]").replace(",", "-")
        main(["estimate", "--checkpoint_dir", str(path), "--train.max_seq_length", "32", "--lora.r", "4",
              "--lora.targets", targets, "--out_dir", str(out)])
        result = json.loads((out / "estimate.json").read_text())
        by_targets[targets] = result["by_category"]
    model = load_model(path, "nf4", "bf16-true")
    # the load's host peak: the model as it trains plus one block's expert stacks as the checkpoint stores them (fp32)
    intermediate = FAMILIES[model_type].get("moe_intermediate_size", 96)
    stacks = 3 * 8 * 64 * intermediate * 4
    assert result["load_held_bytes"] == stacks and "expert stacks" in result["load_held"]
    assert result["load_host_bytes"] == (result["by_category"]["frozen base"]
                                         + result["by_category"]["embeddings and norms"] + stacks)
    experts = sum(nf4_nbytes(m.weight) for m in model.modules() if isinstance(m, ExpertLinear))
    attention_only, with_experts = by_targets["[q,k,v,o]"], by_targets["[q,k,v,o,experts]"]
    assert attention_only["frozen base"] >= experts
    expert_lora = 2 * 8 * 4 * (64 + FAMILIES[model_type].get("moe_intermediate_size", 96)) * 3 * 2  # bf16, 2 blocks
    assert with_experts["LoRA weights"] - attention_only["LoRA weights"] == expert_lora


def test_estimate_traces_an_fp32_lora_mixture_with_its_experts_in_the_frozen_base(tmp_path, monkeypatch):
    """fp32 (what `--precision auto` picks on an AVX2 CPU) on a plain base: torch's fake grouped matmul takes only
    bf16, so the estimate allocates what the CPU's call returns; the dense expert stacks count as the frozen base."""
    from lit_qlora.cli import main

    path = tmp_path / "olmoe"
    write_tiny_moe("olmoe", path)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "estimate"
    main(["estimate", "--checkpoint_dir", str(path), "--quantize", "none", "--precision", "32-true", "--device", "cpu",
          "--train.max_seq_length", "32", "--lora.r", "4", "--lora.targets", "[all]", "--out_dir", str(out)])
    result = json.loads((out / "estimate.json").read_text())
    model = load_model(path, "none", "32-true")
    experts = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, ExpertLinear))
    assert result["by_category"]["frozen base"] >= experts
    assert result["by_category"]["embeddings and norms"] < experts
    assert result["by_category"]["activations"] > 0


def test_an_nf4_mixture_loads_tensor_by_tensor_near_its_nf4_size(tmp_path):
    """A sharded bf16 mixture of experts (transformers' per-expert keys, 216 MB in 100 MB shards) loads as NF4 with a
    host peak within the estimate's prediction (the NF4 model plus one block's expert stacks) and under a third of the
    checkpoint: no shard, and no block but one, is ever held whole in bf16."""
    import subprocess
    import sys

    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "olmoe", hidden_size=512, intermediate_size=256, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, num_experts=32, num_experts_per_tok=4, vocab_size=2048, bos_token_id=1, eos_token_id=2)
    path = tmp_path / "moe"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        path, max_shard_size="100MB")
    checkpoint = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert len(list(path.glob("*.safetensors"))) >= 2
    code = f"""
import json
from pathlib import Path
from lit_qlora.checkpoint.loading import load_model
from lit_qlora.estimate.load import largest_held
from lit_qlora.memory.accounting import module_bytes, peak_rss_bytes
from lit_qlora.nf4 import nf4_backend
import torch
nf4_backend()
torch.zeros(1) + 1
before = peak_rss_bytes()
model = load_model({str(path)!r}, "nf4", "bf16-true")
held = largest_held(model.config, True, torch.bfloat16)[0]
print(json.dumps({{"load": peak_rss_bytes() - before, "model": module_bytes(model), "held": held}}))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    measured = json.loads(out.strip().splitlines()[-1])
    predicted = measured["model"] + measured["held"]
    assert measured["held"] == 3 * 32 * 256 * 512 * 2  # one block's gate, up and down stacks in bf16
    assert measured["load"] <= 1.25 * predicted, measured
    assert measured["load"] < checkpoint / 3, (measured, checkpoint)


def test_export_gguf_refuses_routing_llama_cpp_would_do_otherwise(family):
    """llama.cpp renormalizes the top-k weights for qwen3moe and Mixtral and never for OLMoE, whatever config.json
    says, and has experts in every layer: a checkpoint that differs is refused with the reason."""
    from lit_qlora.export.gguf_families import refusals

    config = Config.from_checkpoint(family[1])
    if family[0] == "gpt_oss":
        found = refusals(config)
        assert len(found) == 1 and "convert_hf_to_gguf.py" in found[0] and "MXFP4" in found[0]
        return
    assert refusals(config) == []
    flipped = refusals(config.replace(norm_topk_prob=not config.norm_topk_prob))
    assert len(flipped) == 1 and "renormalizes the top-k weights" in flipped[0]
    assert "dense MLP layers [1]" in refusals(config.replace(dense_mlp_layers=[1]))[0]
    if family[0] == "olmoe":
        assert "grouped-query attention" in refusals(config.replace(n_query_groups=2))[0]


def test_gguf_export_stacks_each_projections_experts_as_llama_cpp_reads_them(smollm2_dir, tmp_path):
    """export_gguf of each family (fp32): the router f32 as `ffn_gate_inp`, every projection's experts as one
    `ffn_*_exps` tensor equal to ours, the expert counts (and Qwen3-MoE's expert width, OLMoE's clamp) in the
    metadata; llama.cpp runs the files in tests/test_llama_cpp.py."""
    import gguf
    import numpy as np

    from lit_qlora.export.gguf import export_gguf

    for model_type, settings in FAMILIES.items():
        if model_type == "gpt_oss":
            continue  # refused (test above)
        write_tiny_moe(model_type, tmp_path / model_type, vocab_size=49152, tokenizer_dir=smollm2_dir)
        reader = gguf.GGUFReader(export_gguf(tmp_path / model_type, tmp_path / f"{model_type}.gguf", dtype="q8_0"))
        arch = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}[model_type]
        fields = {name: field.contents() for name, field in reader.fields.items()}
        assert fields["general.architecture"] == arch
        assert (fields[f"{arch}.expert_count"], fields[f"{arch}.expert_used_count"]) == (8, settings["num_experts_per_tok"])
        assert fields.get(f"{arch}.expert_feed_forward_length") == settings.get("moe_intermediate_size")
        assert fields.get(f"{arch}.attention.clamp_kqv") == settings.get("clip_qkv")
        tensors = {t.name: t for t in reader.tensors}
        model = load_model(tmp_path / model_type, "none", "32-true")
        moe = model.model.layers[1].mlp
        router = tensors["blk.1.ffn_gate_inp.weight"]
        assert router.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(np.asarray(router.data), moe.gate.weight.detach().numpy())
        for proj in ("gate", "up", "down"):
            stacked = tensors[f"blk.1.ffn_{proj}_exps.weight"]
            ours = getattr(moe.experts, f"{proj}_proj").weight.detach().numpy()
            assert stacked.tensor_type == gguf.GGMLQuantizationType.Q8_0
            values = gguf.quants.dequantize(stacked.data, stacked.tensor_type).reshape(ours.shape)
            assert np.abs(values - ours).max() <= 0.01 * np.abs(ours).max()  # q8_0 rounding


def test_gpt_oss_mxfp4_experts_dequantize_as_transformers_does_and_load(tmp_path):
    """gpt-oss's released checkpoints keep the experts in MXFP4 (`*_blocks`, `*_scales`): our dequantization equals
    transformers' own on random codes and exponents, and a checkpoint in that form loads (then NF4-quantizes) the
    experts it holds: gate and up from alternate rows, down as is."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from lit_qlora.model.hf_layout import dequantize_mxfp4

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(120, 134, (3, 40, 2), dtype=torch.uint8, generator=generator)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # (E, in, out): x @ W
    assert torch.equal(dequantize_mxfp4(blocks, scales, chunk_rows=7), theirs.transpose(1, 2))

    write_tiny_moe("gpt_oss", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    packed = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, in_features, out_features = state.pop(name).shape
        packed[name] = (torch.randint(0, 256, (experts, out_features, in_features // 32, 16), dtype=torch.uint8,
                                      generator=generator),
                        torch.randint(122, 130, (experts, out_features, in_features // 32), dtype=torch.uint8,
                                      generator=generator))
        state[name + "_blocks"], state[name + "_scales"] = packed[name]
    save_file(state, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path, "none", "32-true")
    experts = model.model.layers[1].mlp.experts
    gate_up = dequantize_mxfp4(*packed["model.layers.1.mlp.experts.gate_up_proj"]).float()
    assert torch.equal(experts.gate_proj.weight, gate_up[:, 0::2]) and torch.equal(experts.up_proj.weight,
                                                                                   gate_up[:, 1::2])
    assert torch.equal(experts.down_proj.weight,
                       dequantize_mxfp4(*packed["model.layers.1.mlp.experts.down_proj"]).float())
    assert is_nf4(load_model(tmp_path, "nf4", "bf16-true").model.layers[1].mlp.experts.down_proj.weight)


@pytest.mark.parametrize("verb", ["dpo", "grpo"])
def test_dpo_and_grpo_train_every_experts_adapter_on_an_nf4_mixture(verb, smollm2_dir, tmp_path, monkeypatch):
    """`litqlora dpo` and `grpo` on an NF4 Qwen3-MoE (their demo data): two steps train and log the router's load
    beside the method's metrics; DPO's move every expert's adapter (B starts at zero). (GRPO's cannot here: a random
    model's completions all score 0, so every advantage is 0.) With `router` a target, every training forward's
    load-balancing term joins the loss that is backpropagated."""
    from safetensors.torch import load_file

    import lit_qlora.train.module as module
    from lit_qlora.cli import main

    terms = []
    real = module.auxiliary_loss

    def recorded(model):
        aux = real(model)
        terms.append(aux)
        return aux

    monkeypatch.setattr(module, "auxiliary_loss", recorded)

    write_tiny_moe("qwen3_moe", tmp_path / "hf", vocab_size=49152, tokenizer_dir=smollm2_dir)
    out = tmp_path / verb
    extra = (["--grpo.num_generations", "2", "--grpo.max_completion_length", "8"] if verb == "grpo"
             else ["--train.max_seq_length", "128"])
    main([verb, "--checkpoint_dir", str(tmp_path / "hf"), "--out_dir", str(out), "--train.max_steps", "2",
          "--train.micro_batch_size", "2", "--train.global_batch_size", "2", "--lora.r", "4", "--lora.alpha", "8",
          "--export.merged", "false", "--export.peft", "false", "--lora.targets", "[all,router]", *extra])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("router/max_load" in row for row in rows)
    # a term for each training forward of the two steps, each positive and part of the graph backpropagated
    assert len(terms) >= 2 and all(t is not None and t.requires_grad and t.item() > 0 for t in terms)
    assert ("rewards/margins" if verb == "dpo" else "reward") in rows[-1]
    adapter = load_file(str(out / "final" / "adapter.safetensors"))
    experts_b = [t for name, t in adapter.items() if ".mlp.experts." in name and name.endswith("lora_B")]
    assert any(".mlp.gate." in name for name in adapter)  # the router trained too
    assert len(experts_b) == 2 * 3
    assert all(t.abs().sum() > 0 for t in experts_b) if verb == "dpo" else rows[-1]["reward"] == 0.0
