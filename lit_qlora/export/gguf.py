"""`litqlora export_gguf`: a model, a LoRA adapter merged on the fly, as one GGUF file for llama.cpp, and an Ollama
`Modelfile` beside it.

What llama.cpp reads, written the way its own converter writes it (gguf_import.py reads the same layout back):

* tensor names `token_embd`, `blk.N.attn_q`, ..., `output` and each family's differences (gguf_families.py: Gemma's
  sandwich norms stored as 1 + w, Phi-3's fused attn_qkv and gate-up ffn_up, llama's permuted q/k rows); numpy's
  (out, in) arrays, which the writer stores with ggml's fastest-first dimensions;
* the family's metadata (`{arch}.block_count`, heads, kv heads, rope base and rotated dims, RMSNorm epsilon, context
  length, Gemma's sliding window and soft-caps) and rope scaling as llama.cpp stores it: linear as metadata, Llama
  3.x as a `rope_freqs` tensor of per-frequency divisors, Phi-3's longrope as `rope_factors_long/short` tensors;
* the tokenizer (gguf_tokenizer.py): byte-level BPE (Llama 3, Qwen, SmolLM2) as `gpt2` with its merges and the name
  of its split regex (`tokenizer.ggml.pre`), or SentencePiece BPE (Llama 2, TinyLlama) as `llama` with its pieces'
  scores, byte pieces and space prefix; special and added tokens typed as control or user-defined, BOS/EOS/pad/unk
  ids and the chat template.

Norms and biases stay F32 (llama.cpp's convention); a weight whose rows do not split into the quantization's 32-value
blocks is written F16. Weights are produced a block of rows at a time (merged in fp32 from the base the adapter
trained against: dequant(NF4(W)) for QLoRA), encoded and written, so neither the merged model nor a whole fp32
weight ever exists (llama's q/k, permuted per head, are the exception: n_embd rows at most).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from lit_qlora.export.gguf_families import (ARCHITECTURES, GGUFExportError, context_length, gguf_name, is_norm,
                                            norm_offset, permutes_rope_rows, refusals)
from lit_qlora.export.gguf_tokenizer import tokenizer_metadata

# torch, numpy and gguf are imported inside the functions: the CLI imports this module to build --help.

GGUFType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
# general.file_type, what llama.cpp reports as the model's type (gguf.LlamaFileType's values)
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "bf16": 32}


def permute_rope_rows(w, n_heads: int):
    """HF's rotate-halves q/k rows -> llama.cpp's adjacent pairs (gguf_import.unpermute_rope_rows undoes it)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def architecture(config) -> str:
    """llama.cpp's architecture for `config`; a GGUFExportError naming what llama.cpp would not run as we do."""
    found = refusals(config)
    if found:
        raise GGUFExportError(
            f"export_gguf cannot write this {config.model_type} model for llama.cpp: {'; '.join(found)}. Use the "
            "merged Hugging Face export (out_dir/final/merged) with a runtime that supports it (transformers, vLLM), "
            "or llama.cpp's own convert_hf_to_gguf.py if your llama.cpp version handles it.")
    return ARCHITECTURES[config.model_type]


def export_gguf(checkpoint_dir: Path, out: Path, adapter_dir: Optional[Path] = None, dtype: GGUFType = "f16",
                quantize: Optional[Literal["nf4", "none"]] = None) -> Path:
    """Write `out` (GGUF) and a Modelfile beside it for the checkpoint, with the adapter merged when given; returns
    the GGUF path. See the module docstring."""
    from lit_qlora.checkpoint.hf import require_checkpoint
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.data.inference import trained_chat_template

    checkpoint_dir = Path(checkpoint_dir)
    require_checkpoint(checkpoint_dir)  # (a GGUF file carries the tokenizer)
    tokenizer = require_exportable(checkpoint_dir)  # every refusal before anything loads or is written
    model = load_model(checkpoint_dir, quantize, "32-true" if quantize == "none" or adapter_dir is None else None,
                       adapter_dir=adapter_dir)
    return write_gguf(model, checkpoint_dir, out, dtype, merged=adapter_dir is not None, tokenizer=tokenizer,
                      chat_template=trained_chat_template(adapter_dir))


