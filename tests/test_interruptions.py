"""Interrupted runs and running the same command again.

SIGINT / SIGTERM end a fine-tune within seconds wherever they arrive (a step that takes minutes, as a compiling one
does; a validation), with a resumable checkpoint or a note that none exists yet; a second signal ends it at once; the
run's handlers never outlive it, so Ctrl+C stops a pytest session that fine-tunes in-process. `make demo` again
finishes an interrupted demo, a resumed run's summary covers the whole run, and a new run does not start over another
run's files unless told to."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import pytest

from lit_qlora.cli import main
from lit_qlora.train.signals import StopRequested, StopSignals, TrainingStopped

STEPS = 4

# Runs before `litqlora` in a child (argv: marker, where, seconds, litqlora arguments...): at `where` (the second
# optimizer step, the first or the final validation) it touches the marker, for the parent to signal it then, and
# pauses `seconds`, as a compiling step or a slow validation batch would.
PAUSE = """
import sys, time
from pathlib import Path
from lit_qlora.train.module import FinetuneModule
marker, where, seconds = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
def pause():
    if not marker.exists():
        marker.touch()
        time.sleep(seconds)
real_step, real_validation = FinetuneModule.training_step, FinetuneModule.validation_step
def training_step(self, batch, batch_idx):
    if where == "step" and self.step == 1:
        pause()
    return real_step(self, batch, batch_idx)
def validation_step(self, batch, batch_idx):
    if where == ("first-validation" if self.step == 0 else "final-validation"):
        pause()
    return real_validation(self, batch, batch_idx)
FinetuneModule.training_step, FinetuneModule.validation_step = training_step, validation_step
from lit_qlora.cli import main
main(sys.argv[4:])
"""


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "rows.json"
    path.write_text(json.dumps([{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."}
                                for i in range(24)]))
    return path


def finetune_args(base: Path, rows: Path, out_dir: Path, *extra) -> list[str]:
    """A tiny QLoRA run that saves a checkpoint after every step (fp32: fast on CPUs without native bf16 too)."""
    return [str(a) for a in ["finetune", "--checkpoint_dir", base, "--out_dir", out_dir, "--accelerator", "cpu",
                             "--precision", "32-true", "--data.json_path", rows, "--data.val_split", "0.25",
                             "--lora.r", "4", "--lora.alpha", "8", "--train.max_steps", STEPS,
                             "--train.max_seq_length", "64", "--train.micro_batch_size", "2",
                             "--train.global_batch_size", "4", "--train.save_interval", "1", *extra]]


class Child:
    """`litqlora ARGS` in a child process that pauses at `where`; its stderr is collected as it comes."""

    def __init__(self, tmp_path: Path, where: str, seconds: float, args: list[str]) -> None:
        self.marker = tmp_path / "paused"
        self.proc = subprocess.Popen([sys.executable, "-c", PAUSE, str(self.marker), where, str(seconds), *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    @property
    def err(self) -> str:
        return "".join(self.lines)

    def wait_for(self, condition, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the child ended before {what}:\n{self.err[-3000:]}"
            assert time.monotonic() < deadline, f"the child never reached {what}"
            time.sleep(0.05)

    def signal_when_paused(self, signum: int) -> float:
        self.wait_for(self.marker.exists, "its pause")
        sent = time.monotonic()
        os.kill(self.proc.pid, signum)
        return sent

    def seconds_to_exit(self, since: float) -> float:
        self.proc.wait(timeout=60)
        elapsed = time.monotonic() - since
        self._reader.join(timeout=10)  # its stderr, read to the end
        return elapsed

    def exit_code(self) -> int:
        self.seconds_to_exit(time.monotonic())
        return self.proc.returncode


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_during_a_step_that_takes_minutes_ends_the_run_within_10_s(signame, tiny_llama_dir, rows,
                                                                            tmp_path):
    out = tmp_path / "run"
    child = Child(tmp_path, "step", 600, finetune_args(tiny_llama_dir, rows, out))
    sent = child.signal_when_paused(getattr(signal, signame))
    assert child.seconds_to_exit(sent) < 10
    err = child.err
    assert child.proc.returncode == 128 + getattr(signal, signame), err[-3000:]
    assert "Traceback" not in err
    assert f"litqlora: stopped by {signame}: the current step or validation did not reach a safe point" in err
    assert f"{out / 'checkpoints' / 'step-000001'} (optimizer step 1 of {STEPS})" in err
    assert "Run the same command with --resume auto" in err
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")] == ["step-000001"]


@pytest.mark.parametrize("signame, where, seconds, expected", [
    # The first validation takes minutes: nothing is saved yet, and the line says so.
    ("SIGTERM", "first-validation", 600, "the current step or validation did not reach a safe point within 5 s; "
                                         "no checkpoint exists yet"),
    ("SIGINT", "final-validation", 600, "did not reach a safe point within 5 s; the newest checkpoint"),
    # A validation batch that ends within the grace is a safe point: the run stops there, through Lightning.
    ("SIGINT", "final-validation", 1, "stopped by SIGINT during validation; the newest checkpoint"),
])
def test_a_signal_during_validation_ends_the_run_within_10_s(signame, where, seconds, expected, tiny_llama_dir, rows,
                                                             tmp_path):
    out = tmp_path / "run"
    child = Child(tmp_path, where, seconds, finetune_args(tiny_llama_dir, rows, out))
    sent = child.signal_when_paused(getattr(signal, signame))
    assert child.seconds_to_exit(sent) < 10
    err = child.err
    assert child.proc.returncode == 128 + getattr(signal, signame), err[-3000:]
    assert "Traceback" not in err and expected in err, err[-3000:]
    if where == "final-validation":  # the last step's checkpoint is there: resuming exports
        assert f"{out / 'checkpoints' / 'step-000004'} (optimizer step 4 of {STEPS})" in err
        assert "--resume auto" in err and not (out / "final").exists()
    else:
        assert "run the same command again to start it over" in err and not (out / "checkpoints").exists()


def test_a_second_ctrl_c_ends_the_run_at_once_with_one_line(tiny_llama_dir, rows, tmp_path):
    out = tmp_path / "run"
    child = Child(tmp_path, "step", 600, finetune_args(tiny_llama_dir, rows, out))
    child.signal_when_paused(signal.SIGINT)
    child.wait_for(lambda: "received SIGINT" in child.err, "the first signal's message", timeout=5)
    sent = time.monotonic()
    os.kill(child.proc.pid, signal.SIGINT)
    assert child.seconds_to_exit(sent) < 2
    err = child.err
    assert child.proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("litqlora: stopped at once by a second SIGINT, without saving; the newest checkpoint, ")
    assert "step-000001" in last and "--resume auto" in last


GENERATED_TESTS = """
import signal, sys, time
from pathlib import Path
from lit_qlora.cli import main
from lit_qlora.train.module import FinetuneModule

