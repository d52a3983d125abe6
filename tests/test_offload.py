"""Offloaded activation checkpoints (lit_qlora.model.offload): on CPU tensors, where the offload takes the same path
with plain copies, gradients equal those without it, the checkpointed block inputs are released after the forward and
come back one block ahead of their backward, and the host bytes are the offloaded inputs' own; the option's
resolution and refusals; the estimate's device and host numbers."""

from __future__ import annotations

import json

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lit_qlora.cli import build_parser, commands, main
from lit_qlora.model.config import Config, Quantize
from lit_qlora.base.errors import UserError
from lit_qlora.estimate.command import estimate
from lit_qlora.estimate.step import trace_step
from lit_qlora.lora.layer import apply_lora, lora_modules
from lit_qlora.model.transformer import Transformer
from lit_qlora.train.args import LoRAArgs, TrainArgs
from lit_qlora.model.offload import ActivationOffload
from lit_qlora.train.offload import AUTO_MIN_BYTES, block_input_bytes, offload_choice

HF = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
      "rope_theta": 5000.0, "tie_word_embeddings": False}
B, T = 2, 16


def tiny(checkpoint_blocks: int = 3, **extra) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(Config.from_hf_config({**HF, **extra}))
    model.init_weights()
    model.checkpoint_blocks = checkpoint_blocks
    return model


def grads(model: Transformer, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(idx).float().pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("checkpoint_blocks", [3, 2])
@pytest.mark.parametrize("extra", [{}, {"model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 24,
                                        "sliding_window": 5}], ids=["llama", "gemma2"])
def test_gradients_with_offload_equal_those_without(checkpoint_blocks, extra):
    model = tiny(checkpoint_blocks, **extra)
    idx = torch.randint(0, HF["vocab_size"], (B, T))
    expected = grads(model, idx)
    model.activation_offload = offload = ActivationOffload()
    got = grads(model, idx)
    assert offload.offloaded == checkpoint_blocks  # the block inputs only: not RoPE tables, masks, inner tensors
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


def block_input_refs(model: Transformer) -> tuple[list[StorageWeakRef], list]:
    """Weak references to each block input that forwards pass from now on, and the hooks' handles."""
    refs: list[StorageWeakRef] = []

    def note(block, args):
        refs.append(StorageWeakRef(args[0].untyped_storage()))

    return refs, [block.register_forward_pre_hook(note) for block in model.blocks]


@pytest.mark.parametrize("offloaded", [True, False])
def test_block_inputs_are_released_after_the_forward_and_held_as_host_bytes(offloaded):
    model = tiny()
    model.activation_offload = offload = ActivationOffload() if offloaded else None
    refs, handles = block_input_refs(model)
    loss = model(torch.randint(0, HF["vocab_size"], (B, T))).float().pow(2).mean()
    for handle in handles:
        handle.remove()
    assert len(refs) == 3
    # Without offload the graph keeps every checkpointed block's input (the control: the check can tell them apart).
    assert [ref.expired() for ref in refs] == [offloaded] * 3
    if offloaded:
        one = B * T * HF["hidden_size"] * 4  # fp32
        assert offload.host_bytes == offload.peak_host_bytes == 3 * one == block_input_bytes(64, 3, B, T, 4)
    loss.backward()
    if offloaded:
        assert offload.host_bytes == 0 and offload.peak_host_bytes == 3 * B * T * 64 * 4  # the graph let go of them
        assert offload.pinned_bytes == offload.peak_host_bytes  # CPU copies: no power-of-two rounding


def test_each_input_comes_back_before_its_block_and_the_previous_one_is_prefetched():
    model = tiny(4, num_hidden_layers=4)
    model.activation_offload = offload = ActivationOffload()
    packed, events, fetched = [], [], []
    pack, unpack, to_device = offload._pack, offload._unpack, offload._to_device

    def recording_pack(t):
        out = pack(t)
        if out is not t:
            packed.append(out)
        return out

    def recording_to_device(host):
        events.append(("fetch", next(i for i, p in enumerate(packed) if p.host is host)))
        out = to_device(host)
        fetched.append(StorageWeakRef(out.untyped_storage()))
        events.append(("on device", sum(not ref.expired() for ref in fetched)))
        return out

    def recording_unpack(p):
        out = unpack(p)
        if p in packed:
            events.append(("unpack", packed.index(p)))
        return out

    offload._pack, offload._unpack, offload._to_device = recording_pack, recording_unpack, recording_to_device
    model(torch.randint(0, HF["vocab_size"], (B, T))).float().pow(2).mean().backward()
    order = [e for e in events if e[0] != "on device"]
    # The last block's input is fetched when its backward asks; from then on each block's backward starts the
    # previous block's fetch, so every input but the last is on the device before its block asks for it.
    assert order == [("fetch", 3), ("fetch", 2), ("unpack", 3), ("fetch", 1), ("unpack", 2), ("fetch", 0),
                     ("unpack", 1), ("unpack", 0)]
    assert max(n for kind, n in events if kind == "on device") <= 2  # the block's own and the prefetched one


def test_a_retained_graph_fetches_again_for_a_second_backward():
    model = tiny()
    idx = torch.randint(0, HF["vocab_size"], (B, T))
    expected = grads(model, idx)
    model.activation_offload = ActivationOffload()
    model.zero_grad(set_to_none=True)
    loss = model(idx).float().pow(2).mean()
    loss.backward(retain_graph=True)
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * expected[name], rtol=0, atol=2e-6, msg=name)


