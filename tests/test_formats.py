"""Every dataset source kind and row format (lit_qlora.data.formats) through `litqlora finetune`: each trains two
steps, and the tokens that carry loss are the reply's (alpaca, messages, sharegpt), the completion's
(prompt_completion) or all of them (text); bad input names the file, row and column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_qlora.data.errors import DataError
from lit_qlora.train.datamodule import SFTDataModule
from lit_qlora.data.sft import IGNORE_INDEX
from lit_qlora.train.finetune import finetune
from lit_qlora.checkpoint.tokenizer import Tokenizer
from lit_qlora.train.args import DataArgs, LoRAArgs, TrainArgs

N = 12  # rows per dataset: 2 steps of 4 with 3 held out


def reply(i: int) -> str:
    return f"{i} + {i + 3} = {2 * i + 3}."


def question(i: int) -> str:
    return f"Add {i} and {i + 3}."


ROWS = {  # format -> row i, in the columns that format reads
    "alpaca": lambda i: {"instruction": question(i), "input": "", "output": reply(i)},
    "messages": lambda i: {"messages": [{"role": "user", "content": question(i)},
                                        {"role": "assistant", "content": reply(i)}]},
    "sharegpt": lambda i: {"conversations": [{"from": "human", "value": question(i)}, {"from": "gpt", "value": reply(i)}]},
    "prompt_completion": lambda i: {"prompt": question(i) + " Answer: ", "completion": reply(i)},
    "text": lambda i: {"text": f"{question(i)} {reply(i)}"},
}


def write(kind: str, rows: list[dict], where: Path) -> Path:
    """The rows as a dataset of `kind`: a json or jsonl file, csv, parquet, an arrow folder, or a saved dataset."""
    import datasets

    where.mkdir(parents=True, exist_ok=True)
    if kind == "json":
        (path := where / "rows.json").write_text(json.dumps(rows))
    elif kind == "jsonl":
        (path := where / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "csv":
        datasets.Dataset.from_list(rows).to_csv(str(path := where / "rows.csv"))
    elif kind == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path := where / "rows.parquet"))
    elif kind == "arrow folder":
        path = where / "arrow"
        datasets.Dataset.from_list(rows).save_to_disk(str(where / "saved"))
        path.mkdir()
        for f in (where / "saved").glob("*.arrow"):  # only the arrow files: a folder `load_dataset` reads
            f.rename(path / f.name)
    elif kind == "saved":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(path := where / "saved"))
    else:
        raise ValueError(kind)
    return path


def trained_text(tok: Tokenizer, sample) -> str:
    ids = [i for i, label in zip(sample.input_ids.tolist(), sample.labels.tolist()) if label != IGNORE_INDEX]
    return tok.decode(ids)


# Every source kind once and every format at least once; the saved dataset renames its columns.
CASES = [("json", "alpaca"), ("jsonl", "messages"), ("csv", "prompt_completion"), ("parquet", "text"),
         ("arrow folder", "sharegpt"), ("saved", "alpaca")]


@pytest.mark.parametrize("kind, fmt", CASES)
def test_each_source_and_format_trains_two_steps_on_the_right_tokens(kind, fmt, tiny_llama_dir, tmp_path, capsys):
    rows = [ROWS[fmt](i) for i in range(N)]
    columns = None
    if kind == "saved":  # columns named the user's way
        rows = [{"question": r["instruction"], "answer": r["output"]} for r in rows]
        columns = {"question": "instruction", "answer": "output"}
    source = write(kind, rows, tmp_path / "data")
    data = DataArgs(path=str(source), columns=columns, val_split=0.25)

    tok = Tokenizer(tiny_llama_dir)
    dm = SFTDataModule(data, tok, max_seq_length=128, micro_batch_size=2, seed=3)
    dm.setup("fit")
    assert set(dm.formats) == {fmt} and f": {N} {fmt} rows (detected from their columns)" in capsys.readouterr().out
    assert len(dm.train_set) == 9 and len(dm.val_set) == 3
    eos = tok.eos_token
    for sample in dm.train_set.samples:
        text, trained = tok.decode(sample.input_ids), trained_text(tok, sample)
        i = next(i for i in range(N) if question(i) in text)  # which row this is
        if fmt == "text":
            assert trained == text == f"{question(i)} {reply(i)}{eos}" or trained.lstrip(tok.bos_token or "") == text
            assert (sample.labels == sample.input_ids).all()  # every token trains
        else:
            assert trained.startswith(reply(i)) and question(i) not in trained  # the reply trains, the prompt not
            assert (sample.labels == IGNORE_INDEX).any()

    summary = finetune(checkpoint_dir=tiny_llama_dir, out_dir=tmp_path / "run", precision="32-true", accelerator="cpu",
                       lora=LoRAArgs(r=4, alpha=8, dropout=0.0), data=data,
                       train=TrainArgs(micro_batch_size=2, global_batch_size=4, max_seq_length=128, max_steps=2,
                                       warmup_steps=1, lr=1e-2))
    assert summary["steps"] == 2 and summary["train_loss"] > 0 and summary["val_loss"] > 0


def test_auto_reads_each_row_by_its_columns_and_a_named_format_reads_only_its_own(tiny_llama_dir, tmp_path, capsys):
    """One file may mix alpaca and messages rows (the tutorial's does); --data.format reads the named columns only."""
    tok = Tokenizer(tiny_llama_dir)
    rows = [ROWS["alpaca"](i) for i in range(6)] + [ROWS["messages"](i) for i in range(6, 10)]
    source = write("jsonl", rows, tmp_path / "mixed")
    dm = SFTDataModule(DataArgs(path=str(source), val_split=0), tok, 128, 2, seed=3)
    dm.setup()
    assert dm.formats == {"alpaca": 6, "messages": 4} and ": 6 alpaca, 4 messages rows" in capsys.readouterr().out
    both = write("jsonl", [{**ROWS["text"](i), **ROWS["prompt_completion"](i)} for i in range(4)], tmp_path / "both")
    dm = SFTDataModule(DataArgs(path=str(both), format="prompt_completion", val_split=0), tok, 128, 2, seed=3)
    dm.setup()
    assert all(question(i) not in trained_text(tok, s) for i, s in enumerate(dm.train_set.samples))  # not as text
    with pytest.raises(DataError, match=r"rows.jsonl has rows that cannot be used: row 2: neither `instruction`"):
        SFTDataModule(DataArgs(path=str(write("jsonl", [ROWS["alpaca"](0), ROWS["text"](1)], tmp_path / "t")),
                               format="alpaca", val_split=0), tok, 128, 2, seed=3).setup()


def test_a_validation_file_or_split_of_its_own(tiny_llama_dir, tmp_path):
    import datasets

    tok = Tokenizer(tiny_llama_dir)
    train = write("jsonl", [ROWS["alpaca"](i) for i in range(N)], tmp_path / "train")
    val = write("csv", [ROWS["alpaca"](i) for i in range(100, 105)], tmp_path / "val")
    dm = SFTDataModule(DataArgs(path=str(train), val_path=str(val)), tok, 128, 2, seed=3)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set)) == (N, 5)  # nothing held out of train

    saved = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([ROWS["text"](i) for i in range(N)]),
                          "test": datasets.Dataset.from_list([ROWS["text"](i) for i in range(50, 52)])}
                         ).save_to_disk(str(saved))
    dm = SFTDataModule(DataArgs(path=str(saved), val_split="test"), tok, 128, 2, seed=3)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set)) == (N, 2)
    with pytest.raises(DataError, match=r"has the splits train, test, not 'validation': pass one of them"):
        SFTDataModule(DataArgs(path=str(saved), val_split="validation"), tok, 128, 2, seed=3).setup()


