"""What a `litqlora finetune` process imports, and what that costs (issue 16 item 5).

    python benchmarks/ab/lean_process.py [--checkpoint_dir D] [--steps 1]

Runs a real `litqlora finetune` (lit_qlora.cli.main, 1 step by default, the shipped dataset) in a fresh child process
and prints one JSON line: VmRSS when the fine-tune starts loading the base model (its imports are done, no weight is
loaded yet), the process's VmHWM at the end, the run's time, and which of the libraries a fine-tune never calls
(transformers, matplotlib, scipy) it imported. Without --checkpoint_dir it uses checkpoints/SmolLM2-135M-Instruct,
converting the bundled GGUF there first if needed. To measure another tree, put it first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

UNUSED = ("transformers", "matplotlib", "scipy")


def status_kib(field: str) -> int:
    """A VmRSS/VmHWM line of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(argv: list[str]) -> None:
    """Runs `litqlora ARGV` in this process, recording VmRSS when the base model starts loading."""
    try:  # the module that calls load_model for a run (since issue 38)
        import lit_qlora.train.run as ft
    except ImportError:
        import lit_qlora.train.finetune as ft
    from lit_qlora.cli import main

    seen: dict = {}
    load_model = ft.load_model

    def recording_load_model(*args, **kwargs):
        seen.setdefault("rss_after_imports_mib", status_kib("VmRSS") / 1024)
        seen.setdefault("unused_imported_before_load", sorted(m for m in UNUSED if m in sys.modules))
        return load_model(*args, **kwargs)

    ft.load_model = recording_load_model
    started = time.perf_counter()
    main(argv)
    print("RESULT", json.dumps({**seen, "vm_hwm_mib": status_kib("VmHWM") / 1024,
                                "seconds": round(time.perf_counter() - started, 1),
                                "unused_imported_at_end": sorted(m for m in UNUSED if m in sys.modules),
                                "lit_qlora": ft.__file__}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", type=Path, default=Path("checkpoints/SmolLM2-135M-Instruct"))
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child)
    if not (args.checkpoint_dir / "config.json").is_file():
        from lit_qlora.export.gguf_import import convert_gguf

        convert_gguf("smollm2", args.checkpoint_dir)
    with tempfile.TemporaryDirectory() as out_dir:
        argv = ["finetune", "--checkpoint_dir", str(args.checkpoint_dir), "--out_dir", out_dir, "--accelerator", "cpu",
                "--train.max_steps", str(args.steps), "--train.micro_batch_size", "1", "--train.global_batch_size", "1",
                "--train.max_seq_length", "128", "--data.val_split", "0.02"]
        proc = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not result:
        sys.exit(f"the fine-tune failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(result[0].removeprefix("RESULT "))


if __name__ == "__main__":
    main()
