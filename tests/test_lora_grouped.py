"""LoRA terms of q/k/v and gate/up as one group (lit_qlora/lora/grouped.py, LIT_QLORA_LORA_GROUPED=1): without dropout
the separate modules' outputs and gradients; with dropout one mask of x shared by the group; off by default; traced
by torch.compile with no graph break; a tiny Transformer trains the same step.

On CPU the one-base-matmul fusion (`fusion_plan`) applies first, as it does in training: the tests that go through
`fused_projections` make it say None (monkeypatched, as on a GPU), or call `grouped_projections` directly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_qlora.lora import dropout as lora_dropout
from lit_qlora.lora import grouped
from lit_qlora.lora.layer import LoRALinear, adapters_disabled
from lit_qlora.model import fused_projections as fp
from lit_qlora.nf4 import frozen_linear

from helpers import lora_model

GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def group_of(model, name: str) -> tuple[nn.Module, ...]:
    block = model.model.layers[0]
    parent = block.self_attn if name == "qkv" else block.mlp
    return tuple(getattr(parent, leaf) for leaf in GROUPS[name])


def run(fn, modules, x: torch.Tensor, seed: int = 5):
    """Outputs of fn(x) and the gradients of x and every A and B under one random weighting of the outputs."""
    for m in modules:
        m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    outs = fn(x)
    w = torch.Generator().manual_seed(7)
    sum(o.mul(torch.randn(o.shape, generator=w)).sum() for o in outs).backward()
    grads = [x.grad] + [t.grad for m in modules for t in (m.lora_A, m.lora_B)]
    return [o.detach() for o in outs], grads


def assert_all_close(got, want, rtol: float = 1e-5) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * w.abs().max().item())


def far(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Apart by more than rounding: a tenth of want's largest magnitude somewhere."""
    return (got - want).abs().max().item() > 0.1 * want.abs().max().item()


def separate(modules):
    return lambda x: tuple(m(x) for m in modules)


def group(modules):
    def fn(x):
        out = grouped.grouped_projections(x, modules)
        assert out is not None
        return out
    return fn


