"""lit_qlora.base.threads: the thread count follows the cores other processes leave free; OMP_NUM_THREADS fixes it."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lit_qlora.model import Config
from lit_qlora.base.threads import (CpuTimes, ThreadGovernor, allowed_cpus, cpu_times, govern_threads, others_cores,
                               set_openmp_spin, target_threads, threads_summary, tree_ticks)
from lit_qlora.train.report import threads_rows


@pytest.fixture
def restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_target_threads_is_the_free_cores_rounded_between_one_and_wanted():
    assert target_threads(2, 2, 0.0) == 2
    assert target_threads(2, 2, 0.4) == 2  # background noise under half a core takes nothing away
    assert target_threads(2, 2, 0.6) == 1
    assert target_threads(2, 2, 2.0) == 1  # never below one
    assert target_threads(8, 16, 4.0) == 8  # never above what the process started with
    assert target_threads(8, 16, 12.2) == 4
    assert target_threads(4, 4, 3.9) == 1


def test_others_cores_subtracts_this_process_from_all_busy_ticks():
    before, after = CpuTimes(10.0, 1000, 300), CpuTimes(12.0, 1000 + 350, 300 + 150)
    assert others_cores(before, after, 100) == pytest.approx(1.0)  # (350 - 150) ticks / 100 Hz / 2 s
    assert others_cores(before, CpuTimes(12.0, 1100, 450), 100) == 0.0  # rounding: never negative
    assert others_cores(before, before, 100) == 0.0


def test_cpu_times_reads_only_the_given_cpus_and_this_process():
    cpus = allowed_cpus()
    first = cpu_times(cpus)
    t = time.process_time()
    while time.process_time() - t < 0.3:  # burn 0.3 s of this process's CPU
        pass
    second = cpu_times(cpus)
    own = second.own_ticks - first.own_ticks
    assert 20 <= own <= 60  # ~30 ticks at 100 Hz
    assert second.busy_ticks - first.busy_ticks >= own - 2  # the busy CPUs include ours
    assert cpu_times(frozenset({10**6})).busy_ticks == 0  # a CPU we may not run on counts for nothing


class FakeProc:
    """/proc readings a test scripts: each `advance` adds `seconds`, others' cores and our own cores."""

    def __init__(self):
        self.now = CpuTimes(0.0, 0, 0)

    def advance(self, seconds, others, own):
        n = self.now
        self.now = CpuTimes(n.seconds + seconds, n.busy_ticks + round(100 * seconds * (others + own)),
                            n.own_ticks + round(100 * seconds * own))

    def read(self, cpus):
        return self.now


def test_governor_drops_to_the_free_cores_and_comes_back(restore_threads):
    proc = FakeProc()
    gov = ThreadGovernor(wanted=2, cpus=frozenset({0, 1}), interval=0.95, read=proc.read, ticks_per_second=100,
                         environ={}, clock=lambda: proc.now.seconds)  # (0.95: sums of 1.0 s steps round below)
    assert gov.enabled and gov() == 2 and torch.get_num_threads() == 2
    proc.advance(0.5, others=2.0, own=1.0)
    assert gov() == 2  # the window is not over: nothing read, nothing changed
    proc.advance(0.6, others=2.0, own=1.0)
    assert gov() == 2 and gov.others == pytest.approx(2.0)  # one window asks for 1 thread: maybe a burst
    proc.advance(1.0, others=1.2, own=0.8)  # the second in a row: a competitor
    assert gov() == 1 and torch.get_num_threads() == 1
    proc.advance(1.0, others=1.1, own=0.7)  # still competing
    assert gov() == 1
    proc.advance(1.0, others=0.1, own=1.0)  # the other job ended
    assert gov() == 1
    proc.advance(1.0, others=0.0, own=1.9)
    assert gov() == 2 and torch.get_num_threads() == 2
    proc.advance(1.0, others=1.5, own=1.0)  # a burst of one window
    assert gov() == 2
    proc.advance(1.0, others=0.2, own=1.9)
    assert gov() == 2 and gov.changes == 2
    proc.advance(10.0, others=1.0, own=0.05)  # this process idle while another process worked: no contention
    assert gov() == 2 and gov.others == pytest.approx(0.2)
    proc.advance(1.0, others=0.0, own=1.9)  # and the next window starts after that idle one
    assert gov() == 2 and gov.others == 0.0
    assert gov.changes == 2 and gov.fewest == 1


