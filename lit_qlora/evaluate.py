"""lm-eval on our model: `LitQLoRALM` (an `lm_eval.api.model.LM`) and the `litqlora evaluate` command.

Tokenization follows lm-eval's convention for causal models (the one its Hugging Face backend uses), so numbers
are comparable with `lm_eval --model hf` on the same checkpoint:

- loglikelihood(context, continuation): trailing whitespace of the context moves to the continuation; then
  context+continuation is encoded as one string and split after len(encode(context)) tokens. The word-boundary
  space therefore lands in the continuation's first token, as it would in running text (encoding the two
  parts separately would give the continuation a leading-space token the model never sees in practice).
  An empty context is replaced by one prefix token: BOS, or EOS when the tokenizer has none.
- BOS: contexts are encoded with the checkpoint's own rule (`Tokenizer.add_bos`, from tokenizer_config.json /
  tokenizer.json: Llama 2/3, Mistral and TinyLlama prepend BOS; SmolLM2 and Qwen2 do not), which is what a
  Hugging Face tokenizer does with its default add_special_tokens=True. A BOS is never doubled.
- loglikelihood_rolling(text): the text is encoded without BOS and scored conditioned on the prefix token, in
  windows of at most `max_length` inputs: every token is predicted exactly once, and the last window still
  gets a full context (lm-eval's `get_rolling_token_windows(..., context_len=1)` + `make_disjoint_window`).
- generate_until(context, gen_kwargs): the context is encoded like a loglikelihood context, left-truncated to
  leave room for `max_gen_toks`; decoding is greedy (temperature sampling only with do_sample=True) with the
  KV cache, and stops at EOS / end-of-turn tokens or at the first `until` string, which is cut off.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Sequence

import torch
from lm_eval.api.model import LM
from tqdm import tqdm

from lit_qlora.eval import SAMPLE_DATA_FILE, TASKS_DIR  # noqa: F401 (SAMPLE_DATA_FILE: re-exported)
from lit_qlora.loading import load_model, resolve_quantize
from lit_qlora.lora import read_adapter_config
from lit_qlora.model import Transformer
from lit_qlora.tokenizer import Tokenizer

LOCAL_TASKS = ("truthfulqa_mc1", "truthfulqa_mc2")
"""Tasks that `--data_file` points at a local file."""
DATA_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
HEAD_CHUNK = 1024
"""Output-head rows computed at once: bounds the float32 logits of long continuations (rolling windows)."""


Pair = tuple[list[int], list[int]]


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_length: int) -> list[Pair]:
    """(context, continuation) token pairs that score every token of `tokens` exactly once, conditioned on
    `prefix_token` and as much preceding text as fits: continuation i is tokens[i*L:(i+1)*L], and its context is
    the L - len(continuation) + 1 tokens before it (the prefix token standing in front of the text)."""
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    full = [prefix_token, *tokens]  # full[j + 1] is tokens[j]
    windows = []
    for start in range(0, len(tokens), max_length):
        end = min(start + max_length, len(tokens))
        windows.append((full[max(0, end - max_length):start + 1], list(tokens[start:end])))
    return windows


def first_stop(text: str, stops: Iterable[str]) -> Optional[int]:
    """Index of the earliest stop string in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


