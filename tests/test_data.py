"""Data pipeline: prompt styles and loss masks (real SmolLM2 tokenizer), truncation, packing, padding, the seeded
split, the one training order (lit_qlora.train.sampler) and its exact resume, clear errors for bad datasets, and the
shipped demo set."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_qlora.data.errors import DataError
from lit_qlora.train.datamodule import DataArgs, SFTDataModule, split_rows
from lit_qlora.data.prompts import get_prompt_style, prompt_text
from lit_qlora.data.files import DEMO_DATASET
from lit_qlora.data.sft import (
    IGNORE_INDEX, Collate, Sample, load_hf_rows, load_json_rows, pack, tokenize_rows,
    tokenize_segments,
)
from lit_qlora.checkpoint.tokenizer import Tokenizer

from helpers import CHAT  # the tok and llama3_tok fixtures are conftest's
from lit_qlora.train.sampler import EpochSampler, StepSampler, epoch_order

ROW = {"instruction": "Name the capital of Peru.", "input": "", "output": "The capital of Peru is Lima."}
ROW_INPUT = {"instruction": "Sort the words.", "input": "pear, fig", "output": "fig, pear"}



def masked_and_trained(tok: Tokenizer, sample: Sample) -> tuple[str, list[str]]:
    """The decoded full text, and the decoded runs of trained tokens."""
    runs, current = [], []
    for i, label in zip(sample.input_ids.tolist(), sample.labels.tolist()):
        if label == IGNORE_INDEX:
            if current:
                runs.append(tok.decode(current))
            current = []
        else:
            assert label == i  # labels are aligned with inputs, not shifted
            current.append(i)
    if current:
        runs.append(tok.decode(current))
    return tok.decode(sample.input_ids), runs


def one(style, tok, row, max_seq_length: int = 512) -> Sample:
    return tokenize_rows([row], style, tok, max_seq_length)[0]


# ---------------------------------------------------------------------------------------------- prompt styles

@pytest.mark.parametrize("row", [ROW, ROW_INPUT])
def test_alpaca_masks_the_prompt_and_trains_reply_plus_eos(tok: Tokenizer, row: dict) -> None:
    style = get_prompt_style("alpaca", tok)
    sample = one(style, tok, row)
    prompt = style.generation_prompt(row)
    assert prompt.endswith("### Response:\n") and ("### Input:\npear, fig" in prompt) == bool(row["input"])
    n = len(tok.encode(prompt))
    assert (sample.labels[:n] == IGNORE_INDEX).all()
    assert sample.labels[n:].tolist() == sample.input_ids[n:].tolist()
    assert sample.input_ids[n:].tolist() == tok.encode(row["output"], bos=False) + [tok.eos_id]
    assert sample.input_ids[0].item() != tok.bos_id  # SmolLM2 adds no BOS


def test_chatml_single_and_multi_turn(tok: Tokenizer) -> None:
    style = get_prompt_style("chatml", tok)
    text, trained = masked_and_trained(tok, one(style, tok, ROW))
    assert text == f"<|im_start|>user\n{ROW['instruction']}<|im_end|>\n<|im_start|>assistant\n{ROW['output']}<|im_end|>"
    assert trained == [ROW["output"] + "<|im_end|>"]
    text, trained = masked_and_trained(tok, one(style, tok, CHAT))
    assert trained == ["2 + 3 = 5<|im_end|>", "4 + 4 = 8<|im_end|>"]
    assert text.startswith("<|im_start|>system\nAnswer in one line.<|im_end|>\n") and "Thanks" not in text
    assert style.generation_prompt("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_llama3_style_bos_once_and_eot(llama3_tok: Tokenizer, tok: Tokenizer) -> None:
    style = get_prompt_style("llama3", llama3_tok)
    sample = one(style, llama3_tok, CHAT)
    ids = sample.input_ids.tolist()
    assert ids[0] == llama3_tok.bos_id and ids.count(llama3_tok.bos_id) == 1
    text, trained = masked_and_trained(llama3_tok, sample)
    assert trained == ["2 + 3 = 5<|eot_id|>", "4 + 4 = 8<|eot_id|>"]
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                           "Answer in one line.<|eot_id|>")
    with pytest.raises(DataError, match=r"<\|eot_id\|>"):  # SmolLM2's tokenizer cannot stop on <|eot_id|>
        get_prompt_style("llama3", tok)


def test_chat_template_multi_turn_matches_the_template(tok: Tokenizer) -> None:
    style = get_prompt_style("chat_template", tok)
    sample = one(style, tok, CHAT)
    text, trained = masked_and_trained(tok, sample)
    assert trained == ["2 + 3 = 5<|im_end|>", "4 + 4 = 8<|im_end|>"]
    # The same text the checkpoint's template renders, minus the masked newline after the last reply.
    rendered = tok.apply_chat_template(CHAT["messages"][:5], add_generation_prompt=False)
    assert text == rendered.removesuffix("\n")
    assert sample.input_ids.tolist() == tok.encode(text)  # segment-wise tokenization agrees here
    # An instruction row gets the template's default system prompt.
    text, trained = masked_and_trained(tok, one(style, tok, ROW))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert trained == [ROW["output"] + "<|im_end|>"]
    assert style.generation_prompt(ROW) == tok.apply_chat_template([{"role": "user", "content": ROW["instruction"]}])


def test_chat_template_missing_or_not_prefix_stable(tok: Tokenizer, smollm2_dir: Path, tmp_path: Path) -> None:
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(DataError, match="has none"):
        get_prompt_style("chat_template", Tokenizer(tmp_path))
    unstable = Tokenizer(tmp_path)
    # Says how many turns the conversation has at its start: earlier renderings change as turns are added.
    unstable.chat_template = ("{{ messages|length }} turns\n{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(DataError, match="not prefix-stable"):
        get_prompt_style("chat_template", unstable).render(CHAT)


def test_alpaca_multi_turn_messages(tok: Tokenizer) -> None:
    text, trained = masked_and_trained(tok, one(get_prompt_style("alpaca", tok), tok, CHAT))
    assert text.startswith("Answer in one line.\n\n### Instruction:\nWhat is 2 + 3?\n\n### Response:\n")
    assert trained == ["2 + 3 = 5<|im_end|>", "4 + 4 = 8<|im_end|>"]


# ------------------------------------------------------------------------------ truncation, packing, padding

def test_prompt_text_is_what_the_user_wrote_for_each_kind_of_row() -> None:
    """What a report quotes as a held-out prompt: the user's words, not the template rendered around them."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Red."},
                {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Blue."}]
    assert prompt_text({"instruction": "Add 2 and 3.", "input": "", "output": "5"}) == "Add 2 and 3."
    assert prompt_text({"instruction": "Translate.", "input": "chat", "output": "cat"}) == "Translate.\n\nchat"
    assert prompt_text({"messages": messages}) == "Name a color."  # training's sample prompt stops at the 1st reply
    assert prompt_text({"messages": messages[:1] + messages[3:4]}) is None  # no user turn before the reply
    assert prompt_text({"prompt": "2 + 2 =", "completion": " 4"}) == "2 + 2 ="
    assert prompt_text({"text": "Once upon a time"}) is None
    # preference pairs: an explicit prompt holds every turn before the answers; a raw-text pair its shared start
    assert prompt_text({"prompt": messages[:5], "chosen": "Green.", "rejected": "No."}) == "Another?"
    assert prompt_text({"prompt_text": "The sky is", "chosen": " blue", "rejected": " green"}) == "The sky is"


def test_truncation_keeps_the_start_and_counts_untrained(tok: Tokenizer) -> None:
    style = get_prompt_style("alpaca", tok)
    full = one(style, tok, ROW)
    prompt_len = len(tok.encode(style.generation_prompt(ROW)))
    with pytest.warns(UserWarning, match=r"2 of 3 samples .* 1 of them lost their whole reply"):
        long_prompt = {**ROW, "instruction": ROW["instruction"] + " It is in South America." * 5}
        short_row = {"instruction": "Hi", "output": "Hello"}
        samples = tokenize_rows([ROW, long_prompt, short_row], style, tok, prompt_len + 3)
    assert len(samples[0]) == prompt_len + 3
    assert samples[0].input_ids.tolist() == full.input_ids[: prompt_len + 3].tolist()
    assert (samples[0].labels[prompt_len:] != IGNORE_INDEX).all() and (samples[1].labels == IGNORE_INDEX).all()
    assert samples[2].input_ids.tolist()[-1] == tok.eos_id  # not truncated
    with pytest.warns(UserWarning, match="1 of them lost their whole reply"):
        untrained = tokenize_rows([ROW], style, tok, prompt_len - 1)[0]  # the reply is cut away entirely
    assert len(untrained) == prompt_len - 1 and (untrained.labels == IGNORE_INDEX).all()


def make_sample(ids: list[int], n_prompt: int) -> Sample:
    ids_t = torch.tensor(ids)
    labels = ids_t.clone()
    labels[:n_prompt] = IGNORE_INDEX
    return Sample(ids_t, labels)


def test_packing_never_splits_samples_and_masks_boundaries() -> None:
    shapes = [(5, 2), (4, 0), (6, 3), (9, 1), (3, 0)]  # (length, prompt tokens)
    samples = [make_sample(list(range(100 * k, 100 * k + n)), p) for k, (n, p) in enumerate(shapes)]
    packed = pack(samples, max_seq_length=10)
    assert [len(s) for s in packed] == [9, 6, 9, 3]  # next-fit: 5+4 | 6 | 9 | 3
    assert torch.cat([s.input_ids for s in packed]).tolist() == torch.cat([s.input_ids for s in samples]).tolist()
    labels = torch.cat([s.labels for s in packed])
    starts = [0, 5, 9, 15, 24]
    expected = torch.cat([s.labels for s in samples])
    expected[starts] = IGNORE_INDEX  # the first token of every sample is never a target
    assert labels.tolist() == expected.tolist()
    # sample 2 starts with a trained token: in the packed sequence it is masked, the rest of its reply is not
    assert packed[0].labels[5].item() == IGNORE_INDEX and packed[0].labels[6:].tolist() == [101, 102, 103]


def test_collate_right_pads() -> None:
    batch = Collate(pad_id=7)([make_sample([1, 2, 3], 1), make_sample([4, 5, 6, 8, 9], 2)])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7, 7], [4, 5, 6, 8, 9]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, -100], [-100, -100, 6, 8, 9]]
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long


