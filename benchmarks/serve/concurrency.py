"""How `litqlora serve` holds up under concurrent streamed clients: N OpenAI clients on 127.0.0.1, each streaming
one request after another for 60 s (the bundled SmolLM2-135M-Instruct, greedy, up to 32 tokens a reply, every
question its own: `question`), and what
they see: requests/s, tokens/s, time to first token and to the whole reply (p50/p90/p99), and how many failed (a
request that raised, a stream that ended without its finish reason or its usage chunk).

One run measures several servers one after the other (same machine, same minutes), each a `case`:
  batch1-16      16 clients, --max_batch_size 1: one reply at a time (what serve did before continuous batching)
  batch16-16     16 clients, continuous batching (the default --max_batch_size 16)
  batch16-64     64 clients, the default: 16 decode, the rest queue
  batch64-64     64 clients, --max_batch_size 64
  adapters1-16   16 clients, an NF4 base with one QLoRA adapter (random, r16 on every linear) served by name
  adapters4-16   16 clients, the same base with four such adapters, the clients' requests interleaved over them
  nf4batch16-16  16 clients, continuous batching on the NF4 base (--quantize nf4), no adapter

    python benchmarks/serve/concurrency.py [--cases batch1-16 batch16-16 ...] [--seconds 60]
    # writes benchmarks/serve/results/concurrency.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

RESULTS = Path(__file__).with_name("results")
COUNTRIES = ["France", "Japan", "Kenya", "Peru", "Canada", "Italy", "Egypt", "Norway", "Chile", "India", "Spain"]


def question(n: int) -> str:
    """The n-th request's question: every one its own (after the chat template's shared system prompt), so the
    server's prefix reuse saves what it would for real users' distinct questions, not a repeated prompt."""
    kind, m = n % 4, n // 4
    return [f"What is {m} + {m + 7}?", f"Is {m * 13 + 1} even or odd?",
            f"What is the capital of {COUNTRIES[m % len(COUNTRIES)]}? Answer in {m % 5 + 1} words.",
            f"Name a color whose name starts with the letter {chr(65 + m % 26)}."][kind]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "lit_qlora.cli", "serve", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("the server did not come up in 300 s")


def make_adapters(folder: Path, count: int) -> list[str]:
    """`count` QLoRA adapters (r16 on every linear, random) on the bundled SmolLM2, as `--adapters` entries."""
    import torch

    from lit_qlora.checkpoint.adapter import save_adapter
    from lit_qlora.checkpoint.download import DEFAULT_CHECKPOINT
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.lora.layer import apply_lora, lora_modules

    entries = []
    for i in range(count):
        model = load_model(DEFAULT_CHECKPOINT, "nf4", "bf16-true")
        apply_lora(model, r=16, alpha=32, dtype=torch.bfloat16, targets="all")
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for layer in lora_modules(model).values():
                layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.002)
        out = save_adapter(model, folder / f"a{i}", {"r": 16, "alpha": 32, "targets": ["all"], "quantize": "nf4",
                                                    "base_dtype": "bfloat16", "lora_dtype": "bfloat16"})
        entries.append(f"a{i}={out}")
    return entries


CASES = {  # name: (clients, --max_batch_size, adapters)
    "batch1-16": (16, 1, 0), "batch16-16": (16, 16, 0), "batch16-64": (64, 16, 0), "batch64-64": (64, 64, 0),
    "adapters1-16": (16, 16, 1), "adapters4-16": (16, 16, 4), "nf4batch16-16": (16, 16, 0),
}
NF4_BASE = ("nf4batch16-16",)
"""Cases served on the NF4 base (--quantize nf4, no adapter): a Llama-style NF4 model's batches decode through
lit_qlora/model/decode_step.c."""


def client_loop(url: str, index: int, until: float, records: list, lock: threading.Lock,
                models: list[str]) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    n = 0
    while time.monotonic() < until:
        asked = question(index * 100_000 + n)
        n += 1
        start = time.monotonic()
        first, finish, usage, error = None, None, None, None
        try:
            stream = client.chat.completions.create(model=models[(index + n) % len(models)], temperature=0, max_tokens=32, stream=True,
                                                    messages=[{"role": "user", "content": asked}],
                                                    stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and first is None:
                    first = time.monotonic() - start
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
        except Exception as e:  # counted, not raised: the run goes on and reports it
            error = f"{type(e).__name__}: {e}"
        whole = time.monotonic() - start
        ok = error is None and first is not None and finish in ("stop", "length") and usage
        with lock:
            records.append({"client": index, "ttft": first, "whole": whole, "ok": bool(ok), "error": error,
                            "tokens": usage})


def percentiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(cuts[49], 3), "p90": round(cuts[89], 3), "p99": round(cuts[98], 3)}


def run_case(name: str, seconds: float, folder: Path) -> dict:
    clients, rows, adapters = CASES[name]
    extra = ["--max_batch_size", str(rows)] + (["--quantize", "nf4"] if name in NF4_BASE else [])
    models = ["smollm2"]
    if adapters:
        entries = make_adapters(folder, adapters)
        extra += ["--adapters", f"[{', '.join(entries)}]"]
        models = [e.split("=")[0] for e in entries]
    port = free_port()
    proc = start_server(port, extra)
    url = f"http://127.0.0.1:{port}"
    records: list[dict] = []
    lock = threading.Lock()
    try:
        started = time.monotonic()
        until = started + seconds
        threads = [threading.Thread(target=client_loop, args=(url, i, until, records, lock, models))
                   for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    good = [r for r in records if r["ok"]]
    return {"case": name, "clients": clients, "max_batch_size": rows, "adapters": adapters,
            "seconds": round(elapsed, 1), "requests": len(records), "failed": len(records) - len(good),
            "errors": sorted({r["error"] for r in records if r["error"]})[:5],
            "requests_per_sec": round(len(good) / elapsed, 3),
            "tokens_per_sec": round(sum(r["tokens"] for r in good) / elapsed, 1),
            "time_to_first_token_s": percentiles([r["ttft"] for r in good]),
            "whole_reply_s": percentiles([r["whole"] for r in good])}


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--results_dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        results = []
        for name in args.cases:
            results.append(run_case(name, args.seconds, Path(folder) / name))
            print(json.dumps(results[-1]), flush=True)
    command = f"python benchmarks/serve/concurrency.py --cases {' '.join(args.cases)} --seconds {args.seconds:g}"
    if args.results_dir != RESULTS:
        command += f" --results_dir {args.results_dir}"
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0] if Path("/proc/cpuinfo").exists() else ""
    isa = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags) or platform.machine()
    summary = {"command": command, "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "isa": isa, "results": results}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "concurrency.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = ["# `litqlora serve` under concurrent streamed clients", "",
             f"`{command}` ({os.cpu_count()} CPUs, ISA: {isa}; SmolLM2-135M-Instruct, greedy, up to 32 tokens a "
             "reply, precision auto).", "",
             "| case | clients | max_batch_size | adapters | requests | failed | requests/s | tokens/s | first token "
             "p50 / p90 / p99 (s) | whole reply p50 / p90 / p99 (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ttft, whole = r["time_to_first_token_s"], r["whole_reply_s"]
        lines.append(f"| {r['case']} | {r['clients']} | {r['max_batch_size']} | {r['adapters'] or ('none (NF4 base)' if r['case'] in NF4_BASE else 'none (plain base)')} "
                     f"| {r['requests']} | {r['failed']} | {r['requests_per_sec']} | {r['tokens_per_sec']} | "
                     f"{ttft['p50']} / {ttft['p90']} / {ttft['p99']} | {whole['p50']} / {whole['p90']} / {whole['p99']} |")
    table = "\n".join(lines)
    (args.results_dir / "concurrency.md").write_text(table + "\n")
    print(table)
    failed = sum(r["failed"] for r in results)
    if failed:
        raise SystemExit(f"{failed} requests failed: {[r['errors'] for r in results if r['errors']]}")


if __name__ == "__main__":
    main()
