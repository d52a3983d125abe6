"""Long-context tiling (issue 29): the sequence-tiled MLP and the token x vocabulary tiled loss equal the untiled
ones (values and gradients of the inputs and every LoRA factor), inside checkpointed blocks and through a fine-tune
step, and `litqlora estimate` sees the smaller peak."""

from __future__ import annotations

import pytest
import torch

from lit_qlora.model import tiled_mlp
from lit_qlora.model.config import Config
from lit_qlora.checkpoint.loading import random_base
from lit_qlora.lora.layer import LoRALinear, apply_lora, lora_modules
from lit_qlora.model.transformer import softcap
from lit_qlora.nf4 import is_nf4
from lit_qlora.train import tiled_loss
from lit_qlora.train.loss import chunked_cross_entropy_sum, lm_loss_sum, next_token_pairs
from lit_qlora.train.tiled_loss import tiled_ce_sum

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(model_type="llama"),  # SiLU
    "gemma2": dict(model_type="gemma2", head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                   attn_logit_softcapping=5.0, final_logit_softcapping=2.0, hidden_activation="gelu_pytorch_tanh"),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def model_for(family: str, quantize: str, dtype: torch.dtype, dropout: float = 0.0, seed: int = 0):
    config = Config.from_hf_config({**BASE, **FAMILIES[family]})
    torch.manual_seed(seed)
    model = random_base(config, quantize, dtype)
    for name, p in model.named_parameters():  # non-trivial norms
        if p.requires_grad or is_nf4(p) or "norm" not in name:
            continue
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.1)
    apply_lora(model, r=4, alpha=8, dropout=dropout, dtype=dtype)
    for layer in lora_modules(model).values():  # B != 0: the adapters take part in values and gradients
        torch.nn.init.normal_(layer.lora_B, std=0.05)
    return model.train()


def lora_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return bool((got.float() - want.float()).norm() <= tol * want.float().norm() + 1e-7)


def mlp_run(mlp, x, grad, tile_tokens):
    mlp.tile_tokens = tile_tokens
    x = x.clone().requires_grad_()
    out = mlp(x)
    out.backward(grad)
    grads = [x.grad] + [p.grad.clone() for p in lora_params(mlp)]
    for p in lora_params(mlp):
        p.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("quantize", ["nf4", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_mlp_equals_the_untiled_mlp(family, quantize, dtype):
    mlp = model_for(family, quantize, dtype).blocks[0].mlp
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 37, 64, generator=gen).to(dtype)  # 74 tokens in tiles of 10: the last one 4 tokens
    grad = torch.randn(2, 37, 64, generator=gen).to(dtype)
    want_out, want = mlp_run(mlp, x, grad, 1 << 30)
    got_out, got = mlp_run(mlp, x, grad, 10)
    tol = TOLERANCE[dtype]
    assert len(got) == 7  # x and A, B of gate, up and down
    assert close(got_out, want_out, tol)
    for g, w in zip(got, want):
        assert close(g, w, tol)


def test_tiled_mlp_replays_its_dropout_masks_in_backward():
    """With dropout the tiles draw their own masks (not the untiled MLP's), and backward draws the same ones again:
    values and gradients equal those of the untiled MLP run tile by tile from the same RNG state."""
    mlp = model_for("llama", "nf4", torch.float32, dropout=0.3).blocks[0].mlp
    x, grad = torch.randn(1, 25, 64), torch.randn(1, 25, 64)
    mlp.tile_tokens = 8
    torch.manual_seed(7)
    xt = x.clone().requires_grad_()
    out = mlp(xt)
    out.backward(grad)
    tiled = [out.detach(), xt.grad] + [p.grad.clone() for p in lora_params(mlp)]
    for p in lora_params(mlp):
        p.grad = None
    torch.manual_seed(7)
    xr = x.clone().requires_grad_()
    ref = torch.cat([mlp.forward_untiled(xr[:, i : i + 8]) for i in range(0, 25, 8)], dim=1)
    ref.backward(grad)
    reference = [ref.detach(), xr.grad] + [p.grad.clone() for p in lora_params(mlp)]
    for g, w in zip(tiled, reference):
        assert close(g, w, 1e-5)
    no_dropout = mlp_run(model_for("llama", "nf4", torch.float32).blocks[0].mlp, x, grad, 1 << 30)[0]
    assert not close(tiled[0], no_dropout, 1e-3)  # the dropout did drop


def test_tiled_mlp_recomputes_under_forwards_autocast():
    """16-mixed: backward's recompute runs in the autocast dtype, as forward did (and as checkpointing does)."""
    mlp = model_for("llama", "none", torch.float32).blocks[0].mlp
    seen, act = [], mlp.act
    mlp.act = lambda t: seen.append(t.dtype) or act(t)
    x, grad = torch.randn(1, 30, 64), torch.randn(1, 30, 64)
    results = []
    for tile_tokens in (1 << 30, 8):
        mlp.tile_tokens = tile_tokens
        xt = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = mlp(xt)
        out.backward(grad.to(out.dtype))
        results.append([xt.grad] + [p.grad.clone() for p in lora_params(mlp)])
        mlp.zero_grad(set_to_none=True)
    # untiled: forward and backward (which recomputes act(gate)); tiled: 4 tiles forward, 4 x 2 in backward
    assert len(seen) == 2 + 4 + 8 and set(seen) == {torch.bfloat16}
    for g, w in zip(*results):
        assert close(g, w, 2e-2)


def loss_head(quantize: str, dtype: torch.dtype) -> LoRALinear:
    return model_for("llama", quantize, dtype).lm_head


@pytest.mark.parametrize("quantize", ["nf4", "none"])
@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_loss_equals_the_chunked_loss(quantize, cap, dtype):
    head = loss_head(quantize, dtype)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 41, 64, generator=gen).to(dtype)
    labels = torch.randint(0, 300, (2, 41), generator=gen)
    labels[0, 3:9] = labels[1, 30:] = -100  # ignored targets: left out before the loss
    results = []
    for tiled in (False, True):
        h = hidden.clone().requires_grad_()
        if tiled:  # tiles of 9 tokens (the last one 1 of 65) x slices of 11 rows (the last one 3 of 300)
            total = tiled_ce_sum(head, *next_token_pairs(h, labels), cap, logits_elems=99, tile_tokens=9)
        else:
            total = chunked_cross_entropy_sum(lambda t: softcap(head(t), cap), h, labels, chunk_tokens=5,
                                              params=lora_params(head))
        (total * 0.5).backward()
        results.append([total.detach(), h.grad] + [p.grad.clone() for p in lora_params(head)])
        for p in lora_params(head):
            p.grad = None
    want, got = results
    tol = TOLERANCE[dtype]
    assert close(got[0], want[0], tol)
    for g, w in zip(got[1:], want[1:]):
        assert close(g, w, tol)


