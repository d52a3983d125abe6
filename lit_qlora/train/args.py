"""What `litqlora finetune --lora.* --train.* --data.*` accept, and the step counts that follow from them.

Plain dataclasses, no Lightning: the CLI reads them to build `--help` without importing the training stack."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from lit_qlora.data.templates import PromptStyleName
from lit_qlora.base.errors import InvalidInput, MissingFile, UserError


@dataclass
class LoRAArgs:
    r: int = 8
    """Rank of the adapters."""
    alpha: float = 16.0
    """Scale numerator: updates are multiplied by alpha / r (alpha / sqrt(r) with rslora)."""
    dropout: float = 0.05
    """Dropout on the adapters' input."""
    targets: list[str] = field(default_factory=lambda: ["all"])
    """Projections that get adapters: q, k, v, o, gate, up, down, lm_head, or all (every one, but a head tied to the
    embedding, which stays tied in the exports; name lm_head to adapt it anyway)."""
    rslora: bool = False
    """Rank-stabilized scaling alpha / sqrt(r)."""


@dataclass
class TrainArgs:
    max_steps: Optional[int] = None
    """Optimizer steps to run; default: `epochs` passes over the training split."""
    epochs: int = 1
    """Passes over the training split when max_steps is not set."""
    micro_batch_size: int = 4
    """Samples per forward/backward pass."""
    global_batch_size: int = 16
    """Samples per optimizer step; accumulates global / (micro * devices) micro-batches."""
    max_seq_length: Union[int, Literal["auto"]] = 512
    """Samples are truncated to this many tokens. `litqlora estimate --device_memory SIZE` also takes auto: the
    longest that fits."""
    lr: float = 2e-4
    """Peak learning rate (AdamW), reached after warmup, then cosine decay."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    weight_decay: float = 0.0
    """AdamW weight decay on the adapters."""
    max_norm: float = 1.0
    """Gradient clipping (global norm); 0 disables it."""
    save_interval: Optional[int] = None
    """Write a resumable checkpoint every N optimizer steps (and always at the end)."""
    log_interval: int = 1
    """Write metrics every N optimizer steps."""
    activation_checkpointing: Union[bool, int] = False
    """Recompute block activations in backward: true (all blocks), false, or N (the first N blocks)."""
    offload_activations: Union[bool, Literal["auto"]] = "auto"
    """With activation checkpointing on CUDA: keep the checkpointed blocks' inputs (B x T x n_embd each, the memory
    that grows with the sequence) in pinned host memory instead of on the GPU, copied out on a side stream in forward
    and back ahead of each block's backward, overlapped with compute; results are unchanged. auto: on when they take
    at least 1 GiB per micro-batch (e.g. Llama-3.1-8B from 4096 tokens) and under half the host's available memory;
    off on CPU (there is nothing to offload to: true is refused) and without checkpointing. The run and
    `litqlora estimate` report the host memory it needs."""
    keep_last: int = 2
    """Resumable checkpoints to keep (older ones are deleted)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss stops the run (naming the step), or skips that batch's update."""
    eval_interval: Optional[int] = None
    """Validate every N optimizer steps (besides before the first step and after the last), writing val_loss to
    metrics.jsonl and TensorBoard and the best adapter so far to out_dir/best/."""
    eval_prompt: Optional[str] = None
    """With eval_interval: the prompt whose reply (greedy, up to 48 tokens) is generated at every validation and
    logged (the console, out_dir/samples.jsonl, TensorBoard's TEXT tab). Default: the first validation row's prompt
    (a held-out row; for plain text, its first 32 tokens). Given here, it goes through the chat template. Not
    with tensor parallelism (decoding there has no KV cache for the local heads)."""
    early_stopping_patience: Optional[int] = None
    """With eval_interval: stop after K validations in a row without a lower validation loss; final/ is then the
    best adapter."""
    init_adapter: Optional[Path] = None
    """Start from a finished run's adapter (its out_dir or final/; e.g. SFT before `litqlora dpo`) instead of a new
    one: its rank, alpha, targets and prompt style are taken with it."""

    def checkpointed_blocks(self, n_layer: int) -> int:
        """How many blocks (the first ones) recompute their activations in backward, of `n_layer`."""
        n = self.activation_checkpointing
        return n_layer if n is True else min(int(n or 0), n_layer)

    def adamw(self) -> dict[str, Any]:
        """torch.optim.AdamW's settings for the adapters (the run's and the estimate's optimizer)."""
        return {"lr": self.lr, "weight_decay": self.weight_decay, "betas": (0.9, 0.95)}

    def accumulation(self, world_size: int) -> int:
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise InvalidInput(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of train.micro_batch_size "
                f"x devices ({self.micro_batch_size} x {world_size} = {per_step})."
            )
        return self.global_batch_size // per_step

    def require_valid_offload(self, cuda: bool) -> None:
        """offload_activations can apply to a run on CUDA or not (`cuda`) with this checkpointing: a UserError
        saying why not."""
        require_offload_applies(self.offload_activations, cuda, bool(self.activation_checkpointing))

    def require_fixed_length(self) -> None:
        """max_seq_length is a number of tokens (auto is the estimate's question, not a training setting)."""
        if self.max_seq_length == "auto" or not isinstance(self.max_seq_length, int):
            raise UserError(f"--train.max_seq_length {self.max_seq_length!r}: a fine-tune needs a number of tokens. "
                            "`litqlora estimate --train.max_seq_length auto --device_memory 24GiB` (with the same "
                            "recipe) finds the longest that fits a card; pass that number here.")

    def require_valid_validation(self, data: DataArgs) -> None:
        """eval_interval and early_stopping_patience make sense (and `data` holds a validation set for them): a
        UserError naming the option and the fix if not."""
        if self.eval_interval is not None and self.eval_interval < 1:
            raise UserError(f"--train.eval_interval must be at least 1 (validate every N optimizer steps), got "
                            f"{self.eval_interval}; leave it out to validate only before and after training.")
        patience = self.early_stopping_patience
        if patience is not None and patience < 1:
            raise UserError(f"--train.early_stopping_patience must be at least 1 (validations without improvement "
                            f"before stopping), got {patience}; leave it out to train every step.")
        if self.eval_prompt is not None and (self.eval_interval is None or not self.eval_prompt.strip()):
            raise UserError("--train.eval_prompt is the prompt answered at each validation that --train.eval_interval "
                            "runs: pass --train.eval_interval N too, and a non-empty prompt (or leave it out: the "
                            "first validation row's prompt is used).")
        if patience is not None and self.eval_interval is None:
            raise UserError("--train.early_stopping_patience counts the validations that --train.eval_interval runs, "
                            "and none was given: pass --train.eval_interval N too (e.g. 50), or leave out the "
                            "patience.")
        if self.eval_interval is not None and data.val_split == 0 and getattr(data, "val_path", None) is None:
            raise UserError("--train.eval_interval needs validation data, but --data.val_split is 0 (nothing held "
                            "out): pass --data.val_split 0.05 (or any fraction > 0), or leave out eval_interval.")


