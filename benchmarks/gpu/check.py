"""The GPU kit's check (issue 36 item 3, issue 37's measurements): one call of the device tool each, on a GPU machine
without internet, from the carry folder that build_carry.py makes.

    python3 benchmarks/gpu/check.py main      # call 1 (at most 9 minutes): the CUDA tests, the 8B suite, long context
    python3 benchmarks/gpu/check.py peers     # call 2: torchtune and peft + bitsandbytes beside ours, same GPU
    python3 benchmarks/gpu/check.py profile   # call 3 (optional): the NF4 kernel per weight shape, one-step profiles
    python3 benchmarks/gpu/check.py ab --variant A "SPEC" --variant B "SPEC" [--rounds 3]   # an A/B question
    python3 benchmarks/gpu/check.py grpo      # litqlora grpo on the 8B: eager vs compiled decode, peaks vs estimate
    python3 benchmarks/gpu/check.py grpo_peers   # litqlora grpo against TRL's GRPOTrainer on the 8B
    python3 benchmarks/gpu/check.py main --dry-run   # (or DRY_RUN=1) the whole call on a CPU, GPU steps skipped

Every call first installs the carry (--carry, default .devcarry/kit) into --work/site: its wheels, then this working
tree built with the carried setuptools (eval/ becomes lit_qlora.eval); every step then runs in its own process with
PYTHONPATH=site and PYTHONSAFEPATH=1 (so the tree's lit_qlora/, which lacks eval, never shadows the installed copy).
Steps run in order of importance, each stopped at its own cap (its process group killed), none started once the
call's --budget (seconds) could not give it the time it needs: a slow step costs its own row, never the others'.
Writing a checkpoint first checks that the kit stays within half the disk. Results go to --out ($OUT on the device):
at most 8 files (gpu.txt, the steps' own files, check.json with every row, check.md with the table, log.txt), written
as each step ends, so a call cut short still brings back what it finished. The table is printed at the end.

The dry run installs the carry the same way, hides every module the GPU image lacks (image_packages.txt) unless it
comes from the carry, collects the CUDA tests, writes the same result files and table, and runs `litqlora estimate`
for real on a tiny config (the 8B's take a minute each on 2 cores); steps that need a GPU say `skipped`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from build_carry import image_packages, normalize
import gpu_ab

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
ROOT = BENCH.parent
MAX_FILES = 8  # the device tool brings back at most 8 files a call
DISK_SHARE = 0.5  # the kit's files (checkpoint, outputs, site) stay within this share of the disk
DISK_MARGIN = 2 << 30
RESERVE = 10  # seconds of the budget kept for the table and the files
LOG_TAIL = 200_000  # characters of a step's output that go to log.txt
PRESET, MODEL = "Llama-3.1-8B", "llama-3.1-8b"  # gpu_suite.MODELS' key for the preset
GiB = 1 << 30


# ---- the carry, installed --------------------------------------------------------------------------------------
def pip_env() -> dict[str, str]:
    """pip as on the GPU machine: no configuration file, no index, no find-links of this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def install(carry: Path, site: Path, work: Path, log: Path) -> None:
    """The carry's wheels, then this working tree (a clean copy of what pyproject.toml packs, built offline with the
    carried backend), into `site`. Raises CalledProcessError with pip's output in `log`."""
    shutil.rmtree(site, ignore_errors=True)
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    for name in ("lit_qlora", "eval"):  # no build/ leftovers, caches or compiled kernels of this checkout
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site)]
    wheels = sorted(str(w) for w in (carry / "whl").glob("*.whl"))
    with open(log, "a") as f:
        for cmd in ([*pip, *wheels], [*pip, "--find-links", str(carry / "build"), str(src)]):
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=pip_env(), check=True)


