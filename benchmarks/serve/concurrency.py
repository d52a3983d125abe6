"""How `litqlora serve` holds up under concurrent streamed clients: 16 OpenAI clients on 127.0.0.1, each streaming
one request after another for 60 s (the bundled SmolLM2-135M-Instruct, greedy, up to 32 tokens a reply), and what
they see: requests/s, time to first token and to the whole reply (p50/p90/p99), and how many failed (a request that
raised, a stream that ended without its finish reason or its usage chunk).

    python benchmarks/serve/concurrency.py [--clients 16] [--seconds 60]
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
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Is 167 even or odd?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "lit_qlora.cli", "serve", "--port", str(port)],
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


def client_loop(url: str, index: int, until: float, records: list, lock: threading.Lock) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    n = 0
    while time.monotonic() < until:
        question = QUESTIONS[(index + n) % len(QUESTIONS)]
        n += 1
        start = time.monotonic()
        first, finish, usage, error = None, None, None, None
        try:
            stream = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=32, stream=True,
                                                    messages=[{"role": "user", "content": question}],
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60)
    args = parser.parse_args()
    port = free_port()
    proc = start_server(port)
    url = f"http://127.0.0.1:{port}"
    records: list[dict] = []
    lock = threading.Lock()
    try:
        started = time.monotonic()
        until = started + args.seconds
        threads = [threading.Thread(target=client_loop, args=(url, i, until, records, lock)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    good = [r for r in records if r["ok"]]
    result = {
        "command": f"python benchmarks/serve/concurrency.py --clients {args.clients} --seconds {args.seconds:g}",
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "clients": args.clients,
        "seconds": round(elapsed, 1), "requests": len(records), "failed": len(records) - len(good),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "requests_per_sec": round(len(good) / elapsed, 3),
        "tokens_per_sec": round(sum(r["tokens"] for r in good) / elapsed, 1),
        "time_to_first_token_s": percentiles([r["ttft"] for r in good]),
        "whole_reply_s": percentiles([r["whole"] for r in good]),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "concurrency.json").write_text(json.dumps(result, indent=2) + "\n")
    ttft, whole = result["time_to_first_token_s"], result["whole_reply_s"]
    table = "\n".join([
        f"# `litqlora serve` under {args.clients} concurrent streamed clients", "",
        f"`{result['command']}` ({result['cpus']} CPUs, SmolLM2-135M-Instruct, greedy, up to 32 tokens a reply, "
        f"one worker: requests queue and are answered one at a time).", "",
        "| clients | seconds | requests | failed | requests/s | tokens/s | first token p50 / p90 / p99 (s) | "
        "whole reply p50 / p90 / p99 (s) |", "|---|---|---|---|---|---|---|---|",
        f"| {args.clients} | {result['seconds']} | {result['requests']} | {result['failed']} | "
        f"{result['requests_per_sec']} | {result['tokens_per_sec']} | {ttft['p50']} / {ttft['p90']} / {ttft['p99']} | "
        f"{whole['p50']} / {whole['p90']} / {whole['p99']} |"])
    (RESULTS / "concurrency.md").write_text(table + "\n")
    print(table)
    if result["failed"]:
        raise SystemExit(f"{result['failed']} requests failed: {result['errors']}")


if __name__ == "__main__":
    main()