def gguf_config(model, merged: bool):
    """The config written: the model's, untied where a merged adapter changed a tied head (export.export_config)."""
    from lit_qlora.export.hf import export_config

    return export_config(model, merged=merged)


def require_exportable(checkpoint_dir: Path, head_adapted: bool = False) -> dict[str, Any]:
    """The checkpoint's GGUF tokenizer fields; a GGUFExportError when export_gguf cannot write this model (merged
    with an adapter on lm_head when `head_adapted`: that unties a tied head)."""
    from lit_qlora.model.config import Config

    config = Config.from_checkpoint(checkpoint_dir)
    architecture(config.replace(tie_embeddings=False) if head_adapted else config)
    return tokenizer_metadata(checkpoint_dir)


def write_gguf(model, checkpoint_dir: Path, out: Path, dtype: GGUFType = "f16", merged: bool = True,
               tokenizer: Optional[dict[str, Any]] = None, chat_template: Optional[str] = None) -> Path:
    """`model` (a LoRA model: its adapters merged on the fly, in fp32) as the GGUF file `out`, the tokenizer and chat
    template from `checkpoint_dir` (`tokenizer`: its fields when already read; `chat_template`: the template to embed
    instead, a fine-tune's prompt style), and an Ollama Modelfile beside it."""
    import gguf

    from lit_qlora.checkpoint.files import remove_path

    out = Path(out)
    config = gguf_config(model, merged)
    arch = architecture(config)
    tokenizer = tokenizer or tokenizer_metadata(Path(checkpoint_dir))
    if chat_template is not None:
        tokenizer = {**tokenizer, "chat_template": chat_template}
    tensors = gguf_tensors(model, config, arch, merged)
    storage = storage_types(dtype)
    length, why = context_length(config)
    if why:
        print(f"export_gguf: {why}.", file=sys.stderr)
    tmp = out.with_name(f".{out.name}.tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        _write_metadata(writer, config, arch, tokenizer, Path(checkpoint_dir).name, dtype, length)
        for name, shape, _ in tensors:
            _add_tensor_info(writer, name, shape, storage(shape, name))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, shape, pieces in tensors:
            kind = storage(shape, name)
            writer.write_tensor_data(_Streamed(pieces, kind, _nbytes(shape, kind)))
        writer.close()
        tmp.replace(out)
    except BaseException:
        writer.close()
        remove_path(tmp)
        raise
    write_modelfile(out, tokenizer)
    return out


def storage_types(dtype: str) -> Callable[..., Any]:
    """Each tensor's GGUF storage type in a file of `dtype`, by its shape and name: vectors and a mixture of experts'
    router (`ffn_gate_inp`: its top-k choice flips on small changes, llama.cpp's converter keeps it so too) in f32,
    rows that do not split into the quantization's blocks in f16, the rest in `dtype`."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, dtype.upper())
    block = gguf.GGML_QUANT_SIZES[qtype][0]

    def storage(shape: tuple[int, ...], name: str = "") -> Any:
        if len(shape) == 1 or dtype == "f32" or name.endswith(".ffn_gate_inp.weight"):
            return gguf.GGMLQuantizationType.F32
        if shape[-1] % block:
            return gguf.GGMLQuantizationType.F16  # the rows do not split into the quantization's blocks
        return qtype
    return storage


def gguf_data_bytes(model, dtype: str, merged: bool = True) -> int:
    """The tensor data `write_gguf` writes for `model` (a meta-device model will do: nothing is computed): the file's
    size but for its metadata (the tokenizer's vocabulary, a few MB)."""
    config = gguf_config(model, merged)
    arch = architecture(config)
    storage = storage_types(dtype)
    return sum(_nbytes(shape, storage(shape, name)) for name, shape, _ in gguf_tensors(model, config, arch, merged))


def gguf_tensors(model, config, arch: str, merged: bool) -> list[tuple[str, tuple[int, ...], Any]]:
    """(GGUF name, numpy shape, pieces) per tensor, in file order; `pieces()` yields fp32 numpy row blocks whose
    concatenation is the tensor as llama.cpp reads it. Weights stream a block of rows at a time (a merged head or
    MLP weight never exists whole in fp32), except q/k under `llama`'s per-head row permutation; Phi-3's fused
    projections are their parts' blocks in row order."""
    import numpy as np
    import torch

    from lit_qlora.export.hf import hf_tensor_specs
    from lit_qlora.model.hf_layout import experts_plan, fuse_plan

    specs = {spec.name: spec for spec in hf_tensor_specs(model, torch.float32, merge=merged)}
    plan = {**fuse_plan(config, specs), **experts_plan(config, specs)}
    offset = norm_offset(arch)

    def pieces_of(spec, heads: Optional[int] = None):
        def pieces():
            if heads is not None:
                yield permute_rope_rows(spec.produce().float().numpy(), heads)
                return
            for piece in spec.pieces():
                piece = piece.float().numpy()
                yield piece + np.float32(offset) if offset and is_norm(spec.name) else piece
        return pieces

    tensors = []
    for name, spec in specs.items():
        if config.tie_embeddings and name == "lm_head.weight":
            continue
        fused, members = plan.get(name, (name, [name]))
        if not fused:
            continue  # written inside the fused tensor of its first part
        shape = (sum(specs[m].shape[0] for m in members), *spec.shape[1:])
        if fused.endswith("_exps"):  # a mixture of experts' projection: its experts stacked, (n, out, in)
            shape, fused = (len(members), *spec.shape), fused.removesuffix("_exps")
        gname = gguf_name(fused, arch)
        heads = None
        if permutes_rope_rows(arch):
            heads = config.n_head if ".attn_q." in gname else config.n_query_groups if ".attn_k." in gname else None
        parts = [pieces_of(specs[m], heads) for m in members]
        tensors.append((gname, shape, lambda parts=parts: (p for part in parts for p in part())))
    for name, values in _rope_tensors(config).items():
        tensors.append((name, values.shape, lambda values=values: iter([values])))
    return tensors


class _Streamed:
    """What GGUFWriter.write_tensor_data needs of an array (`nbytes`, `tofile`), its bytes encoded and written a row
    block at a time."""

    def __init__(self, pieces, kind, nbytes: int) -> None:
        self.pieces, self.kind, self.nbytes = pieces, kind, nbytes

    def tofile(self, fout) -> None:
        written = 0
        for piece in self.pieces():
            data = _encode(piece, self.kind)
            data.tofile(fout)
            written += data.nbytes
        if written != self.nbytes:
            raise RuntimeError(f"wrote {written} bytes of a tensor announced as {self.nbytes}")  # a bug


def _nbytes(shape: tuple[int, ...], kind) -> int:
    import gguf
    import numpy as np

    block, size = gguf.GGML_QUANT_SIZES[kind]
    return int(np.prod(shape)) // block * size


def _add_tensor_info(writer, name: str, shape: tuple[int, ...], kind) -> None:
    """The tensor's header entry, its bytes known before any is produced (the file is written in one pass)."""
    import gguf
    import numpy as np

    block, size = gguf.GGML_QUANT_SIZES[kind]
    nbytes = _nbytes(shape, kind)
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        writer.add_tensor_info(name, shape, np.dtype(np.float32 if size == 4 else np.float16), nbytes, raw_dtype=kind)
    elif kind == gguf.GGMLQuantizationType.BF16:
        writer.add_tensor_info(name, shape, np.dtype(np.uint16), nbytes, raw_dtype=kind)
    else:  # block quantizations: the writer takes the row's byte length and derives the value count
        writer.add_tensor_info(name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8), nbytes,
                               raw_dtype=kind)


def _encode(values, kind):
    import gguf
    import numpy as np

    if kind == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(values, dtype=np.float32)
    if kind == gguf.GGMLQuantizationType.F16:
        return np.ascontiguousarray(values, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), kind)


