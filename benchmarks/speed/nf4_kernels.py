"""NF4 kernels: our quantize / dequantize (lit_qlora.nf4) against torchao's NF4Tensor reference on CPU.

    python benchmarks/speed/nf4_kernels.py            # full run (~3-4 min; the torchao memory child takes the longest)
    python benchmarks/speed/nf4_kernels.py --quick    # fewer repeats, no torchao memory child
    python benchmarks/speed/nf4_kernels.py --skip-memory   # re-measure speed only, keep the memory section

* speed: 5632x2048 and 4096x4096 bf16 weights, median of several runs after a warm-up, torch's default
  thread count; variants are interleaved round by round so background load hits them alike; every variant's
  output is asserted bit-identical to torchao's (codes, scalers, dequantized values) before it is timed.
* memory: quantizing a 128256x4096 bf16 weight (a Llama-3 lm_head) in a fresh child process per variant;
  the peak RSS (VmHWM, reset right before quantizing) minus the RSS before quantizing, over the bf16 size.
* forward of one linear (256 tokens) for context: bf16 F.linear, our nf4_linear, torchao's linear_nf4.

Writes benchmarks/speed/results/nf4_kernels.json and benchmarks/speed/results/nf4_kernels.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")  # torchao's optional-extension load warnings

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torchao  # noqa: E402
from torchao.quantization import to_nf4  # noqa: E402
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4  # noqa: E402

from lit_qlora.nf4 import (dequantize_nf4, nf4_backend, nf4_layout, nf4_linear, nf4_nbytes,  # noqa: E402
                           quantize_nf4)
from lit_qlora.nf4.codec import block_scales  # noqa: E402
from lit_qlora.train.offload import available_host_bytes  # noqa: E402
from lit_qlora.nf4.native import native_error  # noqa: E402

RESULTS = ROOT / "benchmarks" / "speed" / "results"
SPEED_SHAPES = [(5632, 2048), (4096, 4096)]
MEMORY_SHAPE = (128256, 4096)
INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


# ------------------------------------------------------------------------------------------------ helpers
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def assert_same(ours, ref) -> None:
    for name in INNER:
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    for attr in ("block_size", "scaler_block_size", "n_blocks"):
        assert getattr(ours, attr) == getattr(ref, attr), attr


def interleaved(fns: dict, rounds: int, warmup: int = 1) -> dict:
    """Median / min seconds per variant; one call of each variant per round."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "runs": len(v)} for k, v in times.items()}


class EagerBackend:
    """Force lit_qlora.nf4's PyTorch path (no C kernel) inside the block."""

    def __enter__(self):
        self.old = os.environ.get("LIT_QLORA_NF4_BACKEND")
        os.environ["LIT_QLORA_NF4_BACKEND"] = "eager"

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("LIT_QLORA_NF4_BACKEND", None)
        else:
            os.environ["LIT_QLORA_NF4_BACKEND"] = self.old


def eager(fn):
    def run():
        with EagerBackend():
            return fn()

    return run


def compiled_dequant():
    """The best torch.compile formulation we found: a (256, 2) byte -> level-pair table gather times the
    per-block scale (static shapes; inductor's CPU code for the gather is scalar)."""

    def kernel(q, scales, pairs):
        v = pairs[q.to(torch.int32)]  # (n_blocks, block_size / 2, 2)
        return (v * scales[:, None, None]).view(q.shape[0], -1)

    return torch.compile(kernel, dynamic=False)


