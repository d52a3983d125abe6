"""What the CPU heap release costs per training step, and the peak RSS it keeps (issue 16 item 4).

    python benchmarks/ab/heap_release.py                         # all three configurations, this tree
    python benchmarks/ab/heap_release.py --configs smol-qlora --rounds 2 --label main

Each configuration runs the real `litqlora finetune` in its own child process (lit_qlora.cli.main):
  smol-lora, smol-qlora: SmolLM2-135M-Instruct, micro-batch 4 x 512 packed (the shipped dataset), checkpointing
                         on, LoRA dropout 0.05;
  1b-qlora:              the random TinyLlama-1.1B-shaped checkpoint of train_memory.py, 1 x 512, checkpointing on.
The child times every glibc call of the release (malloc_trim, mallinfo2, mallopt: `lit_qlora.memory.accounting._libc`
is wrapped, so any tree that releases through it is measured the same way) and reads getrusage at each optimizer
step's end. Per step (after the first): wall seconds, seconds inside those calls, minor page faults, user and
system CPU seconds. Reported: the release's share of the step (time in the calls / step wall time: both move
with load, their ratio much less), faults and system time per step (what the re-faulting of trimmed pages costs),
and VmHWM at the end of training and of the whole process (summary.json). To measure another tree (e.g. main:
`git archive main lit_qlora | tar -x -C /tmp/main`), put it first on PYTHONPATH and give a --label.
Results: benchmarks/ab/results/heap_release.json (appended) and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE / "results"
SMOL = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"
TINY = HERE.parent / "_work" / "tinyllama-1.1b-random"
MIB = 1 << 20
CONFIGS = {  # name -> (checkpoint, quantize, micro-batch, extra finetune arguments)
    "smol-lora": (SMOL, "none", 4, ["--data.packing", "true", "--lora.dropout", "0.05"]),
    "smol-qlora": (SMOL, "nf4", 4, ["--data.packing", "true", "--lora.dropout", "0.05"]),
    "1b-qlora": (TINY, "nf4", 1, ["--lora.dropout", "0.05"]),
}


class TimedLibc:
    """Stands in for the ctypes libc: every call through it is counted and timed."""

    def __init__(self, libc, totals: dict) -> None:
        self._libc, self._totals = libc, totals

    def __getattr__(self, name: str):
        fn = getattr(self._libc, name)
        if not callable(fn):
            return fn

        def timed(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self._totals["calls"] += 1
                self._totals["seconds"] += time.perf_counter() - t
                self._totals.setdefault(name, 0)
                self._totals[name] += 1
        return timed


def child(argv: list[str]) -> None:
    import lightning as L

    try:  # where setup lives (finetune imports it from there when it runs)
        import lit_qlora.train.run as ft
    except ImportError:  # trees before issue 38
        import lit_qlora.train.finetune as ft
    import lit_qlora.memory.accounting as memory
    from lit_qlora.cli import main

    totals = {"calls": 0, "seconds": 0.0}
    real = memory._libc()
    if real is not None:
        memory._libc = lambda: TimedLibc(real, totals)
    try:  # a tree with the budget policy: its checks (RSS read, mallinfo2) count as release time too
        from lit_qlora.train.heap import HeapTrimmer
    except ImportError:
        HeapTrimmer = None
    if HeapTrimmer is not None:
        check = HeapTrimmer.__call__

        def timed_check(self):
            t = time.perf_counter()
            try:
                return check(self)
            finally:
                totals["policy_seconds"] = totals.get("policy_seconds", 0.0) + time.perf_counter() - t
        HeapTrimmer.__call__ = timed_check
    steps: list[dict] = []

    class StepUsage(L.Callback):
        """Reads the counters when each step's work (and the callbacks before this one) is done."""

        def sample(self) -> dict:
            ru = resource.getrusage(resource.RUSAGE_SELF)
            # the policy's time includes its libc calls; a tree without one spends only the libc calls
            release = totals["policy_seconds"] if "policy_seconds" in totals else totals["seconds"]
            return {"t": time.perf_counter(), "user": ru.ru_utime, "sys": ru.ru_stime, "minflt": ru.ru_minflt,
                    "trims": totals.get("malloc_trim", 0), "release": release}

        def on_train_start(self, trainer, pl_module) -> None:
            self.last = self.sample()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = self.sample()
            steps.append({k: now[k] - self.last[k] for k in now})
            self.last = now

    setup = ft.setup

    def instrumented_setup(*args, **kwargs):
        run = setup(*args, **kwargs)
        run.trainer.callbacks.append(StepUsage())  # after HeapRelease: its after-step release counts
        return run

    ft.setup = instrumented_setup
    main(argv)
    print("RESULT", json.dumps({"steps": steps, "fault_us": fault_microseconds(),
                                "calls": {k: v for k, v in totals.items() if "seconds" not in k},
                                "lit_qlora": memory.__file__}))