def require_offload_applies(choice: Any, cuda: bool, checkpointing: bool) -> None:
    """--train.offload_activations `choice` (true, false or auto) can apply to a run on CUDA or not with activation
    checkpointing on or off: the one check of it (the run, the estimate and lit_qlora.train.offload all ask it), a
    UserError saying why not."""
    if choice not in (True, False, "auto"):
        raise UserError(f"--train.offload_activations takes true, false or auto, got {choice!r}.")
    if choice is not True:
        return
    if not cuda:
        raise UserError("--train.offload_activations true moves the checkpointed blocks' inputs from GPU memory to "
                        "the host's, and this run is on the CPU: its activations are in host memory already, so there "
                        "is nothing to offload to. Leave it out (auto is off on CPU) or pass false; on a CPU, "
                        "--train.activation_checkpointing true alone lowers activation memory.")
    if not checkpointing:
        raise UserError("--train.offload_activations true offloads the inputs that activation checkpointing keeps for "
                        "each block, and checkpointing is off: without it every block keeps all its activations on "
                        "the GPU and none are offloaded. Pass --train.activation_checkpointing true too (or N for the "
                        "first N blocks), or leave offload_activations out.")


def total_steps_for(train: TrainArgs, num_samples: int) -> int:
    if train.max_steps is not None:
        if train.max_steps < 1:
            raise InvalidInput(f"train.max_steps must be at least 1, got {train.max_steps}.")
        return train.max_steps
    return train.epochs * max(1, num_samples // train.global_batch_size)


@dataclass
class ExportArgs:
    gguf: Optional[Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]] = None
    """Also write final/model-<type>.gguf (the adapter merged, for llama.cpp, Ollama and LM Studio) and
    final/Modelfile, as `litqlora export_gguf --dtype <type>` would; the base's family and tokenizer are checked
    before training starts."""
    merged: bool = True
    """Write final/merged/, the base with the adapter merged (bf16 Hugging Face directory: 16 GB for an 8B model).
    false skips it: `litqlora merge` builds it later from final/'s adapter."""
    peft: bool = True
    """Write final/peft/, the adapter in PEFT's format (`litqlora export_peft` builds it later)."""