def kit_env(site: Path, first: tuple[Path, ...] = ()) -> dict[str, str]:
    """The environment of every step: the installed kit first, then benchmarks/gpu/, benchmarks/peers/ and
    benchmarks/long_context/ for their modules, no cwd on sys.path."""
    path = [*map(str, first), str(site), str(HERE), str(BENCH / "peers"), str(BENCH / "long_context")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1")


# ---- the GPU image, on a CPU (dry run) -------------------------------------------------------------------------
def hidden_modules(image: set[str]) -> list[str]:
    """Top-level modules installed here whose distributions the GPU image has none of, and lit_qlora itself."""
    hidden = {module for module, dists in md.packages_distributions().items()
              if not any(normalize(d) in image for d in dists)}
    return sorted(hidden | {"lit_qlora"})


IMAGE_SIM = '''"""Written by benchmarks/gpu/check.py (dry run): imports as on the GPU image. A module the image
lacks is found in the installed carry or not at all (sys.path's finder, replaced, looks nowhere else for it)."""
import importlib.machinery
import json
import sys

_HIDDEN = frozenset(json.loads({hidden!r}))
_SITE = {site!r}


class _GpuImage:
    def __init__(self, path_finder):
        self._path_finder = path_finder

    def find_spec(self, name, path=None, target=None):
        if "." not in name and name in _HIDDEN:
            return self._path_finder.find_spec(name, [_SITE])
        return self._path_finder.find_spec(name, path, target)

    def __getattr__(self, name):  # find_distributions, invalidate_caches
        return getattr(self._path_finder, name)


sys.meta_path[:] = [_GpuImage(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''


def write_image_sim(folder: Path, site: Path, hidden: list[str]) -> Path:
    """A sitecustomize.py that makes an interpreter import as the GPU image would (put `folder` on PYTHONPATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(IMAGE_SIM.format(hidden=json.dumps(hidden), site=str(site)))
    return folder


# ---- running steps ----------------------------------------------------------------------------------------------
def run_capped(cmd: list[str], cap: float, env: dict[str, str], output: Path) -> tuple[Optional[int], str]:
    """Run `cmd` (its output into `output`) for at most `cap` seconds: then its whole process group is stopped
    (TERM, then KILL 5 s later). Returns (exit code, None if stopped at the cap; the output)."""
    with open(output, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(timeout=max(cap, 0.1))
        except subprocess.TimeoutExpired:
            rc = None
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            proc.wait()
        try:  # the rest of the group (a child that outlived its parent) goes too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return rc, output.read_text(errors="replace")


def last_json(text: str) -> Optional[dict]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def tail_lines(text: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])


@dataclass
class Step:
    name: str
    what: str
    cap: float  # seconds it may run
    need: float  # seconds below which it is not started
    fn: Callable[["Kit", float], dict]
    gpu: bool = True  # a dry run skips it (or runs dry_fn)
    requires: tuple[str, ...] = ()
    dry_fn: Optional[Callable[["Kit"], dict]] = None
    on_row: Optional[Callable[["Kit", dict], None]] = None  # after the row is complete (its own result file)


@dataclass
class Kit:
    call: str
    out: Path
    work: Path
    carry: Path
    peers_carry: Path
    dry: bool
    deadline: float
    env: dict[str, str] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    ok: set[str] = field(default_factory=set)
    merged_off: list[str] = field(default_factory=list)
    estimates: dict[str, tuple[subprocess.Popen, Path]] = field(default_factory=dict)
    predicted: dict[str, int] = field(default_factory=dict)  # an A/B variant's predicted peak (the grpo call)
    started: float = field(default_factory=time.monotonic)

    @property
    def site(self) -> Path:
        return self.work / "site"

    @property
    def ckpt(self) -> Path:
        return self.work / MODEL

    def result(self, name: str) -> Path:
        """A file of the call's results; at most MAX_FILES names, whatever the steps ask for."""
        if name not in self.files:
            if len(self.files) >= MAX_FILES:
                raise RuntimeError(f"{name}: the call already writes {MAX_FILES} result files ({self.files})")
            self.files.append(name)
        return self.out / name

    def log(self, name: str, text: str) -> None:
        with open(self.result("log.txt"), "a") as f:
            f.write(f"\n===== {name}\n{text[-LOG_TAIL:]}\n")

    def left(self) -> float:
        return self.deadline - time.monotonic() - RESERVE

    def run(self, name: str, cmd: list[str], cap: float, env: Optional[dict[str, str]] = None) -> tuple:
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        rc, text = run_capped(cmd, cap, env or self.env, self.work / "logs" / f"{name}.txt")
        self.log(f"{name}: {shlex.join(cmd)} (cap {cap:.0f} s) -> {'stopped at its cap' if rc is None else rc}",
                 text)
        return rc, text

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def save(self) -> None:
        record = {"call": self.call, "dry_run": self.dry, "rows": self.rows,
                  "seconds": round(time.monotonic() - self.started, 1)}
        self.result("check.json").write_text(json.dumps(record, indent=2) + "\n")


def run_steps(kit: Kit, steps: list[Step]) -> None:
    for step in steps:
        row: dict = {"step": step.name, "what": step.what}
        missing = [r for r in step.requires if r not in kit.ok]
        left = kit.left()
        started = time.monotonic()
        if step.gpu and kit.dry:
            row.update(step.dry_fn(kit) if step.dry_fn else {})
            row.setdefault("status", "skipped: dry run (no GPU)")  # (a dry run's own error stays)
        elif missing:
            row["status"] = f"not run: needs {', '.join(missing)}"
        elif left < step.need:
            row["status"] = f"not run: time budget ({max(left, 0):.0f} s left, needs {step.need:.0f})"
        else:
            cap = min(step.cap, left)
            try:
                row.update(step.fn(kit, cap))
            except Exception as e:  # a broken step is its own row's error, never the call's end
                row["status"] = f"error: {type(e).__name__}: {e}"
            row.setdefault("status", "ok")
            row["cap_seconds"] = round(cap)
            row["seconds"] = round(time.monotonic() - started, 1)
        if row["status"] == "ok":
            kit.ok.add(step.name)
        subrows = row.pop("subrows", [])
        kit.rows.append(row)
        kit.rows.extend(subrows)
        if step.on_row:
            step.on_row(kit, row)
        kit.save()
        print(f"[{time.monotonic() - kit.started:5.0f} s] {step.name}: {row['status']}", flush=True)


# ---- disk ------------------------------------------------------------------------------------------------------
def folder_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def disk_refusal(work: Path, need: int, total: int, free: int, share: float = DISK_SHARE,
                 margin: int = DISK_MARGIN) -> Optional[str]:
    """Why writing `need` more bytes under `work` would break the kit's rule (its files within `share` of the disk,
    `margin` left free), or None."""
    held = folder_bytes(work)
    if held + need > share * total:
        return (f"{need / 1e9:.1f} GB more would bring the kit's files under {work} to {(held + need) / 1e9:.1f} GB, "
                f"over {share:.0%} of the {total / 1e9:.0f} GB disk")
    if need + margin > free:
        return f"{need / 1e9:.1f} GB does not fit the {free / 1e9:.1f} GB free (with {margin / 1e9:.0f} GB to spare)"
    return None


def disk_check(work: Path, need: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    usage = shutil.disk_usage(work)
    return {"need_bytes": need, "free_bytes": usage.free, "total_bytes": usage.total,
            "refused": disk_refusal(work, need, usage.total, usage.free)}


# ---- steps: shared -----------------------------------------------------------------------------------------------
def step_install(kit: Kit, cap: float) -> dict:
    log = kit.work / "install.txt"
    log.unlink(missing_ok=True)
    kit.work.mkdir(parents=True, exist_ok=True)
    try:
        install(kit.carry, kit.site, kit.work, log)
    except subprocess.CalledProcessError:
        kit.log("install", log.read_text())
        return {"status": f"error: pip failed: {tail_lines(log.read_text())}"}
    kit.log("install", log.read_text())
    rc, text = kit.run("finetune-help", kit.python("-m", "lit_qlora.cli", "finetune", "--help"), min(cap, 120))
    if rc != 0:
        return {"status": f"error: the installed kit does not run `litqlora finetune --help`: {tail_lines(text)}"}
    # lit_qlora.eval installed, and which switches this tree's finetune has (--export.merged: issue 36 item 2)
    kit.merged_off = ["--export.merged", "false"] if "--export.merged" in text else []
    manifest = json.loads((kit.carry / "manifest.json").read_text())
    return {"result": f"{len(manifest['wheels'])} wheels + this tree; carry built {manifest['built']} at "
                      f"{manifest['commit']}; merged export {'off' if kit.merged_off else 'on (no --export.merged)'}"}


def tree_fingerprint() -> str:
    """Which code ran: a hash of the package, eval/, the tests and the benchmarks as they are in this tree."""
    digest = hashlib.sha256()
    for folder in ("lit_qlora", "eval", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def step_machine(kit: Kit, cap: float) -> dict:
    lines = [f"call {kit.call}{' (dry run)' if kit.dry else ''}, tree {tree_fingerprint()}"]
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        lines.append(f"nvidia-smi: {done.stdout.strip() or done.stderr.strip()}")
    else:
        lines.append("nvidia-smi: not found")
    probe = ("import sys, torch, lit_qlora.eval; from importlib.metadata import version as v; "
             "print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', "
             "torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'); "
             "print(*[f'{d} {v(d)}' for d in ('triton', 'torchao', 'lightning', 'jsonargparse')], "
             "'lit_qlora from', lit_qlora.__file__)")
    rc, text = kit.run("versions", kit.python("-c", probe), min(cap, 60))
    lines += [line for line in text.splitlines() if line.startswith(("python ", "triton "))] or [tail_lines(text)]
    usage = shutil.disk_usage(kit.work)
    lines.append(f"disk at {kit.work}: {usage.free / 1e9:.1f} GB free of {usage.total / 1e9:.1f} GB; "
                 f"cpus {os.cpu_count()}")
    lines.append("carry manifest: " + (kit.carry / "manifest.json").read_text())
    kit.result("gpu.txt").write_text("\n".join(lines) + "\n")
    if rc != 0:
        return {"status": f"error: {tail_lines(text)}"}
    return {"result": lines[1] if smi else lines[2][:120]}


def step_checkpoint(kit: Kit, cap: float) -> dict:
    """The 8B's random bf16 checkpoint (16 GB), once per machine, after the disk check."""
    cmd = kit.python(str(HERE / "check.py"), "_checkpoint", "--dir", str(kit.ckpt), "--tokenizer",
                     str(kit.carry / "smol"), *(["--dry"] if kit.dry else []))
    rc, text = kit.run("checkpoint", cmd, cap)
    info = last_json(text) or {}
    row = {k: info[k] for k in ("need_bytes", "free_bytes", "total_bytes") if k in info}
    if rc is None:
        return row | {"status": "error: stopped at its cap"}
    if info.get("refused"):
        return row | {"status": f"refused: {info['refused']}"}
    if rc != 0:
        return row | {"status": f"error: {tail_lines(text)}"}
    what = "would write" if kit.dry else "reused" if info.get("reused") else "wrote"
    return row | {"result": f"{what} {info['need_bytes'] / 1e9:.1f} GB; {info['free_bytes'] / 1e9:.0f} of "
                            f"{info['total_bytes'] / 1e9:.0f} GB were free"}


def finetune_disk(kit: Kit) -> Optional[str]:
    """Without --export.merged false, each run also writes a merged model of the checkpoint's size."""
    if kit.merged_off:
        return None
    return disk_check(kit.work, folder_bytes(kit.ckpt)).get("refused")


def clean_outputs(kit: Kit) -> None:
    for path in kit.work.glob("out-*"):
        shutil.rmtree(path, ignore_errors=True)


SUITE_KEYS = ("steady_tokens_per_sec", "first_step_tokens_per_sec", "peak_allocated_train_bytes",
              "peak_reserved_bytes", "peak_allocated_bytes", "compile_seconds", "offload_activations",
              "offload_host_bytes", "wall_seconds", "rc", "timed_steps", "tokens_per_sec_spread", "step_seconds")


def suite_step(quantize: str, compile_: bool, offload: str) -> Step:
    name = f"suite_{'qlora' if quantize == 'nf4' else 'lora'}_{'compiled' if compile_ else 'eager'}_{offload}"
    what = (f"8B 2x2048 {'QLoRA' if quantize == 'nf4' else 'LoRA'} {'compiled' if compile_ else 'eager'}, "
            f"offload {offload}")

    def fn(kit: Kit, cap: float) -> dict:
        if refused := finetune_disk(kit):
            return {"status": f"not run: {refused}"}
        out = kit.work / f"{name}.json"
        cmd = kit.python(str(HERE / "gpu_suite.py"), "--models", MODEL, "--quantize", quantize, "--compile",
                         str(compile_).lower(), "--offload", offload, "--tokenizer_dir", str(kit.carry / "smol"),
                         "--work", str(kit.work), "--out", str(out), "--finetune_args", shlex.join(kit.merged_off))
        try:
            with quiet_cpus(kit) as paused:
                rc, text = kit.run(name, cmd, cap)
        finally:
            clean_outputs(kit)
        runs = json.loads(out.read_text())["runs"] if out.is_file() else []
        if runs:
            merge_suite(kit, json.loads(out.read_text()))
        if not runs:
            return {"status": "error: stopped at its cap" if rc is None else f"error: {tail_lines(text)}"}
        run = runs[0]
        row = {k: run[k] for k in SUITE_KEYS if k in run} | ({"paused_estimates": paused} if paused else {})
        if run.get("rc"):
            row["status"] = f"error: {tail_lines(run.get('error', ''))}"
        return row

    return Step(name, what, cap=130, need=75, fn=fn, requires=("install", "checkpoint"))


def merge_suite(kit: Kit, result: dict) -> None:
    path = kit.result("suite.json")
    merged = json.loads(path.read_text()) if path.is_file() else {k: v for k, v in result.items() if k != "runs"}
    merged.setdefault("runs", []).extend(result["runs"])
    path.write_text(json.dumps(merged, indent=2) + "\n")


# ---- steps: long context (issue 37 item 2) ------------------------------------------------------------------------
def recipe(**options: str) -> list[str]:
    """long_context.RECIPE (Unsloth's: 8B QLoRA r 32, alpha 32, dropout 0, the 7 projections, micro-batch 1,
    checkpointing) with `options` (name without the dashes -> value) replaced or added; a value None drops it."""
    if str(BENCH / "long_context") not in sys.path:
        sys.path.insert(0, str(BENCH / "long_context"))
    from long_context import RECIPE

    pairs = dict(zip(RECIPE[::2], RECIPE[1::2]))
    pairs.update({f"--{k}": v for k, v in options.items()})
    return [x for key, value in pairs.items() if value is not None for x in (key, value)]


@dataclass
class LongPlan:
    """The long-context steps' sizes: the 8B on a GPU; a tiny config in a dry run (estimates only)."""
    checkpoint: str
    length: int
    card: str  # the card size whose longest sequence the third step trains

    @classmethod
    def of(cls, kit: Kit) -> "LongPlan":
        if not kit.dry:
            return cls(PRESET, 65536, "24GiB")
        config = json.loads((kit.carry / "smol" / "config.json").read_text())
        config.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
        folder = kit.work / "tiny-config"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        return cls(str(folder), 1024, "1GiB")


def start_estimates(kit: Kit) -> None:
    """`litqlora estimate` for the long-context steps, in the background (CPU only: fake tensors)."""
    plan = LongPlan.of(kit)
    runs = {"on": recipe(**{"checkpoint_dir": plan.checkpoint, "train.max_seq_length": str(plan.length),
                            "train.offload_activations": "true"}),
            "off": recipe(**{"checkpoint_dir": plan.checkpoint, "train.max_seq_length": str(plan.length),
                             "train.offload_activations": "false"}),
            "card": recipe(**{"checkpoint_dir": plan.checkpoint, "device_memory": plan.card})}
    (kit.work / "logs").mkdir(parents=True, exist_ok=True)
    for name, args in runs.items():
        out = kit.work / f"estimate-{name}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = kit.python("-m", "lit_qlora.cli", "estimate", *args, "--out_dir", str(out))
        log = open(kit.work / "logs" / f"estimate-{name}.txt", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=kit.env, cwd=ROOT,
                                start_new_session=True)
        kit.estimates[name] = (proc, out)


@contextmanager
def quiet_cpus(kit: Kit) -> Iterator[list[str]]:
    """Nothing else on the machine's CPUs while a step is timed (issue 48 item 1): the background estimates still
    running are stopped (SIGSTOP) for the step and continued after it. Yields their names (the row records them)."""
    paused = [name for name, (proc, _) in kit.estimates.items() if proc.poll() is None]
    for name in paused:
        os.killpg(kit.estimates[name][0].pid, signal.SIGSTOP)
    try:
        yield paused
    finally:
        for name in paused:
            try:
                os.killpg(kit.estimates[name][0].pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def estimate(kit: Kit, name: str, wait: float) -> dict:
    """The estimate's estimate.json (waiting up to `wait` s for it), or {"error": ...}."""
    if name not in kit.estimates:
        return {"error": "not started"}
    proc, out = kit.estimates[name]
    try:
        proc.wait(timeout=max(wait, 0.1))
    except subprocess.TimeoutExpired:
        return {"error": "still running"}
    if proc.returncode:
        return {"error": tail_lines((kit.work / "logs" / f"estimate-{name}.txt").read_text())}
    return json.loads((out / "estimate.json").read_text())


def stop_estimates(kit: Kit) -> None:
    for name, (proc, _) in kit.estimates.items():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kit.log(f"estimate {name}", (kit.work / "logs" / f"estimate-{name}.txt").read_text())


def prediction(kit: Kit, name: str, wait: float) -> dict:
    est = estimate(kit, name, wait)
    if "error" in est:
        return {"estimate_error": est["error"]}
    return {"predicted_peak_bytes": est["peak_bytes"], "predicted_offload": est["offload_activations"],
            "predicted_host_bytes": est["offload_host_bytes"], "seq": est["max_seq_length"]}


def record_long(kit: Kit, estimate_name: str, row: dict) -> None:
    """long_context.json: each long-context row beside the whole estimate it is compared with."""
    path = kit.result("long_context.json")
    record = json.loads(path.read_text()) if path.is_file() else {"rows": {}, "estimates": {}}
    record["rows"][row["step"]] = row
    record["estimates"][estimate_name] = estimate(kit, estimate_name, 0)
    path.write_text(json.dumps(record, indent=2) + "\n")


def long_step(name: str, what: str, estimate_name: str, memory_gib: Optional[int], steps: int, cap: float,
              need: float) -> Step:
    def dry_fn(kit: Kit) -> dict:
        return prediction(kit, estimate_name, kit.left())

    def fn(kit: Kit, cap: float) -> dict:
        end = time.monotonic() + cap
        row = prediction(kit, estimate_name, cap / 2)
        if "seq" not in row:
            return row | {"status": f"not run: no estimate ({row['estimate_error']})"}
        if refused := finetune_disk(kit):
            return row | {"status": f"not run: {refused}"}
        cmd = kit.python(str(HERE / "check.py"), "_long", "--ckpt", str(kit.ckpt), "--work", str(kit.work),
                         "--seq", str(row["seq"]), "--offload", str(row["predicted_offload"]).lower(), "--steps",
                         str(steps), "--finetune_args", shlex.join(kit.merged_off),
                         *(["--memory_gib", str(memory_gib)] if memory_gib else []))
        try:
            with quiet_cpus(kit) as paused:
                rc, text = kit.run(name, cmd, end - time.monotonic())
        finally:
            clean_outputs(kit)
        row.update({"paused_estimates": paused} if paused else {})
        run = last_json(text)
        if run is None:
            return row | {"status": "error: stopped at its cap" if rc is None else f"error: {tail_lines(text)}"}
        row.update({k: run[k] for k in SUITE_KEYS if k in run})
        if run.get("rc"):
            error = run.get("error", "")
            oom = "out of memory" in error.lower() or "OutOfMemoryError" in error
            row["status"] = "OOM" if oom else f"error: {tail_lines(error)}"
        elif row.get("peak_allocated_train_bytes"):
            row["measured_over_predicted"] = round(row["peak_allocated_train_bytes"] / row["predicted_peak_bytes"], 4)
        return row

    def on_row(kit: Kit, row: dict) -> None:
        record_long(kit, estimate_name, row)

    return Step(name, what, cap=cap, need=need, fn=fn, requires=("install", "checkpoint"), dry_fn=dry_fn,
                on_row=on_row)


# ---- steps: the main call ----------------------------------------------------------------------------------------
def step_tests(kit: Kit, cap: float) -> dict:
    cmd = kit.python("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py", "tests/test_offload.py")
    cmd += ["--collect-only"] if kit.dry else []
    env = dict(kit.env, LIT_QLORA_TEST_TOKENIZER=str(kit.carry / "smol"))
    rc, text = kit.run("tests", cmd, cap, env)
    kit.result("tests.txt").write_text(text[-LOG_TAIL:])
    summary = next((line.strip("= ") for line in reversed(text.splitlines())
                    if re.search(r"\d+ (passed|failed|error|tests? collected|skipped)", line)), tail_lines(text))
    if rc is None:
        return {"status": "error: stopped at its cap", "result": summary}
    return {"result": summary} | ({} if rc == 0 else {"status": f"failed: {summary}"})


def main_steps() -> list[Step]:
    return [
        Step("tests", "tests/test_cuda.py + tests/test_offload.py", cap=200, need=60, fn=step_tests, gpu=False,
             requires=("install",)),
        Step("checkpoint", "random 8B bf16 checkpoint (disk checked)", cap=150, need=60, fn=step_checkpoint,
             gpu=False, requires=("install",)),
        suite_step("nf4", False, "false"),
        suite_step("none", False, "false"),
        suite_step("nf4", False, "auto"),
        long_step("long_on", "8B, Unsloth's recipe, offload on", "on", None, 2, cap=130, need=80),
        long_step("long_off", "8B, Unsloth's recipe, offload off", "off", None, 2, cap=130, need=80),
        long_step("long_card", "8B, the estimate's longest for a 24 GiB card, allocator capped at 24 GiB", "card", 24,
                  1, cap=180, need=100),
        suite_step("nf4", True, "false"),
        suite_step("none", True, "false"),
        suite_step("nf4", True, "auto"),
        suite_step("none", False, "auto"),
    ]


# ---- steps: the peers call -----------------------------------------------------------------------------------------
def step_peer_envs(kit: Kit, cap: float) -> dict:
    if not any(kit.peers_carry.glob("*.whl")):
        return {"status": f"error: no wheels in {kit.peers_carry} (build_carry.py without --no-peers)"}
    env = dict(kit.env, WHEELS=str(kit.peers_carry), PYTHON=sys.executable)
    rc, text = kit.run("peer_envs", ["bash", str(HERE / "gpu_peer_envs.sh")], cap, env)
    kit.result("envs.txt").write_text(text[-LOG_TAIL:])
    failed = [line for line in text.splitlines() if "FAILED" in line]
    if rc is None or failed:
        return {"status": f"error: {'; '.join(failed) or 'stopped at its cap'}"}
    return {"result": tail_lines(text, 2)}


def step_peers(kit: Kit, cap: float) -> dict:
    out = kit.work / "peers.json"
    out.unlink(missing_ok=True)
    args = ["--tokenizer_dir", str(kit.carry / "smol"), "--work", str(kit.work), "--out", str(out)]
    if kit.dry:  # gpu_peers.py's smoke test: its tiny checkpoint on the CPU; peers without a venv are `not run`
        args += ["--device", "cpu", "--preset", "tiny", "--seq", "64", "--steps", "2"]
    else:
        args += ["--runs", "torchtune:qlora-compile", "peft-bnb:qlora", "torchtune:lora-compile"]
    budget = max(cap - 15, 10)
    cmd = kit.python(str(HERE / "gpu_peers.py"), "--time_budget", str(round(budget)), "--child_timeout", "200",
                     *args)
    rc, text = kit.run("peers", cmd, cap)
    if not out.is_file():
        return {"status": "error: stopped at its cap" if rc is None else f"error: {tail_lines(text)}"}
    result = json.loads(out.read_text())
    kit.result("peers.json").write_text(json.dumps(result, indent=2) + "\n")
    subrows = [{"step": f"{r['peer']}:{r['variant']}", "what": r.get("adapts", ""),
                "status": r.get("status", "ok").split("\n")[0][:100], "steady_tokens_per_sec": r.get("tokens_per_sec"),
                "peak_allocated_train_bytes": r.get("peak_allocated_train_bytes")} for r in result["rows"]]
    return {"result": f"{len(result['rows'])} peer rows on {result['device']}", "subrows": subrows}


def peers_steps() -> list[Step]:
    return [
        Step("checkpoint", "random 8B bf16 checkpoint (disk checked)", cap=150, need=60, fn=step_checkpoint,
             gpu=False, requires=("install",)),
        Step("peer_envs", "torchtune and bitsandbytes venvs from the carry", cap=150, need=30, fn=step_peer_envs,
             requires=("install",)),
        suite_step("nf4", True, "false"),
        Step("peers", "gpu_peers.py: torchtune QLoRA/LoRA compiled, peft + bitsandbytes QLoRA", cap=330, need=120,
             fn=step_peers, gpu=False, requires=("install", "checkpoint")),
        suite_step("none", True, "false"),
    ]


# ---- steps: the profile call (issue 48 item 2) -----------------------------------------------------------------------
PROFILE_ARGS = ["--preset", PRESET, "--quantize", "nf4", "--batch", "2", "--seq", "2048", "--steps", "3", "--rows", "12"]
DRY_PROFILE_ARGS = ["--device", "cpu", "--tiny", "--quantize", "nf4", "--batch", "2", "--seq", "64", "--steps", "1",
                    "--rows", "5"]


def traces(kit: Kit) -> Path:
    folder = kit.work / "traces"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def ours_profile_step(compiled: bool) -> Step:
    """gpu_profile.py: one 8B 2x2048 QLoRA step of ours (FinetuneModule's loss, backward, clipping, fused AdamW,
    dropout 0.05, checkpointing), traced for kernel_table.py."""
    label = f"ours-{'compiled' if compiled else 'eager'}"

    def run(kit: Kit, cap: float, args: list[str]) -> dict:
        trace = traces(kit) / f"{label}.json"
        trace.unlink(missing_ok=True)
        cmd = kit.python(str(HERE / "gpu_profile.py"), *args, *(["--compile"] if compiled else []), "--trace",
                         str(trace))
        with quiet_cpus(kit):
            rc, text = kit.run(label, cmd, cap)
        row = last_json(text) or {}
        status = {} if rc == 0 and trace.is_file() else {
            "status": "error: stopped at its cap" if rc is None else f"error: {tail_lines(text)}"}
        return {k: row[k] for k in ("tokens_per_sec", "warmup_seconds") if k in row} | status

    def dry_fn(kit: Kit) -> dict:  # the compiled one is the same script with --compile: the eager one suffices
        return {} if compiled else run(kit, 300, DRY_PROFILE_ARGS)

    return Step(f"profile_{label}", f"gpu_profile.py: 8B 2x2048 QLoRA, {label}, one step traced", cap=150, need=60,
                fn=lambda kit, cap: run(kit, cap, PROFILE_ARGS), dry_fn=dry_fn)


def torchtune_profile(kit: Kit, cap: float) -> dict:
    """gpu_peers.py's torchtune child (lora_finetune_single_device's steps, qlora_llama3_1_8b, compiled, its builders'
    random weights: no checkpoint to write), 3 steps then one traced."""
    out = kit.work / "peers-profile.json"
    out.unlink(missing_ok=True)
    if kit.dry:  # its CPU smoke test: the tiny model, eager (where the torchtune venv exists here)
        args = ["--device", "cpu", "--preset", "tiny", "--seq", "64", "--steps", "2", "--runs", "torchtune:qlora-eager"]
    else:
        args = ["--steps", "3", "--runs", "torchtune:qlora-compile"]
    cmd = kit.python(str(HERE / "gpu_peers.py"), "--random_init", "--profile_dir", str(traces(kit)), "--work",
                     str(kit.work), "--out", str(out), "--tokenizer_dir", str(kit.carry / "smol"), "--time_budget",
                     str(round(max(cap - 15, 10))), "--child_timeout", str(round(max(cap - 15, 10))), *args)
    with quiet_cpus(kit):
        rc, text = kit.run("torchtune-profile", cmd, cap)
    if not out.is_file():
        return {"status": "error: stopped at its cap" if rc is None else f"error: {tail_lines(text)}"}
    row = json.loads(out.read_text())["rows"][0]
    result = {"steady_tokens_per_sec": row.get("tokens_per_sec")}
    if row.get("status"):
        result["status"] = row["status"].split("\n")[0][:160]
    return result


def step_kernel_table(kit: Kit, cap: float) -> dict:
    """kernel_table.py over the traces the call made: profile.md (the grouped table), profile.json."""
    found = [f"{p.stem}={p}" for p in sorted(traces(kit).glob("*.json"), key=lambda p: ("torchtune" in p.stem, p.stem))]
    if not found:
        return {"status": "not run: no trace was made"}
    cmd = kit.python(str(HERE / "kernel_table.py"), *found, "--out", str(kit.result("profile.json")), "--md",
                     str(kit.result("profile.md")))
    rc, text = kit.run("kernel_table", cmd, cap)
    if rc != 0:
        return {"status": f"error: {tail_lines(text)}"}
    return {"result": f"{len(found)} traces: {', '.join(f.split('=')[0] for f in found)}"}


def step_dequant(kit: Kit, cap: float) -> dict:
    rc, text = kit.run("dequant", kit.python(str(HERE / "gpu_dequant.py")), cap)
    kit.result("dequant.txt").write_text(text[-LOG_TAIL:])
    return {} if rc == 0 else {"status": "error: stopped at its cap" if rc is None else f"error: {tail_lines(text)}"}


def profile_steps() -> list[Step]:
    return [Step("dequant", "gpu_dequant.py: the NF4 kernels per 8B weight shape", cap=70, need=30, fn=step_dequant),
            ours_profile_step(False), ours_profile_step(True),
            Step("peer_envs", "torchtune and bitsandbytes venvs from the carry", cap=150, need=30, fn=step_peer_envs,
                 requires=("install",)),
            Step("profile_torchtune", "gpu_peers.py: torchtune QLoRA compiled, 8B 2x2048, one step traced", cap=200,
                 need=90, fn=torchtune_profile, gpu=False, requires=("install",)),
            Step("kernel_table", "kernel_table.py: the traces' kernels grouped, side by side", cap=120, need=10,
                 fn=step_kernel_table, gpu=False)]


# ---- steps: the A/B call (issue 48 item 1) -----------------------------------------------------------------------
AB_VARIANTS = [["qlora", "--quantize nf4"], ["lora", "--quantize none"]]  # the goal ratio (>= 0.92), eager
TINY = dict(name="tiny", n_layer=2, n_embd=128, n_head=4, n_query_groups=2, head_dim=32, intermediate_size=256)


@dataclass
class ABShape:
    """What every variant of an A/B call runs: the verb, its shape on the GPU and in the dry run, common options."""
    verb: str = "finetune"
    gpu: tuple[str, ...] = ("--micro", "2", "--seq", "2048")  # gpu_ab.py's defaults: 24 steps, 4 warm-up
    dry: tuple[str, ...] = ("--micro", "2", "--seq", "64", "--steps", "5", "--warmup", "2")
    options: tuple[str, ...] = ()  # finetune options every variant gets
    what: str = "8B 2x2048"

    @staticmethod
    def seq(args: tuple[str, ...]) -> str:
        """The --seq of `gpu` or `dry` (the sequence length every run trains at)."""
        return args[args.index("--seq") + 1]


# --grpo.num_generations 8 (one prompt's group a step: --train.global_batch_size 8), completions of up to 128 tokens
# after the bundled prompts (~40 tokens): rows of at most 192; 5 steps, 2 of them warm-up (the first compiles); no
# validation (its greedy decodes, before and after training, would cost each run more than its steps).
GRPO_SHAPE = ABShape("grpo", ("--micro", "8", "--seq", "192", "--steps", "5", "--warmup", "2"),
                     ("--micro", "8", "--seq", "64", "--steps", "4", "--warmup", "2"),
                     ("--grpo.num_generations", "8", "--grpo.max_completion_length", "128", "--data.val_split", "0"),
                     "8B GRPO, groups of 8 x 128 tokens")
GRPO_DRY_OPTIONS = ("--grpo.max_completion_length", "16")  # (the tiny rows: 64 tokens)
GRPO_VARIANTS = [["eager", "--quantize nf4"], ["compiled", "--quantize nf4 --grpo.compile_decode true"]]


def ab_step(variants: list[list[str]], rounds: int, shape: ABShape = ABShape()) -> Step:
    """gpu_ab.py: the variants interleaved over `rounds` at `shape` (its table in ab.md, every run in ab.json); the
    dry run asks the same of a tiny random checkpoint on the CPU (2 rounds)."""
    spec = [x for name, what in variants for x in ("--variant", name, what)]

    def run_ab(kit: Kit, cap: float, ckpt: Path, extra: list[str], rounds: int, options: tuple[str, ...],
               env: Optional[dict[str, str]] = None) -> dict:
        out = kit.work / "ab.json"
        out.unlink(missing_ok=True)
        cmd = kit.python(str(HERE / "gpu_ab.py"), "--ckpt", str(ckpt), "--work", str(kit.work), "--out", str(out),
                         "--rounds", str(rounds), "--time_budget", str(round(max(cap - 15, 10))), "--verb", shape.verb,
                         "--finetune_args", shlex.join([*kit.merged_off, *options]), *spec, *extra)
        try:
            with quiet_cpus(kit):
                rc, text = kit.run("ab", cmd, cap, env)
        finally:
            clean_outputs(kit)
        if not out.is_file():
            return {"status": "error: stopped at its cap" if rc is None else f"error: {tail_lines(text)}"}
        result = json.loads(out.read_text())
        kit.result("ab.json").write_text(json.dumps(result, indent=2) + "\n")
        kit.result("ab.md").write_text(gpu_ab.table(result) + "\n")
        summary = result["summary"]
        subrows = [{"step": f"ab:{name}", "what": " ".join([*(f"{k}={v}" for k, v in v["env"].items()), *v["args"]]),
                    "status": "ok" if v["median_tokens_per_sec"] else "error: " + (v["failed"] or ["no run"])[0][-100:],
                    "steady_tokens_per_sec": v["median_tokens_per_sec"],
                    "peak_allocated_train_bytes": v["peak_allocated_train_bytes"],
                    "predicted_peak_bytes": kit.predicted.get(name)}
                   for name, v in summary["variants"].items()]
        ratios = "; ".join(f"{name}/{summary['baseline']} {r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]"
                           for name, r in summary["ratios"].items())
        row = {"result": f"{summary['complete_rounds']} rounds: {ratios or 'no ratio'}", "subrows": subrows,
               "ab_ratios": summary["ratios"]}
        if not summary["ratios"]:
            row["status"] = f"error: no complete round ({result.get('stopped') or tail_lines(text)})"
        return row

    def fn(kit: Kit, cap: float) -> dict:
        if refused := finetune_disk(kit):
            return {"status": f"not run: {refused}"}
        return run_ab(kit, cap, kit.ckpt, list(shape.gpu), rounds, shape.options)

    def dry_fn(kit: Kit) -> dict:
        tiny = tiny_checkpoint(kit)
        if isinstance(tiny, dict):
            return tiny
        options = (*shape.options, *(GRPO_DRY_OPTIONS if shape.verb == "grpo" else ()))
        # a compiled decode traced, not code-generated: inductor's CPU code needs what the GPU image lacks
        env = dict(kit.env, LIT_QLORA_DECODE_BACKEND="aot_eager")
        return run_ab(kit, 300, tiny, ["--accelerator", "cpu", *shape.dry], 2, options, env)

    what = f"gpu_ab.py: {' vs '.join(name for name, _ in variants)}, {shape.what}, {rounds} rounds interleaved"
    return Step("ab", what, cap=600, need=200, fn=fn, requires=("install", "checkpoint"), dry_fn=dry_fn)


def tiny_checkpoint(kit: Kit):
    """The dry runs' tiny random checkpoint (written once), or the error row."""
    tiny = kit.work / "tiny-ckpt"
    rc, text = kit.run("tiny-checkpoint", kit.python(str(HERE / "check.py"), "_checkpoint", "--dir", str(tiny),
                                                     "--tokenizer", str(kit.carry / "smol"), "--tiny"), 120)
    return tiny if rc == 0 else {"status": f"error: tiny checkpoint: {tail_lines(text)}"}


def grpo_estimate_step(variants: list[list[str]]) -> Step:
    """`litqlora estimate --method grpo --device cuda` for each variant at the A/B call's shape, before anything is
    timed (CPU only): the A/B rows then show each variant's measured peak beside its prediction."""
    def run(kit: Kit, cap: float, ckpt: Path, seq: str, options: tuple[str, ...]) -> dict:
        found = {}
        for name, what in variants:
            out = kit.work / f"estimate-grpo-{name}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = kit.python("-m", "lit_qlora.cli", "estimate", "--method", "grpo", "--device", "cuda",
                             "--checkpoint_dir", str(ckpt), "--out_dir", str(out), "--train.micro_batch_size", "8",
                             "--train.global_batch_size", "8", "--train.max_seq_length", seq, "--lora.dropout",
                             "0.05", *options, *shlex.split(what))
            rc, text = kit.run(f"estimate-grpo-{name}", cmd, cap / len(variants))
            if rc != 0:
                return {"status": f"error: {name}: {tail_lines(text)}"}
            result = json.loads((out / "estimate.json").read_text())
            kit.predicted[name] = found[name] = result["peak_bytes"]
        return {"result": "; ".join(f"{k} {v / GiB:.2f} GiB" for k, v in found.items())}

    def fn(kit: Kit, cap: float) -> dict:
        return run(kit, cap, kit.ckpt, GRPO_SHAPE.seq(GRPO_SHAPE.gpu), GRPO_SHAPE.options)

    def dry_fn(kit: Kit) -> dict:
        tiny = tiny_checkpoint(kit)
        if isinstance(tiny, dict):
            return tiny
        return run(kit, 240, tiny, GRPO_SHAPE.seq(GRPO_SHAPE.dry), (*GRPO_SHAPE.options, *GRPO_DRY_OPTIONS))

    return Step("grpo_estimate", "litqlora estimate --method grpo --device cuda, each variant", cap=240, need=60,
                fn=fn, requires=("install", "checkpoint"), dry_fn=dry_fn)


def grpo_trl_step(kit: Kit, cap: float) -> dict:
    """benchmarks/peers/grpo_trl.py on the GPU: TRL's GRPOTrainer + peft + bitsandbytes 4-bit (the bnb venv, TRL
    installed in it) and `litqlora grpo` QLoRA on the 8B, the same groups (8 x up to 128 tokens, one a step), tokens/s
    of whole steps (generation included) and each side's whole-run peak of allocated bytes. Dry: the tiny checkpoint
    on the CPU, with the TRL venv of this machine where peer_envs.sh made one."""
    out = kit.work / "grpo_trl.json"
    out.unlink(missing_ok=True)
    if kit.dry:
        tiny = tiny_checkpoint(kit)
        if isinstance(tiny, dict):
            return tiny
        args = ["--device", "cpu", "--checkpoint_dir", str(tiny), "--steps", "2", "--max_completion", "8",
                "--max_seq_length", "64", "--global_batch", "8", "--n_prompts", "8", "--modes", "qlora",
                "--precision", "32-true"]
    else:
        args = ["--device", "cuda", "--checkpoint_dir", str(kit.ckpt), "--steps", "4", "--max_completion", "128",
                "--max_seq_length", "192", "--global_batch", "8", "--n_prompts", "16", "--modes", "qlora",
                "--trl_python", str(BENCH / "_work" / "gpu-venv-bnb" / "bin" / "python")]
    cmd = kit.python(str(BENCH / "peers" / "grpo_trl.py"), *args, "--out", str(out))
    with quiet_cpus(kit):
        rc, text = kit.run("grpo_trl", cmd, cap)
    if not out.is_file():
        return {"status": "error: stopped at its cap" if rc is None else f"error: {tail_lines(text)}"}
    record = json.loads(out.read_text())
    kit.result("grpo_trl.json").write_text(json.dumps(record, indent=2) + "\n")
    subrows = [{"step": f"grpo:{r['side']}:{r['mode']}", "what": r.get("command", "TRL GRPOTrainer")[:80],
                "status": "not run: " + r["unavailable"][:120] if r.get("unavailable") else "ok",
                "steady_tokens_per_sec": round(r["tokens_per_sec"], 1) if r.get("tokens_per_sec") else None,
                "peak_allocated_train_bytes": r.get("peak_allocated_bytes")} for r in record["runs"]]
    return {"result": json.dumps(record["ratios"]) if record["ratios"] else "no ratio", "subrows": subrows}


def grpo_peers_steps(args: argparse.Namespace) -> list[Step]:
    """Issue 49 item 7 on a GPU: ours against TRL at the 8B."""
    return [Step("checkpoint", "random 8B bf16 checkpoint (disk checked)", cap=150, need=60, fn=step_checkpoint,
                 gpu=False, requires=("install",)),
            Step("peer_envs", "the peers' venvs from the carry (TRL in the bnb one)", cap=150, need=30,
                 fn=step_peer_envs, requires=("install",)),
            Step("grpo_trl", "grpo_trl.py: TRL GRPOTrainer + bitsandbytes 4-bit vs litqlora grpo QLoRA, 8B", cap=420,
                 need=200, fn=grpo_trl_step, gpu=False, requires=("install", "checkpoint"))]


def ab_steps(args: argparse.Namespace) -> list[Step]:
    return [Step("checkpoint", "random 8B bf16 checkpoint (disk checked)", cap=150, need=60, fn=step_checkpoint,
                 gpu=False, requires=("install",)),
            ab_step(args.variant or AB_VARIANTS, args.rounds)]


def grpo_steps(args: argparse.Namespace) -> list[Step]:
    """Issue 49 on a GPU: `litqlora grpo` on the 8B, eager decode against --grpo.compile_decode (CUDA graphs),
    interleaved, each variant's measured peak beside `litqlora estimate --method grpo`'s."""
    variants = args.variant or GRPO_VARIANTS
    return [Step("checkpoint", "random 8B bf16 checkpoint (disk checked)", cap=150, need=60, fn=step_checkpoint,
                 gpu=False, requires=("install",)),
            grpo_estimate_step(variants), ab_step(variants, args.rounds, GRPO_SHAPE)]


def decode_step(kit: Kit, cap: float) -> dict:
    """gpu_decode.py: one stream, greedy, 128 new tokens on the 8B: ours NF4 (the few-row Triton kernel), ours NF4
    dequantized whole, ours bf16, bitsandbytes 4-bit (the bnb venv); `decode.json`. Dry: the tiny checkpoint on the
    CPU, ours only, 8 tokens."""
    out = kit.work / "decode.json"
    out.unlink(missing_ok=True)
    if kit.dry:
        tiny = tiny_checkpoint(kit)
        if isinstance(tiny, dict):
            return tiny
        args = ["--checkpoint_dir", str(tiny), "--device", "cpu", "--tokens", "8", "--rounds", "1"]
    else:
        args = ["--checkpoint_dir", str(kit.ckpt), "--rounds", "2",
                "--bnb_python", str(BENCH / "_work" / "gpu-venv-bnb" / "bin" / "python")]
    cmd = kit.python(str(HERE / "gpu_decode.py"), *args, "--time_budget", str(round(max(cap - 30, 30))), "--out",
                     str(out))
    with quiet_cpus(kit):
        rc, text = kit.run("decode", cmd, cap)
    if not out.is_file():
        return {"status": "error: stopped at its cap" if rc is None else f"error: {tail_lines(text)}"}
    record = json.loads(out.read_text())
    kit.result("decode.json").write_text(json.dumps(record, indent=2) + "\n")
    subrows = [{"step": f"decode:{name}", "what": "one stream, greedy, bf16",
                "status": "error: " + s["error"][-100:] if "error" in s else "ok",
                "tokens_per_sec": round(s["tokens_per_sec"], 1) if s.get("tokens_per_sec") else None,
                "peak_allocated_bytes": s.get("peak_allocated_bytes")} for name, s in record["summary"].items()]
    return {"result": json.dumps(record["ratios"]) if record["ratios"] else "no ratio", "subrows": subrows}


def decode_steps(args: argparse.Namespace) -> list[Step]:
    """Issue 56 item 5 on a GPU: the 8B's NF4 one-stream decode against bitsandbytes' 4-bit and our bf16."""
    return [Step("checkpoint", "random 8B bf16 checkpoint (disk checked)", cap=150, need=60, fn=step_checkpoint,
                 gpu=False, requires=("install",)),
            Step("peer_envs", "the peers' venvs from the carry (bitsandbytes in the bnb one)", cap=150, need=30,
                 fn=step_peer_envs, requires=("install",)),
            Step("decode", "gpu_decode.py: 8B one stream, ours NF4 / NF4 dequantized / bf16, bitsandbytes 4-bit",
                 cap=400, need=150, fn=decode_step, gpu=False, requires=("install", "checkpoint"))]


CALLS = {"main": lambda args: main_steps(), "peers": lambda args: peers_steps(),
         "profile": lambda args: profile_steps(), "ab": ab_steps, "grpo": grpo_steps, "grpo_peers": grpo_peers_steps,
         "decode": decode_steps}


# ---- the table ------------------------------------------------------------------------------------------------------
def gib(n) -> str:
    return f"{n / GiB:.2f}" if isinstance(n, (int, float)) and n else "-"


def table(kit: Kit) -> str:
    lines = ["| step | what | status | tok/s | [min, max] | peak allocated GiB | predicted GiB | seconds (cap) |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in kit.rows:
        status = r["status"] if r["status"] != "ok" else f"ok{': ' + r['result'] if r.get('result') else ''}"
        rate = r.get("steady_tokens_per_sec") or r.get("first_step_tokens_per_sec") or r.get("tokens_per_sec")
        if r.get("steady_tokens_per_sec") is None and r.get("first_step_tokens_per_sec"):
            rate = f"{rate} (step 1)"
        seconds = f"{r['seconds']:.0f} ({r['cap_seconds']})" if "seconds" in r else "-"
        what = r["what"] + (f" ({r['seq']:,} tokens)" if r.get("seq") else "")
        spread = r.get("tokens_per_sec_spread")
        spread = f"[{spread['min']}, {spread['max']}]" if spread else "-"
        lines.append(f"| {r['step']} | {what} | {status[:160]} | {rate or '-'} | {spread} | "
                     f"{gib(r.get('peak_allocated_train_bytes') or r.get('peak_allocated_bytes'))} | "
                     f"{gib(r.get('predicted_peak_bytes'))} | {seconds} |")
    steps = [f"- {r['step']}: {' '.join(f'{x:.3f}' for x in r['step_seconds'])}" for r in kit.rows
             if isinstance(r.get("step_seconds"), list)]
    if steps:  # a slow first step or a stall shows here
        lines += ["", "Seconds of every step (the first ones are warm-up):", *steps]
    return "\n".join(lines)


def derived(kit: Kit) -> list[str]:
    """The ratios the issues' goals are stated in, where both sides ran."""
    rows = {r["step"]: r for r in kit.rows}

    def rate(name):
        return (rows.get(name) or {}).get("steady_tokens_per_sec")

    out = []
    for mode in ("eager", "compiled"):
        q, lo = rate(f"suite_qlora_{mode}_false"), rate(f"suite_lora_{mode}_false")
        if q and lo:
            out.append(f"QLoRA / LoRA, {mode}: {q / lo:.3f} (goal >= 0.92)")
    for quant in ("qlora", "lora"):
        off, auto = rows.get(f"suite_{quant}_eager_false", {}), rows.get(f"suite_{quant}_eager_auto", {})
        if rate(f"suite_{quant}_eager_false") and rate(f"suite_{quant}_eager_auto"):
            out.append(f"{quant} eager, offload auto ({'on' if auto.get('offload_activations') else 'off'}) vs off: "
                       f"tok/s x{auto['steady_tokens_per_sec'] / off['steady_tokens_per_sec']:.3f}, peak allocated "
                       f"{gib(off.get('peak_allocated_train_bytes'))} -> {gib(auto.get('peak_allocated_train_bytes'))}"
                       " GiB")
    for name, r in (rows.get("ab", {}).get("ab_ratios") or {}).items():
        out.append(f"A/B {name}: median of {r['rounds']} per-round ratios {r['median']:.3f} "
                   f"[{r['min']:.3f}, {r['max']:.3f}]")
    for r in kit.rows:  # the grpo call: each variant's measured peak against its estimate
        if r["step"].startswith("ab:") and r.get("predicted_peak_bytes") and r.get("peak_allocated_train_bytes"):
            out.append(f"{r['step']}: measured peak / estimate "
                       f"{r['peak_allocated_train_bytes'] / r['predicted_peak_bytes']:.3f}")
    for name in ("long_on", "long_off", "long_card"):
        r = rows.get(name, {})
        if r.get("measured_over_predicted"):
            out.append(f"{name}: measured peak / estimate {r['measured_over_predicted']:.3f} (goal within 3%)")
    return out


# ---- internal subcommands (run in the kit's environment) ------------------------------------------------------------
def sub_checkpoint(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--preset", default=PRESET)
    p.add_argument("--dry", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a tiny random checkpoint (the A/B call's dry run), written")
    args = p.parse_args(argv)
    import torch

    from lit_qlora.model.presets import preset
    from lit_qlora.model import Transformer

    config = preset("SmolLM2-135M").replace(**TINY) if args.tiny else preset(args.preset)
    with torch.device("meta"):
        model = Transformer(config)
    need = sum(t.numel() for t in model.state_dict().values()) * 2  # bf16
    reused = (args.dir / "model.safetensors").is_file()
    info = disk_check(args.dir.parent, 0 if reused else need) | {"need_bytes": need, "reused": reused}
    print(json.dumps(info), flush=True)
    if info["refused"] or args.dry or reused:
        return
    import gpu_suite

    gpu_suite.write_random_checkpoint(config, args.dir, args.tokenizer)
    print(json.dumps(info), flush=True)


def sub_long(argv: list[str]) -> None:
    """One long-context fine-tune (gpu_suite.run with Unsloth's recipe, no validation), its row as JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--offload", required=True)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--memory_gib", type=float)
    p.add_argument("--finetune_args", default="")
    args = p.parse_args(argv)
    import gpu_suite

    data = args.work / "data.json"
    if not data.is_file():
        gpu_suite.write_dataset(data)
    extra = recipe(**{"checkpoint_dir": None, "train.max_seq_length": None, "data.val_split": "0"})
    launcher = None
    if args.memory_gib:
        launcher = [sys.executable, str(Path(__file__).resolve()), "_capped", "--memory_gib", str(args.memory_gib)]
    row = gpu_suite.run(args.ckpt, data, args.work / f"out-long-{args.seq}", "nf4", 1, args.seq, args.steps, None, True,
                        args.offload, extra=[*extra, *shlex.split(args.finetune_args)], launcher=launcher)
    print(json.dumps(row), flush=True)


def sub_capped(argv: list[str]) -> None:
    """`litqlora ARGS` with the CUDA caching allocator capped at --memory_gib GiB, as on a card of that size."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--memory_gib", type=float, required=True)
    args, rest = p.parse_known_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as lit_qlora.cli.main sets it
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * GiB / total))
    from lit_qlora.cli import main as cli

    cli(rest)


SUBCOMMANDS = {"_checkpoint": sub_checkpoint, "_long": sub_long, "_capped": sub_capped}


# ---- main ----------------------------------------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        SUBCOMMANDS[argv[0]](argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("call", choices=list(CALLS))
    parser.add_argument("--dry-run", action="store_true", default=os.environ.get("DRY_RUN", "0") not in ("", "0"))
    parser.add_argument("--carry", type=Path, default=ROOT / ".devcarry/kit")
    parser.add_argument("--peers-carry", type=Path, default=ROOT / ".devcarry/peers")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/gpu_kit/out"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_kit/work"))
    parser.add_argument("--budget", type=float, default=530, help="seconds for the whole call (default: 530)")
    parser.add_argument("--steps", help="comma-separated step names to run (default: all of the call's, in order)")
    parser.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "SPEC"),
                        help="ab: a variant, its NAME=VALUE settings then finetune options (gpu_ab.py); the first is "
                             "the baseline (default: qlora '--quantize nf4' vs lora '--quantize none')")
    parser.add_argument("--rounds", type=int, default=3, help="ab: rounds of interleaved runs (default 3)")
    args = parser.parse_args(argv)
    if not (args.carry / "manifest.json").is_file():
        parser.error(f"{args.carry} holds no carry: build it with `python benchmarks/gpu/build_carry.py` (README.md)")
    args.out.mkdir(parents=True, exist_ok=True)
    if any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty: the call's result files must be its own")
    args.work.mkdir(parents=True, exist_ok=True)
    kit = Kit(args.call, args.out.resolve(), args.work.resolve(), args.carry.resolve(), args.peers_carry.resolve(),
              args.dry_run, time.monotonic() + args.budget)
    first: tuple[Path, ...] = ()
    if kit.dry:
        first = (write_image_sim(kit.work / "image-sim", kit.site, hidden_modules(image_packages())),)
    kit.env = kit_env(kit.site, first)
    steps = CALLS[args.call](args)
    if args.steps:
        chosen = set(args.steps.split(","))
        if unknown := chosen - {s.name for s in steps}:
            parser.error(f"unknown steps {sorted(unknown)}; {args.call}'s: {[s.name for s in steps]}")
        chosen |= {r for s in steps if s.name in chosen for r in s.requires}  # (checkpoint on a fresh machine)
        steps = [s for s in steps if s.name in chosen]
    setup = [Step("install", "the carry's wheels and this tree into the kit's site", cap=180, need=0,
                  fn=step_install, gpu=False),
             Step("machine", "GPU, versions, disk", cap=60, need=0, fn=step_machine, gpu=False, requires=("install",))]
    print(f"check.py {args.call}{' (dry run)' if kit.dry else ''}: {len(steps)} steps, budget {args.budget:.0f} s, "
          f"results in {kit.out}", flush=True)
    try:
        run_steps(kit, setup)
        if args.call == "main" and "install" in kit.ok and any(s.name.startswith("long_") for s in steps):
            start_estimates(kit)
        run_steps(kit, steps)
    finally:
        stop_estimates(kit)
        md_table = table(kit)
        extra = derived(kit)
        kit.result("check.md").write_text(md_table + "\n" + "".join(f"\n{line}" for line in extra) + "\n")
        kit.save()
        print("\n" + md_table + "".join(f"\n{line}" for line in extra))
        print(f"\nresult files ({len(kit.files)} of at most {MAX_FILES}): {', '.join(kit.files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
