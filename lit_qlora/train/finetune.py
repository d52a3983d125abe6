"""`litqlora finetune`: check what a user can get wrong (paths, precision, compile, out_dir and resume:
lit_qlora.train.resume), then run the fine-tune (lit_qlora.train.run: load the (NF4) base, add LoRA, train with the
Lightning Trainer, write the run's files).

Light at import: the CLI reads `finetune`'s signature for `--help` and argument errors, which must not wait for torch
and the training stack (lit_qlora.cli.commands); they load inside the functions that need them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from lit_qlora.checkpoint.download import DEFAULT_CHECKPOINT
from lit_qlora.train.args import data_source, with_init_adapter
from lit_qlora.train.method import Method
from lit_qlora.train.spec import RunSpec, decide


def finetune(spec: Optional[RunSpec] = None, **settings: Any) -> dict[str, Any]:
    """Fine-tune a LoRA adapter on a frozen base: NF4 (QLoRA, the default) or plain (LoRA, the baseline).

    Args:
        spec: The run's settings (lit_qlora.train.spec.RunSpec: every option of `litqlora finetune`), or its fields
            as keywords.
    """
    return run_method(SFT(RunSpec.of(spec, settings)))


class SFT(Method):
    """Supervised fine-tuning: next-token cross-entropy on the answers (`litqlora finetune`)."""

    command = staticmethod(finetune)


def run_method(method: Method) -> dict[str, Any]:
    """A verb's run: its method's checks, its demo data where no dataset is given, a line saying what it optimizes,
    `start_run`, and (a method other than SFT) a held-out prompt's reply before training and after."""
    spec = method.spec
    if method.demo_data is not None and data_source(spec.data) is None:
        from lit_qlora.data import files

        spec = replace(spec, data=replace(spec.data, path=str(getattr(files, method.demo_data))))
        method = type(method)(spec)
    method.check()
    if method.section is not None:
        print(f"Objective: {method.describe()}")
    summary = start_run(spec, method)
    if summary and method.section is not None:
        from lit_qlora.train.report import print_sample_change

        print_sample_change(Path(spec.out_dir))
    return summary

def start_run(spec: RunSpec, method: Optional[Method] = None) -> dict[str, Any]:
    """`finetune`'s checks, resume and run, for any method (lit_qlora.train.method: SFT when None)."""

    from lit_qlora.checkpoint.hf import require_checkpoint
    from lit_qlora.model.config import require_checkpoint_dir
    from lit_qlora.data.formats import require_source
    from lit_qlora.data.files import require_data_file
    from lit_qlora.train.resume import claim_out_dir, finished_summary, recipe, require_same_recipe
    from lit_qlora.train.run import fit, setup
    from lit_qlora.train.state import read_state

    data, train, out_dir = spec.data, spec.train, Path(spec.out_dir)
    # Input a user can get wrong, checked before setup() spends seconds importing the training stack.
    default = Path(spec.checkpoint_dir) == DEFAULT_CHECKPOINT  # (converted from the bundled GGUF in setup)
    if not default:
        require_checkpoint_dir(spec.checkpoint_dir)
    data_source(data)  # one dataset option at most
    if data.json_path is not None:
        require_data_file(data.json_path)
    for source in (data.path, data.val_path):
        if source is not None:
            require_source(source)
    lora, data = with_init_adapter(spec.lora, data, train.init_adapter)  # a missing adapter: a clear error now
    spec = replace(spec, lora=lora, data=data)
    if spec.export.gguf and not default:
        from lit_qlora.export.gguf import require_exportable
        from lit_qlora.lora.layer import resolve_targets

        from lit_qlora.model.config import Config

        tied = Config.from_checkpoint(spec.checkpoint_dir).tie_embeddings
        require_exportable(Path(spec.checkpoint_dir), head_adapted="lm_head" in resolve_targets(lora.targets, tied))
    decided = decide(spec)  # (a refusal of --compile comes before claim_out_dir deletes anything of --overwrite's)
    if not default:
        require_checkpoint(spec.checkpoint_dir)  # config fields, weights, tokenizer: before the disk check reads it
    claim_out_dir(out_dir, spec.resume, spec.overwrite)
    if decided.resume_from is not None:
        state = read_state(decided.resume_from)
        now = recipe(spec, decided.precision)
        require_same_recipe(state, decided.resume_from, {**now, **(method.recorded() if method else {})})
        finished = finished_summary(out_dir, state, train.max_steps)
        if finished is not None:
            return finished
        print(f"Resuming from {decided.resume_from}, after optimizer step {state.get('step', 0)}")
    print(f"Precision: {decided.precision} ({decided.precision_reason})")
    return fit(setup(spec, decided, method))