@dataclass
class DataArgs:
    path: Optional[str] = None
    """The dataset: a local file (.json, .jsonl, .csv, .parquet, .arrow), a folder (of such files, or one written by
    `datasets`' save_to_disk), or a Hugging Face Hub dataset name. Default: the demo set shipped with lit-qlora."""
    subset: Optional[str] = None
    """The Hub dataset's configuration (subset), e.g. `main`."""
    split: str = "train"
    """The split to train on (Hub datasets and saved dataset dicts; a single file is its own `train` split)."""
    val_path: Optional[str] = None
    """A validation set of its own (same kinds as --data.path), instead of holding rows out with val_split."""
    format: Literal["auto", "alpaca", "messages", "sharegpt", "prompt_completion", "text"] = "auto"
    """Row format: alpaca (instruction, optional input, output), messages (role/content turns), sharegpt
    (conversations of from/value), prompt_completion (prompt, completion), text (continued pre-training: every
    token trains); auto detects it from the columns and says which."""
    columns: Optional[dict[str, str]] = None
    """Rename columns before reading rows, e.g. {question: instruction, answer: output}."""
    json_path: Optional[Path] = None
    """Kept for older recipes: the same as --data.path with a JSON / JSONL file."""
    hf_dataset: Optional[str] = None
    """Kept for older recipes: the same as --data.path with a Hub dataset name."""
    prompt_style: PromptStyleName = "auto"
    """How rows become text: auto (the checkpoint's chat template where it has one, as generate, chat, serve and
    the exports will format prompts; else alpaca), alpaca, chatml, llama3, or chat_template. The style trained with
    is recorded beside the adapter, and inference and exports follow it."""
    val_split: Union[float, str] = 0.1
    """Fraction of rows held out for validation (at least one row when > 0; 0 disables validation), or the name of
    the dataset's validation split (e.g. `validation`, `test`)."""
    packing: bool = False
    """Pack several training samples into each max_seq_length sequence (fewer padding tokens). Packed samples stay
    isolated: each attends only within itself, with its own positions from 0, so its loss is what it is alone."""
    num_workers: int = 0
    """DataLoader worker processes (0: load in the training process)."""


def data_source(data: DataArgs) -> Optional[str]:
    """The one dataset option that is set (--data.path, or the older --data.json_path / --data.hf_dataset); None:
    the shipped demo set. Two given is an error."""
    given = {name: value for name, value in (("path", data.path), ("json_path", data.json_path),
                                               ("hf_dataset", data.hf_dataset)) if value is not None}
    if len(given) > 1:
        raise InvalidInput(f"--data.{' and --data.'.join(given)} each name a dataset: pass one of them (--data.path "
                         "takes files, folders and Hub names alike).")
    return str(next(iter(given.values()))) if given else None


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings by their option names: {"lora": {"r": 8}} -> {"lora.r": 8}, as `--lora.r 8` sets it."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def with_init_adapter(lora: LoRAArgs, data: DataArgs, init_adapter: Optional[Path]) -> tuple[LoRAArgs, DataArgs]:
    """--train.init_adapter: the adapter's shape (r, alpha, targets, rslora) replaces --lora.*'s (a run goes on from
    it; --lora.dropout stays the user's), and --data.prompt_style auto becomes the style it trained in."""
    if init_adapter is None:
        return lora, data
    from dataclasses import replace

    from lit_qlora.checkpoint.adapter import read_adapter_config

    try:
        config = read_adapter_config(Path(init_adapter), flag="--train.init_adapter")
    except MissingFile as e:
        raise MissingFile(f"{e} {starting_adapter_hint(Path(init_adapter))}") from None
    lora = replace(lora, r=config["r"], alpha=config["alpha"], targets=list(config["targets"]),
                   rslora=bool(config.get("rslora", False)))
    if data.prompt_style == "auto" and config.get("prompt_style"):
        data = replace(data, prompt_style=config["prompt_style"])
        # Not a field (no flag): where the style came from, for the run's "Prompt style:" line.
        data.prompt_style_source = f"the starting adapter, --train.init_adapter {init_adapter}"
    return lora, data


def starting_adapter_hint(init_adapter: Path) -> str:
    """What writes a missing --train.init_adapter: the preset under ./config_hub whose out_dir it is, else the
    fine-tune with that --out_dir (a GRPO preset run before its SFT preset met a bare "must be" before)."""
    import yaml

    run_dir = init_adapter.parent if init_adapter.name == "final" else init_adapter
    for preset in sorted(Path("config_hub").glob("**/*.yaml")):
        try:
            recipe = yaml.safe_load(preset.read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(recipe, dict) and recipe.get("out_dir") and Path(recipe["out_dir"]) == run_dir:
            verb = "grpo" if "grpo" in recipe else "dpo" if "dpo" in recipe else "finetune"
            return (f"This run starts from the adapter that `litqlora {verb} --config {preset}` writes there: run "
                    "that first, then this command again.")
    return (f"This run starts from that adapter: run the fine-tune whose --out_dir is {run_dir} first, or point "
            "--train.init_adapter at a finished run's out_dir.")
