"""`litqlora estimate --device cpu` against a real step's measured peak of allocated tensor bytes (issue 17).

    python benchmarks/memory/estimate_accuracy.py                     # every row below
    python benchmarks/memory/estimate_accuracy.py --rows SmolLM2-135M:nf4:4:on:0.05

Each row runs in its own process: the prediction (`lit_qlora.estimate.trace_step`, fake tensors) for a preset's
shape, then the real thing: the same shape with random weights built as the loader builds it, LoRA r=8 alpha=16 on
every linear (dropout as the row says), and the `litqlora finetune` step of benchmarks/speed/one_step.py (fused AdamW, clipping), one warm-up step
and one step under torch.profiler(profile_memory=True). Measured peak: the bytes of every storage alive before the
step (counted from the model, optimizer and NF4 buffers: the C kernels read NF4 codes by pointer, so no profiler
sees them as op inputs) plus the highest running sum of the step's allocation and free events. Results: benchmarks/memory/results/estimate_accuracy.{json,md}.

Long-sequence rows (issue 29) add two fields, MODEL:QUANTIZE:BATCH:CHECKPOINTING:DROPOUT:SEQ:OPTIONS, OPTIONS being
`tiled` or `tiled+offload`:

    python benchmarks/memory/estimate_accuracy.py --rows SmolLM2-135M:nf4:4:on:0:2048:tiled SmolLM2-135M:nf4:4:on:0:2048:tiled+offload

* `tiled`: the sequence-tiled MLP and the tiled loss, forced (at 2048 tokens neither would run: SmolLM2's MLP tile is
  43690 tokens, and an NF4 head takes the tiled loss only from V / 2 = 24576 positions) by the same settings in the
  prediction's process and the measured one, before the model is built: MLP tiles of MLP_TILE tokens
  (`tiled_mlp.MLP_TILE_ELEMS`), loss tiles of LOSS_TILE tokens (`tiled_loss.LOSS_TILE_TOKENS`), and
  `loss.use_tiled_loss` without its NF4-head V / 2 condition. Both sides count the tiled MLP's and the tiled loss's
  forwards (`tiled_calls`; the prediction's over the two steps it traces), so a row shows they ran.
* `offload`: offloaded activation checkpoints (`train.offload.ActivationOffload`). A CPU run refuses
  `--train.offload_activations true` (and so does `trace_step` on CPU, through `estimate.offload_decision`), so both
  sides install the component directly: the prediction with `offload_decision` answering on, the measured step with
  `model.activation_offload = ActivationOffload()`. On CPU the component makes plain copies, one standing for the
  pinned host copy of each checkpointed block's input (`to_host`), one for the copy fetched back to the device
  for the block's backward (`_to_device`). The estimate counts the host copies apart (`trace.host_peak`) and never
  in its device peak. The measured device peak is defined alike: the step's `to_host` runs inside a
  torch.profiler scope, every allocation event under that scope is a host copy, and so is the free event of the
  same address that follows; the measured peak is what is resident before the step plus the highest running sum
  of all the other allocation and free events (that is, the peak of all allocations minus the host copies held at
  each moment). The host copies' own running sum is the measured host peak, checked against the prediction's.
  A row and its `+offload` twin share one process (a 4 x 2048 step takes minutes on two cores): both predictions,
  then one model and one warm-up step, the row without offload measured, offload installed, its row measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROWS = [f"{model}:{q}:{batch}:{ckpt}:{dropout}" for model, batch, dropouts in (("SmolLM2-135M", 4, ("0", "0.05")),
                                                                            ("TinyLlama-1.1B", 1, ("0",)))
        for dropout in dropouts for q in ("nf4", "none") for ckpt in ("on", "off")]
ROWS += [f"SmolLM2-135M:{q}:4:on:{dropout}:2048:{options}" for q in ("nf4", "none") for dropout in ("0", "0.05")
         for options in ("tiled", "tiled+offload")]  # issue 29: long sequences, tiling forced, offload
MLP_TILE = 512  # tokens per MLP tile in the `tiled` rows: 16 tiles of a 4 x 2048 micro-batch
LOSS_TILE = 2048  # tokens per loss tile in the `tiled` rows: 4 tiles of its 8188 next-token positions
HOST_SCOPE = "estimate_accuracy: offloaded host copy"


def force_tiling(config) -> dict[str, int]:
    """The tiled MLP and loss at any length past a tile (module doc); returns the counts of their forwards."""
    from lit_qlora.model import tiled_mlp
    from lit_qlora.train import loss, tiled_loss

    tiled_mlp.MLP_TILE_ELEMS = MLP_TILE * config.intermediate_size  # read as the model is built
    tiled_loss.LOSS_TILE_TOKENS = LOSS_TILE
    real_use = tiled_loss.use_tiled_loss
    loss.use_tiled_loss = lambda head, tokens, vocab_sliced: real_use(head, tokens, False)
    calls = {"mlp": 0, "loss": 0}
    for key, function in (("mlp", tiled_mlp._TiledMLP), ("loss", tiled_loss._TiledLoss)):
        def counted(ctx, *args, real=function.forward, key=key):
            calls[key] += 1
            return real(ctx, *args)

        function.forward = staticmethod(counted)
    return calls


def profiled_device_peak(step, alive: list) -> tuple[int, int]:
    """(device peak, host peak) of a step whose offloaded host copies are made inside HOST_SCOPE (module doc): as
    `memory_trace.profiled_peak`, with the host copies' allocations and frees counted apart."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    from lit_qlora.memory.trace import storages

    before = sum({s.data_ptr(): s.nbytes() for t in alive for s in storages(t)}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [(event, False) for event in prof.profiler.kineto_results.experimental_event_tree()]
    allocations = []
    while events:
        event, host = events.pop()
        host = host or event.name == HOST_SCOPE
        events.extend((child, host) for child in event.children)
        if event.typed[0] == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].alloc_size, event.typed[1].ptr, host))
    host_ptrs: set[int] = set()
    running = during = host_now = host_peak = 0
    for _, size, ptr, host in sorted(allocations):
        if (size > 0 and host) or (size < 0 and ptr in host_ptrs):
            (host_ptrs.add if size > 0 else host_ptrs.discard)(ptr)
            host_now += size
            host_peak = max(host_peak, host_now)
            continue
        running += size
        during = max(during, running)
    return before + during, host_peak


