"""The files rows come in: the instruction and preference sets shipped with the package, JSON and JSONL read with
each row's line (for errors that point at it), and a file's digest (a run's recipe records its data by content)."""

from __future__ import annotations

import functools
import hashlib
import json
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional

from lit_qlora.data.errors import DataError

# The instruction dataset shipped with the package (see scripts/make_demo.py), found from any working directory.
DEMO_DATASET = Path(str(files("lit_qlora.data").joinpath("demo.jsonl")))
# Its preference pairs (see scripts/make_preference_demo.py): each demo prompt with a right and a wrong answer.
PREFERENCE_DEMO_DATASET = Path(str(files("lit_qlora.data").joinpath("preference_demo.jsonl")))
# The verifiable task of `litqlora grpo` (see scripts/make_grpo_demo.py): small sums with an `answer` column.
GRPO_DEMO_DATASET = Path(str(files("lit_qlora.data").joinpath("grpo_demo.jsonl")))
# The unpaired rows of `litqlora kto` (see scripts/make_kto_demo.py): each demo prompt once, with a right answer
# (label true) or a wrong one (false).
KTO_DEMO_DATASET = Path(str(files("lit_qlora.data").joinpath("kto_demo.jsonl")))

FORMAT_HELP = (
    "Each row must hold `instruction` and `output` strings (optional `input`), or `messages`: a list of "
    '{"role": "system" | "user" | "assistant", "content": string} with at least one assistant turn, or `prompt` and '
    "`completion` strings, or a `text` string (see --data.format; --data.columns renames columns)."
)


def require_data_file(path: Path) -> Path:
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataError(f"The dataset {path} {what}. Pass --data.json_path pointing to a .json or .jsonl file.")
    return path


def file_sha256(path: Path) -> str:
    stat = Path(path).stat()
    return _file_sha256(Path(path).resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    # Keyed on size and mtime too: a run asks for its recipe several times and reads the file once, an edited file
    # is read again.
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_rows(path: Path) -> tuple[list[Any], Optional[list[int]]]:
    """Rows of a JSON file (a list of rows) or a JSONL file (one row per line; blank lines skipped), and for JSONL
    the 1-based line of each row. `.jsonl` files are read as JSONL, `.json` as JSON, anything else by its first
    character (`[` means JSON)."""
    path = require_data_file(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path} is not UTF-8 text (undecodable byte at line {line}, byte offset {e.start}). Re-save it as "
            "UTF-8, e.g. `iconv -f LATIN1 -t UTF-8 in.jsonl > out.jsonl`."
        ) from None
    if path.suffix == ".jsonl" or (path.suffix != ".json" and not text.lstrip().startswith("[")):
        return _read_jsonl(path, text)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path} is not valid JSON: {e.msg}, line {e.lineno}, column {e.colno} (truncated or malformed file?). "
            "A .json dataset must be one list of rows; use .jsonl for one row per line."
        ) from None
    if not isinstance(rows, list):
        raise DataError(f"{path} holds a JSON {type(rows).__name__}, not a list of rows. {FORMAT_HELP}")
    return rows, None


def _read_jsonl(path: Path, text: str) -> tuple[list[Any], list[int]]:
    rows, lines = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}, line {number}: invalid JSON ({e.msg}, column {e.colno}). A .jsonl dataset needs one "
                "complete JSON object per line; fix or delete that line (a truncated last line usually means an "
                "interrupted download or write)."
            ) from None
        lines.append(number)
    return rows, lines