def test_tokenize_segments_adds_bos_once_for_families_that_want_it(llama3_tok: Tokenizer) -> None:
    from lit_qlora.data.prompts import Segment

    sample = tokenize_segments([Segment("Hi", False), Segment("there", True)], llama3_tok)
    assert sample.input_ids.tolist()[0] == llama3_tok.bos_id and sample.input_ids.tolist().count(llama3_tok.bos_id) == 1


# ---------------------------------------------------------------------------------------------- split, order, resume

def test_split_is_deterministic_and_keeps_one_val_row() -> None:
    rows = list(range(50))
    train, val = split_rows(rows, 0.1, seed=3)
    assert (train, val) == split_rows(rows, 0.1, seed=3) and len(val) == 5
    assert sorted(train + val) == rows and split_rows(rows, 0.1, seed=4) != (train, val)
    assert len(split_rows(rows[:4], 0.01, seed=0)[1]) == 1 and split_rows(rows, 0, seed=0)[1] == []
    with pytest.raises(DataError, match="too few"):
        split_rows([1], 0.5, seed=0)


def test_step_sampler_is_seeded_and_resumes_exactly_at_any_step() -> None:
    full = list(StepSampler(23, global_batch=4, seed=7, start_step=0, total_steps=12))  # 5 steps per epoch
    assert len(full) == 12 and all(len(b) == 4 for b in full) and full == list(StepSampler(23, 4, 7, 0, 12))
    order0, order1 = epoch_order(23, 7, 0), epoch_order(23, 7, 1)
    assert sorted(order0) == list(range(23)) and order0 != order1
    assert sum(full[:5], []) == order0[:20] and sum(full[5:10], []) == order1[:20]  # each epoch drops its last 3
    assert sum(full[10:], []) == epoch_order(23, 7, 2)[:8]
    for k in range(12):  # a run restarted at step k sees what the uninterrupted one saw from k on
        assert list(StepSampler(23, 4, 7, start_step=k, total_steps=12)) == full[k:]
    ranks = [list(StepSampler(23, 4, 7, 0, 12, rank=r, world_size=2)) for r in range(2)]
    assert all(ranks[r][i] == full[i][r::2] for r in range(2) for i in range(12))
    per_epoch = EpochSampler(23, 4, 7, rank=1, world_size=2)  # a Trainer's view: the epoch Lightning sets
    assert len(per_epoch) == 10 and list(per_epoch) == sum(ranks[1][:5], [])
    per_epoch.set_epoch(1)
    assert list(per_epoch) == sum(ranks[1][5:10], [])
    with pytest.raises(ValueError, match="fewer than one global batch"):
        StepSampler(3, 4, 7, 0, 1)


