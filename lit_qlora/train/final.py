"""A fine-tune's final/ directory: its adapter, the merged model and the PEFT adapter (lit_qlora.export.hf) and,
when asked, a GGUF file (lit_qlora.export.gguf); an export that fails keeps the adapter and says how to finish.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lit_qlora.export.hf import export_config, hf_tensor_specs, write_peft_adapter
from lit_qlora.base.errors import UserError


def export_final(model: nn.Module, final_dir: Path, checkpoint_dir: Path, adapter_config: dict,  # noqa: F821
                 adapter: Optional[dict[str, torch.Tensor]] = None, gguf: Optional[str] = None,  # noqa: F821
                 merged: bool = True, peft: bool = True) -> None:
    """A fine-tune's final/: adapter.safetensors (+ adapter_config.json), merged/ (Hugging Face, bf16; unless
    `merged` is false) and peft/ (unless `peft` is false), streamed from the trained model. `adapter`: its tensors
    when already gathered (`full_lora_state_dict`). `gguf`: a GGUF type (--export.gguf): model-<type>.gguf and an
    Ollama Modelfile too (lit_qlora.export.gguf).

    final/ is complete or absent: it is built as .final.tmp beside it and swapped in by renames when whole
    (`replace_dir`), so a run killed while exporting leaves no half-written final/ that a user could take for a
    finished one (`--resume auto` exports again, first removing the leftovers). An export that fails (a full disk)
    keeps the trained adapter: final/ then holds the adapter alone, the failed parts are deleted, and
    ExportFailed names the commands that finish the export later.

    An FSDP-sharded or tensor-parallel model has no whole base here: the merged model and PEFT adapter are then
    built from the base checkpoint and the written adapter, as `litqlora merge` does (the same NF4 layout,
    recorded as nf4_world_size / nf4_tensor_parallel, gives the same bits)."""
    from lit_qlora.checkpoint.adapter import save_adapter
    from lit_qlora.checkpoint.files import remove_path, replace_dir

    final_dir = Path(final_dir)
    staging = final_dir.with_name(f".{final_dir.name}.tmp")
    remove_path(staging)  # a killed export's leftovers
    save_adapter(model, staging, adapter_config, adapter)
    adapter_files = {path.name for path in staging.iterdir()}
    parts = [*(["merged"] if merged else []), *(["peft"] if peft else []), *([f"model-{gguf}.gguf"] if gguf else [])]
    try:
        _export_parts(model, staging, checkpoint_dir, adapter_config, gguf, merged, peft)
    except Exception as e:
        for path in staging.iterdir():  # the failed parts go (a full disk gets its space back); the adapter stays
            if path.name not in adapter_files:
                remove_path(path)
        replace_dir(staging, final_dir)
        raise ExportFailed(final_dir, Path(checkpoint_dir), parts, gguf, e) from e
    replace_dir(staging, final_dir)  # a re-export replaces an older final/ as a whole too


def _export_parts(model: nn.Module, staging: Path, checkpoint_dir: Path, adapter_config: dict,  # noqa: F821
                  gguf: Optional[str], merged: bool, peft: bool) -> None:
    import torch

    from lit_qlora.checkpoint.hf import save_hf_checkpoint
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.data.inference import exported_chat_template
    from lit_qlora.parallel.distributed import is_sharded

    if not (merged or peft or gguf):
        return
    if is_sharded(model):
        model = load_model(checkpoint_dir, adapter_dir=staging)
    model = model.eval()
    template = exported_chat_template(adapter_config.get("prompt_style"))  # the format it trained in
    if merged:
        save_hf_checkpoint(staging / "merged", export_config(model, True), hf_tensor_specs(model, torch.bfloat16),
                           tokenizer_dir=Path(checkpoint_dir), dtype=torch.bfloat16, chat_template=template)
    if peft:
        write_peft_adapter(model, adapter_config, staging / "peft", str(Path(checkpoint_dir).resolve()))
    if gguf:
        from lit_qlora.export.gguf import write_gguf

        write_gguf(model, Path(checkpoint_dir), staging / f"model-{gguf}.gguf", gguf, chat_template=template)


class ExportFailed(UserError):
    """The exports after training failed; the trained adapter is kept in final/ and the message says how to finish."""

    def __init__(self, final_dir: Path, checkpoint_dir: Path, parts: list[str], gguf: Optional[str],
                 cause: BaseException) -> None:
        base, adapter = _quoted(checkpoint_dir), _quoted(final_dir)
        commands = {"merged": f"litqlora merge --checkpoint_dir {base} --adapter_dir {adapter} --out_dir "
                              f"{_quoted(final_dir / 'merged')}",
                    "peft": f"litqlora export_peft --checkpoint_dir {base} --adapter_dir {adapter} --out_dir "
                            f"{_quoted(final_dir / 'peft')}",
                    f"model-{gguf}.gguf": f"litqlora export_gguf --checkpoint_dir {base} --adapter_dir {adapter} "
                                          f"--out {_quoted(final_dir / f'model-{gguf}.gguf')} --dtype {gguf}"}
        reason = (str(cause).strip().splitlines() or [""])[0]
        super().__init__(
            f"Training finished, but exporting {', '.join(parts)} into {final_dir} failed ({type(cause).__name__}: "
            f"{reason}). The trained adapter is safe in {final_dir} (adapter.safetensors, adapter_config.json) and "
            "the failed parts were deleted. Once the cause is fixed (free disk space, for instance), finish the "
            f"export with: {'; '.join(commands[part] for part in parts)}. Or run the same finetune command again "
            "with --resume auto, which validates and exports again from the last checkpoint.")


def _quoted(path: Path) -> str:
    import shlex

    return shlex.quote(str(path))