def test_no_offload_outside_training_forwards():
    model = tiny()
    model.activation_offload = offload = ActivationOffload()
    with torch.no_grad():
        model(torch.randint(0, HF["vocab_size"], (B, T)))
    assert offload.offloaded == 0 and offload.peak_host_bytes == 0


def test_the_option_parses_true_false_and_auto_and_defaults_to_auto():
    parser = build_parser(commands())
    for text, value in (("true", True), ("false", False), ("auto", "auto")):
        cfg = parser.parse_args(["finetune", "--train.offload_activations", text])
        assert cfg.finetune.train.offload_activations == value
    assert parser.parse_args(["finetune"]).finetune.train.offload_activations == "auto"
    assert TrainArgs().offload_activations == "auto"


def test_resolution_cpu_refuses_true_and_auto_is_off():
    with pytest.raises(UserError, match="nothing to offload to"):
        offload_choice(True, cuda=False, checkpoint_blocks=32, input_bytes=8 << 30)
    assert offload_choice("auto", cuda=False, checkpoint_blocks=32, input_bytes=8 << 30)[0] is False
    assert offload_choice(False, cuda=False, checkpoint_blocks=32, input_bytes=8 << 30)[0] is False


def test_resolution_on_cuda():
    with pytest.raises(UserError, match="--train.activation_checkpointing true"):
        offload_choice(True, cuda=True, checkpoint_blocks=0, input_bytes=0)
    assert offload_choice("auto", cuda=True, checkpoint_blocks=0, input_bytes=0) == (
        False, "auto: no activation checkpointing")
    assert offload_choice(True, cuda=True, checkpoint_blocks=2, input_bytes=1)[0] is True
    assert offload_choice(False, cuda=True, checkpoint_blocks=32, input_bytes=8 << 30)[0] is False
    # auto: on from AUTO_MIN_BYTES of checkpointed inputs (Llama-3.1-8B: 32 blocks x 8 KiB x 4096 tokens) ...
    llama8b_4096 = block_input_bytes(4096, 32, 1, 4096, 2)
    assert llama8b_4096 == AUTO_MIN_BYTES
    assert offload_choice("auto", True, 32, llama8b_4096)[0] is True
    assert offload_choice("auto", True, 32, llama8b_4096 // 2)[0] is False
    # ... unless the pinned copies would take more than half the host's available memory.
    on, why = offload_choice("auto", True, 32, llama8b_4096, host_available=llama8b_4096)
    assert not on and "available memory" in why
    with pytest.raises(UserError, match="true, false or auto"):
        offload_choice("sometimes", True, 32, 1)


def test_auto_stays_off_where_the_inputs_are_a_small_share_of_the_card_and_says_so():
    """The 8B preset at 2 x 2048 (1 GiB of block inputs): off on an H200 (141 GB) and a 24 GB card, on for a 16 GB
    T4; at 65,536 tokens (16 GiB) on everywhere. The reason names the share and the card."""
    from lit_qlora.train.offload import AUTO_MIN_DEVICE_SHARE

    preset = block_input_bytes(4096, 32, 2, 2048, 2)
    long = block_input_bytes(4096, 32, 1, 65536, 2)
    h200, card24, t4 = 143771 << 20, 24 << 30, 15 << 30
    on, why = offload_choice("auto", True, 32, preset, device_total=h200)
    assert not on and "under 1/16 of the card's 140.4 GiB" in why and "1.00 GiB" in why
    assert offload_choice("auto", True, 32, preset, device_total=card24)[0] is False
    assert offload_choice("auto", True, 32, preset, device_total=t4)[0] is True
    for total in (h200, card24, t4):
        on, why = offload_choice("auto", True, 32, long, device_total=total)
        assert on and "1/16 of the card's memory" in why
    assert preset < AUTO_MIN_DEVICE_SHARE * card24 <= 2 * preset  # the threshold sits between the two sizes
    assert offload_choice(True, True, 32, preset, device_total=h200) == (True, "--train.offload_activations true")
    # without the card's size (an estimate without --device_memory) the byte floor alone decides, as before
    assert offload_choice("auto", True, 32, preset)[0] is True


def test_finetune_refuses_true_on_the_cpu_before_loading_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["finetune", "--accelerator", "cpu", "--out_dir", str(tmp_path / "o"),
              "--train.activation_checkpointing", "true", "--train.offload_activations", "true"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "nothing to offload to" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


LLAMA_LIKE = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 8192, "tie_word_embeddings": False}


def test_the_estimate_moves_the_block_inputs_to_host_memory():
    """Fake CUDA, a Llama-like model at a long sequence with checkpointing: the host bytes are exactly the block
    inputs (n_layer x T x n_embd x 2 bytes in bf16), and the device peak drops by all of them but the two a
    backward holds (its block's input and the prefetched previous one); the peak moves from the loss into the last
    block's backward, where some LoRA gradients exist already."""
    config = Config.from_hf_config(LLAMA_LIKE)
    traces = {offload: trace_step(config, Quantize.NF4, "bf16-true", LoRAArgs(r=4, alpha=8),
                                  TrainArgs(micro_batch_size=1, global_batch_size=1, max_seq_length=2048,
                                            activation_checkpointing=True, offload_activations=offload), "cuda")
              for offload in (False, True)}
    one = 2048 * 256 * 2
    assert traces[True].host_peak == 8 * one and traces[False].host_peak == 0
    saved = traces[False].peak - traces[True].peak
    lora_gradients = traces[True].peak_by_category["LoRA weights"]  # at most one set of them
    assert (8 - 2) * one - lora_gradients <= saved <= 8 * one, (saved, one)


def test_estimate_reports_host_bytes_apart_and_refuses_true_on_cpu(tmp_path, capsys):
    config_dir = tmp_path / "model"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(LLAMA_LIKE))
    common = ["estimate", "--checkpoint_dir", str(config_dir), "--lora.r", "4", "--lora.alpha", "8",
              "--train.micro_batch_size", "1", "--train.global_batch_size", "1", "--train.max_seq_length", "512",
              "--train.activation_checkpointing", "true"]
    main([*common, "--out_dir", str(tmp_path / "on"), "--train.offload_activations", "true"])
    result = json.loads((tmp_path / "on" / "estimate.json").read_text())
    assert result["offload_activations"] is True
    assert result["offload_host_bytes"] == 8 * 512 * 256 * 2 == result["offload_pinned_bytes"]  # 256 KiB: 2^18
    assert result["peak_bytes"] == sum(result["by_category"].values())  # the host bytes are not in the device peak
    assert "Host memory for offloaded activations: 0.00 GiB" in capsys.readouterr().out
    auto = estimate(checkpoint_dir=str(config_dir), out_dir=tmp_path / "auto", lora=LoRAArgs(r=4, alpha=8),
                    train=TrainArgs(micro_batch_size=1, global_batch_size=1, max_seq_length=512,
                                    activation_checkpointing=True))
    assert auto["offload_activations"] is False and auto["offload_host_bytes"] == 0  # 2 MiB: under auto's 1 GiB
    assert auto["peak_bytes"] > result["peak_bytes"]
    with pytest.raises(SystemExit) as e:
        main([*common, "--out_dir", str(tmp_path / "cpu"), "--device", "cpu", "--train.offload_activations", "true"])
    assert e.value.code == 1 and "nothing to offload to" in capsys.readouterr().err