ARGS = {args!r}
TMP = Path({tmp!r})

def test_a_run_gives_the_signal_handlers_back():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    main(ARGS + ["--out_dir", str(TMP / "first")])
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before

def test_interrupted_here(monkeypatch):
    real = FinetuneModule.training_step
    def step(self, batch, batch_idx):
        if self.step == 1:
            (TMP / "paused").touch()  # the parent sends SIGINT now; the step ends a second later
            time.sleep(1)
        return real(self, batch, batch_idx)
    monkeypatch.setattr(FinetuneModule, "training_step", step)
    main(ARGS + ["--out_dir", str(TMP / "second")])

def test_never_reached():
    (TMP / "reached").touch()
"""


def test_ctrl_c_during_a_test_that_fine_tunes_in_process_stops_pytest(tiny_llama_dir, rows, tmp_path):
    test_file = tmp_path / "test_generated.py"  # (its tests give --out_dir again: the last one counts)
    test_file.write_text(GENERATED_TESTS.format(args=finetune_args(tiny_llama_dir, rows, tmp_path / "unused"),
                                                tmp=str(tmp_path)))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(test_file)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (tmp_path / "paused").exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out[-3000:]  # pytest's "interrupted"
    assert not (tmp_path / "reached").exists()
    assert "1 passed" in out and "Interrupted: 130" in out  # pytest took the stop for a KeyboardInterrupt
    assert "stopped by SIGINT after optimizer step 2" in out
    assert (tmp_path / "second" / "checkpoints" / "step-000002").is_dir()


# ------------------------------------------------------------------------------------ StopSignals, in this process

def sentinel(signum, frame) -> None:
    raise AssertionError("the run's handler should be in place")


@pytest.fixture
def previous_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in saved:
        signal.signal(s, sentinel)
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("ending, raised", [("returns", None), ("raises", ValueError), ("stops", TrainingStopped)])
def test_the_callers_handlers_are_back_however_the_run_ends(ending, raised, previous_handlers):
    stop = StopSignals(lambda: "nothing to resume")
    with pytest.raises(raised) if raised else nullcontext():
        with stop:
            assert signal.getsignal(signal.SIGINT) == stop._handle
            assert signal.getsignal(signal.SIGTERM) == stop._handle
            if ending == "raises":
                raise ValueError("a failing run")
            if ending == "stops":
                raise StopRequested("stopped by SIGTERM during validation", signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) is sentinel and signal.getsignal(signal.SIGTERM) is sentinel


def test_a_stop_inside_lightning_becomes_a_keyboard_interrupt_with_the_exit_code(previous_handlers):
    with pytest.raises(TrainingStopped) as stopped:
        with StopSignals(lambda: ""):
            raise StopRequested("stopped by SIGTERM during validation", signal.SIGTERM)
    assert isinstance(stopped.value, KeyboardInterrupt) and not isinstance(stopped.value, Exception)
    assert stopped.value.exit_code == 143 and str(stopped.value) == "stopped by SIGTERM during validation"


@pytest.mark.parametrize("ending", ["returns", "Lightning's SIGTERM exit"])
def test_a_signal_the_run_had_no_safe_point_for_still_stops_its_caller(ending, previous_handlers):
    """A signal during the export (no safe point after it) or one Lightning's own handler acted on."""
    with pytest.raises(TrainingStopped) as stopped:
        with StopSignals(lambda: "the newest checkpoint is step-000004", grace=600):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs in this thread, between two bytecodes
            if ending != "returns":
                raise SystemExit  # lightning.pytorch.utilities.exceptions.SIGTERMException
    assert stopped.value.exit_code == 143
    finished = "SIGTERM arrived as the run was finishing; it finished and its results are complete."
    stopped_early = "stopped by SIGTERM; the newest checkpoint is step-000004"
    assert str(stopped.value) == (finished if ending == "returns" else stopped_early)
    assert signal.getsignal(signal.SIGTERM) is sentinel