def test_a_starved_process_on_a_full_machine_still_counts_as_working(restore_threads):
    """More busy processes than cores: a working process gets well under half a core, and the CPUs are full; its
    windows count (it drops to one thread). Idle on the same full machine, it does not."""
    proc = FakeProc()
    gov = ThreadGovernor(wanted=2, cpus=frozenset({0, 1}), interval=0.95, read=proc.read, ticks_per_second=100,
                         environ={}, clock=lambda: proc.now.seconds)
    for _ in range(2):
        proc.advance(1.0, others=1.95, own=0.02)  # idle here while the others fill the CPUs: says nothing
        assert gov() == 2 and gov.others == 0.0
    proc.advance(1.0, others=1.6, own=0.4)  # working, starved: four spinners beside it on two cores
    assert gov() == 2 and gov.others == pytest.approx(1.6)  # one window: maybe a burst
    proc.advance(1.0, others=1.6, own=0.4)
    assert gov() == 1 and torch.get_num_threads() == 1
    proc.advance(1.0, others=1.0, own=0.3)  # under half a core on a machine with a core free: idle time, skipped
    assert gov() == 1 and gov.others == pytest.approx(1.6)


def test_governor_leaves_a_fixed_count_alone(restore_threads):
    proc = FakeProc()
    torch.set_num_threads(2)
    for environ in ({"OMP_NUM_THREADS": "2"},):
        gov = ThreadGovernor(wanted=2, cpus=frozenset({0, 1}), read=proc.read, ticks_per_second=100,
                             environ=environ, clock=lambda: proc.now.seconds)
        proc.advance(2.0, others=2.0, own=0.5)
        assert not gov.enabled and gov() == 2 and torch.get_num_threads() == 2
    one = ThreadGovernor(wanted=1, read=proc.read, environ={})
    assert not one.enabled  # nothing to give back
    no_proc = ThreadGovernor(wanted=2, read=lambda cpus: None, environ={})
    assert not no_proc.enabled and no_proc() == 2