def _rope_tensors(config) -> dict[str, Any]:
    """Rope scaling that llama.cpp stores as tensors: Llama 3.x's per-frequency divisors (`rope_freqs`), Phi-3's
    longrope factors (`rope_factors_long`, `rope_factors_short`)."""
    import numpy as np

    from lit_qlora.model.rope import rope_inv_freq

    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":
        return {f"rope_factors_{which}.weight": np.asarray(scaling[f"{which}_factor"], dtype=np.float32)
                for which in ("long", "short")}
    if kind != "llama3":
        return {}
    plain = rope_inv_freq(config.replace(rope_scaling=None)).double()
    scaled = rope_inv_freq(config).double()
    return {"rope_freqs.weight": (plain / scaled).float().numpy().astype(np.float32)}


def _write_metadata(writer, config, arch: str, tok: dict[str, Any], name: str, file_type: str, length: int) -> None:
    from lit_qlora.model.rope import rope_attention_factor, rotary_dim

    writer.add_name(name)
    writer.add_context_length(length)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.intermediate_size)
    if config.n_experts:
        writer.add_expert_count(config.n_experts)
        writer.add_expert_used_count(config.n_experts_per_token)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.clip_qkv is not None:
        writer.add_clamp_kqv(float(config.clip_qkv))
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_query_groups)
    writer.add_rope_freq_base(float(config.rope_base))
    writer.add_layer_norm_rms_eps(float(config.norm_eps))
    writer.add_rope_dimension_count(rotary_dim(config))
    if config.head_dim * config.n_head != config.n_embd or arch in ("gemma2", "gemma3"):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if scaling.get("original_max_position_embeddings"):
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    if kind == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    if kind == "longrope":
        writer.add_rope_scaling_attn_factors(rope_attention_factor(config))
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(int(config.sliding_window))
    if config.attn_softcap is not None:
        writer.add_attn_logit_softcapping(float(config.attn_softcap))
    if config.final_softcap is not None:
        writer.add_final_logit_softcapping(float(config.final_softcap))
    writer.add_file_type(int(FILE_TYPES[file_type]))
    writer.add_tokenizer_model(tok["model"])
    writer.add_tokenizer_pre(tok["pre"])
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    if tok["merges"]:
        writer.add_token_merges(tok["merges"])
    if "scores" in tok:
        writer.add_token_scores(tok["scores"])
        writer.add_add_space_prefix(bool(tok["add_space_prefix"]))
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("pad", writer.add_pad_token_id), ("unk", writer.add_unk_token_id)):
        if tok.get(key) is not None:
            add(int(tok[key]))
    writer.add_add_bos_token(bool(tok["add_bos"]))
    if tok["chat_template"]:
        writer.add_chat_template(tok["chat_template"])