def test_the_older_options_map_onto_path(tiny_llama_dir, tmp_path):
    tok = Tokenizer(tiny_llama_dir)
    source = write("json", [ROWS["alpaca"](i) for i in range(N)], tmp_path / "d")
    a = SFTDataModule(DataArgs(json_path=source), tok, 128, 2, seed=3)
    b = SFTDataModule(DataArgs(path=str(source)), tok, 128, 2, seed=3)
    a.setup(), b.setup()
    assert [s.input_ids.tolist() for s in a.train_set.samples] == [s.input_ids.tolist() for s in b.train_set.samples]
    with pytest.raises(DataError, match="--data.path and --data.json_path each name a dataset: pass one of them"):
        SFTDataModule(DataArgs(path=str(source), json_path=source), tok, 128, 2, seed=3)


def test_bad_input_names_the_file_row_and_column(tiny_llama_dir, tmp_path):
    tok = Tokenizer(tiny_llama_dir)

    def setup(**kw):
        SFTDataModule(DataArgs(**kw), tok, 128, 2, seed=3).setup()

    csv = write("csv", [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": ""}], tmp_path / "c")
    with pytest.raises(DataError, match=r"rows.csv has rows that cannot be used: row 2: empty `completion`"):
        setup(path=str(csv), val_split=0)
    jsonl = write("jsonl", [ROWS["sharegpt"](0), {"conversations": [{"from": "robot", "value": "x"}]}], tmp_path / "j")
    with pytest.raises(DataError, match=r"rows.jsonl, row 2: a turn .* is not \{from: human\|gpt\|system"):
        setup(path=str(jsonl), val_split=0)
    odd = write("json", [{"q": "x", "a": "y"}] * 3, tmp_path / "o")
    with pytest.raises(DataError, match=r"Cannot tell the format of .*rows.json from its columns \(q, a\).*--data.columns"):
        setup(path=str(odd))
    with pytest.raises(DataError, match=r"--data.columns renames 'question', but .*rows.json has no such column"):
        setup(path=str(odd), columns={"question": "instruction"})
    with pytest.raises(DataError, match=r"The dataset .*missing.parquet does not exist"):
        setup(path=str(tmp_path / "missing.parquet"))
    (tmp_path / "rows.txt").write_text("hello")
    with pytest.raises(DataError, match=r"has the extension '.txt'; lit-qlora reads .json, .jsonl, .csv"):
        setup(path=str(tmp_path / "rows.txt"))


def test_a_hub_name_offline_is_the_clear_download_error(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"Cannot load the Hugging Face dataset 'nobody/no-such-set'.*--data.path"):
        SFTDataModule(DataArgs(path="nobody/no-such-set"), Tokenizer(tiny_llama_dir), 128, 2, seed=3).setup()


def test_the_resume_fingerprint_follows_the_files(tmp_path):
    from lit_qlora.data.formats import fingerprint
    from lit_qlora.data.files import file_sha256

    one = write("jsonl", [ROWS["text"](i) for i in range(3)], tmp_path / "a")
    assert fingerprint([str(one)]) == file_sha256(one)  # one file: its sha256, as older checkpoints recorded
    folder = write("arrow folder", [ROWS["text"](i) for i in range(3)], tmp_path / "b")
    before = fingerprint([str(folder)])
    assert before is not None and fingerprint([str(folder)]) == before
    next(folder.glob("*.arrow")).write_bytes(b"edited")
    assert fingerprint([str(folder)]) != before
    assert fingerprint(["nobody/hub-set"]) is None