class LitQLoRALM(LM):
    """An lm-eval model over a lit-qlora `Transformer` (plain, NF4, or NF4/plain base + LoRA adapter).

    Args:
        model: The model, already on its device and in eval mode.
        tokenizer: The checkpoint's tokenizer.
        batch_size: Sequences per forward pass in loglikelihood requests.
        max_length: Longest input in tokens (default: the model's context length); longer inputs are
            left-truncated.
        max_gen_toks: Default generation budget of generate_until when a task does not set one.
        share_context: Run a context shared by several requests (multiple-choice options) once.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, batch_size: int = 8,
                 max_length: Optional[int] = None, max_gen_toks: int = 256, share_context: bool = True) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"--batch_size must be at least 1, got {batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length or model.config.max_seq_length
        self.max_gen_toks = max_gen_toks
        self.share_context = share_context
        self._device = next(model.parameters()).device
        prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        if prefix is None:
            raise ValueError(f"The tokenizer in {tokenizer.checkpoint_dir} has neither a BOS nor an EOS token; "
                             "lm-eval needs one to condition texts that have no context.")
        self.prefix_token_id: int = prefix
        self.pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0

    # -- tokenization ------------------------------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> Pair:
        """(context tokens, continuation tokens) per lm-eval's convention (see the module docstring)."""
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        if not stripped:
            tokens = self.tokenizer.encode(continuation, bos=False)
            if tokens[:1] == [self.prefix_token_id]:
                return tokens[:1], tokens[1:]
            return [self.prefix_token_id], tokens
        whole = self.tokenizer.encode(stripped + continuation)
        context_ids = self.tokenizer.encode(stripped)
        return context_ids, whole[len(context_ids):]

    # -- scoring -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def loglikelihood_tokens(self, pairs: Sequence[Pair], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """(sum of log p(continuation token), is every continuation token the argmax) per (context, continuation)
        pair, in the order given.

        Requests run in batches of `batch_size`, longest first (a batch that does not fit in memory fails at
        once), right-padded: under causal attention padding after a sequence cannot change its logits. Requests
        that share their context (the choices of a multiple-choice question) run it once: the context goes
        through the model once into the KV cache, then all continuations run as one batch on top of it, and the
        next group reuses whatever prefix it shares with the previous one (a few-shot preamble). Same numbers
        as running every sequence whole, up to float rounding; `share_context=False` turns it off.
        """
        results: list[Optional[tuple[float, bool]]] = [None] * len(pairs)
        plain: list[tuple[int, list[int], list[int]]] = []
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (context, continuation) in enumerate(pairs):
            if not continuation:
                results[i] = (0.0, True)
                continue
            if not context:
                raise ValueError("a loglikelihood request needs at least one context token")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens does not fit in max_length "
                                 f"{self.max_length}")
            tokens = (list(context) + list(continuation))[-(self.max_length + 1):]
            if self.share_context and len(context) + len(continuation) <= self.max_length + 1:
                groups.setdefault(tuple(context), []).append(i)
            else:
                plain.append((i, tokens[:-1], list(continuation)))
        shared = []
        for context, members in groups.items():
            if len(members) == 1:
                (i,) = members
                plain.append((i, [*context, *pairs[i][1]][:-1], list(pairs[i][1])))
            else:
                for start in range(0, len(members), self.batch_size):
                    shared.append((list(context), members[start:start + self.batch_size]))
        plain.sort(key=lambda item: -len(item[1]))  # stable: equal lengths keep request order
        shared.sort(key=lambda group: -(len(group[0]) + max(len(pairs[i][1]) for i in group[1])))
        steps = math.ceil(len(plain) / self.batch_size) + len(shared)
        with tqdm(total=steps, disable=disable_tqdm, desc="loglikelihood") as bar:
            for start in range(0, len(plain), self.batch_size):
                batch = plain[start:start + self.batch_size]
                x = self._right_padded([inputs for _, inputs, _ in batch])
                hidden = self.model.forward_hidden(x)
                # Only the positions that predict continuation tokens go through the head.
                selected = [hidden[row, len(inputs) - len(cont):len(inputs)]
                            for row, (_, inputs, cont) in enumerate(batch)]
                self._score(selected, [(i, cont) for i, _, cont in batch], results)
                bar.update()
            if shared:
                self._score_shared(shared, pairs, results, bar)
        return results  # type: ignore[return-value]

    def _right_padded(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        x = torch.full((len(rows), max(len(r) for r in rows)), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            x[i, :len(row)] = torch.tensor(row)
        return x.to(self._device)

    def _score(self, hidden_rows: list[torch.Tensor], items: list[tuple[int, list[int]]],
               results: list) -> None:
        """Head + log-softmax (float32) over the hidden states that predict each item's continuation."""
        selected = torch.cat(hidden_rows)
        targets = torch.tensor([t for _, cont in items for t in cont], device=self._device)
        logprobs, greedy = [], []
        for h, t in zip(selected.split(HEAD_CHUNK), targets.split(HEAD_CHUNK)):  # bounds float32 logits
            logits = self.model.lm_head(h).float()
            logprobs.append(logits.log_softmax(-1).gather(-1, t[:, None]).squeeze(-1))
            greedy.append(logits.argmax(-1) == t)
        logprob, is_greedy = torch.cat(logprobs).double().cpu(), torch.cat(greedy).cpu()
        offset = 0
        for i, cont in items:
            n = len(cont)
            results[i] = (float(logprob[offset:offset + n].sum()), bool(is_greedy[offset:offset + n].all()))
            offset += n

    def _score_shared(self, groups: list[tuple[list[int], list[int]]], pairs: Sequence[Pair], results: list,
                      bar) -> None:
        """Each group: context[:-1] into row 0 of the KV cache (reusing the prefix it shares with the previous
        group's), copied to the other rows, then [context[-1], *continuation[:-1]] for every member at once."""
        model = self.model
        batch = max(len(members) for _, members in groups)
        tails = max(max(len(pairs[i][1]) for i in members) for _, members in groups)
        model.set_kv_cache(batch, max(len(context) for context, _ in groups) + tails, device=self._device)
        caches = [block.self_attn.kv_cache for block in model.blocks]
        cached: list[int] = []  # the tokens whose keys/values row 0 of the cache holds, from position 0
        try:
            for context, members in groups:
                prefix = context[:-1]
                keep = 0
                while keep < min(len(cached), len(prefix)) and cached[keep] == prefix[keep]:
                    keep += 1
                if keep < len(prefix):
                    model.forward_hidden(torch.tensor([prefix[keep:]], device=self._device),
                                         input_pos=torch.arange(keep, len(prefix), device=self._device))
                for cache in caches:
                    cache.k[1:len(members), :, :len(prefix)] = cache.k[:1, :, :len(prefix)]
                    cache.v[1:len(members), :, :len(prefix)] = cache.v[:1, :, :len(prefix)]
                conts = [list(pairs[i][1]) for i in members]
                x = self._right_padded([[context[-1], *cont[:-1]] for cont in conts])
                hidden = model.forward_hidden(x, input_pos=torch.arange(len(prefix), len(prefix) + x.size(1),
                                                                         device=self._device))
                self._score([hidden[row, :len(cont)] for row, cont in enumerate(conts)],
                            list(zip(members, conts)), results)
                cached = prefix  # row 0 beyond the prefix now holds this group's first continuation
                bar.update()
        finally:
            model.clear_kv_cache()

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*req.args) for req in requests]
        results = self.loglikelihood_tokens(pairs, disable_tqdm)
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs: list[Pair] = []
        owners: list[int] = []
        for r, req in enumerate(requests):
            (text,) = req.args
            windows = rolling_windows(self.tokenizer.encode(text, bos=False), self.prefix_token_id, self.max_length)
            pairs += windows
            owners += [r] * len(windows)
        totals = [0.0] * len(requests)
        for r, (logprob, _) in zip(owners, self.loglikelihood_tokens(pairs, disable_tqdm)):
            totals[r] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation --------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lit_qlora.generate import generate

        outputs = []
        for req in tqdm(requests, disable=disable_tqdm, desc="generate_until"):
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if kwargs.pop("do_sample", False) else 0.0
            budget = self.max_length - max_new
            if budget < 1:
                raise ValueError(f"max_gen_toks={max_new} leaves no room for a prompt in max_length {self.max_length}")
            prompt = self.tokenizer.encode(context)[-budget:]
            tokens: list[int] = []
            text = ""
            for token in generate(self.model, prompt, max_new, temperature=temperature,
                                  stop_ids=self.tokenizer.eos_ids):
                tokens.append(token)
                text = self.tokenizer.decode(tokens)
                cut = first_stop(text, until)
                if cut is not None:
                    text = text[:cut]
                    break
            self.cache_hook.add_partial("generate_until", req.args, text)
            outputs.append(text)
        return outputs

    def get_model_info(self) -> dict[str, Any]:
        """Merged into lm-eval's results["config"]."""
        return {"model_name": str(self.tokenizer.checkpoint_dir), "max_length": self.max_length,
                "model_dtype": str(self.model.lm_head.weight.dtype).replace("torch.", "")}