# ---------------------------------------------------------------------------------- running the same command again

ROOT = Path(__file__).resolve().parents[1]


def demo_finetune_args() -> list[str]:
    """`make demo`'s fine-tune, as `litqlora` arguments (its --config made absolute)."""
    demo = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1]
    line = next(line for line in demo.splitlines() if line.strip().startswith("litqlora finetune"))
    args = shlex.split(line)[1:]
    args[args.index("--config") + 1] = str(ROOT / args[args.index("--config") + 1])
    return args


def test_make_demo_again_after_ctrl_c_finishes_the_demo(tiny_llama_dir, tmp_path, capsys):
    """`make demo`'s own fine-tune command (on the tiny model, 3 steps): stopped by Ctrl+C after step 2, the same
    command finishes it, and once more only says that it is complete."""
    out = tmp_path / "demo"
    args = [*demo_finetune_args(), "--checkpoint_dir", str(tiny_llama_dir), "--out_dir", str(out),
            "--accelerator", "cpu", "--train.max_steps", "3"]
    child = Child(tmp_path, "step", 1, args)
    child.signal_when_paused(signal.SIGINT)
    assert child.exit_code() == 130, child.err[-3000:]
    assert "stopped by SIGINT after optimizer step 2 of 3" in child.err and "the same command" in child.err

    main(args)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["resumed_from_step"] == 2 and (out / "final").is_dir()
    capsys.readouterr()
    main(args)
    assert f"{out} is already complete: 3 of 3 steps trained" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text()) == summary


def test_a_resumed_runs_summary_covers_the_whole_run(tiny_llama_dir, rows, tmp_path):
    out = tmp_path / "run"
    child = Child(tmp_path, "step", 2, finetune_args(tiny_llama_dir, rows, out))  # step 2 takes 2 s more
    child.signal_when_paused(signal.SIGTERM)
    assert child.exit_code() == 143, child.err[-3000:]
    first_wall = json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())["totals"]["wall_seconds"]
    assert first_wall > 2

    started = time.monotonic()
    main(finetune_args(tiny_llama_dir, rows, out, "--resume", "auto"))
    resumed_wall = time.monotonic() - started
    summary = json.loads((out / "summary.json").read_text())
    rows_logged = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    seconds = {step: r["tokens"] / r["tokens_per_sec"] for step, r in rows_logged.items()}
    # Each process's first step (1 and 3) is its warm-up; steps 2 and 4 are the run's steady ones.
    assert summary["steps"] == STEPS and summary["resumed_from_step"] == 2 and summary["warmup_steps"] == 2
    assert summary["tokens_per_sec"] == pytest.approx(
        (rows_logged[2]["tokens"] + rows_logged[4]["tokens"]) / (seconds[2] + seconds[4]), rel=1e-6)
    assert summary["first_step_seconds"] == pytest.approx(seconds[1], rel=1e-6)
    assert first_wall < summary["wall_seconds"] <= first_wall + resumed_wall
    # this process's part is said apart: the whole run's time less what the checkpoint counted before it
    assert 0 < summary["process_wall_seconds"] <= resumed_wall
    assert summary["wall_seconds"] - first_wall == pytest.approx(summary["process_wall_seconds"], abs=0.5)
    assert "s of it in this process (resumed at step 2)" in capsys_report(out)


def capsys_report(out):
    from lit_qlora.train.report import print_report

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        print_report(json.loads((out / "summary.json").read_text()), out)
    return buffer.getvalue()


def test_an_out_dir_holding_another_run_is_refused_without_resume_or_overwrite(tiny_llama_dir, rows, tmp_path,
                                                                              capsys):
    out = tmp_path / "run"
    main(finetune_args(tiny_llama_dir, rows, out, "--train.max_steps", "3", "--train.keep_last", "3"))
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    capsys.readouterr()

    with pytest.raises(SystemExit) as refused:
        main(finetune_args(tiny_llama_dir, rows, out, "--train.max_steps", "1"))
    assert refused.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"litqlora: error: {out} holds another fine-tune's summary.json, final/, checkpoints/; ")
    assert "--resume auto" in err and "another --out_dir" in err and "--overwrite true" in err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing touched

    main(finetune_args(tiny_llama_dir, rows, out, "--train.max_steps", "1", "--overwrite", "true"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["resumed_from_step"] == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]  # none of the old run's
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not list(out.glob(".*overwritten"))
