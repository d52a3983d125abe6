"""Validation during training (--train.eval_interval), out_dir/best/, early stopping, and their bad values."""

import json
import shutil
from dataclasses import replace

import pytest
from safetensors.torch import load_file

from lit_qlora.base.errors import UserError
from lit_qlora.train.finetune import finetune
from lit_qlora.train.args import LoRAArgs, TrainArgs
from helpers import metrics_rows, small_data, tensorboard_scalars


def run(tiny_llama_dir, out_dir, data, resume=False, targets=("all",), **train_kw):
    """A tiny LoRA run in fp32 (fast and exact on any CPU), with adapter dropout: dropout draws from torch's RNG,
    so a validation that disturbed it would change the training losses."""
    kw = dict(micro_batch_size=2, global_batch_size=4, max_seq_length=64, lr=1e-2, warmup_steps=1, max_steps=20)
    kw.update(train_kw)
    return finetune(checkpoint_dir=tiny_llama_dir, out_dir=out_dir, quantize="none", precision="32-true",
                    accelerator="cpu", resume=resume, lora=LoRAArgs(r=4, alpha=8, dropout=0.1, targets=list(targets)),
                    data=data, train=TrainArgs(**kw))


HEAD_TOO = ("all", "lm_head")


def val_rows(out_dir):
    return [r for r in metrics_rows(out_dir) if "val_loss" in r]


def train_losses(out_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in metrics_rows(out_dir) if "loss" in r]


def same_tensors(a_dir, b_dir):
    a, b = load_file(str(a_dir / "adapter.safetensors")), load_file(str(b_dir / "adapter.safetensors"))
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.fixture(scope="module")
def validated(tiny_llama_dir, tmp_path_factory):
    """A 20-step run validating every 5 steps (a checkpoint every 5 kept), and the same run without eval_interval."""
    tmp = tmp_path_factory.mktemp("validated")
    data = small_data(tmp)
    summary = run(tiny_llama_dir, tmp / "eval", data, eval_interval=5, save_interval=5, keep_last=4)
    plain = run(tiny_llama_dir, tmp / "plain", data, save_interval=5, keep_last=4)
    return tmp, data, summary, plain


def test_validation_every_5_steps_in_metrics_jsonl_and_tensorboard(validated):
    tmp, _, summary, _ = validated
    out = tmp / "eval"
    rows = val_rows(out)
    assert [r["step"] for r in rows] == [0, 5, 10, 15, 20]
    assert set(rows[1]) == {"step", "val_loss"}
    assert rows[0]["val_loss"] == summary["initial_val_loss"] and rows[-1]["val_loss"] == summary["val_loss"]
    assert len({r["val_loss"] for r in rows}) == 5  # five distinct measurements, not one repeated
    # Each validation row follows its step's training row.
    steps = [(r["step"], "loss" in r) for r in metrics_rows(out)]
    assert steps.index((5, False)) == steps.index((5, True)) + 1
    tb = tensorboard_scalars(out / "logs")["val/loss"]
    assert [s for s, _ in tb] == [0, 5, 10, 15, 20]
    assert [v for _, v in tb] == pytest.approx([r["val_loss"] for r in rows], rel=1e-6)


def test_validations_do_not_change_training(validated):
    tmp, _, summary, plain = validated
    assert train_losses(tmp / "eval") == train_losses(tmp / "plain")  # exactly, dropout included
    assert len(train_losses(tmp / "plain")) == 20
    assert same_tensors(tmp / "eval" / "final", tmp / "plain" / "final")
    assert summary["val_loss"] == plain["val_loss"]