@pytest.mark.parametrize("packing", [False, True])
def test_datamodule_loaders_follow_the_one_order(tok: Tokenizer, tmp_path: Path, packing: bool) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"Say {i}.", "output": f"{i} " * (i % 7 + 1)}) + "\n"
                            for i in range(40)))
    args = DataArgs(json_path=path, val_split=0.2, packing=packing)
    dm = SFTDataModule(args, tok, max_seq_length=128, micro_batch_size=3, seed=11)
    dm.setup()
    assert len(dm.val_set) == 8 and dm.train_token_count == sum(dm.train_lengths)
    n = len(dm.train_set)

    def ids(batch):
        return batch["input_ids"].tolist()

    # A Trainer of your own: micro-batches, epoch by epoch, in StepSampler's order.
    loader = dm.train_dataloader()
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        epochs.append([ids(b) for b in loader])
    order = [dm.collate([dm.train_set[i] for i in b]) for b in StepSampler(n, 3, 11, 0, n // 3)]
    assert epochs[0] == [ids(b) for b in order] and len(epochs[0]) == n // 3 and epochs[0] != epochs[1]
    # `litqlora finetune`: the same order grouped into optimizer steps of two micro-batches, resumable at any step.
    steps = n // 6
    full = list(dm.step_dataloader(6, 0, steps, rank=0, world_size=1))
    assert [len(s) for s in full] == [2] * steps
    assert [ids(mb) for s in full for mb in s] == epochs[0][: 2 * steps]
    step_samples = list(StepSampler(n, 6, 11, 0, steps))
    assert [mb["num_tokens"] for s in full for mb in s] == [
        sum(len(dm.train_set[k]) for k in samples[j : j + 3]) for samples in step_samples for j in (0, 3)]
    resumed = list(dm.step_dataloader(6, 2, steps, rank=0, world_size=1))
    assert [[ids(mb) for mb in s] for s in resumed] == [[ids(mb) for mb in s] for s in full[2:]]
    val = list(dm.val_dataloader())
    assert val[0]["input_ids"].shape[0] == 3 and all((b["labels"] != IGNORE_INDEX).any() for b in val)


def test_datamodule_serves_a_trainer_of_your_own(tok: Tokenizer, tmp_path: Path) -> None:
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))
            self.seen: list = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["input_ids"].tolist())
            return self.weight * batch["labels"].ne(IGNORE_INDEX).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"Say {i}.", "output": f"{i}"}) + "\n" for i in range(20)))
    dm = SFTDataModule(DataArgs(json_path=path, val_split=0.2), tok, max_seq_length=64, micro_batch_size=4, seed=3)
    module = Recorder()
    L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, use_distributed_sampler=False).fit(module, datamodule=dm)
    sampler = StepSampler(len(dm.train_set), 4, 3, 0, 8)  # both epochs, as the one order has them
    assert module.seen == [dm.collate([dm.train_set[i] for i in b])["input_ids"].tolist() for b in sampler]


