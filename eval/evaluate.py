"""`litqlora evaluate`: a checkpoint, or a base + LoRA adapter, on lm-eval tasks through `LitQLoRALM`."""

from __future__ import annotations

import difflib
import json
import math
import os
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from lit_qlora.checkpoint.download import DownloadError
from lit_qlora.base.errors import InvalidInput, MissingFile
from lit_qlora.eval.truthfulqa import LOCAL_TASKS, check_truthfulqa_file, prepare_local_tasks
from lit_qlora.base.hardware import PrecisionChoice, resolved


# lm-eval (our LM adapter subclasses its LM; its evaluator, task index and utils take over a second), torch and
# the model stack are imported where used, so `litqlora --help` and the other commands, which import this module
# for the command table, do not pay for them.


def split_tasks(tasks: str | Sequence[str]) -> list[str]:
    names = tasks.split(",") if isinstance(tasks, str) else [t for item in tasks for t in str(item).split(",")]
    names = [t.strip() for t in names if t.strip()]
    if not names:
        raise InvalidInput("--tasks is empty: give one or more lm-eval task names, comma-separated.")
    return names


def check_task_names(names: Sequence[str], available: Sequence[str]) -> None:
    """Raise InvalidInput for names lm-eval does not know, with close matches (YAML paths and globs pass)."""
    known = set(available)
    unknown = [n for n in names if n not in known and "*" not in n and not os.path.exists(n)]
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, available, n=5, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else " (no close match)"))
    raise InvalidInput(f"Unknown lm-eval task(s): {'; '.join(parts)}. `lm-eval ls tasks` lists the "
                       f"{len(available)} known names.")


def task_manager(names: Sequence[str], include_path: Optional[Path]):
    """lm-eval's TaskManager. When every task is one of ours, lm-eval's own index of ~15k tasks is skipped
    (it takes seconds to build); otherwise ours override lm-eval's tasks of the same name."""
    from lm_eval.tasks import TaskManager  # slow import, see the top of the module

    only_local = include_path is not None and all(n in LOCAL_TASKS for n in names)
    manager = TaskManager(include_path=str(include_path) if include_path else None, include_defaults=not only_local)
    check_task_names(names, manager.all_tasks)
    return manager


# -- output --------------------------------------------------------------------------------------------------------
def to_jsonable(obj: Any) -> Any:
    """lm-eval's results as strict JSON: numpy scalars to numbers, NaN/inf to null, anything else to str."""
    from lm_eval.utils import handle_non_serializable  # slow import, see the top of the module

    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "tolist"):  # numpy arrays and scalars, tensors
        return to_jsonable(obj.tolist())
    return to_jsonable(handle_non_serializable(obj))  # sets to lists, anything else to its str()