def test_best_holds_the_adapter_of_the_lowest_validation_after_training_started(validated):
    tmp, _, summary, _ = validated
    out = tmp / "eval"
    rows = val_rows(out)[1:]  # the validation before training measures the base: never "best"
    best = min(rows, key=lambda r: r["val_loss"])
    assert json.loads((out / "best" / "best.json").read_text()) == best
    assert same_tensors(out / "best", out / "checkpoints" / f"step-{best['step']:06d}")
    config = json.loads((out / "best" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["quantize"] == "none"
    final = json.loads((out / "final" / "adapter_config.json").read_text())
    assert (final["best_step"], final["best_val_loss"], final["stopped_early"]) == (best["step"], best["val_loss"], False)
    assert (summary["best_step"], summary["stopped_early"], summary["stopped_at_step"]) == (best["step"], False, None)
    assert not (tmp / "plain" / "best").exists() and "best_step" not in summary_of(tmp / "plain")


def summary_of(out_dir):
    return json.loads((out_dir / "summary.json").read_text())


def test_a_resume_validates_as_the_uninterrupted_run(validated, tiny_llama_dir):
    """Killed after step 12 (its last checkpoint step 10): the resume redoes step 15's and 20's validations and
    ends with the same rows, best/ and summary."""
    tmp, data, summary, _ = validated
    out = tmp / "resumed"
    shutil.copytree(tmp / "eval", out)
    for step in (15, 20):
        shutil.rmtree(out / "checkpoints" / f"step-{step:06d}")
    for name in ("final", "summary.json", "best"):
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    resumed = run(tiny_llama_dir, out, data, resume="auto", eval_interval=5, save_interval=5, keep_last=4)
    assert val_rows(out) == val_rows(tmp / "eval")
    assert train_losses(out) == train_losses(tmp / "eval")
    assert (out / "best" / "best.json").read_text() == (tmp / "eval" / "best" / "best.json").read_text()
    for key in ("val_loss", "best_step", "best_val_loss", "stopped_early"):
        assert resumed[key] == summary[key], key


def test_early_stopping_stops_after_patience_validations_without_improvement(tiny_llama_dir, tmp_path):
    """lr 1 on the tiny model: validation loss falls, then rises; with patience 2 the run stops at the second
    validation in a row above the best, and final/ is the best adapter."""
    out = tmp_path / "run"
    # the head adapted too (the tiny model ties it: named) and alpaca rows: lr 1 then overshoots within 20 steps
    data = replace(small_data(tmp_path), prompt_style="alpaca")
    summary = run(tiny_llama_dir, out, data, lr=1.0, eval_interval=2, early_stopping_patience=2,
                  save_interval=2, keep_last=20, targets=HEAD_TOO)
    rows = val_rows(out)[1:]
    best, since, expected_stop = rows[0], 0, None
    for r in rows[1:]:  # the rule, restated: strictly lower is an improvement
        if r["val_loss"] < best["val_loss"]:
            best, since = r, 0
        else:
            since += 1
            if since == 2:
                expected_stop = r["step"]
                break
    assert expected_stop is not None and expected_stop < 20, rows  # the learning rate did make it rise
    assert rows[-1]["step"] == expected_stop  # nothing validated after the stop...
    assert max(r["step"] for r in metrics_rows(out)) == expected_stop  # ...nor trained
    assert (summary["stopped_early"], summary["stopped_at_step"], summary["steps"]) == (True, expected_stop,
                                                                                       expected_stop)
    assert (summary["best_step"], summary["best_val_loss"], summary["val_loss"]) == (best["step"], best["val_loss"],
                                                                                     best["val_loss"])
    assert same_tensors(out / "final", out / "best")
    assert same_tensors(out / "final", out / "checkpoints" / f"step-{best['step']:06d}")
    state = json.loads((out / "checkpoints" / f"step-{expected_stop:06d}" / "state.json").read_text())
    assert state["validation"]["stopped_early"] == expected_stop
    # A resume of the stopped run says it is complete and changes nothing.
    before = (out / "summary.json").read_text()
    again = run(tiny_llama_dir, out, data, resume="auto", lr=1.0, eval_interval=2,
                early_stopping_patience=2, save_interval=2, keep_last=20, targets=HEAD_TOO)
    assert (out / "summary.json").read_text() == before and again == json.loads(before)
    assert max(r["step"] for r in metrics_rows(out)) == expected_stop
    assert (again["best_step"], again["stopped_at_step"]) == (best["step"], expected_stop)
    assert same_tensors(out / "final", out / "best")
    # A run killed while exporting after the stop (summary.json gone) exports again without training on.
    (out / "summary.json").unlink()
    again = run(tiny_llama_dir, out, data, resume="auto", lr=1.0, eval_interval=2,
                early_stopping_patience=2, save_interval=2, keep_last=20, targets=HEAD_TOO)
    assert max(r["step"] for r in metrics_rows(out)) == expected_stop
    assert (again["steps"], again["stopped_at_step"]) == (expected_stop, expected_stop)
    assert same_tensors(out / "final", out / "best")


@pytest.mark.parametrize("train_kw, val_split, message", [
    (dict(eval_interval=0), 0.25, "--train.eval_interval must be at least 1"),
    (dict(eval_interval=5, early_stopping_patience=0), 0.25, "--train.early_stopping_patience must be at least 1"),
    (dict(early_stopping_patience=3), 0.25, "pass --train.eval_interval N too"),
    (dict(eval_interval=5), 0.0, "--data.val_split is 0"),
])
def test_bad_validation_options_are_refused_before_anything_loads(tmp_path, train_kw, val_split, message):
    data = small_data(tmp_path)
    data.val_split = val_split
    with pytest.raises(UserError, match=message):
        finetune(out_dir=tmp_path / "out", accelerator="cpu", data=data, precision="32-true",
                 train=TrainArgs(**train_kw))
    assert not (tmp_path / "out").exists()  # refused before any output (or model load)


def test_a_validation_row_is_not_written_twice_for_one_step(tmp_path):
    """A run killed after its final validation's row, before final/, validates that step again when resumed."""
    import json as _json

    from lit_qlora.train.validation import write_val_row

    write_val_row(tmp_path, 0, 2.5, True)
    write_val_row(tmp_path, 5, 2.0, True)
    write_val_row(tmp_path, 5, 2.0, True)  # the resumed run's repeat
    write_val_row(tmp_path, 5, 2.0, False)  # other ranks never write
    rows = [_json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "val_loss": 2.5}, {"step": 5, "val_loss": 2.0}]
