"""Where rows come from and what shape they have: one path for every source (`datasets` reads CSV, Parquet, Arrow,
saved datasets and the Hub; our own reader keeps JSON/JSONL's line numbers in errors) and every row format, each
turned into the rows `lit_qlora.data.sft` validates and the prompt styles render:

- alpaca: `{"instruction", "input", "output"}` (the prompt is masked, the reply trains);
- messages / sharegpt: `{"messages": [{"role", "content"}, ...]}` (assistant turns train);
- prompt_completion: `{"prompt", "completion"}` (raw text, no template: the completion trains);
- text: `{"text"}` (continued pre-training: every token trains).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

from lit_qlora.data.errors import DataError
from lit_qlora.data.files import DEMO_DATASET, file_sha256, read_rows

FORMATS = ("alpaca", "messages", "sharegpt", "prompt_completion", "text")
# What `auto` looks for, in order: the first format whose columns a row has.
DETECT = (("messages", ("messages",)), ("sharegpt", ("conversations",)), ("alpaca", ("instruction", "output")),
          ("prompt_completion", ("prompt", "completion")), ("text", ("text",)))
COLUMNS = {"alpaca": ("instruction", "input", "output"), "messages": ("messages",), "sharegpt": ("conversations",),
           "prompt_completion": ("prompt", "completion"), "text": ("text",)}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
BUILDERS = {".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}  # `datasets`' packaged readers
JSON_SUFFIXES = (".json", ".jsonl")


def read_source(source: str, subset: Optional[str] = None, split: str = "train"
                ) -> tuple[list[Any], Optional[list[int]]]:
    """The rows of a file, a folder or a Hub dataset (and, for JSONL, each row's line, for errors)."""
    path = Path(source)
    if path.is_file():
        if path.suffix in JSON_SUFFIXES:
            return read_rows(path)
        if path.suffix not in BUILDERS:
            raise DataError(f"The dataset {path} has the extension {path.suffix or '(none)'!r}; lit-qlora reads "
                            ".json, .jsonl, .csv, .parquet and .arrow files, folders of them, folders written by "
                            "`datasets`' save_to_disk, and Hub dataset names. Convert it to one of those.")
        return _load(source, lambda ds: ds.load_dataset(BUILDERS[path.suffix], data_files=str(path), split="train")), None
    if path.is_dir():
        saved = any((path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json", "state.json"))
        if saved:
            return _load(source, lambda ds: _split_of(ds.load_from_disk(str(path)), split, source)), None
        return _load(source, lambda ds: ds.load_dataset(str(path), subset, split=split)), None
    require_source(source)
    return _load(source, lambda ds: ds.load_dataset(source, subset, split=split), hub=True), None


def require_source(source: str) -> None:
    """A source meant as a local path (it starts with . / ~ or has a dataset file's extension) must exist; anything
    else that is not on disk is taken for a Hub dataset name."""
    path = Path(source).expanduser()
    if not path.exists() and (source.startswith((".", "/", "~")) or path.suffix in (*JSON_SUFFIXES, *BUILDERS)):
        raise DataError(f"The dataset {source} does not exist. Pass --data.path a file (.json, .jsonl, .csv, .parquet, "
                        ".arrow), a folder, or a Hugging Face Hub dataset name (owner/name).")


def _split_of(loaded: Any, split: str, source: str) -> Any:
    """A saved DatasetDict's split (a saved Dataset is its own)."""
    if not hasattr(loaded, "keys"):
        return loaded
    if split not in loaded:
        raise DataError(f"{source} has the splits {', '.join(loaded.keys())}, not {split!r}: pass one of them with "
                        "--data.split (or --data.val_split).")
    return loaded[split]


def _load(source: str, load, hub: bool = False) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise DataError("Reading this dataset needs the `datasets` package: pip install datasets") from None
    try:
        return load(datasets).to_list()
    except DataError:
        raise
    except Exception as e:  # offline, unknown name or split, unreadable file
        message = " ".join(f"{type(e).__name__}: {e}".split())
        if hub and (isinstance(e, ConnectionError) or "offline" in message.lower() or "connect" in message.lower()):
            raise DataError(
                f"Cannot load the Hugging Face dataset {source!r}: the Hub cannot be reached (offline?) and it is not "
                "in the local cache. Download it where there is network (it is cached), or pass a local file or "
                "folder with --data.path (or the older --data.json_path)."
            ) from e
        raise DataError(f"Cannot read the dataset {source!r}: {message[:500]}") from e


def rename_columns(rows: list[Any], columns: Optional[dict[str, str]], source: str) -> list[Any]:
    if not columns:
        return rows
    present = set().union(*(row.keys() for row in rows if isinstance(row, dict))) if rows else set()
    missing = [old for old in columns if old not in present]
    if missing:
        raise DataError(f"--data.columns renames {', '.join(map(repr, missing))}, but {source} has no such column (its "
                        f"columns: {', '.join(sorted(present)) or 'none'}). Use the names its rows hold.")
    return [{columns.get(k, k): v for k, v in row.items()} if isinstance(row, dict) else row for row in rows]


def row_format(row: Any) -> Optional[str]:
    """The format a row's columns say (the first of DETECT it has), or None."""
    if isinstance(row, dict):
        for name, needs in DETECT:
            if all(column in row for column in needs):
                return name
    return None


def to_rows(rows: list[Any], fmt: str, source: str, lines: Optional[list[int]] = None
            ) -> tuple[list[Any], dict[str, int]]:
    """Rows of `fmt` (auto: each row's own, from its columns: one file may mix alpaca and messages rows) in the
    shapes lit_qlora.data.sft validates, and how many rows of each format there were. A row that fits no format is
    reported with its number (and line) by sft's validation, or here for sharegpt's own fields."""
    formats = [row_format(row) if fmt == "auto" else fmt for row in rows]
    if fmt == "auto" and rows and not any(formats):
        first = next((row for row in rows if isinstance(row, dict)), {})
        raise DataError(
            f"Cannot tell the format of {source} from its columns ({', '.join(first) or 'none'}): lit-qlora reads "
            "alpaca (instruction, output, optional input), messages, sharegpt (conversations), prompt_completion "
            "(prompt, completion) and text rows. Rename columns with --data.columns (e.g. {question: instruction, "
            "answer: output}) or name the format with --data.format.")
    out = []
    for index, (row, row_fmt) in enumerate(zip(rows, formats)):
        if row_fmt == "sharegpt":
            out.append(_sharegpt_row(row, index, source, lines))
        elif row_fmt is not None and isinstance(row, dict):
            # Only the format's own columns: a row with `text` beside `prompt` is read as the format says.
            out.append({k: row[k] for k in COLUMNS[row_fmt] if k in row})
        else:
            out.append(row)
    counts: dict[str, int] = {}
    for row_fmt in formats:
        if row_fmt is not None:
            counts[row_fmt] = counts.get(row_fmt, 0) + 1
    return out, counts


def _sharegpt_row(row: Any, index: int, source: str, lines: Optional[list[int]]) -> Any:
    where = f"row {index + 1}" + (f" (line {lines[index]})" if lines and lines[index] != index + 1 else "")
    turns = row.get("conversations") if isinstance(row, dict) else None
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{source}, {where}: `conversations` is not a non-empty list of {{from, value}} turns. Fix "
                        "or remove that row.")
    messages = []
    for turn in turns:
        role = SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        if role is None or not isinstance(turn.get("value"), str):
            raise DataError(f"{source}, {where}: a turn {turn!r} is not {{from: human|gpt|system, value: string}}. "
                            "Fix or remove that row.")
        messages.append({"role": role, "content": turn["value"]})
    return {"messages": messages}


def fingerprint(sources: list[Optional[str]]) -> Optional[str]:
    """sha256 over the local files the rows come from (a folder: every file in it, by relative name); None when a
    source is a Hub dataset (its revision is `datasets`' business). What a resume compares: edited rows under the same
    path are another run's data."""
    files: list[tuple[str, Path]] = []
    for source in sources:
        path = Path(source) if source is not None else DEMO_DATASET
        if path.is_file():
            files.append((path.name, path))
        elif path.is_dir():
            files += sorted((str(p.relative_to(path)), p) for p in path.rglob("*") if p.is_file())
        else:
            return None
    if len(files) == 1:  # one file: its own sha256, as checkpoints from before folders and val_path recorded it
        return file_sha256(files[0][1])
    digest = hashlib.sha256()
    for name, file in files:
        digest.update(f"{name}\0{file_sha256(file)}\0".encode())
    return digest.hexdigest()