# -- offline TruthfulQA --------------------------------------------------------------------------------------------
def _row_error(path: Path, where: str, problem: str) -> ValueError:
    return ValueError(
        f"{path}: {where}: {problem}. --data_file must hold TruthfulQA multiple-choice rows (JSON list, JSON "
        "Lines or Parquet), each with \"question\" (a string) and \"mc1_targets\" and \"mc2_targets\", each "
        "{\"choices\": [strings], \"labels\": [0 or 1 per choice]}; mc1 has exactly one correct answer, listed "
        "first (lm-eval's truthfulqa_mc1 scores choice 0), mc2 at least one."
    )


def _read_rows(path: Path) -> list[tuple[str, Any]]:
    """(where, row) pairs of a JSON, JSON Lines or Parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise ValueError(f"{path} is not a readable Parquet file ({e}).") from None
        return [(f"row {i + 1}", row) for i, row in enumerate(rows)]
    text = path.read_text(encoding="utf-8")
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}).") from None
        return [(f"row {i + 1}", row) for i, row in enumerate(rows)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise _row_error(path, f"row {len(out) + 1} (line {n})", f"not valid JSON ({e})") from None
        out.append((f"row {len(out) + 1} (line {n})", row))
    return out


def _check_targets(path: Path, where: str, row: dict, key: str) -> None:
    targets = row.get(key)
    if not isinstance(targets, dict) or "choices" not in targets or "labels" not in targets:
        raise _row_error(path, where, f"{key!r} must be an object with \"choices\" and \"labels\" (got "
                                      f"{type(targets).__name__ if key in row else 'no such key'})")
    choices, labels = targets["choices"], targets["labels"]
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise _row_error(path, where, f"{key}.choices must be a non-empty list of strings (got {choices!r:.80})")
    if (not isinstance(labels, list) or len(labels) != len(choices)
            or not all(isinstance(v, int) and v in (0, 1) for v in labels)):
        raise _row_error(path, where, f"{key}.labels must be a list of 0/1 integers, one per choice "
                                      f"({len(choices)} choices; got {labels!r:.80})")
    if key == "mc1_targets" and (labels[0] != 1 or sum(labels) != 1):
        raise _row_error(path, where, f"mc1_targets.labels must be [1, 0, 0, ...] (got {labels!r:.80})")
    if key == "mc2_targets" and 1 not in labels:
        raise _row_error(path, where, "mc2_targets has no true answer (no label 1)")


def check_truthfulqa_file(data_file: Path) -> int:
    """Validate a TruthfulQA multiple-choice file; returns its row count, or raises ValueError naming the file
    and the first bad row."""
    path = Path(data_file)
    if not path.is_file():
        raise FileNotFoundError(f"--data_file {path} does not exist.")
    if path.suffix.lower() not in DATA_FORMATS:
        raise ValueError(f"--data_file {path}: unknown format {path.suffix!r}; use .json, .jsonl or .parquet.")
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"--data_file {path} holds no rows.")
    for where, row in rows:
        if not isinstance(row, dict):
            raise _row_error(path, where, f"a row must be an object (got {type(row).__name__})")
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise _row_error(path, where, f"\"question\" must be a non-empty string (got {question!r:.80})")
        _check_targets(path, where, row, "mc1_targets")
        _check_targets(path, where, row, "mc2_targets")
    return len(rows)


def prepare_local_tasks(data_file: Path, out_dir: Path) -> Path:
    """Copy the offline TruthfulQA task templates into `out_dir` with `data_file` filled in, for
    `TaskManager(include_path=out_dir)`. The task names stay truthfulqa_mc1 / truthfulqa_mc2."""
    data_file = Path(data_file).resolve()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("truthfulqa_mc1.yaml", "truthfulqa_mc2.yaml"):
        text = (TASKS_DIR / name).read_text(encoding="utf-8")
        # A JSON string is a valid YAML double-quoted scalar: any path (spaces, quotes, backslashes) survives.
        text = text.replace("__DATA_FORMAT__", DATA_FORMATS[data_file.suffix.lower()])
        text = text.replace("__DATA_FILE__", json.dumps(str(data_file)))
        (out_dir / name).write_text(text, encoding="utf-8")
    shutil.copyfile(TASKS_DIR / "utils.py", out_dir / "utils.py")
    return out_dir


def split_tasks(tasks: str | Sequence[str]) -> list[str]:
    names = tasks.split(",") if isinstance(tasks, str) else [t for item in tasks for t in str(item).split(",")]
    names = [t.strip() for t in names if t.strip()]
    if not names:
        raise ValueError("--tasks is empty: give one or more lm-eval task names, comma-separated.")
    return names


def check_task_names(names: Sequence[str], available: Sequence[str]) -> None:
    """Raise ValueError for names lm-eval does not know, with close matches (YAML paths and globs pass)."""
    known = set(available)
    unknown = [n for n in names if n not in known and "*" not in n and not os.path.exists(n)]
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, available, n=5, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else " (no close match)"))
    raise ValueError(f"Unknown lm-eval task(s): {'; '.join(parts)}. `lm-eval ls tasks` lists the "
                     f"{len(available)} known names.")


def task_manager(names: Sequence[str], include_path: Optional[Path]):
    """lm-eval's TaskManager. When every task is one of ours, lm-eval's own index of ~15k tasks is skipped
    (it takes seconds to build); otherwise ours override lm-eval's tasks of the same name."""
    from lm_eval.tasks import TaskManager

    only_local = include_path is not None and all(n in LOCAL_TASKS for n in names)
    manager = TaskManager(include_path=str(include_path) if include_path else None, include_defaults=not only_local)
    check_task_names(names, manager.all_tasks)
    return manager