def cpu_isa() -> str:
    """This CPU's bf16-relevant extensions, as `lscpu | grep -o 'avx512_bf16\\|amx\\|avx2' | sort -u` lists them."""
    import re

    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return " ".join(sorted(set(re.findall(r"avx512_bf16|amx|avx2", flags))))


def parse_row(row: str) -> tuple[str, str, int, bool, float, int, set[str]]:
    fields = row.split(":")
    model_name, quantize, batch, ckpt, dropout = fields[:5]
    options = set(fields[6].split("+")) if len(fields) > 6 else set()
    if options - {"tiled", "offload"} or ("offload" in options and ckpt != "on"):
        raise SystemExit(f"{row}: OPTIONS takes tiled, offload or tiled+offload; offload needs checkpointing on")
    return (model_name, quantize, int(batch), ckpt == "on", float(dropout), int(fields[5]) if len(fields) > 5 else 512,
            options)


def without_offload(row: str) -> str:
    """The row its run shares a process with: a row and its `+offload` twin take one model and one warm-up step."""
    import re

    return re.sub(r"[:+]offload$", "", row)


def child(group: str) -> None:
    """Rows (comma-separated) that differ at most by offload: predictions first, then one model, one warm-up
    step and a measured step per row, the row without offload first (its offload installed after it)."""
    import time

    import torch
    from lit_qlora.estimate import step as estimate
    from lit_qlora.model.config import Quantize
    from lit_qlora.model.presets import PRESETS
    from lit_qlora.estimate.step import resident_tensors, trace_step
    from lit_qlora.memory.trace import profiled_peak
    from lit_qlora.train.args import LoRAArgs, TrainArgs
    from lit_qlora.model.offload import ActivationOffload
    sys.path.insert(0, str(HERE.parent / "speed"))
    from one_step import build_step

    rows = sorted(group.split(","), key=lambda row: "offload" in parse_row(row)[-1])
    assert len({without_offload(row) for row in rows}) == 1 and len(rows) == len(set(rows)), rows
    model_name, quantize, batch, checkpointing, dropout, seq, options = parse_row(rows[0])
    config = PRESETS[model_name]
    calls = force_tiling(config) if "tiled" in options else None
    real_decision, results, traces = estimate.offload_decision, {}, {}
    for row in rows:
        offload = "offload" in parse_row(row)[-1]
        # as a CUDA run would decide it (a CPU run refuses it: see the module doc)
        estimate.offload_decision = ((lambda *args, **kwargs: (True, "forced on CPU by the benchmark", 0))
                                     if offload else real_decision)
        started = time.perf_counter()
        traces[row] = trace_step(config, Quantize(quantize), "bf16-true", LoRAArgs(r=8, alpha=16, dropout=dropout),
                                 TrainArgs(micro_batch_size=batch, global_batch_size=batch, max_seq_length=seq,
                                           activation_checkpointing=checkpointing, max_norm=1.0), device="cpu")
        results[row] = {"row": row, "estimate_seconds": round(time.perf_counter() - started, 1)}
        if calls is not None:
            results[row]["tiled_calls"] = {"predicted": dict(calls)}
            calls.update(mlp=0, loss=0)

    model, optimizer, step = build_step(model_name, quantize, batch, seq, checkpointing, dropout)
    step()  # warm-up: AdamW's state and the NF4 scratch exist from here on
    for row in rows:
        trace, result = traces[row], results[row]
        if calls is not None:
            calls.update(mlp=0, loss=0)
        started = time.perf_counter()
        if "offload" in parse_row(row)[-1]:
            model.activation_offload = offload = ActivationOffload()
            to_host = offload.to_host

            def tagged_to_host(t, to_host=to_host):
                with torch.profiler.record_function(HOST_SCOPE):
                    return to_host(t)

            offload.to_host = tagged_to_host
            measured, measured_host = profiled_device_peak(step, resident_tensors(model, optimizer))
            assert offload.offloaded == config.n_layer, offload.offloaded  # every block's input
            result.update(predicted_host_bytes=trace.host_peak, measured_host_bytes=measured_host,
                          offload_peak_host_bytes=offload.peak_host_bytes)
        else:
            measured = profiled_peak(step, resident_tensors(model, optimizer))
        if calls is not None:
            result["tiled_calls"]["measured"] = dict(calls)
        result.update(predicted_bytes=trace.peak, measured_bytes=measured, ratio=trace.peak / measured,
                      predicted_by_category=trace.peak_by_category,
                      step_seconds=round(time.perf_counter() - started, 1), threads=torch.get_num_threads(),
                      cpu_isa=cpu_isa())
        print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=ROWS,
                        help="MODEL:QUANTIZE:BATCH:CHECKPOINTING:DROPOUT (seq 512) or ...:SEQ:OPTIONS (module doc)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    path = RESULTS / "estimate_accuracy.json"
    record = json.loads(path.read_text()) if path.is_file() else {"rows": {}}
    groups: dict[str, list[str]] = {}
    for row in args.rows:
        groups.setdefault(without_offload(row), []).append(row)
    for group in groups.values():
        done = subprocess.run([sys.executable, __file__, "--child", ",".join(group)], capture_output=True, text=True,
                              cwd=HERE)
        if done.returncode:
            sys.exit(f"{group} failed:\n{done.stderr[-4000:]}")
        for line in done.stdout.strip().splitlines()[-len(group):]:
            result = json.loads(line)
            row = result["row"]
            result["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            record["rows"][row] = result
            host = (f", host {result['predicted_host_bytes'] / 2**20:.1f} / "
                    f"{result['measured_host_bytes'] / 2**20:.1f} MiB" if "measured_host_bytes" in result else "")
            print(f"{row}: predicted {result['predicted_bytes'] / 2**20:.1f} MiB, measured "
                  f"{result['measured_bytes'] / 2**20:.1f} MiB, ratio {result['ratio']:.3f}{host}"
                  f"{', tiled forwards ' + json.dumps(result['tiled_calls']) if 'tiled_calls' in result else ''}",
                  flush=True)
        record.update(machine=f"{platform.machine()} CPU", python=platform.python_version())
        path.write_text(json.dumps(record, indent=2) + "\n")  # after every group: a later failure keeps it
        write_markdown(record)


def write_markdown(record: dict) -> None:
    lines = ["# `litqlora estimate --device cpu` vs a real step (allocated tensor bytes)", "",
             "Seq 512 unless the row says (`...:SEQ:OPTIONS`), LoRA r=8 alpha=16 on every linear, fused AdamW, "
             "clipping 1.0. Measured, over a step after "
             "a warm-up step: everything resident before it plus the highest running sum of torch.profiler's "
             "allocation and free events during it (`memory_trace.profiled_peak`). `tiled`: the sequence-tiled MLP "
             f"({MLP_TILE}-token tiles) and the tiled loss ({LOSS_TILE}-token tiles, the NF4 head's V / 2 condition "
             "lifted) forced in both; `offload`: offloaded activation checkpoints (CPU copies standing for host "
             "memory), the host copies counted apart on both sides and not in the peak (benchmarks/"
             "estimate_accuracy.py's docstring defines the measured device peak). Reproduce: "
             "`python benchmarks/memory/estimate_accuracy.py --rows ROW`.", "",
             "| row (model:quantize:batch:checkpointing:dropout[:seq:options]) | predicted MiB | measured MiB | "
             "predicted / measured | host MiB predicted / measured | CPU |",
             "|---|---:|---:|---:|---:|---|"]
    for row, r in record["rows"].items():
        host = (f"{r['predicted_host_bytes'] / 2**20:.1f} / {r['measured_host_bytes'] / 2**20:.1f}"
                if "measured_host_bytes" in r else "")
        lines.append(f"| {row} | {r['predicted_bytes'] / 2**20:.1f} | {r['measured_bytes'] / 2**20:.1f} | "
                     f"{r['ratio']:.3f} | {host} | {r.get('cpu_isa', '')} |")
    lines += [line for note in record.get("notes", []) for line in ("", note)]
    (RESULTS / "estimate_accuracy.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