def test_ranks_of_a_multi_process_run_get_a_fixed_share_of_the_cores(restore_threads):
    """WORLD_SIZE ranks on this machine (LOCAL_WORLD_SIZE first, as torchrun sets it): each runs on cpus // ranks
    threads from its first forward on, whatever the others do, so no rank changes its count mid-run."""
    proc = FakeProc()
    torch.set_num_threads(2)
    for environ, cpus, share in (({"WORLD_SIZE": "2"}, {0, 1}, 1), ({"WORLD_SIZE": "2"}, {0, 1, 2, 3, 4}, 2),
                                 ({"LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "6"}, set(range(12)), 4),
                                 ({"WORLD_SIZE": "8"}, {0, 1}, 1)):
        gov = ThreadGovernor(cpus=frozenset(cpus), read=proc.read, ticks_per_second=100, environ=environ,
                             clock=lambda: proc.now.seconds)
        assert not gov.enabled and gov() == share and torch.get_num_threads() == share
        proc.advance(2.0, others=len(cpus), own=1.0)
        assert gov() == share and torch.get_num_threads() == share and gov.changes == 0
    torch.set_num_threads(2)
    gov = ThreadGovernor(cpus=frozenset({0, 1}), read=proc.read, environ={"WORLD_SIZE": "2", "OMP_NUM_THREADS": "2"})
    assert gov() == 2 == torch.get_num_threads()  # where OMP_NUM_THREADS is set, the count stays as it is


def test_set_openmp_spin_respects_the_users_choice():
    env = {}
    set_openmp_spin(env)
    assert env == {"GOMP_SPINCOUNT": "30000"}
    for mine in ({"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "passive"}):
        env = dict(mine)
        set_openmp_spin(env)
        assert env == mine


@pytest.fixture(params=["quiet", "busy"])
def machine(request):
    """The machine as the test finds it, or with another process tree keeping one core busy throughout (users run
    the suite beside other work): the tests below must hold either way."""
    pids = [outsider("while True: pass")] if request.param == "busy" else []
    time.sleep(0.3 if pids else 0)
    yield request.param
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def working(seconds: float) -> None:
    """Keep this process busy, as a training process is (the governor skips windows in which it idles)."""
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


def test_a_real_competitor_takes_threads_away_and_gives_them_back(restore_threads, machine):
    """Busy processes on every CPU this process may use: the governor runs torch on one thread; once they are gone it
    gives the threads back as far as the other work on the machine leaves cores free (all of them on a quiet
    machine), each within a few windows."""
    gov = ThreadGovernor(wanted=2, interval=0.5, environ={})

    def settles(expected) -> bool:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            gov()
            if gov.target == expected() == torch.get_num_threads():
                return True
            working(0.25)
        return False

    competitors = [outsider("while True: pass") for _ in gov.cpus]
    try:
        assert settles(lambda: 1)
        during = gov.others
    finally:
        for pid in competitors:
            os.kill(pid, signal.SIGKILL)
    # what its own measurement of the other processes asks for: every thread where the machine is otherwise quiet
    assert settles(lambda: target_threads(2, len(gov.cpus), gov.others)), (during, gov.others)
    if machine == "quiet" and gov.others < 0.5:
        assert gov.target == 2


def outsider(code: str) -> int:
    """Start `python -c code` as another process tree's (its shell exits at once, so it is no child of ours); its
    pid."""
    started = subprocess.run(["sh", "-c", '"$0" -c "$1" >/dev/null 2>&1 & echo $!', sys.executable, code],
                             capture_output=True, text=True, check=True)
    return int(started.stdout)


def test_work_this_process_started_is_its_own_not_a_competitors(restore_threads, machine):
    """Child processes (torch.compile's compiler workers, DataLoader workers, a child a test waits for) count as this
    process: busy children on every CPU add nothing to what the governor counts as other processes' (whatever else
    the machine is doing), and their ticks stay counted after they exit."""
    gov = ThreadGovernor(wanted=2, interval=0.5, environ={})
    working(0.6)
    gov()
    outside = gov.others  # the other processes' load before the children: the machine's own
    before = tree_ticks()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"
    children = [subprocess.Popen([sys.executable, "-c", burn]) for _ in gov.cpus]
    time.sleep(0.7)
    gov()
    # the children's ~2 cores would show here if they were counted as others'; the machine's own load may move a little
    assert gov.others < outside + 0.5, (outside, gov.others)
    for p in children:
        p.wait()
    assert tree_ticks() - before >= 90 * len(children)  # ~1 s each at 100 Hz, now in this process's reaped count


def test_loaded_models_blocks_consult_the_process_governor(monkeypatch, restore_threads):
    """govern_threads (which each command calls on the model it loaded) hooks every block: each CPU forward, with or
    without grad, asks the governor, which sets the count."""
    import lit_qlora.base.threads as threads
    from lit_qlora.model import Transformer

    proc = FakeProc()
    gov = ThreadGovernor(wanted=2, cpus=frozenset({0, 1}), read=proc.read, ticks_per_second=100, environ={},
                         clock=lambda: proc.now.seconds)
    monkeypatch.setattr(threads, "_governor", gov)
    config = Config(vocab_size=64, n_layer=3, n_embd=32, n_head=4, n_query_groups=2, intermediate_size=64)
    model = Transformer(config)
    handles = govern_threads(model)
    assert len(handles) == 3
    for _ in range(2):
        proc.advance(1.5, others=2.0, own=1.0)
        model(torch.randint(0, 64, (1, 8)))
    assert torch.get_num_threads() == 1 and gov.changes == 1
    with torch.no_grad():
        for _ in range(2):
            proc.advance(1.5, others=0.0, own=2.0)
            model(torch.randint(0, 64, (1, 8)))
    assert torch.get_num_threads() == 2 and gov.changes == 2
    summary = threads_summary()  # what summary.json and the final table report
    assert summary == {"cpu_threads": 2, "cpu_threads_fewest": 1, "cpu_thread_changes": 2}
    assert threads_rows(summary) == [("CPU threads", "2, down to 1 beside other busy processes (2 changes)")]
    assert threads_rows({**summary, "cpu_thread_changes": 0}) == []  # a quiet run's table says nothing
    assert threads_rows({**summary, "cpu_thread_changes": 1})[0][1].endswith("(1 change)")
    monkeypatch.setattr(threads, "_governor", None)
    assert threads_summary() == {}  # no CPU forward ran (a GPU run)


def governor_calls(model, monkeypatch) -> int:
    """How often one CPU forward of `model` consults the process's governor (a counting stand-in for it)."""
    import lit_qlora.base.threads as threads

    calls = []
    monkeypatch.setattr(threads, "_governor", lambda: calls.append(1) or torch.get_num_threads())
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    monkeypatch.setattr(threads, "_governor", None)
    return len(calls)


def load_for_train(tiny_llama_dir, tmp_path, monkeypatch):
    """`litqlora finetune` (and `dpo`, which runs the same setup) up to its model: train.run's setup."""
    import json

    import lit_qlora.train.run as run
    from lit_qlora.train.args import DataArgs, LoRAArgs, TrainArgs
    from lit_qlora.train.spec import RunSpec

    rows = [{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."} for i in range(8)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    train = TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=32, max_steps=1)
    return run.setup(RunSpec(checkpoint_dir=tiny_llama_dir, out_dir=tmp_path / "run", precision="32-true",
                             accelerator="cpu", devices=1, lora=LoRAArgs(r=2, alpha=4, dropout=0.0), train=train,
                             data=DataArgs(json_path=tmp_path / "rows.json", val_split=0.25)))


def load_for_evaluate(tiny_llama_dir, tmp_path, monkeypatch):
    import lm_eval

    from lit_qlora.eval import SAMPLE_DATA_FILE
    from lit_qlora.eval.evaluate import evaluate

    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):  # the model is loaded: no need to evaluate anything
        raise Loaded

    monkeypatch.setattr(lm_eval, "simple_evaluate", stop)
    with pytest.raises(Loaded):
        evaluate(checkpoint_dir=tiny_llama_dir, tasks="truthfulqa_mc2", data_file=SAMPLE_DATA_FILE, limit=1,
                 precision="32-true", out_dir=tmp_path / "eval", device="cpu")


def load_for_generate(tiny_llama_dir, tmp_path, monkeypatch):
    from lit_qlora.deploy.generate import generate_command

    generate_command(prompt="Hello", checkpoint_dir=tiny_llama_dir, precision="32-true", max_new_tokens=1)


def load_for_chat(tiny_llama_dir, tmp_path, monkeypatch):
    import io

    from lit_qlora.deploy.chat import chat_command

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # no turn: the session ends at once
    chat_command(checkpoint_dir=tiny_llama_dir, precision="32-true", max_new_tokens=1)


def load_for_serve(tiny_llama_dir, tmp_path, monkeypatch):
    pytest.importorskip("litserve")
    from lit_qlora.deploy.choice import ModelChoice
    from lit_qlora.deploy.worker import ChatAPI

    ChatAPI(ModelChoice(checkpoint_dir=tiny_llama_dir, precision="32-true"), 4).setup("cpu")  # what a server's worker runs


@pytest.mark.parametrize("load", [load_for_train, load_for_evaluate, load_for_generate, load_for_chat, load_for_serve],
                         ids=lambda f: f.__name__.removeprefix("load_for_"))
def test_each_command_governs_the_model_it_loads(load, tiny_llama_dir, tmp_path, monkeypatch, restore_threads):
    """Scheduling is the command's: train, evaluate, generate, chat and serve each hook the governor into the blocks
    of the model they loaded (load_model itself hooks nothing)."""
    import lit_qlora.checkpoint.loading as loading
    import lit_qlora.train.run as run

    loaded, real_load = [], loading.load_model

    def recording_load(*args, **kwargs):
        model = real_load(*args, **kwargs)
        assert governor_calls(model, monkeypatch) == 0  # the loader alone attaches nothing
        loaded.append(model)
        return model

    monkeypatch.setattr(loading, "load_model", recording_load)
    monkeypatch.setattr(run, "load_model", recording_load)  # (train.run imports it at its top)
    load(tiny_llama_dir, tmp_path, monkeypatch)
    assert len(loaded) == 1
    assert governor_calls(loaded[0], monkeypatch) == loaded[0].config.n_layer


def test_estimates_fake_model_reads_no_proc(monkeypatch):
    """`random_base`, the model `litqlora estimate` traces on fake tensors, gets no governor: its forwards must not
    read /proc or set the thread count (commit d2f4b4f)."""
    from lit_qlora.checkpoint.loading import random_base

    config = Config(vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_query_groups=2, intermediate_size=64)
    for quantize in ("none", "nf4"):
        assert governor_calls(random_base(config, quantize, torch.float32), monkeypatch) == 0