def test_the_runs_summary_and_report_say_what_host_memory_it_took(capsys, tmp_path):
    from lit_qlora.train.offload import offload_summary
    from lit_qlora.train.report import print_report

    assert offload_summary(None) == {"offload_activations": False, "offload_host_bytes": 0, "offload_pinned_bytes": 0}
    model = tiny()
    model.activation_offload = offload = ActivationOffload()
    model(torch.randint(0, HF["vocab_size"], (B, T))).float().pow(2).mean().backward()
    summary = offload_summary(offload)
    assert summary == {"offload_activations": True, "offload_host_bytes": 3 * B * T * 64 * 4,
                       "offload_pinned_bytes": 3 * B * T * 64 * 4}
    print_report({"steps": 1, "train_loss": 1.0, "initial_val_loss": None, "val_loss": None, "tokens_per_sec": None,
                  "peak_rss_bytes": 1 << 30, "peak_rss_train_bytes": 1 << 30, "quantized_linears": 1,
                  "total_linears": 1, "trainable_params": 1, "total_params": 2, "wall_seconds": 1.0,
                  **summary, "offload_host_bytes": 3 << 30, "offload_pinned_bytes": 4 << 30}, tmp_path)
    assert "offloaded activations (host)  3.00 GiB (4.00 GiB pinned)" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_gradients_are_equal_the_inputs_leave_the_device_and_come_back_through_pinned_memory():
    """The real CUDA path (side stream, pinned buffers, events, record_stream) where offloading matters: LoRA on a
    frozen base, so block inputs, not weight gradients, are what a step's memory grows with. The adapters' gradients
    are equal with and without it; when backward starts the device holds exactly the 6 block inputs less (they are
    in pinned host memory, in buffers of exactly their size); the step's peak is lower by about 4 of them (a
    backward keeps its own block's input and the prefetched previous one on the device). Each configuration runs
    once unmeasured first (cuBLAS workspace, caches), and nothing of one measured run stays on the device during the
    other: its gradients go to the CPU and the cache is emptied before the next run's peak is reset."""
    hf = {**HF, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 8,
          "num_key_value_heads": 4, "max_position_embeddings": 4096}
    model = tiny(6, **hf)
    apply_lora(model, 8, 16, 0.0, dtype=torch.float32)  # freezes the base
    for layer in lora_modules(model).values():  # B != 0: every adapter's gradient is non-trivial
        torch.nn.init.normal_(layer.lora_B, std=0.02)
    model = model.cuda().train()
    idx = torch.randint(0, hf["vocab_size"], (2, 2048), device="cuda")
    one = 2 * 2048 * 512 * 4  # one block input, fp32: 8 MiB

    def step(offload):
        model.activation_offload = offload
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = model(idx).float().pow(2).mean()
        torch.cuda.synchronize()
        at_backward = torch.cuda.memory_allocated() - before
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        grads = {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}
        del loss
        model.zero_grad(set_to_none=True)
        left = torch.cuda.memory_allocated() - before
        return {"at_backward": at_backward, "peak": peak, "left": left, "grads": grads, "offload": offload}

    for offloaded in (False, True):
        step(ActivationOffload() if offloaded else None)  # warm-up, not measured
    runs = {offloaded: step(ActivationOffload() if offloaded else None) for offloaded in (False, True)}
    off, on = runs[False], runs[True]
    assert len(off["grads"]) == 2 * 7 * 6 + 2  # lora_A and lora_B of every linear (7 a block, and the head)
    assert off["grads"].keys() == on["grads"].keys()
    for name in off["grads"]:
        torch.testing.assert_close(on["grads"][name], off["grads"][name], rtol=1e-5, atol=1e-6, msg=name)
    offload = on["offload"]
    assert offload.offloaded == 6 and offload.host_bytes == 0 and offload.peak_host_bytes == 6 * one
    assert offload.pinned_bytes == 6 * one  # 8 MiB each: a power of two already
    measured = {k: (off[k], on[k]) for k in ("at_backward", "peak", "left")}
    assert abs(off["left"]) < one and abs(on["left"]) < one, measured  # nothing of a run outlives it
    assert abs((off["at_backward"] - on["at_backward"]) - 6 * one) <= one // 2, measured  # all 6 inputs are away
    assert off["at_backward"] >= 6 * one, measured
    assert 3 * one <= off["peak"] - on["peak"] <= 6 * one + one // 2, measured


def test_block_inputs_go_to_host_memory_in_pieces_that_round_only_the_last():
    """Pinned buffers are rounded up to a power of two each: a block input goes in PINNED_PIECE pieces, so an 8B
    input of 1.07 GiB (140k tokens) takes 1.07 GiB + at most one piece, not 2 GiB; its bytes come back exactly."""
    from lit_qlora.model.offload import PINNED_PIECE, copy_pieces, host_pieces, pinned_size

    one = 140_000 * 4096 * 2
    assert one < pinned_size(one) < one + PINNED_PIECE and pinned_size(one) < (1 << 31)
    assert pinned_size(PINNED_PIECE * 3) == PINNED_PIECE * 3 and pinned_size(5) == 8 and pinned_size(0) == 0
    x = torch.randn(3, 37, 29)
    flat = x.reshape(-1).view(torch.uint8)
    pieces = host_pieces(flat, pin=False, piece=1024)
    assert flat.numel() == 12876 and [p.numel() for p in pieces] == [1024] * 12 + [588]
    copy_pieces(pieces, flat, to_pieces=True)
    back = torch.empty_like(x)
    copy_pieces(pieces, back.view(-1).view(torch.uint8), to_pieces=False)
    assert torch.equal(back, x)