# -- output --------------------------------------------------------------------------------------------------------
def to_jsonable(obj: Any) -> Any:
    """lm-eval's results as strict JSON: numpy scalars to numbers, NaN/inf to null, anything else to str."""
    from lm_eval.utils import handle_non_serializable

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
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def evaluate(
    checkpoint_dir: Path,
    tasks: str,
    adapter_dir: Optional[Path] = None,
    quantize: Optional[Literal["nf4", "none"]] = None,
    precision: Literal["bf16-true", "16-true", "32-true"] = "bf16-true",
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
        adapter_dir: A fine-tune's output directory: evaluate its LoRA adapter on top of the base, unmerged.
        quantize: nf4 = NF4-quantize every base linear as it loads (with an adapter: the exact model QLoRA
            trained); none = plain precision weights. With --adapter_dir it defaults to what the adapter was
            trained with (adapter_config.json "quantize"), else none.
        precision: Weights and compute dtype: bf16-true, 16-true (fp16) or 32-true (fp32).
        data_file: Local TruthfulQA multiple-choice rows (JSON, JSON Lines or Parquet with question,
            mc1_targets, mc2_targets) for truthfulqa_mc1 / truthfulqa_mc2, so they run offline. The bundled
            sample: eval/data/truthfulqa_mc_sample.jsonl.
        limit: Evaluate only the first N examples of each task (below 1: that fraction); for quick checks.
        batch_size: Sequences per forward pass.
        num_fewshot: Few-shot examples per prompt, for tasks that do not fix it (TruthfulQA fixes 0).
        out_dir: Where results.json and the samples go.
        device: cpu, cuda, cuda:1, ...; default cuda when available, else cpu.
    """
    from lm_eval import simple_evaluate
    from lm_eval.utils import make_table

    from lit_qlora.checkpoint import atomic_write_text
    from lit_qlora.memory import module_bytes, peak_rss_bytes

    started = time.perf_counter()
    names = split_tasks(tasks)
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "config.json").is_file():
        raise FileNotFoundError(f"--checkpoint_dir {checkpoint_dir} has no config.json: it must be a Hugging Face "
                                "model directory (see `litqlora download` / `litqlora convert_gguf`).")
    if data_file is not None:
        check_truthfulqa_file(Path(data_file))
    if limit is not None and limit <= 0:
        raise ValueError(f"--limit must be positive, got {limit}")
    if limit is not None and limit >= 1:
        limit = int(limit)
    run_device = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")

    with tempfile.TemporaryDirectory(prefix="litqlora-tasks-") as tmp:
        include = prepare_local_tasks(Path(data_file), Path(tmp)) if data_file is not None else None
        manager = task_manager(names, include)  # unknown names fail here, with close matches
        if data_file is not None and not any(n in LOCAL_TASKS for n in names):
            raise ValueError(f"--data_file feeds the tasks {', '.join(LOCAL_TASKS)}; --tasks {','.join(names)} "
                             "uses none of them.")

        tokenizer = Tokenizer(checkpoint_dir)
        acfg = read_adapter_config(adapter_dir) if adapter_dir is not None else None
        quantize = resolve_quantize(quantize, acfg)
        model = load_model(checkpoint_dir, quantize, precision, adapter_dir, device=run_device)
        loaded = time.perf_counter()
        if run_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run_device)
        lm = LitQLoRALM(model, tokenizer, batch_size=batch_size)
        try:
            results = simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, batch_size=batch_size,
                                      limit=limit, task_manager=manager, log_samples=True)
        except ConnectionError as e:
            hint = (f" {', '.join(LOCAL_TASKS)} can run offline from a local file: --data_file FILE."
                    if any(n.startswith("truthfulqa") for n in names) else "")
            raise RuntimeError(f"lm-eval could not download a task's dataset ({e}).{hint}") from e
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
