"""A fine-tune's final/ directory: its adapter, the merged model and the PEFT adapter (lit_qlora.deploy.export) and,
when asked, a GGUF file (lit_qlora.deploy.gguf_export)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lit_qlora.deploy.export import export_config, hf_tensor_specs, write_peft_adapter


def export_final(model: nn.Module, final_dir: Path, checkpoint_dir: Path, adapter_config: dict,
                 adapter: Optional[dict[str, torch.Tensor]] = None, gguf: Optional[str] = None) -> None:
    """A fine-tune's final/: adapter.safetensors (+ adapter_config.json), merged/ (Hugging Face, bf16) and peft/,
    streamed from the trained model. `adapter`: its tensors when already gathered (`full_lora_state_dict`). `gguf`:
    a GGUF type (--export.gguf): model-<type>.gguf and an Ollama Modelfile too (lit_qlora.deploy.gguf_export).

    final/ is complete or absent: it is built as .final.tmp beside it and swapped in by renames when whole
    (`replace_dir`), so a run killed while exporting leaves no half-written final/ that a user could take for a
    finished one (`--resume auto` exports again, first removing the leftovers).

    An FSDP-sharded or tensor-parallel model has no whole base here: the merged model and PEFT adapter are then
    built from the base checkpoint and the written adapter, as `litqlora merge` does (the same NF4 layout,
    recorded as nf4_world_size / nf4_tensor_parallel, gives the same bits)."""
    import torch

    from lit_qlora.checkpoint.hf import save_hf_checkpoint

    from lit_qlora.checkpoint.files import remove_path, replace_dir
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.checkpoint.adapter import save_adapter
    from lit_qlora.parallel.distributed import is_sharded

    final_dir = Path(final_dir)
    staging = final_dir.with_name(f".{final_dir.name}.tmp")
    remove_path(staging)  # a killed export's leftovers
    save_adapter(model, staging, adapter_config, adapter)
    if is_sharded(model):
        model = load_model(checkpoint_dir, adapter_dir=staging)
    model = model.eval()
    save_hf_checkpoint(staging / "merged", export_config(model, True), hf_tensor_specs(model, torch.bfloat16),
                       tokenizer_dir=Path(checkpoint_dir), dtype=torch.bfloat16)
    write_peft_adapter(model, adapter_config, staging / "peft", str(Path(checkpoint_dir).resolve()))
    if gguf:
        from lit_qlora.deploy.gguf_export import write_gguf

        write_gguf(model, Path(checkpoint_dir), staging / f"model-{gguf}.gguf", gguf)
    replace_dir(staging, final_dir)  # a re-export replaces an older final/ as a whole too