def package_version(name: str) -> Optional[str]:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def evaluate(
    checkpoint_dir: Path,
    tasks: str,
    adapter_dir: Optional[Path] = None,
    quantize: Optional[Literal["nf4", "none"]] = None,
    precision: PrecisionChoice = "auto",
    data_file: Optional[Path] = None,
    limit: Optional[float] = None,
    batch_size: int = 8,
    num_fewshot: Optional[int] = None,
    out_dir: Path = Path("out/evaluate"),
    device: Optional[str] = None,
) -> dict:
    """Evaluate a checkpoint, or a base + LoRA adapter, on lm-eval tasks; writes OUT_DIR/results.json.

    Prints lm-eval's table. results.json is the dictionary `lm_eval.simple_evaluate` returns (results,
    configs, versions, n-shot, ...) plus a "lit_qlora" key with the model and run info (wall seconds, peak
    memory); OUT_DIR/samples_TASK.jsonl holds each example's inputs, log-likelihoods and scores.

    Args:
        checkpoint_dir: Hugging Face model directory: a merged fine-tune, or the base of --adapter_dir.
        tasks: lm-eval task names, comma-separated (e.g. truthfulqa_mc2,hellaswag); any name lm-eval knows.
        adapter_dir: A fine-tune's out_dir (or its final/ directory): evaluate its LoRA adapter on top of the base, unmerged.
        quantize: nf4 = NF4-quantize every base linear as it loads (with an adapter: the exact model QLoRA
            trained); none = plain precision weights. With --adapter_dir it defaults to what the adapter was
            trained with (adapter_config.json "quantize"), else none.
        precision: Weights and compute dtype: auto (bf16 where the device computes it natively, else fp32 on a CPU
            and fp16 on a GPU), bf16-true, 16-mixed (fp16 for inference), 16-true (fp16) or 32-true (fp32).
        data_file: Local TruthfulQA multiple-choice rows (JSON, JSON Lines or Parquet with question,
            mc1_targets, mc2_targets) for truthfulqa_mc1 / truthfulqa_mc2, so they run offline. The bundled
            sample: eval/data/truthfulqa_mc_sample.jsonl.
        limit: Evaluate only the first N examples of each task (below 1: that fraction); for quick checks.
        batch_size: Sequences per forward pass.
        num_fewshot: Few-shot examples per prompt, for tasks that do not fix it (TruthfulQA fixes 0).
        out_dir: Where results.json and the samples go.
        device: cpu, cuda, cuda:1, ...; default cuda when available, else cpu.
    """
    import torch
    from lm_eval import simple_evaluate  # slow imports, see the top of the module
    from lm_eval.utils import make_table

    from lit_qlora.checkpoint.files import atomic_write_text
    from lit_qlora.checkpoint.loading import load_model, resolve_quantize
    from lit_qlora.checkpoint.adapter import read_adapter_config
    from lit_qlora.memory.accounting import module_bytes, peak_rss_bytes
    from lit_qlora.checkpoint.tokenizer import Tokenizer
    from lit_qlora.checkpoint.hf import require_checkpoint
    from lit_qlora.base.threads import govern_threads

    started = time.perf_counter()
    names = split_tasks(tasks)
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "config.json").is_file():
        raise MissingFile(f"--checkpoint_dir {checkpoint_dir} has no config.json: it must be a Hugging Face "
                          "model directory (see `litqlora download` / `litqlora convert_gguf`).")
    require_checkpoint(checkpoint_dir)  # its config's fields, weights and tokenizer, before lm-eval starts
    if data_file is not None:
        check_truthfulqa_file(Path(data_file))
    if limit is not None and limit <= 0:
        raise InvalidInput(f"--limit must be positive, got {limit}")
    if limit is not None and limit >= 1:
        limit = int(limit)
    run_device = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")

    with tempfile.TemporaryDirectory(prefix="litqlora-tasks-") as tmp:
        include = prepare_local_tasks(Path(data_file), Path(tmp)) if data_file is not None else None
        manager = task_manager(names, include)  # unknown names fail here, with close matches
        if data_file is not None and not any(n in LOCAL_TASKS for n in names):
            raise InvalidInput(f"--data_file feeds the tasks {', '.join(LOCAL_TASKS)}; --tasks {','.join(names)} "
                               "uses none of them.")

        tokenizer = Tokenizer(checkpoint_dir)
        acfg = read_adapter_config(adapter_dir) if adapter_dir is not None else None
        if acfg and acfg.get("prompt_style"):
            print(f"Prompt format: lm-eval's tasks format their own prompts (truthfulqa_mc2: its 6-example QA "
                  f"preamble, 0-shot), not the {acfg['prompt_style']} style the adapter trained in; every harness "
                  "user's scores are on that same text.")
        quantize = resolve_quantize(quantize, acfg)
        precision = resolved(precision, run_device.type)  # results.json records what ran
        model = load_model(checkpoint_dir, quantize, precision, adapter_dir, device=run_device)
        govern_threads(model)  # an evaluation shares the CPU with other processes (lit_qlora.base.threads)
        loaded = time.perf_counter()
        if run_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run_device)
        from lit_qlora.eval.lm import LitQLoRALM  # lm-eval: see the top of the module

        lm = LitQLoRALM(model, tokenizer, batch_size=batch_size)
        try:
            results = simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, batch_size=batch_size,
                                      limit=limit, task_manager=manager, log_samples=True)
        except ConnectionError as e:
            hint = (f" {', '.join(LOCAL_TASKS)} can run offline from a local file: --data_file FILE."
                    if any(n.startswith("truthfulqa") for n in names) else "")
            raise DownloadError(f"lm-eval could not download a task's dataset ({e}).{hint}") from e
    finished = time.perf_counter()

    memory = {"peak_rss_bytes": peak_rss_bytes()}
    if run_device.type == "cuda":
        memory["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(run_device)
        memory["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(run_device)
    samples = results.pop("samples", {})
    results["lit_qlora"] = {
        "checkpoint_dir": str(checkpoint_dir.resolve()),
        "adapter_dir": str(Path(adapter_dir).resolve()) if adapter_dir is not None else None,
        "quantize": quantize.value,
        "precision": precision,
        "device": str(run_device),
        "tasks": names,
        "data_file": str(Path(data_file).resolve()) if data_file is not None else None,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "batch_size": batch_size,
        "max_length": lm.max_length,
        "model_bytes": module_bytes(model),
        "adapter_config": acfg,
        "prompt_format": "the tasks' own (lm-eval formats each task's prompts)",
        "wall_seconds": round(finished - started, 3),
        "load_seconds": round(loaded - started, 3),
        "eval_seconds": round(finished - loaded, 3),
        "peak_memory_bytes": max(memory.values()),
        "memory": memory,
        "versions": {"lit_qlora": package_version("lit-qlora"), "lm_eval": package_version("lm_eval"),
                     "torch": torch.__version__},
    }
    results = to_jsonable(results)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    atomic_write_text(out_dir / "results.json", json.dumps(results, indent=2) + "\n")
    for task, rows in samples.items():
        lines = (json.dumps(to_jsonable(row)) + "\n" for row in rows)
        atomic_write_text(out_dir / f"samples_{task}.jsonl", "".join(lines))
    print(f"Wrote {out_dir / 'results.json'} ({results['lit_qlora']['wall_seconds']:.1f} s)")
    return results
