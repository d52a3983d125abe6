"""`litqlora finetune`: check what a user can get wrong (paths, precision, compile, out_dir and resume:
lit_qlora.train.resume), then run the fine-tune (lit_qlora.train.run: load the (NF4) base, add LoRA, train with the
Lightning Trainer, write the run's files).

Light at import: the CLI reads `finetune`'s signature for `--help` and argument errors, which must not wait for torch
and the training stack (lit_qlora.cli.commands); they load inside the functions that need them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

from lit_qlora.deploy.gguf_import import DEFAULT_CHECKPOINT
from lit_qlora.errors import UserError
from lit_qlora.hardware import PrecisionChoice, choose_precision, cpu_emulates, uses_cuda
from lit_qlora.train.args import DataArgs, ExportArgs, LoRAArgs, TrainArgs, data_source, with_init_adapter
from lit_qlora.train.loggers import LoggerName, require_loggers

def finetune(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT,
    out_dir: Path = Path("out/finetune"),
    quantize: Literal["nf4", "none"] = "nf4",
    precision: PrecisionChoice = "auto",
    seed: int = 1337,
    accelerator: str = "auto",
    devices: int = 1,
    num_nodes: int = 1,
    strategy: Literal["auto", "ddp", "fsdp", "tp"] = "auto",
    tensor_parallel: int = 1,
    nf4_shards: Optional[int] = None,
    resume: Union[bool, Literal["auto"], Path] = False,
    lora: LoRAArgs = LoRAArgs(),
    train: TrainArgs = TrainArgs(),
    data: DataArgs = DataArgs(),
    ignore_modules: Optional[list[str]] = None,
    compile: Union[bool, Literal["force"]] = False,
    overwrite: bool = False,
    logger: Union[LoggerName, list[LoggerName]] = "tensorboard",
    export: ExportArgs = ExportArgs(),
) -> dict[str, Any]:
    """Fine-tune a LoRA adapter on a frozen base: NF4 (QLoRA, the default) or plain (LoRA, the baseline).

    Args:
        checkpoint_dir: Base model (Hugging Face directory). The default is the bundled SmolLM2-135M-Instruct,
            converted on first use.
        out_dir: Where adapters, merged model, logs, metrics and resumable checkpoints go.
        quantize: nf4 = every base linear stored as NF4 (QLoRA); none = base in the precision's dtype (LoRA).
        precision: auto picks by hardware: bf16-true on a GPU with bf16 (compute capability >= 8.0) or a CPU with
            native bf16 (AVX512-BF16, AMX); 16-mixed on older GPUs (T4, V100: fp16 compute, fp32 adapters and
            AdamW state, dynamic loss scaling); 32-true on other CPUs (they emulate bf16, 5-10x slower than
            fp32). An explicit bf16-true, bf16-mixed (bf16 compute, fp32 adapters and AdamW state), 16-mixed,
            16-true or 32-true wins; Lightning's short names bf16, 16 and 32 mean bf16-mixed, 16-mixed and 32-true.
        seed: Seeds adapter init, data order and dropout: CPU runs repeat exactly.
        accelerator: cpu, cuda, auto...
        devices: Devices per node.
        num_nodes: Nodes.
        strategy: auto (one device), ddp (every rank holds the whole NF4 base) or fsdp (FSDP2: each of the
            devices x num_nodes ranks holds 1/N of it) or tp (tensor parallelism: the blocks' weights split over
            `tensor_parallel` ranks). Lightning starts the processes; see tutorials/distributed.md.
        tensor_parallel: With --strategy tp, ranks per tensor-parallel group (it must divide devices x num_nodes,
            the number of heads, of kv groups and the MLP width); the rest is data parallelism.
        nf4_shards: NF4 layout: how many FSDP shards every NF4 weight must split into. Default: devices x
            num_nodes with fsdp, else 1. Give an FSDP run's value to a smaller run to quantize to the same bits.
        resume: auto = continue from the newest checkpoint in out_dir (fresh start if none); a checkpoint
            directory; or false.
        lora: Adapter settings.
        train: Optimization settings.
        data: Dataset settings; with nothing given, the dataset shipped with lit-qlora.
        ignore_modules: Module names (prefixes) whose linears stay in high precision with nf4, e.g. lm_head.
        compile: torch.compile each transformer block (regional compilation): faster steps after a warm-up,
            which summary.json reports apart (compile_seconds; tokens_per_sec excludes the steps that compiled).
            A resume may change it. Refused on a CPU that emulates the precision's matmuls (bf16 without
            AVX512-BF16/AMX: minutes per step for nothing); `force` compiles anyway.
        overwrite: Start a new run (no --resume) in an out_dir that holds another run's checkpoints or results,
            deleting them, its metrics.jsonl and logs first; without it, such an out_dir is refused.
        logger: Where the scalars (and the settings as hyperparameters) go besides metrics.jsonl, one or several
            (--logger '[tensorboard,csv]'): tensorboard (out_dir/logs), csv (out_dir/csv/metrics.csv), wandb
            (offline in out_dir/wandb unless you are logged in; pip install wandb) or mlflow (out_dir/mlruns unless
            MLFLOW_TRACKING_URI is set; pip install mlflow).
        export: More exports of the fine-tune beside final/'s adapter, merged model and PEFT adapter.
    """
    return start_run(checkpoint_dir, out_dir, quantize, precision, seed, accelerator, devices, num_nodes, strategy,
                     tensor_parallel, nf4_shards, resume, lora, train, data, ignore_modules, compile, overwrite, logger,
                     export)


def start_run(checkpoint_dir: Path, out_dir: Path, quantize: str, precision: str, seed: int, accelerator: str,
              devices: int, num_nodes: int, strategy: str, tensor_parallel: int, nf4_shards: Optional[int],
              resume: Union[bool, str, Path], lora: LoRAArgs, train: TrainArgs, data: DataArgs,
              ignore_modules: Optional[list[str]], compile: Union[bool, str], overwrite: bool,
              logger: Union[str, list[str]], export: ExportArgs, hooks: Optional[Any] = None) -> dict[str, Any]:
    """`finetune`'s checks, resume and run, for any objective: `hooks` (lit_qlora.train.run.RunHooks) is what a verb
    above train/ trains instead of SFT (`litqlora dpo`)."""

    from lit_qlora.model.config import require_checkpoint_dir
    from lit_qlora.data.formats import require_source
    from lit_qlora.data.files import require_data_file
    from lit_qlora.train.resume import claim_out_dir, finished_summary, recipe, require_same_recipe, resolve_resume
    from lit_qlora.train.run import fit, setup
    from lit_qlora.train.state import read_state

    # Input a user can get wrong, checked before setup() spends seconds importing the training stack.
    if Path(checkpoint_dir) != DEFAULT_CHECKPOINT:
        require_checkpoint_dir(checkpoint_dir)
    data_source(data)  # one dataset option at most
    if data.json_path is not None:
        require_data_file(data.json_path)
    for source in (data.path, data.val_path):
        if source is not None:
            require_source(source)
    loggers = require_loggers(logger)
    if train.init_adapter is not None:
        from lit_qlora.checkpoint.adapter import read_adapter_config

        read_adapter_config(Path(train.init_adapter))  # it exists and is an adapter: a clear error now, not after loading
    lora, data = with_init_adapter(lora, data, train.init_adapter)
    if export.gguf and Path(checkpoint_dir).is_dir():  # (the default checkpoint, not yet converted: after training)
        from lit_qlora.deploy.gguf_export import require_exportable
        from lit_qlora.lora.layer import resolve_targets

        from lit_qlora.model.config import Config

        tied = Config.from_checkpoint(checkpoint_dir).tie_embeddings
        require_exportable(Path(checkpoint_dir), head_adapted="lm_head" in resolve_targets(lora.targets, tied))
    precision, precision_reason = choose_precision(precision, accelerator)
    compile = compile_choice(compile, accelerator, precision)
    train.require_fixed_length()
    train.require_valid_validation(data)
    train.require_valid_offload(uses_cuda(accelerator))
    claim_out_dir(Path(out_dir), resume, overwrite)
    resume_from = resolve_resume(resume, Path(out_dir))
    if resume_from is not None:
        state = read_state(resume_from)
        now = recipe(checkpoint_dir, quantize, precision, seed, lora, train, data, ignore_modules)
        require_same_recipe(state, resume_from, {**now, **(hooks.recorded() if hooks else {})})
        finished = finished_summary(Path(out_dir), state, train.max_steps)
        if finished is not None:
            return finished
        print(f"Resuming from {resume_from}, after optimizer step {state.get('step', 0)}")
    print(f"Precision: {precision} ({precision_reason})")
    return fit(setup(checkpoint_dir=checkpoint_dir, out_dir=out_dir, quantize=quantize, precision=precision, seed=seed,
                     accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
                     tensor_parallel=tensor_parallel, nf4_shards=nf4_shards, resume=resume_from or False, lora=lora,
                     train=train, data=data, ignore_modules=ignore_modules, compile=compile,
                     precision_reason=precision_reason, logger=loggers, export=export, hooks=hooks))


COMPILE_EMULATED = (
    "--compile true with --precision {precision} on a CPU: {why}, so every matmul is emulated, and compiling that "
    "costs far more than it saves (measured on a 2-core AVX2-only CPU: the SmolLM2 QLoRA preset at 4x512 in bf16 spent "
    "7 min 50 s in step 1 and 6 min 35 s in step 2, and step 3 had not finished after 21 minutes). Use --precision "
    "auto ({auto} here: compiled, the preset warms up in well under a minute and then runs faster than eager, "
    "benchmarks/README.md \"Compile on CPU\"), or leave --compile off; --compile force compiles anyway.")


def compile_choice(compile: Union[bool, str], accelerator: str, precision: str) -> bool:
    """Whether to compile: `force` always; `true` unless the run is on a CPU that emulates its precision (a clear
    refusal with the measured why: that combination compiles for many minutes and never pays off)."""
    if compile == "force":
        return True
    if compile and not uses_cuda(accelerator):
        why = cpu_emulates(precision)
        if why is not None:
            raise UserError(COMPILE_EMULATED.format(precision=precision, why=why,
                                                    auto=choose_precision("auto", "cpu")[0]))
    return bool(compile)