def fault_microseconds(n_bytes: int = 64 << 20) -> float:
    """Wall microseconds per minor page fault here and now: a memset over a fresh anonymous mapping, less a second
    memset over the same (now resident) pages."""
    import ctypes
    import mmap

    area = mmap.mmap(-1, n_bytes)
    address = ctypes.addressof(ctypes.c_char.from_buffer(area))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    ctypes.memset(address, 1, n_bytes)
    t1 = time.perf_counter()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    ctypes.memset(address, 2, n_bytes)
    t2 = time.perf_counter()
    del address
    area.close()
    return round(1e6 * max((t1 - t0) - (t2 - t1), 0.0) / max(faults, 1), 2)


def run_one(config: str, steps: int, seq: int) -> dict:
    from export_peak import byte_tokenizer, dataset

    checkpoint, quantize, batch, extra = CONFIGS[config]
    if checkpoint == TINY and not (TINY / "model.safetensors").is_file():
        from load_memory import write_tinyllama

        write_tinyllama(TINY)
    data = []
    if checkpoint == TINY:
        byte_tokenizer(TINY)
        data = ["--data.json_path", str(dataset(HERE.parent / "_work" / "export_peak.jsonl"))]
    with tempfile.TemporaryDirectory() as out_dir:
        argv = ["finetune", "--checkpoint_dir", str(checkpoint), "--out_dir", out_dir, "--quantize", quantize,
                "--accelerator", "cpu", "--train.max_steps", str(steps), "--train.micro_batch_size", str(batch),
                "--train.global_batch_size", str(batch), "--train.max_seq_length", str(seq),
                "--train.warmup_steps", "1", "--train.activation_checkpointing", "true", "--train.save_interval",
                str(steps), "--data.val_split", "0.02", *data, *extra]
        proc = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True)
        summary = json.loads((Path(out_dir) / "summary.json").read_text()) if not proc.returncode else {}
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not result:
        sys.exit(f"{config} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    got = json.loads(result[0].removeprefix("RESULT "))
    timed = got["steps"][1:]  # the first step builds kernels and grows the heap for the first time

    def per_step(key: str) -> float:
        return statistics.median(s[key] for s in timed)
    return {
        "config": config, "peak_rss_mib": round(summary["peak_rss_bytes"] / MIB, 1),
        "peak_rss_train_mib": round(summary["peak_rss_train_bytes"] / MIB, 1),
        "release_share": round(sum(s["release"] for s in timed) / sum(s["t"] for s in timed), 4),
        "step_s": round(per_step("t"), 2), "release_s": round(per_step("release"), 3),
        "trims_per_step": per_step("trims"), "minflt_per_step": per_step("minflt"),
        "sys_s_per_step": round(per_step("sys"), 3), "user_s_per_step": round(per_step("user"), 2),
        "fault_us": got["fault_us"],
        # faults priced at fault_us: an upper bound on what re-faulting released pages costs (all faults counted)
        "release_and_faults_share": round(
            sum(s["release"] + s["minflt"] * got["fault_us"] * 1e-6 for s in timed) / sum(s["t"] for s in timed), 4),
        "calls": got["calls"], "lit_qlora": got["lit_qlora"], "loadavg": os.getloadavg()[0],
    }


def write_markdown(record: list) -> None:
    lines = ["# Heap release cost per step and peak RSS (issue 16 item 4)", "",
             "Whole `litqlora finetune` processes (`python benchmarks/ab/heap_release.py`), checkpointing on, dropout "
             "0.05. Per step = median over the steps after the first. `release %` = seconds inside the release (the "
             "policy's checks and its glibc calls) / step wall seconds, summed over those steps. `+ faults %` adds "
             "every minor fault of the step priced at `fault us` (measured in the same process at its end): an upper "
             "bound on re-faulting what was released. Peaks are VmHWM (load independent). Rows with one `started` "
             "ran one after another in one session.",
             "", "| label | started | config | whole-run peak MiB | training peak MiB | release % | + faults % | "
             "trims/step | minor faults/step | fault us | sys s/step | step s | load |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rec in record:
        for r in rec["rows"]:
            lines.append(f"| {rec['label']} | {rec['started']} | {r['config']} | {r['peak_rss_mib']:.0f} | "
                         f"{r['peak_rss_train_mib']:.0f} | {100 * r['release_share']:.2f} | "
                         f"{100 * r['release_and_faults_share']:.1f} | {r['trims_per_step']:.0f} | "
                         f"{r['minflt_per_step']:.0f} | {r['fault_us']} | {r['sys_s_per_step']:.2f} | "
                         f"{r['step_s']:.1f} | {r['loadavg']:.1f} |")
    (RESULTS / "heap_release.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--no_record", action="store_true", help="print only; leave the results files alone")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child)
    sys.path.insert(0, str(HERE.parent / "memory"))
    started = datetime.now(timezone.utc).isoformat(timespec="minutes")
    rows = []
    for _ in range(args.rounds):
        for config in args.configs:
            rows.append(run_one(config, args.steps, args.seq))
            print(json.dumps(rows[-1]), flush=True)
    if args.no_record:
        return
    path = RESULTS / "heap_release.json"
    record = json.loads(path.read_text()) if path.is_file() else []
    record.append({"label": args.label, "started": started, "command": " ".join(["python", *sys.argv]),
                   "rows": rows})
    path.write_text(json.dumps(record, indent=2) + "\n")
    write_markdown(record)


if __name__ == "__main__":
    main()
