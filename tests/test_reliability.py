"""A fine-tune survives kill -9, SIGTERM/SIGINT and non-finite numbers: atomic checkpoints, exact resume, no
non-finite weights on disk, nothing unpickled."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from lit_qlora.checkpoint.files import replace_dir
from lit_qlora.cli import main
from lit_qlora.train.loss import chunked_cross_entropy_sum
from lit_qlora.lora.layer import LoRALinear, lora_state_dict
from lit_qlora.train.state import latest_checkpoint, load_training_state, save_training_state
from lit_qlora.train.module import FinetuneModule

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "rows.json"
    path.write_text(json.dumps([{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."}
                                for i in range(24)]))
    return path


def args(base, rows, out_dir, *extra):
    """A tiny QLoRA run (NF4 base, bf16) with dropout, so the resumed RNG matters too."""
    return [str(a) for a in ["finetune", "--checkpoint_dir", base, "--out_dir", out_dir, "--accelerator", "cpu",
                             "--data.json_path", rows, "--data.val_split", "0.25", "--lora.r", "4", "--lora.alpha", "8",
                             "--lora.dropout", "0.1", "--train.max_steps", STEPS, "--train.max_seq_length", "64",
                             "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.lr", "1e-2",
                             "--train.warmup_steps", "1", "--train.save_interval", "1", "--train.keep_last", "3",
                             *extra]]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, rows, tmp_path_factory):
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("reference")
    main(args(tiny_llama_dir, rows, out))
    return out


def adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter.safetensors"))


def assert_same_adapter(a: Path, b: Path) -> None:
    x, y = adapter(a), adapter(b)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def metric_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def child(code: str, *argv) -> subprocess.Popen:
    """`litqlora` in a child process, with `code` run first (to time a signal deterministically)."""
    script = f"import sys\n{code}\nfrom lit_qlora.cli import main\nmain(sys.argv[2:])\n"
    return subprocess.Popen([sys.executable, "-c", script, *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def kill_9_where_it_pauses(code: str, marker: Path, *argv) -> None:
    """`litqlora ARGV` in a child whose `code` touches `marker` (sys.argv[1]) where it pauses; SIGKILL it there, from
    outside, as a machine failure would."""
    proc = child(code, marker, *argv)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"the child never reached the point where it touches {marker.name}"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def test_reference_keeps_the_last_k_checkpoints_as_safetensors_and_json(reference):
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == ["step-000002", "step-000003",
                                                                             "step-000004"]
    written = [p for p in reference.rglob("*") if p.is_file() and "logs" not in p.relative_to(reference).parts]
    assert {p.suffix for p in written} == {".safetensors", ".json", ".jsonl"}  # .jsonl: metrics.jsonl only
    assert [p.name for p in written if p.suffix == ".jsonl"] == ["metrics.jsonl"]
    state = json.loads((reference / "checkpoints" / "step-000004" / "state.json").read_text())
    assert state["step"] == STEPS and state["total_steps"] == STEPS and state["run"]["train"]["keep_last"] == 3
    assert sorted(p.name for p in (reference / "checkpoints" / "step-000004").iterdir()) == [
        "adapter.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"]


KILL_DURING_CHECKPOINT_3 = """
import time
from pathlib import Path
import lit_qlora.train.state as ts
real = ts.write_safetensors
def write(path, specs, metadata=None):
    if path.parent.name == "step-000003.tmp" and path.name == "optimizer.safetensors":
        Path(sys.argv[1]).touch()  # checkpoint 3 is half written: the parent kills us now
        time.sleep(600)
    return real(path, specs, metadata)