# ------------------------------------------------------------------------------------------------ speed
def bench_speed(shape, rounds: int) -> dict:
    torch.manual_seed(0)
    w = (torch.randn(shape) * 0.02).to(torch.bfloat16)
    layout = nf4_layout(shape)
    ref = to_nf4(w, *layout)
    expected = ref.get_original_weight()
    ours = quantize_nf4(w)
    assert_same(ours, ref)
    assert_same(quantize_nf4(w, native=False), ref)
    assert torch.equal(dequantize_nf4(ref), expected)
    with EagerBackend():
        assert torch.equal(dequantize_nf4(ref), expected)

    quant = interleaved(
        {
            "torchao to_nf4": lambda: to_nf4(w, *layout),
            "ours (native)": lambda: quantize_nf4(w),
            "ours (eager)": lambda: quantize_nf4(w, native=False),
        },
        rounds=rounds,
    )

    # compiled variant of the dequantize (measured, not used: slower than both of ours on this CPU)
    fn = compiled_dequant()
    q2 = ref.quantized_data.view(-1, ref.block_size // 2)
    scales = block_scales(ref)
    pairs = torch.stack([ref.nf4.repeat_interleave(16), ref.nf4.repeat(16)], dim=1).contiguous()
    t0 = time.perf_counter()
    got = fn(q2, scales, pairs)
    compile_s = time.perf_counter() - t0
    assert torch.equal(got.view(shape), expected)

    out = torch.empty(shape, dtype=torch.bfloat16)
    deq = interleaved(
        {
            "torchao get_original_weight": lambda: ref.get_original_weight(),
            "ours (native)": lambda: dequantize_nf4(ref),
            "ours (native, out=)": lambda: dequantize_nf4(ref, out=out),
            "ours (eager)": eager(lambda: dequantize_nf4(ref)),
            "torch.compile lookup": lambda: fn(q2, scales, pairs),
        },
        rounds=max(rounds, 9),
    )
    deq["torch.compile lookup"]["compile_s"] = compile_s

    # one linear forward, 256 tokens, for context
    x = torch.randn(256, shape[1], dtype=torch.bfloat16)
    assert torch.equal(nf4_linear(x, ours), F.linear(x, expected))
    lin = interleaved(
        {
            "bf16 F.linear": lambda: F.linear(x, w),
            "ours nf4_linear": lambda: nf4_linear(x, ours),
            "torchao linear_nf4": lambda: linear_nf4(x, ref),
        },
        rounds=max(rounds, 9),
    )

    def speedups(table, base, stat="median_s"):
        return {k: table[base][stat] / v[stat] for k, v in table.items() if k != base}

    return {
        "shape": list(shape),
        "layout": list(layout),
        "numel": w.numel(),
        "quantize": quant,
        "quantize_speedup_vs_torchao": speedups(quant, "torchao to_nf4"),
        "quantize_speedup_vs_torchao_min": speedups(quant, "torchao to_nf4", "min_s"),
        "dequantize": deq,
        "dequantize_speedup_vs_torchao": speedups(deq, "torchao get_original_weight"),
        "dequantize_speedup_vs_torchao_min": speedups(deq, "torchao get_original_weight", "min_s"),
        "linear_forward_256_tokens": lin,
    }


# ------------------------------------------------------------------------------------------------ memory
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


def child_memory(variant: str, rows: int, cols: int) -> dict:
    import resource

    nf4_backend()  # compile / load the kernels before anything is measured
    rss_start = _status_kb("VmRSS") * 1024
    w = torch.empty(rows, cols, dtype=torch.bfloat16).normal_(std=0.02)
    gc.collect()
    rss_before = _status_kb("VmRSS") * 1024
    reset = _reset_peak()
    t0 = time.perf_counter()
    if variant == "ours (native)":
        t = quantize_nf4(w)
    elif variant == "ours (eager)":
        t = quantize_nf4(w, native=False)
    elif variant == "torchao to_nf4":
        t = to_nf4(w, *nf4_layout(w.shape))
    else:
        raise ValueError(variant)
    seconds = time.perf_counter() - t0
    peak = _status_kb("VmHWM") * 1024 if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tensor_bytes = w.numel() * w.element_size()
    nf4_bytes = nf4_nbytes(t)
    return {
        "variant": variant,
        "shape": [rows, cols],
        "seconds": seconds,
        "tensor_bytes": tensor_bytes,
        "nf4_bytes": nf4_bytes,
        "rss_before_tensor": rss_start,
        "rss_before_quantize": rss_before,
        "peak_rss_during_quantize": peak,
        "peak_reset_ok": reset,
        # what quantizing adds on top of the loaded tensor (the NF4 result, 0.26x, is part of it)
        "transient_ratio": (peak - rss_before) / tensor_bytes,
        # the tensor plus everything quantizing adds
        "peak_over_tensor_ratio": (peak - rss_start) / tensor_bytes,
        "backend": nf4_backend(),
    }


def bench_memory(variants) -> list:
    results = []
    for variant in variants:
        cmd = [sys.executable, __file__, "--child-memory", variant, *map(str, MEMORY_SHAPE)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            results.append({"variant": variant, "error": proc.stderr.strip()[-2000:]})
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"  memory {variant}: {results[-1]['transient_ratio']:.2f}x transient, {results[-1]['seconds']:.1f} s")
    return results


def available_bytes() -> int:
    return available_host_bytes() or 0


# ------------------------------------------------------------------------------------------------ report
def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def fmt_x(speedup: float | None) -> str:
    return "-" if speedup is None else f"{speedup:.1f}x"


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        "# NF4 kernels: lit_qlora.nf4 vs torchao",
        "",
        f"{m['cpu']} ({m['cpus']} CPUs, torch threads {m['torch_threads']}), torch {m['torch']}, "
        f"torchao {m['torchao']}, Python {m['python']}, lit_qlora.nf4 backend `{res['backend']}`.",
        "",
        *[
            f"- {name} measured {run['date']}, load average before/after {run['loadavg_start']} / "
            f"{run['loadavg_end']} (the machine is shared with other jobs)"
            for name, run in (("speed", res.get("speed_run")), ("memory", res.get("memory_run")))
            if run
        ],
        "",
        "Every variant is asserted bit-identical to torchao (codes, scalers, factors, mean, dequantized values).",
        "Times (ms) of interleaved runs after a warm-up; speedup = torchao time / variant time, from the medians",
        "and from the minimums (the least disturbed runs on a shared machine).",
        "`native` = the C kernels, `eager` = the PyTorch fallback (no compiler). Dequantize without `out=`",
        "allocates a fresh output; when glibc hands that memory back to the OS between calls, first-touch page",
        "faults cost ~8 ms per 23 MB on this VM (~2.5 GB/s), more than the kernel itself; `nf4_linear`",
        "therefore dequantizes into a reused per-thread buffer on CPU (the `out=` row is that case).",
        "",
    ]
    for r in res.get("speed", []):
        shape = "x".join(map(str, r["shape"]))
        lines += [f"## {shape} bf16 (layout block_size={r['layout'][0]}, scaler_block_size={r['layout'][1]})", ""]
        for kind in ("quantize", "dequantize"):
            lines += [
                f"| {kind} | median ms | min ms | speedup (medians) | speedup (mins) |",
                "|---|---:|---:|---:|---:|",
            ]
            for k, v in r[kind].items():
                sp = r[f"{kind}_speedup_vs_torchao"].get(k)
                sp_min = r[f"{kind}_speedup_vs_torchao_min"].get(k)
                extra = f" (compile {v['compile_s']:.1f} s)" if "compile_s" in v else ""
                lines.append(
                    f"| {k}{extra} | {fmt_ms(v['median_s'])} | {fmt_ms(v['min_s'])} | {fmt_x(sp)} | {fmt_x(sp_min)} |"
                )
            lines.append("")
        lines.pop()
        lines += ["", "| linear forward, 256 tokens | median ms |", "|---|---:|"]
        for k, v in r["linear_forward_256_tokens"].items():
            lines.append(f"| {k} | {fmt_ms(v['median_s'])} |")
        lines.append("")
    if res.get("memory"):
        shape = "x".join(map(str, MEMORY_SHAPE))
        gib = MEMORY_SHAPE[0] * MEMORY_SHAPE[1] * 2 / 2**30
        lines += [
            f"## Quantization memory, {shape} bf16 ({gib:.2f} GiB), fresh process each",
            "",
            "transient = (peak RSS while quantizing - RSS before) / bf16 size (includes the NF4 result, 0.26x); "
            "peak/tensor = (peak RSS - RSS before the tensor existed) / bf16 size.",
            "",
            "| variant | seconds | transient | peak / tensor | NF4 bytes / param |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in res["memory"]:
            if "error" in r:
                lines.append(f"| {r['variant']} | failed: {r['error'][-200:]} | | | |")
                continue
            numel = r["shape"][0] * r["shape"][1]
            lines.append(
                f"| {r['variant']} | {r['seconds']:.1f} | {r['transient_ratio']:.2f}x | "
                f"{r['peak_over_tensor_ratio']:.2f}x | {r['nf4_bytes'] / numel:.4f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds, no torchao memory child")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--skip-speed", action="store_true", help="keep the speed section of the existing JSON")
    parser.add_argument("--skip-memory", action="store_true", help="keep the memory section of the existing JSON")
    parser.add_argument("--skip-torchao-memory", action="store_true")
    parser.add_argument("--child-memory", nargs=3, metavar=("VARIANT", "ROWS", "COLS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory:
        variant, rows, cols = args.child_memory
        print(json.dumps(child_memory(variant, int(rows), int(cols))))
        return

    rounds = 3 if args.quick else args.rounds
    json_path = RESULTS / "nf4_kernels.json"
    previous = json.loads(json_path.read_text()) if json_path.exists() else {}

    def run_info(**extra) -> dict:
        now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        return {"date": now, "loadavg_start": loadavg(), **extra}

    res = {
        "machine": {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchao": torchao.__version__,
            "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        },
        "backend": nf4_backend(),
        "native_error": native_error(),
    }
    if args.skip_speed:
        for key in ("speed_run", "speed"):
            if key in previous:
                res[key] = previous[key]
    else:
        res["speed_run"] = run_info(rounds=rounds)
        res["speed"] = []
        for shape in SPEED_SHAPES:
            print(f"speed {shape} ...", flush=True)
            r = bench_speed(shape, rounds)
            res["speed"].append(r)
            print(
                "  quantize speedup: "
                + ", ".join(f"{k} {v:.1f}x" for k, v in r["quantize_speedup_vs_torchao"].items())
                + "\n  dequantize speedup: "
                + ", ".join(f"{k} {v:.1f}x" for k, v in r["dequantize_speedup_vs_torchao"].items()),
                flush=True,
            )
        res["speed_run"]["loadavg_end"] = loadavg()
    if args.skip_memory:
        for key in ("memory_run", "memory", "torchao_memory_skipped"):
            if key in previous:
                res[key] = previous[key]
    else:
        res["memory_run"] = run_info()
        variants = ["ours (native)", "ours (eager)"]
        tensor_bytes = MEMORY_SHAPE[0] * MEMORY_SHAPE[1] * 2
        if args.quick or args.skip_torchao_memory:
            res["torchao_memory_skipped"] = "by option"
        elif available_bytes() < 6 * tensor_bytes:
            res["torchao_memory_skipped"] = f"only {available_bytes() / 2**30:.1f} GiB available"
        else:
            variants.append("torchao to_nf4")
        print(f"memory {MEMORY_SHAPE} ...", flush=True)
        res["memory"] = bench_memory(variants)
        res["memory_run"]["loadavg_end"] = loadavg()

    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "nf4_kernels.md").write_text(markdown(res))
    print(f"wrote {RESULTS / 'nf4_kernels.json'} and {RESULTS / 'nf4_kernels.md'}")


if __name__ == "__main__":
    main()