# ---------------------------------------------------------------------------------------------- errors

def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_bad_rows_are_reported_with_row_numbers(tmp_path: Path) -> None:
    rows = [ROW, {"instruction": "x"}, {"output": "y"}, {"title": "z"}, {"instruction": "x"},
            {"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "bot", "content": "x"}]}, 5]
    path = write(tmp_path, "bad.json", json.dumps(rows))
    with pytest.raises(DataError) as e:
        load_json_rows(path)
    message = str(e.value)
    assert str(path) in message
    for expected in ["rows 2, 5: missing `output`", "row 3: missing `instruction`",
                     "row 4: neither `instruction`/`output` nor `messages`", "rows 6, 7: no assistant message",
                     "row 7: a message with role 'bot'", "row 8: not a JSON object"]:
        assert expected in message
    jsonl = write(tmp_path, "bad.jsonl", json.dumps(ROW) + "\n\n" + json.dumps({"instruction": "x"}) + "\n")
    with pytest.raises(DataError, match=r"row 2 \(line 3\): missing `output`"):
        load_json_rows(jsonl)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="line 2: invalid JSON"):
        load_json_rows(write(tmp_path, "t.jsonl", json.dumps(ROW) + '\n{"instruction": "x", "outp'))
    with pytest.raises(DataError, match="not valid JSON: .* line 1"):
        load_json_rows(write(tmp_path, "t.json", '[{"instruction": "x"'))
    with pytest.raises(DataError, match="not a list of rows"):
        load_json_rows(write(tmp_path, "d.json", json.dumps(ROW)))
    with pytest.raises(DataError, match="not UTF-8 .* line 2"):
        load_json_rows(write(tmp_path, "l.jsonl", json.dumps(ROW).encode() + b'\n{"instruction": "caf\xe9"}\n'))
    for name, content in [("e.jsonl", ""), ("e2.jsonl", "\n \n"), ("e.json", "[]")]:
        with pytest.raises(DataError, match="holds no rows"):
            load_json_rows(write(tmp_path, name, content))
    with pytest.raises(DataError, match="does not exist"):
        load_json_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="--data.json_path and --data.hf_dataset each name a dataset: pass one"):
        SFTDataModule(DataArgs(json_path=tmp_path / "x.json", hf_dataset="a/b"), None, 64, 1, 0)