def test_tiled_loss_without_gradients_and_with_a_bare_head():
    head = loss_head("nf4", torch.float32)
    hidden, labels = torch.randn(1, 30, 64), torch.randint(0, 300, (1, 30))
    with torch.no_grad():
        want = chunked_cross_entropy_sum(head, hidden, labels)
        got = tiled_ce_sum(head, *next_token_pairs(hidden, labels), None, logits_elems=64, tile_tokens=4)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    bare = model_for("llama", "nf4", torch.float32).lm_head
    bare.lora_A.requires_grad_(False)
    bare.lora_B.requires_grad_(False)
    h = hidden.clone().requires_grad_()
    tiled_ce_sum(bare, *next_token_pairs(h, labels), None, logits_elems=64, tile_tokens=4).backward()
    h2 = hidden.clone().requires_grad_()
    chunked_cross_entropy_sum(bare, h2, labels, chunk_tokens=3).backward()
    assert close(h.grad, h2.grad, 1e-5)


def force_tiles(monkeypatch, model, mlp_tokens: int, loss_tokens: int) -> None:
    for block in model.blocks:
        block.mlp.tile_tokens = mlp_tokens
    monkeypatch.setattr(tiled_loss, "LOSS_TILE_TOKENS", loss_tokens)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpointed_models_loss_and_gradients_are_the_same_tiled(monkeypatch, family, dtype):
    model = model_for(family, "nf4", dtype)
    model.checkpoint_blocks = model.config.n_layer
    ids = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[1, :10] = -100
    results = []
    for mlp_tokens, loss_tokens in ((1 << 30, 1 << 30), (13, 11)):  # untiled, then tiles that divide nothing
        force_tiles(monkeypatch, model, mlp_tokens, loss_tokens)
        if loss_tokens < 1000:  # the tiled loss is taken from more than one tile's tokens (an NF4 head: and V / 2)
            assert tiled_loss.use_tiled_loss(model.lm_head, labels[:, 1:].numel(), True)
        total = lm_loss_sum(model, ids, labels)
        total.backward()
        results.append([total.detach()] + [p.grad.clone() for p in lora_params(model)])
        model.zero_grad(set_to_none=True)
    (want, got), tol = results, TOLERANCE[dtype]
    assert len(got) == 1 + 2 * 15  # every adapter of the 2 blocks and the head
    for g, w in zip(got, want):
        assert close(g, w, tol)


