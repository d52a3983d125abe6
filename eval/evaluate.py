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
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lit_qlora.checkpoint.download import DownloadError
from lit_qlora.base.errors import InvalidInput
from lit_qlora.deploy.choice import ModelChoice
from lit_qlora.eval.truthfulqa import LOCAL_TASKS, check_truthfulqa_file, prepare_local_tasks


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


@dataclass(kw_only=True)
class EvaluateSpec(ModelChoice):
    """`litqlora evaluate`'s options: the model (ModelChoice: a merged fine-tune, or a base and --adapter_dir) and the
    lm-eval run."""

    tasks: str
    """lm-eval task names, comma-separated (e.g. truthfulqa_mc2,hellaswag); any name lm-eval knows."""
    data_file: Optional[Path] = None
    """Local TruthfulQA multiple-choice rows (JSON, JSON Lines or Parquet with question, mc1_targets, mc2_targets) for
    truthfulqa_mc1 / truthfulqa_mc2, so they run offline. The bundled sample: eval/data/truthfulqa_mc_sample.jsonl."""
    limit: Optional[float] = None
    """Evaluate only the first N examples of each task (below 1: that fraction); for quick checks."""
    batch_size: int = 8
    """Sequences per forward pass."""
    num_fewshot: Optional[int] = None
    """Few-shot examples per prompt, for tasks that do not fix it (TruthfulQA fixes 0)."""
    out_dir: Path = Path("out/evaluate")
    """Where results.json and the samples go."""


def evaluate(spec: Optional[EvaluateSpec] = None, **settings: Any) -> dict:
    """Evaluate a checkpoint, or a base + LoRA adapter, on lm-eval tasks; writes OUT_DIR/results.json.

    Prints lm-eval's table. results.json is the dictionary `lm_eval.simple_evaluate` returns (results,
    configs, versions, n-shot, ...) plus a "lit_qlora" key with the model and run info (wall seconds, peak
    memory); OUT_DIR/samples_TASK.jsonl holds each example's inputs, log-likelihoods and scores. Takes an
    EvaluateSpec, or its fields as keywords (`evaluate(tasks="truthfulqa_mc2", adapter_dir=...)`).
    """
    import torch
    from lm_eval import simple_evaluate  # slow imports, see the top of the module
    from lm_eval.utils import make_table

    from lit_qlora.checkpoint.files import atomic_write_text
    from lit_qlora.memory.accounting import module_bytes, peak_rss_bytes
    from lit_qlora.checkpoint.tokenizer import Tokenizer
    from lit_qlora.base.threads import govern_threads

    spec = EvaluateSpec.of(spec, settings)
    started = time.perf_counter()
    names = split_tasks(spec.tasks)
    spec.check()  # its config's fields, weights and tokenizer, and the adapter's config, before lm-eval starts
    checkpoint_dir = spec.checkpoint_dir
    data_file, limit, adapter_dir = spec.data_file, spec.limit, spec.adapter_dir
    if data_file is not None:
        check_truthfulqa_file(Path(data_file))
    if limit is not None and limit <= 0:
        raise InvalidInput(f"--limit must be positive, got {limit}")
    if limit is not None and limit >= 1:
        limit = int(limit)
    run_device = spec.run_device

    with tempfile.TemporaryDirectory(prefix="litqlora-tasks-") as tmp:
        include = prepare_local_tasks(Path(data_file), Path(tmp)) if data_file is not None else None
        manager = task_manager(names, include)  # unknown names fail here, with close matches
        if data_file is not None and not any(n in LOCAL_TASKS for n in names):
            raise InvalidInput(f"--data_file feeds the tasks {', '.join(LOCAL_TASKS)}; --tasks {','.join(names)} "
                               "uses none of them.")

        tokenizer = Tokenizer(checkpoint_dir)
        acfg = spec.adapter_config
        if acfg and acfg.get("prompt_style"):
            print(f"Prompt format: lm-eval's tasks format their own prompts (truthfulqa_mc2: its 6-example QA "
                  f"preamble, 0-shot), not the {acfg['prompt_style']} style the adapter trained in; every harness "
                  "user's scores are on that same text.")
        model = spec.load()
        govern_threads(model)  # an evaluation shares the CPU with other processes (lit_qlora.base.threads)
        loaded = time.perf_counter()
        if run_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run_device)
        from lit_qlora.eval.lm import LitQLoRALM  # lm-eval: see the top of the module

        lm = LitQLoRALM(model, tokenizer, batch_size=spec.batch_size)
        try:
            results = simple_evaluate(model=lm, tasks=names, num_fewshot=spec.num_fewshot, batch_size=spec.batch_size,
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
        "quantize": spec.run_quantize,
        "precision": spec.run_precision,
        "device": str(run_device),
        "tasks": names,
        "data_file": str(Path(data_file).resolve()) if data_file is not None else None,
        "limit": limit,
        "num_fewshot": spec.num_fewshot,
        "batch_size": spec.batch_size,
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

    out_dir = Path(spec.out_dir)
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
