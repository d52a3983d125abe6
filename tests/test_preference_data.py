"""Preference pairs (lit_qlora.data.preference): every row form split into prompt and answers as TRL reads them, token
labels (the prompt masked, only the final answer and its stop token trained, both answers on the same prompt ids),
row errors with their numbers, left-out pairs, the paired batch layout, CSV/Parquet sources, and the shipped demo set
(real SmolLM2 tokenizer)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lit_qlora.checkpoint.tokenizer import Tokenizer
from lit_qlora.data import PREFERENCE_DEMO_DATASET, PairCollate, PairSample, read_pairs, to_pairs, tokenize_pairs
from lit_qlora.data.errors import DataError
from lit_qlora.data.files import DEMO_DATASET, read_rows
from lit_qlora.data.preference import render_pair, split_text
from lit_qlora.data.prompts import get_prompt_style
from lit_qlora.data.sft import IGNORE_INDEX, Sample

REPO = Path(__file__).resolve().parents[1]
USER, ASSISTANT = "user", "assistant"


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def parts(tok: Tokenizer, sample: Sample) -> tuple[list[int], str, list[str]]:
    """The prompt's ids (every token before the first trained one), the prompt's text, and each run of trained
    tokens decoded; checks that nothing after the first trained token is masked and labels equal inputs there."""
    labels = sample.labels.tolist()
    first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    assert labels[first:] == sample.input_ids[first:].tolist()  # one trained run, to the end
    prompt = sample.input_ids[:first].tolist()
    return prompt, tok.decode(prompt), [tok.decode(sample.input_ids[first:].tolist())]


def tokenized(tok: Tokenizer, pair: dict, style: str = "chatml") -> tuple[str, str, str]:
    """(prompt text, chosen trained text, rejected trained text) of one pair, checking both share the prompt ids."""
    [sample] = tokenize_pairs([pair], get_prompt_style(style, tok), tok, 512)
    chosen_prompt, text, [chosen] = parts(tok, sample.chosen)
    rejected_prompt, _, [rejected] = parts(tok, sample.rejected)
    assert chosen_prompt == rejected_prompt
    assert sample.input_ids is sample.chosen.input_ids and sample.labels is sample.chosen.labels
    assert len(sample) == len(sample.chosen) + len(sample.rejected) and sample.index == 0
    return text, chosen, rejected


# ---------------------------------------------------------------------------------------------- the four forms

def test_explicit_string_rows(tok: Tokenizer) -> None:
    rows = [{"prompt": "What is the capital of Austria?", "chosen": "The capital of Austria is Vienna.",
             "rejected": "The capital of Austria is Madrid.", "id": 7}]
    pairs, counts = to_pairs(rows, "auto", "p.jsonl")
    assert counts == {"explicit": 1}
    assert pairs == [{"prompt": [msg(USER, "What is the capital of Austria?")],
                      "chosen": "The capital of Austria is Vienna.", "rejected": "The capital of Austria is Madrid."}]
    prompt, chosen, rejected = tokenized(tok, pairs[0])
    assert prompt == "<|im_start|>user\nWhat is the capital of Austria?<|im_end|>\n<|im_start|>assistant\n"
    assert chosen == "The capital of Austria is Vienna.<|im_end|>"
    assert rejected == "The capital of Austria is Madrid.<|im_end|>"
    # The alpaca style renders the string prompt as an instruction, as finetune renders an alpaca row.
    prompt, chosen, _ = tokenized(tok, pairs[0], "alpaca")
    assert prompt.endswith("### Instruction:\nWhat is the capital of Austria?\n\n### Response:\n")
    assert chosen == "The capital of Austria is Vienna." + tok.eos_token


def test_explicit_conversational_rows_earlier_turns_join_the_prompt(tok: Tokenizer) -> None:
    earlier = [msg(ASSISTANT, "1 + 1 = 2"), msg(USER, "And times 3?")]
    rows = [{"prompt": [msg("system", "Be brief."), msg(USER, "What is 1 + 1?")],
             "chosen": [*earlier, msg(ASSISTANT, "2 × 3 = 6")], "rejected": [*earlier, msg(ASSISTANT, "2 × 3 = 5")]}]
    pairs, counts = to_pairs(rows, "explicit", "p.jsonl")
    assert counts == {"explicit": 1}
    assert pairs == [{"prompt": [msg("system", "Be brief."), msg(USER, "What is 1 + 1?"), *earlier],
                      "chosen": "2 × 3 = 6", "rejected": "2 × 3 = 5"}]
    prompt, chosen, rejected = tokenized(tok, pairs[0])  # the earlier answer is context: masked
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n"
                      "<|im_start|>assistant\n1 + 1 = 2<|im_end|>\n<|im_start|>user\nAnd times 3?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert (chosen, rejected) == ("2 × 3 = 6<|im_end|>", "2 × 3 = 5<|im_end|>")
    for style in ("chat_template", "alpaca"):  # one trained run, the last answer, in every style
        _, chosen, rejected = tokenized(tok, pairs[0], style)
        assert chosen.startswith("2 × 3 = 6") and rejected.startswith("2 × 3 = 5")


def test_implicit_string_rows_split_at_a_word_boundary(tok: Tokenizer) -> None:
    question = "Q: What is 6 × 7?\nA: The answer is"
    rows = [{"chosen": f"{question} 42.", "rejected": f"{question} 45."}]
    pairs, counts = to_pairs(rows, "auto", "p.jsonl")
    assert counts == {"implicit": 1}
    # The common start "...answer is 4" is cut back to the last whitespace: no word (number) is split.
    assert pairs == [{"prompt_text": question, "chosen": " 42.", "rejected": " 45."}]
    prompt, chosen, rejected = tokenized(tok, pairs[0], "chat_template")  # raw text: no template, whatever the style
    assert prompt == question
    assert (chosen, rejected) == (" 42." + tok.eos_token, " 45." + tok.eos_token)
    assert split_text("x=4", "x=5") == ("", "x=4", "x=5")  # nothing shared up to a whitespace: no prompt
    assert split_text("Say hi\n\nhello", "Say hi\n\nbye") == ("Say hi", "\n\nhello", "\n\nbye")


def test_implicit_conversational_rows(tok: Tokenizer) -> None:
    shared = [msg("system", "Be brief."), msg(USER, "Capital of Austria?")]
    rows = [{"chosen": [*shared, msg(ASSISTANT, "Vienna.")], "rejected": [*shared, msg(ASSISTANT, "Madrid.")]}]
    pairs, counts = to_pairs(rows, "implicit", "p.jsonl")
    assert counts == {"implicit": 1}
    assert pairs == [{"prompt": shared, "chosen": "Vienna.", "rejected": "Madrid."}]
    prompt, chosen, rejected = tokenized(tok, pairs[0])
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of Austria?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert (chosen, rejected) == ("Vienna.<|im_end|>", "Madrid.<|im_end|>")


def test_auto_reads_each_row_by_its_columns() -> None:
    rows = [{"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."}, {"chosen": "a b", "rejected": "a c"},
            {"prompt": [msg(USER, "Hi")], "chosen": "Hello.", "rejected": "Bye."}]
    pairs, counts = to_pairs(rows, "auto", "p.jsonl")
    assert counts == {"explicit": 2, "implicit": 1}
    assert [sorted(p) for p in pairs] == [["chosen", "prompt", "rejected"], ["chosen", "prompt_text", "rejected"],
                                          ["chosen", "prompt", "rejected"]]
    with pytest.raises(DataError, match="Unknown preference format 'pairs'"):
        to_pairs(rows, "pairs", "p.jsonl")


# ---------------------------------------------------------------------------------------------- row errors

def test_bad_rows_are_reported_with_row_numbers_and_the_file(tmp_path: Path) -> None:
    good = {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."}
    a = msg(ASSISTANT, "ok")
    rows = [
        good,
        {"prompt": "Hi", "chosen": "Hello."},                                      # 2 missing rejected
        {"prompt": "Hi", "chosen": 5, "rejected": "x"},                            # 3 not a string / list
        {"prompt": "Hi", "chosen": [msg("bot", "x")], "rejected": [a]},            # 4 bad role
        {"prompt": "Hi", "chosen": [{"role": ASSISTANT, "content": 3}], "rejected": [a]},  # 5 content not a string
        {"prompt": "Hi", "chosen": "  ", "rejected": "x"},                         # 6 empty string
        {"prompt": "Hi", "chosen": [], "rejected": [a]},                           # 7 empty list
        {"prompt": "Hi", "chosen": None, "rejected": "x"},                         # 8 None (a CSV's empty cell)
        {"prompt": "Hi", "chosen": [msg(ASSISTANT, " ")], "rejected": [a]},        # 9 empty answer
        {"chosen": "The answer is ", "rejected": "The answer is 4"},               # 10 implicit: nothing differs
        {"prompt": "Hi", "chosen": [a, msg(USER, "x")], "rejected": [a]},          # 11 does not end with assistant
        {"prompt": "Hi", "chosen": [a, msg(USER, "x"), a], "rejected": [msg(ASSISTANT, "no"), msg(USER, "x"), a]},
        {"prompt": "Hi", "chosen": "x", "rejected": [a]},                          # 13 mixed kinds
        5,                                                                         # 14 not an object
        {"prompt": "", "chosen": "x", "rejected": "y"},                            # 15 empty prompt
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + "".join(json.dumps(row) + "\n" for row in rows))  # lines = rows + 1
    with pytest.raises(DataError) as e:
        read_pairs(str(path), None, "train", None, "auto")
    message = str(e.value)
    assert "\n" not in message and str(path) in message and "Fix or remove those rows" in message
    for expected in [
        "row 3 (line 4): missing `rejected`",
        "row 4 (line 5): `chosen` is not a string or a list of messages (a int)",
        "row 5 (line 6): `chosen` has a message with role 'bot' (use system, user or assistant)",
        "row 6 (line 7): `chosen` has a message without a string `content`",
        "rows 7 (line 8), 8 (line 9), 9 (line 10): empty `chosen`",
        "row 10 (line 11): `chosen` ends with an empty answer",
        "row 11 (line 12): `chosen` and `rejected` have no differing part",
        "row 12 (line 13): `chosen` does not end with an assistant message",
        "row 13 (line 14): `chosen` and `rejected` differ before their last message",
        "row 14 (line 15): `chosen` and `rejected` are not of one kind",
        "row 15 (line 16): not a JSON object (a int)",
        "row 16 (line 17): empty `prompt`",
    ]:
        assert expected in message, expected
    assert "row 1 " not in message and "row 2 " not in message
    many = [{"prompt": "Hi", "chosen": "x"}] * 7
    with pytest.raises(DataError, match=r"rows 1, 2, 3, 4, 5 and 2 more: missing `rejected`"):
        to_pairs(many, "explicit", "many.json")


def test_unknown_columns_suggest_renaming_them(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "qa.json"
    path.write_text(json.dumps([{"question": "Hi", "good": "Hello.", "bad": "Go away."}]))
    with pytest.raises(DataError, match=r"from its columns \(question, good, bad\).*--data.columns \(e.g. "
                                        r"\{question: prompt, good: chosen, bad: rejected\}\)") as e:
        read_pairs(str(path), None, "train", None, "auto")
    assert str(path) in str(e.value)
    pairs = read_pairs(str(path), None, "train", {"question": "prompt", "good": "chosen", "bad": "rejected"}, "auto")
    assert pairs == [{"prompt": [msg(USER, "Hi")], "chosen": "Hello.", "rejected": "Go away."}]
    assert f"Data: {path}: 1 explicit rows (detected from their columns)" in capsys.readouterr().out


def test_identical_answers_are_left_out_with_one_counted_warning() -> None:
    rows = [{"prompt": "Hi", "chosen": "Hello.", "rejected": "Hello. "},  # the same but for trailing whitespace
            {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."},
            {"chosen": "Say it: yes", "rejected": "Say it: yes"}]
    with pytest.warns(UserWarning, match=r"p.jsonl: 2 of 3 pairs have identical chosen and rejected answers and were "
                                         "left out: they carry no preference") as record:
        pairs, counts = to_pairs(rows, "auto", "p.jsonl")
    assert len(record) == 1 and counts == {"explicit": 2, "implicit": 1}
    assert pairs == [{"prompt": [msg(USER, "Hi")], "chosen": "Hello.", "rejected": "Go away."}]
    with pytest.raises(DataError, match="Every pair in p.jsonl has identical chosen and rejected answers"):
        to_pairs([rows[0], rows[2]], "auto", "p.jsonl")


# ---------------------------------------------------------------------------------------------- tokens and batches

def test_long_prompts_are_left_out_and_long_answers_truncated(tok: Tokenizer) -> None:
    style = get_prompt_style("chatml", tok)
    long_prompt = {"prompt": [msg(USER, "word " * 100)], "chosen": "Yes.", "rejected": "No."}
    long_answer = {"prompt": [msg(USER, "Hi")], "chosen": "la " * 100, "rejected": "No."}
    short = {"prompt": [msg(USER, "Hi")], "chosen": "Hello.", "rejected": "Go away."}
    with pytest.warns(UserWarning) as record:
        samples = tokenize_pairs([long_prompt, long_answer, short], style, tok, max_seq_length=40)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2
    assert messages[0].startswith("1 of 3 pairs were left out: their prompt fills max_seq_length=40 tokens")
    assert "--train.max_seq_length" in messages[0]
    assert messages[1].startswith("1 of 4 sequences (a prompt with its chosen or rejected answer) are longer than "
                                  "max_seq_length=40 tokens and were truncated")
    assert [s.index for s in samples] == [0, 1]  # positions in the returned list: what cached log-probs key on
    assert [s.row for s in samples] == [1, 2]  # and the rows they came from: a report quotes the kept pair's prompt
    assert len(samples[0].chosen) == 40 and samples[0].chosen.labels[-1] != IGNORE_INDEX
    with pytest.raises(DataError, match="Every one of the 1 pairs has a prompt of max_seq_length=40 tokens or more.*"
                                        "--train.max_seq_length"):
        tokenize_pairs([long_prompt], style, tok, max_seq_length=40)


def test_pair_collate_computes_each_prompt_once_with_its_answers_as_branches() -> None:
    def sample(ids: list[int], n_prompt: int) -> Sample:
        labels = [IGNORE_INDEX] * n_prompt + ids[n_prompt:]
        return Sample(torch.tensor(ids), torch.tensor(labels))

    pairs = [PairSample(sample([1, 2, 3], 2), sample([1, 2, 4, 5, 6], 2), index=4),
             PairSample(sample([7, 8], 1), sample([7, 9, 9], 1), index=1)]
    assert len(pairs[0]) == 8 and pairs[0].input_ids.tolist() == [1, 2, 3]
    batch = PairCollate(pad_id=0)(pairs)
    assert sorted(batch) == ["index", "input_ids", "positions", "seq", "src", "tgt"]
    # prompt, chosen answer, rejected answer (at the positions it has after the prompt alone), padding
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 9, 0, 0]]
    assert batch["positions"].tolist() == [[0, 1, 2, 2, 3, 4], [0, 1, 1, 2, 0, 0]]
    # each trained token, the flat index of the hidden state predicting it (a rejected answer's first token: the
    # prompt's last), and its answer (pair i: chosen i, rejected B + i)
    assert batch["tgt"].tolist() == [3, 4, 5, 6, 8, 9, 9]
    assert batch["src"].tolist() == [1, 1, 3, 4, 6, 6, 8]
    assert batch["seq"].tolist() == [0, 2, 2, 2, 1, 3, 3]
    assert batch["index"].tolist() == [4, 1]
    assert all(t.dtype == torch.long for t in batch.values())


def test_branch_attention_sees_the_prompt_and_not_the_other_answer() -> None:
    """The mask of a collated row: the rejected answer attends to the prompt and itself, never to the chosen answer;
    padding attends to nothing else; a row without branches (packing) is plain per-document causal."""
    from lit_qlora.model.attention_mask import dense_mask, document_mask_mod

    positions = torch.tensor([[0, 1, 2, 2, 3, 4, 0]])  # prompt 1-2, chosen 3, rejected 4-6, padding
    mask = dense_mask(document_mask_mod(positions), 1, 7)[0, 0].int().tolist()
    assert mask[2] == [1, 1, 1, 0, 0, 0, 0]  # the chosen token: prompt and itself
    assert mask[3] == [1, 1, 0, 1, 0, 0, 0]  # the rejected answer's first token: the prompt, not the chosen token
    assert mask[5] == [1, 1, 0, 1, 1, 1, 0]
    assert mask[6] == [0, 0, 0, 0, 0, 0, 1]
    packed = torch.tensor([[0, 1, 2, 0, 1]])
    causal_docs = dense_mask(document_mask_mod(packed), 1, 5)[0, 0].int().tolist()
    assert causal_docs == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


def test_render_pair_masks_every_answer_but_the_last(tok: Tokenizer) -> None:
    pair = {"prompt": [msg(USER, "a"), msg(ASSISTANT, "b"), msg(USER, "c")], "chosen": "d", "rejected": "e"}
    chosen, rejected = render_pair(pair, get_prompt_style("alpaca", tok), tok)
    assert [s.text for s in chosen if s.train] == ["d" + tok.eos_token]
    assert [s.text for s in rejected if s.train] == ["e" + tok.eos_token]
    assert [s for s in chosen if not s.train] == [s for s in rejected if not s.train]
    raw = render_pair({"prompt_text": "x is", "chosen": " 1", "rejected": " 2"}, None, tok)
    assert [[(s.text, s.train) for s in side] for side in raw] == [
        [("x is", False), (" 1" + tok.eos_token, True)], [("x is", False), (" 2" + tok.eos_token, True)]]


# ---------------------------------------------------------------------------------------------- sources

def test_csv_and_parquet_sources(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "pairs.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["question", "good", "bad"])
        writer.writerows([["What is 2 + 2?", "4", "5"], ["Capital of Austria?", "Vienna", "Madrid"]])
    columns = {"question": "prompt", "good": "chosen", "bad": "rejected"}
    pairs = read_pairs(str(path), None, "train", columns, "explicit")
    assert pairs[1] == {"prompt": [msg(USER, "Capital of Austria?")], "chosen": "Vienna", "rejected": "Madrid"}
    assert f"Data: {path}: 2 explicit rows (as --data.format says)" in capsys.readouterr().out
    with open(path, "a", newline="", encoding="utf-8") as f:
        csv.writer(f).writerow(["Capital of Peru?", "Lima", ""])  # an empty cell reads as None
    with pytest.raises(DataError, match=r"pairs.csv has preference rows that cannot be used: row 3: empty `rejected`"):
        read_pairs(str(path), None, "train", columns, "auto")

    shared = [msg(USER, "Capital of Austria?")]
    table = pa.Table.from_pylist([{"chosen": [*shared, msg(ASSISTANT, "Vienna.")],
                                   "rejected": [*shared, msg(ASSISTANT, "Madrid.")]}])
    pq.write_table(table, tmp_path / "pairs.parquet")
    pairs = read_pairs(str(tmp_path / "pairs.parquet"), None, "train", None, "auto")
    assert pairs == [{"prompt": shared, "chosen": "Vienna.", "rejected": "Madrid."}]
    assert "1 implicit rows (detected from their columns)" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- the shipped demo set

def test_preference_demo_is_regenerable_and_every_row_a_valid_explicit_pair(tok: Tokenizer) -> None:
    script = REPO / "scripts" / "make_preference_demo.py"
    out = subprocess.run([sys.executable, str(script), "--stdout"], capture_output=True, text=True, check=True,
                         encoding="utf-8")
    assert PREFERENCE_DEMO_DATASET.read_text(encoding="utf-8") == out.stdout
    rows, _ = read_rows(PREFERENCE_DEMO_DATASET)
    demo, _ = read_rows(DEMO_DATASET)
    assert all(sorted(row) == ["chosen", "prompt", "rejected"] and row["chosen"] != row["rejected"] for row in rows)
    answers = {row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else ""): row["output"] for row in demo}
    assert len(rows) == len(demo) and {row["prompt"]: row["chosen"] for row in rows} == answers  # each demo row once
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no pair left out
        pairs = read_pairs(str(PREFERENCE_DEMO_DATASET), None, "train", None, "explicit")
        samples = tokenize_pairs(pairs, get_prompt_style("chatml", tok), tok, 256)
    assert len(samples) == len(rows)
    austria = [row for row in rows if "capital of Austria" in row["prompt"]]
    assert [row["rejected"].startswith("The capital of Austria is ") for row in austria] == [True]