def test_a_finetune_gives_the_same_losses_tiled(monkeypatch, tiny_llama_dir, tmp_path):
    import json

    from tests.test_finetune import small_data
    from lit_qlora.train.finetune import finetune
    from lit_qlora.train.args import LoRAArgs, TrainArgs

    def losses(name: str) -> list[float]:
        out = tmp_path / name
        finetune(checkpoint_dir=tiny_llama_dir, out_dir=out, quantize="nf4", precision="32-true", accelerator="cpu",
                 lora=LoRAArgs(r=4, alpha=8, dropout=0.0), data=small_data(tmp_path),
                 train=TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=64, lr=1e-2,
                                 warmup_steps=1, max_steps=2, activation_checkpointing=True))
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    untiled = losses("untiled")
    monkeypatch.setattr(tiled_mlp, "MLP_TILE_ELEMS", 7 * 128)  # the tiny Llama's MLP is 128 wide: 7-token tiles
    monkeypatch.setattr(tiled_loss, "LOSS_TILE_TOKENS", 5)
    calls = {"mlp": 0, "loss": 0}
    applies, real_loss = tiled_mlp.tiling_applies, tiled_loss.tiled_ce_sum

    def counted_applies(x, tile_tokens):
        calls["mlp"] += applies(x, tile_tokens)
        return applies(x, tile_tokens)

    def counted_loss(*args, **kwargs):
        calls["loss"] += 1
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(tiled_mlp, "tiling_applies", counted_applies)
    monkeypatch.setattr("lit_qlora.train.loss.tiled_ce_sum", counted_loss)
    monkeypatch.setattr("lit_qlora.train.loss.use_tiled_loss", lambda head, tokens, sliced: tokens > 5)
    tiled = losses("tiled")
    assert calls["mlp"] and calls["loss"]  # both ran tiled
    assert len(untiled) == len(tiled) == 2
    assert tiled == pytest.approx(untiled, rel=1e-5)


def test_the_estimate_sees_the_tiled_mlps_smaller_peak(monkeypatch):
    """`litqlora estimate` at 8192 tokens (micro-batch 1, every block checkpointed): untiled, the recomputed block's
    MLP backward holds five sequence x intermediate bf16 tensors at the step's peak (gate and up, saved; the
    gradients of act(gate) * up, of gate and of up). Tiled, it holds them for one tile: the peak drops by five such
    tensors less one tile's (within 2%: the tiled backward's input-gradient buffer, and the like)."""
    from lit_qlora.model.config import Quantize
    from lit_qlora.estimate.step import trace_step
    from lit_qlora.train.args import LoRAArgs, TrainArgs

    length, width, tile = 8192, 1536, 1024
    config = Config.from_hf_config({**BASE, "vocab_size": 384, "intermediate_size": width,
                                    "max_position_embeddings": length, "tie_word_embeddings": True})
    peaks = {}
    for tiled in (False, True):
        monkeypatch.setattr(tiled_mlp, "MLP_TILE_ELEMS", tile * width if tiled else 1 << 40)
        monkeypatch.setattr(tiled_loss, "LOSS_TILE_TOKENS", tile if tiled else 1 << 40)
        peaks[tiled] = trace_step(config, Quantize.NF4, "bf16-true", LoRAArgs(r=4, alpha=8, dropout=0.0),
                                  TrainArgs(micro_batch_size=1, global_batch_size=1, max_seq_length=length,
                                            activation_checkpointing=True), device="cpu").peak
    expected = 5 * 2 * width * (length - tile)  # 110 MB of a 139 MB peak
    assert peaks[False] - peaks[True] == pytest.approx(expected, rel=0.02), peaks


@pytest.mark.parametrize("family,passes", [("llama", 2), ("gemma2", 3)])
def test_a_checkpointed_block_runs_its_tiled_mlp_twice_unless_its_output_is_read(monkeypatch, family, passes):
    """Within a checkpointed block's recompute the MLP runs only so its input is saved again: a Llama block (the
    output goes to a residual add) skips the tiles there, 2 passes over the tiles per step (forward, backward) where
    it ran 3; Gemma's post-MLP norm reads the output, so its recompute still computes it. Gradients are unchanged
    (the test above)."""
    model = model_for(family, "nf4", torch.float32)
    model.checkpoint_blocks = model.config.n_layer
    force_tiles(monkeypatch, model, 16, 1 << 30)
    calls = []
    for block in model.blocks:
        real = block.mlp.forward_untiled
        block.mlp.forward_untiled = lambda x, real=real: calls.append(x.shape[0]) or real(x)
    ids = torch.randint(0, 300, (1, 96), generator=torch.Generator().manual_seed(3))
    lm_loss_sum(model, ids, ids.clone()).backward()
    assert sum(calls) == passes * 96 * model.config.n_layer and max(calls) == 16