ts.write_safetensors = write
"""


def test_kill_9_mid_checkpoint_then_resume_auto_is_bit_exact(tiny_llama_dir, rows, reference, tmp_path):
    out = tmp_path / "run"
    kill_9_where_it_pauses(KILL_DURING_CHECKPOINT_3, tmp_path / "half-written", *args(tiny_llama_dir, rows, out))
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001", "step-000002", "step-000003.tmp"]
    assert sorted(p.name for p in (checkpoints / "step-000003.tmp").iterdir()) == ["adapter.safetensors"]
    assert latest_checkpoint(out) == checkpoints / "step-000002"
    assert metric_steps(out) == [1, 2, 3]  # step 3 was logged, its checkpoint never completed

    main(args(tiny_llama_dir, rows, out, "--resume", "auto"))
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2
    assert_same_adapter(out / "final", reference / "final")
    assert_same_adapter(checkpoints / "step-000003", reference / "checkpoints" / "step-000003")
    assert metric_steps(out) == [1, 2, 3, 4]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses == [json.loads(line)["loss"] for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002", "step-000003", "step-000004"]


SIGNAL_IN_STEP_2 = """
import os, signal
from lit_qlora.train.module import FinetuneModule
real = FinetuneModule.training_step
def step(self, batch, batch_idx):
    if self.step == 1:  # the signal arrives at the start of the second optimizer step
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return real(self, batch, batch_idx)
FinetuneModule.training_step = step
"""


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_signal_saves_at_the_next_step_and_resume_matches(signame, tiny_llama_dir, rows, reference, tmp_path):
    out = tmp_path / "run"
    proc = child(SIGNAL_IN_STEP_2, signame, *args(tiny_llama_dir, rows, out, "--train.save_interval", "100"))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + getattr(signal, signame), err[-2000:]
    assert "Traceback" not in err
    assert f"litqlora: stopped by {signame} after optimizer step 2 of {STEPS}" in err
    assert "step-000002" in err and "--resume auto" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]  # saved only because of the signal
    assert not (out / "final").exists()

    main(args(tiny_llama_dir, rows, out, "--train.save_interval", "100", "--resume", "auto"))
    assert_same_adapter(out / "final", reference / "final")


def nan_loss_at_step_2(self, batch):
    hidden = self.model.forward_hidden(batch["input_ids"])
    loss = chunked_cross_entropy_sum(self.model.lm_head, hidden, batch["labels"])
    return loss * float("nan") if self.training and self.step == 1 else loss


def inf_gradients_at_step_2(self, batch):
    hidden = self.model.forward_hidden(batch["input_ids"])
    if self.training and self.step == 1:
        hidden.register_hook(lambda grad: grad * float("inf"))  # the loss stays finite, the gradients do not
    return chunked_cross_entropy_sum(self.model.lm_head, hidden, batch["labels"])


NONFINITE = {"loss": nan_loss_at_step_2, "gradients": inf_gradients_at_step_2}


@pytest.mark.parametrize("what", list(NONFINITE))
def test_nonfinite_stop_names_the_step_and_saves_nothing_of_it(what, tiny_llama_dir, rows, tmp_path, monkeypatch,
                                                                capsys):
    monkeypatch.setattr(FinetuneModule, "micro_loss_sum", NONFINITE[what])
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(args(tiny_llama_dir, rows, out))
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert re.search(rf"litqlora: error: The {what} became (nan|inf|non-finite).* at optimizer step 2;", err), err
    assert "--train.on_nonfinite skip" in err and "Traceback" not in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]
    assert not (out / "final").exists()


@pytest.mark.parametrize("what", list(NONFINITE))
def test_nonfinite_skip_leaves_weights_untouched_and_finite(what, tiny_llama_dir, rows, tmp_path, monkeypatch):
    monkeypatch.setattr(FinetuneModule, "micro_loss_sum", NONFINITE[what])
    out = tmp_path / "run"
    main(args(tiny_llama_dir, rows, out, "--train.on_nonfinite", "skip", "--train.keep_last", "4"))
    rows_logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_logged] == [1, 2, 3, 4]
    assert rows_logged[1]["loss"] is None and f"The {what} became" in rows_logged[1]["skipped"]
    assert all(r["loss"] is not None and "skipped" not in r for i, r in enumerate(rows_logged) if i != 1)
    ckpt = out / "checkpoints"
    assert_same_adapter(ckpt / "step-000001", ckpt / "step-000002")  # the skipped step changed nothing
    step3, final = adapter(ckpt / "step-000003"), adapter(out / "final")
    assert any(not torch.equal(step3[k], adapter(ckpt / "step-000002")[k]) for k in step3)
    assert all(torch.isfinite(t).all() for t in final.values())


def tiny_lora_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.proj = LoRALinear(nn.Linear(8, 8), r=2, alpha=4.0)
    return model


def test_a_killed_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    model = tiny_lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.proj(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    saved = {k: v.clone() for k, v in lora_state_dict(model).items()}
    good = save_training_state(tmp_path, 1, model, optimizer, {"total_steps": 9}, keep_last=2)
    # What kills at other moments leave behind: a half-written temporary checkpoint, a file's temporary copy,
    # a step directory without its state.json (written last).
    (tmp_path / "checkpoints" / "step-000002.tmp").mkdir()
    (tmp_path / "checkpoints" / "step-000002.tmp" / "adapter.safetensors").write_bytes(b"\x10\x00\x00")
    (good / "optimizer.safetensors.tmp").write_bytes(b"\x00" * 5)
    (tmp_path / "checkpoints" / "step-000003").mkdir()
    (tmp_path / "checkpoints" / "step-000003" / "adapter.safetensors").write_bytes(b"")
    assert latest_checkpoint(tmp_path) == good

    fresh = tiny_lora_model()
    with torch.no_grad():
        fresh.proj.lora_B.fill_(7.0)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=0.1)
    assert load_training_state(good, fresh, fresh_opt)["step"] == 1
    assert all(torch.equal(saved[k], v) for k, v in lora_state_dict(fresh).items())
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])

    with torch.no_grad():
        model.proj.lora_B[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="not finite .*proj.lora_B.*checkpoint step-000004 was not written"):
        save_training_state(tmp_path, 4, model, optimizer, {"total_steps": 9}, keep_last=2)
    assert not (tmp_path / "checkpoints" / "step-000004").exists()
    assert not (tmp_path / "checkpoints" / "step-000004.tmp").exists()
    with torch.no_grad():
        model.proj.lora_B[0, 0] = 0.0
    assert save_training_state(tmp_path, 2, model, optimizer, {"total_steps": 9}, keep_last=2).name == "step-000002"
    assert not (tmp_path / "checkpoints" / "step-000002.tmp").exists()
    assert latest_checkpoint(tmp_path).name == "step-000002"


def test_library_never_unpickles_or_trusts_remote_code():
    sources = [p for d in ("lit_qlora", "eval") for p in (ROOT / d).rglob("*.py")]
    assert len(sources) > 10
    for path in sources:
        text = path.read_text()
        assert "trust_remote_code=True" not in text, path
        assert not re.search(r"\bpickle\.loads?\(|\bdill\.|joblib\.load", text), path
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (path, call)


def snapshot(out: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}


def test_resuming_a_finished_run_says_so_and_changes_nothing(tiny_llama_dir, rows, reference, tmp_path, capsys):
    out = tmp_path / "done"
    shutil.copytree(reference, out)
    before = snapshot(out)
    capsys.readouterr()
    summary = main(args(tiny_llama_dir, rows, out, "--resume", "auto"))  # main returns: exit code 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1, printed  # one line, and no "Resuming from" before it
    assert printed[0].startswith(f"{out} is already complete: {STEPS} of {STEPS} steps trained, the adapter and "
                                 f"exports are in {out / 'final'}/, the results in {out / 'summary.json'}. Nothing was "
                                 "changed")
    assert snapshot(out) == before
    assert summary is None or summary == json.loads((out / "summary.json").read_text())


def test_a_run_killed_before_its_summary_exports_again_without_losing_its_numbers(tiny_llama_dir, rows, reference,
                                                                                   tmp_path):
    """The last checkpoint is written, summary.json is not: the resume validates and exports, and summary.json
    still has the run's first validation loss and last training loss (not nulls)."""
    out = tmp_path / "no-summary"
    shutil.copytree(reference, out)
    (out / "summary.json").unlink()
    main(args(tiny_llama_dir, rows, out, "--resume", "auto"))
    summary, ref = json.loads((out / "summary.json").read_text()), json.loads((reference / "summary.json").read_text())
    assert summary["initial_val_loss"] == ref["initial_val_loss"] is not None
    assert summary["train_loss"] == ref["train_loss"] is not None
    assert summary["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6)
    assert_same_adapter(out / "final", reference / "final")


@pytest.mark.parametrize("changes, named", [
    (["--seed", "7"], ["seed 1337 -> 7"]),
    (["--train.lr", "0.02", "--train.max_seq_length", "32"], ["train.lr 0.01 -> 0.02", "train.max_seq_length 64 -> 32"]),
    (["--train.global_batch_size", "2", "--data.val_split", "0.5"],
     ["train.global_batch_size 4 -> 2", "data.val_split 0.25 -> 0.5"]),
])
def test_resume_with_another_recipe_is_refused_naming_what_changed(tiny_llama_dir, rows, reference, tmp_path,
                                                                   capsys, changes, named):
    out = tmp_path / "changed"
    shutil.copytree(reference, out)
    (out / "summary.json").unlink()  # unfinished as far as a resume can tell
    before = snapshot(out)
    with pytest.raises(SystemExit) as refused:
        main(args(tiny_llama_dir, rows, out, "--resume", "auto", *changes))
    err = capsys.readouterr().err
    assert refused.value.code == 1 and "Traceback" not in err
    assert "step-000004/state.json belongs to a run with other settings" in err and "another --out_dir" in err
    assert all(change in err for change in named), err
    assert snapshot(out) == before


def test_resume_after_the_datasets_rows_were_edited_is_refused(tiny_llama_dir, rows, reference, tmp_path, capsys):
    """Same --data.json_path, other rows: checkpoints record the file's sha256, so the resume is refused."""
    out, data = tmp_path / "edited", tmp_path / "rows.json"
    shutil.copytree(reference, out)
    shutil.copy(rows, data)
    recorded = json.loads((out / "checkpoints" / "step-000004" / "state.json").read_text())["run"]["data_sha256"]
    assert recorded == hashlib.sha256(rows.read_bytes()).hexdigest()
    # The reference run as if started with this copy of its rows (the same bytes: the same sha256).
    for state_file in (out / "checkpoints").glob("*/state.json"):
        state = json.loads(state_file.read_text())
        state["run"]["data"]["json_path"] = str(data)
        state_file.write_text(json.dumps(state))
    main(args(tiny_llama_dir, data, out, "--resume", "auto"))  # the same rows: nothing to refuse
    assert "is already complete" in capsys.readouterr().out

    edited = json.loads(data.read_text())
    edited[5]["output"] = "5 + 8 = 14."
    data.write_text(json.dumps(edited))
    before = snapshot(out)
    with pytest.raises(SystemExit) as refused:
        main(args(tiny_llama_dir, data, out, "--resume", "auto"))
    err = capsys.readouterr().err
    now = hashlib.sha256(data.read_bytes()).hexdigest()
    assert refused.value.code == 1 and "Traceback" not in err
    assert f"step-000004/state.json belongs to a run with other settings (the dataset file's contents (sha256 " \
           f"{recorded[:12]}... -> {now[:12]}...)):" in err, err
    assert snapshot(out) == before


def test_resume_may_change_how_often_it_logs_and_saves(tiny_llama_dir, rows, reference, tmp_path):
    out = tmp_path / "logs-less"
    shutil.copytree(reference, out)
    (out / "summary.json").unlink()
    main(args(tiny_llama_dir, rows, out, "--resume", "auto", "--train.log_interval", "2", "--train.keep_last", "1"))
    assert (out / "summary.json").is_file()


PAUSE_IN_MERGED_EXPORT = """
import time
from pathlib import Path
import lit_qlora.checkpoint.hf as ck
real = ck.write_safetensors
def write(path, specs, metadata=None):
    if path.parent.name == "merged" and path.parent.parent.name == ".final.tmp":
        def pause():
            Path(sys.argv[1]).touch()  # merged/model.safetensors is half written: the parent kills us now
            time.sleep(600)
        specs = [specs[0], ck.TensorSpec(specs[1].name, specs[1].shape, specs[1].dtype, pause), *specs[2:]]
    return real(path, specs, metadata)
ck.write_safetensors = write
"""


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_kill_9_during_export_leaves_no_final_and_resume_writes_it_whole(tiny_llama_dir, rows, reference, tmp_path):
    """SIGKILL from outside while the merged model is half written: no final/ (nor summary.json) exists, only the
    .final.tmp build; `--resume auto` removes it and writes the same final/, byte for byte, as the uninterrupted run."""
    out = tmp_path / "killed-export"
    kill_9_where_it_pauses(PAUSE_IN_MERGED_EXPORT, tmp_path / "merged-half-written", *args(tiny_llama_dir, rows, out))
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    merged = out / ".final.tmp" / "merged"
    assert [p.name for p in merged.iterdir()] == ["model.safetensors.tmp"]  # killed inside its first file
    assert latest_checkpoint(out).name == f"step-{STEPS:06d}"  # training itself had finished

    main(args(tiny_llama_dir, rows, out, "--resume", "auto"))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no .final.tmp or .final.old left
    assert sorted(p.name for p in (out / "final").iterdir()) == ["adapter.safetensors", "adapter_config.json", "merged",
                                                                 "peft"]
    assert files_of(out / "final") == files_of(reference / "final")
    summary, ref = json.loads((out / "summary.json").read_text()), json.loads((reference / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["resumed_from_step"] == STEPS
    assert summary["initial_val_loss"] == ref["initial_val_loss"] and summary["train_loss"] == ref["train_loss"]
    assert summary["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6)


def test_replacing_a_directory_never_leaves_a_half_deleted_one(tmp_path, monkeypatch):
    """replace_dir swaps by renames only: a kill between them leaves the old directory whole (as .NAME.old) and the
    target absent, never a partly deleted target; the next call cleans up. A file in the way is replaced too."""
    target, staging = tmp_path / "final", tmp_path / ".final.tmp"
    for folder, names in ((target, ["a", "b", "c"]), (staging, ["new"])):
        folder.mkdir()
        for name in names:
            (folder / name).write_text(name)
    real, renames = os.replace, []

    def killed_before_the_second_rename(src, dst):
        renames.append((Path(src).name, Path(dst).name))
        if len(renames) == 2:
            raise KeyboardInterrupt  # stands for the kill
        real(src, dst)

    monkeypatch.setattr(os, "replace", killed_before_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        replace_dir(staging, target)
    monkeypatch.undo()
    assert renames == [("final", ".final.old"), (".final.tmp", "final")]
    assert not target.exists() and sorted(p.name for p in (tmp_path / ".final.old").iterdir()) == ["a", "b", "c"]
    replace_dir(staging, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"] and files_of(target) == {"new": b"new"}

    (tmp_path / "file").write_text("old")
    (tmp_path / "staged").mkdir()
    replace_dir(tmp_path / "staged", tmp_path / "file")
    assert (tmp_path / "file").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["file", "final"]


def test_a_finished_run_trains_on_when_max_steps_grows_and_refuses_to_shrink(tiny_llama_dir, rows, reference,
                                                                              tmp_path, capsys):
    out = tmp_path / "longer"
    shutil.copytree(reference, out)
    main(args(tiny_llama_dir, rows, out, "--resume", "auto", "--train.max_steps", STEPS + 1))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS + 1 and summary["resumed_from_step"] == STEPS
    assert metric_steps(out) == list(range(1, STEPS + 2))
    longer = files_of(out / "final")
    assert_same_adapter(out / "final", out / "checkpoints" / f"step-{STEPS + 1:06d}")

    # Killed while exporting the longer run: its last checkpoint is written, final/ and summary.json are still the
    # shorter run's. That run is not complete: the resume exports the longer one, it does not report the old one.
    shutil.rmtree(out / "final")
    shutil.copytree(reference / "final", out / "final")
    shutil.copy(reference / "summary.json", out / "summary.json")
    capsys.readouterr()
    main(args(tiny_llama_dir, rows, out, "--resume", "auto", "--train.max_steps", STEPS + 1))
    assert "already complete" not in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["steps"] == STEPS + 1
    assert files_of(out / "final") == longer

    with pytest.raises(SystemExit):
        main(args(tiny_llama_dir, rows, out, "--resume", "auto", "--train.max_steps", 2))
    assert f"train.max_steps {STEPS + 1} -> 2" in capsys.readouterr().err


@pytest.mark.parametrize("lora_head", [False, True])
def test_chunked_loss_gradients_equal_the_whole_loss_and_the_head_runs_once_per_chunk(lora_head):
    """The chunked loss computes each chunk's gradients in forward (no recomputation of the head in backward):
    loss and gradients of hidden states and of the head's LoRA factors equal one whole-batch cross-entropy."""
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    if lora_head:
        head = LoRALinear(head, r=2, alpha=4)
        nn.init.normal_(head.lora_B)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :3] = -100
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    loss = chunked_cross_entropy_sum(head, hidden, labels, chunk_tokens=4)
    (loss * 0.5).backward()
    assert len(calls) == 4  # 13 targets in chunks of 4: one head call each, none again in backward
    got = [hidden.grad] + [p.grad for p in head.parameters() if p.requires_grad]
    for p in [hidden, *head.parameters()]:
        p.grad = None
    logits = head(hidden[:, :-1]).float()
    whole = nn.functional.cross_entropy(logits.reshape(-1, 50), labels[:, 1:].reshape(-1), ignore_index=-100,
                                        reduction="sum")
    (whole * 0.5).backward()
    torch.testing.assert_close(loss, whole.detach(), rtol=1e-5, atol=1e-5)
    want = [hidden.grad] + [p.grad for p in head.parameters() if p.requires_grad]
    assert len(got) == (3 if lora_head else 2)  # hidden and A, B; or hidden and the plain weight
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