def inputs(width: int = 128) -> torch.Tensor:
    return torch.randn(2, 5, width, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("quantize", ["nf4", "none"])
@pytest.mark.parametrize("name", ["qkv", "gate_up"])
@pytest.mark.parametrize("scales", ["equal", "different"])
def test_without_dropout_the_separate_modules_outputs_and_gradients(quantize, name, scales):
    model = lora_model(quantize, 0.0, bias=True, dtype=torch.float32)  # q/k/v with biases: 128, 64, 64 rows (GQA)
    modules = group_of(model, name)
    if scales == "different":
        modules[1].scale *= 0.5
    got, want = run(group(modules), modules, inputs()), run(separate(modules), modules, inputs())
    assert [o.shape for o in got[0]] == [o.shape for o in want[0]]
    assert_all_close(got[0] + got[1], want[0] + want[1])


@pytest.mark.parametrize("mask", ["hash", "torch"])
def test_with_dropout_one_mask_shared_by_the_group(mask, monkeypatch):
    """The reference draws one mask of x (as each path does: the hash of a seed from torch's generator on CPU, else
    nn.Dropout's) and applies it to every adapter; outputs and gradients match it."""
    p = 0.3
    model = lora_model("nf4", p, dtype=torch.float32)
    modules = group_of(model, "qkv")
    if mask == "torch":  # as on a GPU with the replay off, or compiled: nn.Dropout
        monkeypatch.setattr(lora_dropout, "hash_dropout_applies", lambda x: False)
    seeds = []
    draw = lora_dropout.draw_seed
    monkeypatch.setattr(lora_dropout, "draw_seed", lambda x: seeds.append(draw(x)) or seeds[-1])

    def reference(x):
        if mask == "hash":
            seed = int(torch.randint(0, 2**32, (), dtype=torch.int64).item())
            keep = lora_dropout.keep_mask_eager(x.numel(), seed, lora_dropout.keep_threshold(p)).view(x.shape)
            xd = x * keep / (1 - p)
        else:
            xd = F.dropout(x, p, training=True)
        return tuple(frozen_linear(x, m.weight, m.bias) + m.scale * (xd @ m.lora_A.T @ m.lora_B.T) for m in modules)

    got, want = run(group(modules), modules, inputs()), run(reference, modules, inputs())
    assert len(seeds) == (1 if mask == "hash" else 0)  # one mask for the group
    assert_all_close(got[0] + got[1], want[0] + want[1])
    model.eval()
    assert far(got[0][0], run(separate(modules), modules, inputs())[0][0])  # it dropped


def test_in_eval_no_dropout_and_no_draw():
    model = lora_model("none", 0.5, dtype=torch.float32).eval()
    modules = group_of(model, "qkv")
    state = torch.get_rng_state()
    grouped.grouped_projections(inputs(), modules)
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn
    got = run(group(modules), modules, inputs())
    assert_all_close(got[0] + got[1], sum(run(separate(modules), modules, inputs()), []))


def test_unset_is_the_existing_path_bitwise(monkeypatch):
    model = lora_model("nf4", 0.0, dtype=torch.float32)
    x = inputs()
    monkeypatch.setattr(grouped, "grouped_projections", lambda *a: pytest.fail("grouped path taken"))
    for value in (None, "0"):
        if value is None:
            monkeypatch.delenv(grouped.ENV, raising=False)
        else:
            monkeypatch.setenv(grouped.ENV, value)
        for name in GROUPS:
            modules = group_of(model, name)
            plan = fp.fusion_plan(x, modules)
            assert plan is not None  # CPU: the one-base-matmul fusion
            assert all(torch.equal(a, b) for a, b in zip(fp.fused_projections(x, modules),
                                                         fp._run_fused(x, modules, plan)))
            with monkeypatch.context() as m:
                m.setattr(fp, "fusion_plan", lambda x, modules: None)
                assert all(torch.equal(a, b) for a, b in zip(fp.fused_projections(x, modules),
                                                             (mod(x) for mod in modules)))


def test_a_value_other_than_0_or_1_is_refused_naming_the_setting(monkeypatch):
    """A misspelt switch ("true", "yes") would otherwise run the default path and an A/B would measure nothing."""
    from lit_qlora.base.errors import InvalidInput

    model = lora_model("nf4", 0.0, dtype=torch.float32)
    modules, x = group_of(model, "qkv"), inputs()
    monkeypatch.setattr(fp, "fusion_plan", lambda x, modules: None)
    for value in ("true", "yes", "2"):
        monkeypatch.setenv(grouped.ENV, value)
        with pytest.raises(InvalidInput, match=f"LIT_QLORA_LORA_GROUPED='{value}': this switch takes 1 .on. or 0"):
            fp.fused_projections(x, modules)


def test_set_it_applies_only_where_the_fusion_does_not(monkeypatch):
    model = lora_model("none", 0.0, dtype=torch.float32)
    modules, x = group_of(model, "qkv"), inputs()
    calls = []
    run_grouped = grouped._run_grouped
    monkeypatch.setattr(grouped, "_run_grouped", lambda *a: calls.append(1) or run_grouped(*a))
    monkeypatch.setenv(grouped.ENV, "1")
    fp.fused_projections(x, modules)
    assert calls == []  # CPU: the fusion applies first
    monkeypatch.setattr(fp, "fusion_plan", lambda x, modules: None)
    assert_all_close(fp.fused_projections(x, modules), [m(x) for m in modules])
    assert calls == [1]


def test_where_it_does_not_apply():
    model = lora_model("nf4", 0.1, dtype=torch.float32)
    modules, x = group_of(model, "qkv"), inputs()
    assert grouped.group_dropout(x, modules) == 0.1
    assert grouped.group_dropout(x, modules[:1]) is None  # one module: nothing to group
    plain = nn.Linear(128, 64)
    assert grouped.group_dropout(x, (modules[0], plain)) is None  # every module a LoRALinear
    handle = modules[1].register_forward_hook(lambda *a: None)
    assert grouped.group_dropout(x, modules) is None  # hooks would be skipped
    handle.remove()
    with adapters_disabled(model):
        assert grouped.group_dropout(x, modules) is None  # scale 0: the base alone, each module's own
    modules[2].lora_dropout.p = 0.2
    assert grouped.group_dropout(x, modules) is None  # one mask needs one p
    modules[2].lora_dropout.p = 0.1
    modules[2].lora_B.data = modules[2].lora_B.data.double()
    assert grouped.group_dropout(x, modules) is None  # one dtype of the factors
    modules[2].lora_B.data = modules[2].lora_B.data.float()
    model.eval()
    assert grouped.group_dropout(x, modules) == 0.0

    class Sharded(LoRALinear):
        fusable = False  # as ParallelLoRALinear

    sharded = modules[0]
    sharded.__class__ = Sharded
    assert grouped.group_dropout(x, modules) is None
    sharded.__class__ = LoRALinear


def compiled(fn, graphs: list):
    """fn under torch.compile(fullgraph: a graph break fails), aot_eager; each graph's code kept in `graphs`."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return aot_eager(gm, example_inputs)

    return torch.compile(fn, backend=backend, fullgraph=True)


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_compiled_as_eager_with_no_graph_break(quantize, monkeypatch):
    torch._dynamo.reset()
    model = lora_model(quantize, 0.0, dtype=torch.float32)
    modules = group_of(model, "qkv")
    monkeypatch.setenv(grouped.ENV, "1")
    graphs = []
    fn = compiled(lambda x: fp.fused_projections(x, modules), graphs)  # compiled: fusion_plan says None
    got, want = run(fn, modules, inputs()), run(group(modules), modules, inputs())
    assert len(graphs) == 1 and "block_diag" in graphs[0]
    assert_all_close(got[0] + got[1], want[0] + want[1])


def test_compiled_with_dropout_one_shared_mask(monkeypatch):
    """gate and up with the same A, B and scale: their LoRA terms are equal exactly when they saw the same mask."""
    torch._dynamo.reset()
    model = lora_model("none", 0.5, dtype=torch.float32)
    gate, up = modules = group_of(model, "gate_up")
    with torch.no_grad():
        up.lora_A.copy_(gate.lora_A)
        up.lora_B.copy_(gate.lora_B)
    monkeypatch.setenv(grouped.ENV, "1")
    x = inputs()
    for fn in (compiled(lambda x: fp.fused_projections(x, modules), []), group(modules)):
        g, u = fn(x)
        terms = g - frozen_linear(x, gate.weight, None), u - frozen_linear(x, up.weight, None)
        torch.testing.assert_close(terms[0], terms[1], rtol=1e-5, atol=1e-6)
        assert far(terms[0], x @ gate.lora_A.T @ gate.lora_B.T * gate.scale)  # dropped
    separate_terms = [m(x) - frozen_linear(x, m.weight, None) for m in modules]
    assert far(*separate_terms)  # the separate path: a mask each


def train_step(grouped_on: bool, monkeypatch, quantize: str = "nf4", dropout: float = 0.0, checkpoint: int = 0):
    """A tiny fp32 Transformer's loss, LoRA gradients, and loss after one AdamW step, with the fusion off (as on a
    GPU); the number of grouped calls per forward."""
    from lit_qlora.train.loss import lm_loss_sum

    calls = []
    run_grouped = grouped._run_grouped
    with monkeypatch.context() as m:
        m.setattr(fp, "fusion_plan", lambda x, modules: None)
        m.setattr(grouped, "_run_grouped", lambda *a: calls.append(1) or run_grouped(*a))
        m.setenv(grouped.ENV, "1" if grouped_on else "0")
        model = lora_model(quantize, dropout, dtype=torch.float32)
        model.checkpoint_blocks = checkpoint
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        optimizer = torch.optim.AdamW(params.values(), lr=1e-2)
        ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)
        loss = lm_loss_sum(model, ids, ids) / ids.numel()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in params.items()}
        optimizer.step()
        forwards = len(calls)
        with torch.no_grad():
            after = (lm_loss_sum(model.eval(), ids, ids) / ids.numel()).item()
    return loss.item(), grads, after, forwards


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_a_tiny_transformer_trains_the_same_step(quantize, monkeypatch):
    loss, grads, after, calls = train_step(True, monkeypatch, quantize)
    ref_loss, ref_grads, ref_after, ref_calls = train_step(False, monkeypatch, quantize)
    assert calls == 2 * 2 and ref_calls == 0  # attention and MLP of both blocks
    assert loss == pytest.approx(ref_loss, rel=1e-5) and after == pytest.approx(ref_after, rel=1e-4)
    assert after < loss
    assert grads.keys() == ref_grads.keys() and any("v_proj.lora_B" in n for n in grads)
    assert_all_close([grads[n] for n in grads], [ref_grads[n] for n in grads], rtol=1e-4)


def test_with_dropout_checkpointing_recomputes_the_same_masks(monkeypatch):
    """The hash mask's seed is drawn again in the recompute (checkpointing restores the RNG state)."""
    loss, grads, _, calls = train_step(True, monkeypatch, dropout=0.3, checkpoint=2)
    ref_loss, ref_grads, _, _ = train_step(True, monkeypatch, dropout=0.3, checkpoint=0)
    assert calls == 2 * 2 * 2  # each block forward twice
    assert loss == ref_loss
    assert_all_close([grads[n] for n in grads], [ref_grads[n] for n in grads])
