"""TruthfulQA multiple-choice from a local file: check the file, and fill it into the offline task templates.

lm-eval's `truthfulqa_mc1` / `truthfulqa_mc2` download their dataset from the Hub; `litqlora evaluate
--data_file FILE` runs them from FILE instead, under the same task names, through the templates in tasks/.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from lit_qlora.base.errors import InvalidInput, MissingFile
from lit_qlora.eval import TASKS_DIR

LOCAL_TASKS = ("truthfulqa_mc1", "truthfulqa_mc2")
"""Tasks that `--data_file` points at a local file."""
DATA_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _row_error(path: Path, where: str, problem: str) -> InvalidInput:
    return InvalidInput(
        f"{path}: {where}: {problem}. --data_file must hold TruthfulQA multiple-choice rows (JSON list, JSON "
        "Lines or Parquet), each with \"question\" (a string) and \"mc1_targets\" and \"mc2_targets\", each "
        "{\"choices\": [strings], \"labels\": [0 or 1 per choice]}; mc1 has exactly one correct answer, listed "
        "first (lm-eval's truthfulqa_mc1 scores choice 0), mc2 at least one."
    )


def _read_rows(path: Path) -> list[tuple[str, Any]]:
    """(where, row) pairs of a JSON, JSON Lines or Parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # only for Parquet files; pyarrow takes a while to import

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise InvalidInput(f"{path} is not a readable Parquet file ({e}).") from None
        return [(f"row {i + 1}", row) for i, row in enumerate(rows)]
    text = path.read_text(encoding="utf-8")
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidInput(f"{path} is not valid JSON ({e}).") from None
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
    """Validate a TruthfulQA multiple-choice file; returns its row count, or raises InvalidInput naming the file
    and the first bad row."""
    path = Path(data_file)
    if not path.is_file():
        raise MissingFile(f"--data_file {path} does not exist.")
    if path.suffix.lower() not in DATA_FORMATS:
        raise InvalidInput(f"--data_file {path}: unknown format {path.suffix!r}; use .json, .jsonl or .parquet.")
    rows = _read_rows(path)
    if not rows:
        raise InvalidInput(f"--data_file {path} holds no rows.")
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