def test_hf_dataset_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets.config
    import huggingface_hub.constants

    # both libraries read these variables at import; make an earlier import see them too
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(DataError, match="Hub cannot be reached.*--data.json_path") as e:
        load_hf_rows("lit-qlora/no-such-dataset-for-tests")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- the shipped demo set

def test_demo_dataset_is_regenerable_and_loads(tok: Tokenizer) -> None:
    rows = load_json_rows(DEMO_DATASET)
    assert len(rows) >= 300
    # The generator is a script beside the package, not part of it: run it as a user would.
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_demo.py"
    out = subprocess.run([sys.executable, str(script), "--stdout"], capture_output=True, text=True, check=True,
                         encoding="utf-8")
    regenerated = out.stdout
    assert DEMO_DATASET.read_text(encoding="utf-8") == regenerated
    dm = SFTDataModule(DataArgs(), tok, max_seq_length=256, micro_batch_size=4, seed=0)
    dm.setup()
    assert len(dm.train_set) + len(dm.val_set) == len(rows) and max(dm.train_lengths) < 128


def test_demo_dataset_is_found_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = "from lit_qlora.data import DEMO_DATASET, load_json_rows; print(len(load_json_rows(DEMO_DATASET)))"
    import lit_qlora

    # The package is importable from elsewhere; the data file must be found next to it, not in the working dir.
    env = {**os.environ, "PYTHONPATH": str(Path(lit_qlora.__file__).parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True)
    assert int(out.stdout) >= 300