def write_modelfile(gguf_path: Path, tok: dict[str, Any]) -> Path:
    """An Ollama Modelfile beside the GGUF file (`ollama create NAME -f Modelfile`). The GGUF carries the chat
    template, which Ollama reads from it; the stop tokens are listed here so a reply ends at end-of-turn."""
    from lit_qlora.checkpoint.files import atomic_write_text

    stops = [tok["tokens"][i] for i in tok["eos_ids"] if i is not None and i < len(tok["tokens"])]
    lines = [f"FROM ./{gguf_path.name}", *(f"PARAMETER stop {json.dumps(s)}" for s in dict.fromkeys(stops))]
    path = gguf_path.with_name("Modelfile")
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def export_gguf_command(
    checkpoint_dir: Path,
    out: Path,
    adapter_dir: Optional[Path] = None,
    dtype: GGUFType = "f16",
    quantize: Optional[Literal["nf4", "none"]] = None,
) -> str:
    """Write a GGUF file for llama.cpp, Ollama and LM Studio (and an Ollama Modelfile beside it).

    Args:
        checkpoint_dir: The base model's Hugging Face directory.
        out: The .gguf file to write (replaced whole when complete; a failed export leaves none).
        adapter_dir: A fine-tune's out_dir or final/ directory: its adapter is merged into the weights on the fly.
        dtype: f32, f16 or bf16 weights, or llama.cpp's block quantizations q8_0, q4_0, q4_1, q5_0, q5_1 (norms
            stay f32; a weight whose rows do not split into 32-value blocks is written f16).
        quantize: The base the adapter is merged into: nf4 = dequant(NF4(W)), what QLoRA trained against; none =
            W. Default: what the adapter trained with.
    """
    path = export_gguf(checkpoint_dir, out, adapter_dir, dtype, quantize)
    print(f"Wrote {path} and {path.with_name('Modelfile')} (ollama create NAME -f {path.with_name('Modelfile')})",
          file=sys.stderr)
    return str(path)
