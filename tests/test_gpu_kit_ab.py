"""The GPU kit's figures that decide and its profile table (issue 48 items 1-2), without a GPU: the step-time
statistics and per-round A/B ratios, the variant syntax, the kernel grouping and host gaps of a Chrome trace (a
written one with known kernels, and a real torch.profiler trace of a CPU step), and the dry runs of the `ab` and
`profile` calls end to end (a tiny checkpoint trained by `litqlora finetune` on the CPU, interleaved; a traced step of
ours grouped into the table)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(KIT))

import gpu_ab  # noqa: E402
import kernel_table  # noqa: E402
import timing  # noqa: E402


def test_spread_and_timed_steps_leave_out_the_warm_up():
    steps = [100.0, 900.0, 950.0, 1000.0, 1010.0, 990.0, 1005.0, 700.0, 1000.0]
    kept = timing.timed(steps, warmup=4)
    assert kept == [1010.0, 990.0, 1005.0, 700.0, 1000.0]
    s = timing.spread(kept)
    assert s["median"] == 1000.0 and s["min"] == 700.0 and s["max"] == 1010.0 and s["n"] == 5
    assert s["p25"] == 990.0 and s["p75"] == 1005.0 and s["rel_iqr"] == pytest.approx(0.015)
    assert timing.timed([5.0, 6.0], warmup=4) == [6.0]  # a smoke run shorter than the warm-up: all but the first
    assert timing.quantile([1, 2, 3, 4], 0.5) == 2.5


def test_ab_ratios_are_per_round_and_skip_rounds_a_variant_missed():
    rounds = [{"a": 100.0, "b": 90.0}, {"a": 80.0, "b": 76.0}, {"a": 120.0, "b": 96.0}, {"a": 100.0}]
    r = timing.ab_ratios(rounds, "a")["b"]
    assert r["ratios"] == pytest.approx([0.9, 0.95, 0.8]) and r["rounds"] == 3
    assert r["median"] == pytest.approx(0.9) and r["min"] == pytest.approx(0.8) and r["max"] == pytest.approx(0.95)
    # the same runs as plain averages would say 0.884 (262/296.7): the round's drift is what the ratio cancels
    assert timing.ab_ratios([{"a": 1.0}], "a") == {}


def test_a_variant_is_settings_then_finetune_options():
    v = gpu_ab.parse_variant("fused", "LIT_QLORA_NF4_FUSED=1 LIT_QLORA_X=a=b --quantize nf4 --lora.r 16")
    assert v == {"name": "fused", "env": {"LIT_QLORA_NF4_FUSED": "1", "LIT_QLORA_X": "a=b"},
                 "args": ["--quantize", "nf4", "--lora.r", "16"]}
    assert gpu_ab.parse_variant("base", "") == {"name": "base", "env": {}, "args": []}
    with pytest.raises(ValueError, match="environment settings go before"):
        gpu_ab.parse_variant("bad", "--quantize nf4 LIT_QLORA_NF4_FUSED=1")


def test_the_ab_summary_counts_whole_rounds_and_names_failures():
    variants = [gpu_ab.parse_variant("q", "--quantize nf4"), gpu_ab.parse_variant("l", "--quantize none")]
    runs = [{"round": 0, "variant": "q", "steady_tokens_per_sec": 90.0, "peak_allocated_train_bytes": 5},
            {"round": 0, "variant": "l", "steady_tokens_per_sec": 100.0, "peak_allocated_train_bytes": 9},
            {"round": 1, "variant": "q", "steady_tokens_per_sec": 95.0, "peak_allocated_train_bytes": 6},
            {"round": 1, "variant": "l", "rc": 1, "error": "CUDA out of memory"}]
    summary = gpu_ab.summarize(variants, runs)
    assert summary["complete_rounds"] == 1 and summary["baseline"] == "q"
    assert summary["ratios"]["l"]["ratios"] == pytest.approx([100 / 90])
    assert summary["variants"]["q"]["median_tokens_per_sec"] == 92.5
    assert summary["variants"]["q"]["peak_allocated_train_bytes"] == 6
    assert summary["variants"]["l"]["failed"] == ["CUDA out of memory"]
    md = gpu_ab.table({"runs": [dict(r, step_seconds=[1.0, 0.5]) for r in runs], "summary": summary})
    assert "l / q: median of 1 per-round ratios **1.111** [1.111, 1.111]" in md
    assert "| 0 | q | 90.0 |" in md and "1.000 0.500" in md


def kernel(name, ts, dur, ext, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7,
            "args": {"External id": ext}}


def op(name, ts, dur, ext, dims=None):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1,
            "args": {"External id": ext, **({"Input Dims": dims} if dims else {})}}


def test_kernels_are_grouped_by_name_and_launching_op_and_the_gaps_found():
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "step", "ts": 0, "dur": 1000, "pid": 1, "tid": 1},
        op("aten::mm", 0, 50, 1, [[4096, 4096], [4096, 14336]]),
        op("aten::mm", 60, 20, 2, [[4096, 4096], [4096, 8]]),
        op("lit_qlora::nf4_dequantize", 90, 10, 3),
        op("aten::_scaled_dot_product_flash_attention", 100, 10, 4),
        op("aten::_fused_adamw_", 700, 10, 5),
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 10, 300, 1),
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 310, 40, 2),  # back to back: no gap
        kernel("_nf4_dequantize_kernel", 400, 50, 3),  # 50 us idle before it
        kernel("flash_fwd_kernel", 450, 100, 4),
        kernel("Memcpy DtoD", 555, 5, 0, cat="gpu_memcpy"),  # 5 us: launch latency, not a gap
        kernel("multi_tensor_apply_kernel", 800, 100, 5),  # 240 us idle: the host was in the optimizer's op
    ]
    s = kernel_table.summarize(events)
    assert s["device"] == "cuda" and s["kernels"] == 6 and s["wall_ms"] == 1.0
    ms = {g: v["ms"] for g, v in s["groups"].items() if v["kernels"]}
    assert ms == pytest.approx({"matmul": 0.3, "lora": 0.04, "nf4_dequant": 0.05, "attention": 0.1,
                                "copies": 0.005, "optimizer": 0.1})
    assert s["groups"]["matmul"]["share"] == pytest.approx(0.3)
    assert s["busy_ms"] == pytest.approx(0.595) and s["idle_ms"] == pytest.approx(0.405)
    assert s["gaps"]["count"] == 2 and s["gaps"]["ms"] == pytest.approx(0.29)
    assert s["gaps"]["longest"][0] == {"ms": pytest.approx(0.24), "host_op": "-"}
    md = kernel_table.table({"ours": s, "peer": s})
    assert "| matmul | 0.3 (30.0%) | 0.3 (30.0%) |" in md and "| **device idle (host-side)** | 0.4 | 0.4 |" in md


@pytest.mark.parametrize("name,op_name,dims,group", [
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "", None, "norm_rope_act"),
    ("triton_poi_fused_mul_silu_1", "", None, "norm_rope_act"),
    ("void at::native::vectorized_elementwise_kernel<bernoulli>", "aten::bernoulli_", None, "lora"),
    ("triton_poi_fused_bitwise_and_index_mul_rshift_2", "", None, "nf4_dequant"),
    ("nvjet_hsh_128x256", "aten::mm", [[4096, 8], [8, 4096]], "lora"),
    ("nvjet_hsh_128x256", "aten::mm", [[4096, 4096], [4096, 1024]], "matmul"),
    ("cunn_SoftMaxForward", "aten::_log_softmax", None, "loss"),
    ("triton_tem_fused_flex_attention_0", "", None, "attention"),
    ("at::native::CatArrayBatchedCopy", "aten::cat", None, "copies"),
])
def test_kernel_names_of_eager_and_compiled_steps_fall_in_their_groups(name, op_name, dims, group):
    assert kernel_table.classify(name, op_name, dims) == group


def test_a_real_cpu_trace_is_grouped_by_self_time(tmp_path):
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(256, 512, requires_grad=True)
    w, a = torch.randn(1024, 512), torch.randn(8, 512, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function("step"):
            y = x @ w.T + (x @ a.T).sum()
            torch.nn.functional.cross_entropy(y, torch.zeros(256, dtype=torch.long)).backward()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    s = kernel_table.summarize(kernel_table.load(path))
    assert s["device"] == "cpu"
    groups = s["groups"]
    assert groups["matmul"]["kernels"] >= 1 and groups["lora"]["kernels"] >= 1 and groups["loss"]["kernels"] >= 1
    # self times: nested ops counted once, so the groups never add up to more than the step
    total = sum(g["ms"] for g in groups.values())
    assert 0 < total <= s["wall_ms"] * 1.001 and s["busy_ms"] <= s["wall_ms"] * 1.001


def dry_run(call: str, kit_carry: Path, tmp_path: Path, *extra: str) -> tuple[Path, dict, str]:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(KIT / "check.py"), call, "--dry-run", "--carry", str(kit_carry), "--out",
                           str(out), "--work", str(tmp_path / "work"), *extra], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = {r["step"]: r for r in json.loads((out / "check.json").read_text())["rows"]}
    return out, rows, done.stdout


@pytest.mark.slow
def test_the_ab_calls_dry_run_interleaves_two_variants_of_litqlora_finetune(carry, tmp_path):  # noqa: F811
    out, rows, stdout = dry_run("ab", carry, tmp_path, "--variant", "qlora", "--quantize nf4", "--variant", "lora",
                                "LIT_QLORA_FLEX_ATTENTION=0 --quantize none")
    assert sorted(p.name for p in out.iterdir()) == ["ab.json", "ab.md", "check.json", "check.md", "gpu.txt",
                                                      "log.txt"]
    ab = json.loads((out / "ab.json").read_text())
    assert [(r["round"], r["variant"]) for r in ab["runs"]] == [(0, "qlora"), (0, "lora"), (1, "qlora"), (1, "lora")]
    for r in ab["runs"]:
        assert r["rc"] == 0 and len(r["step_seconds"]) == 5 and r["timed_steps"] == 3
    ratio = ab["summary"]["ratios"]["lora"]
    assert ratio["rounds"] == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
    assert ab["summary"]["variants"]["lora"]["env"] == {"LIT_QLORA_FLEX_ATTENTION": "0"}
    assert rows["ab:lora"]["status"] == "ok" and rows["ab:qlora"]["steady_tokens_per_sec"] > 0
    assert "lora / qlora: median of 2 per-round ratios" in (out / "ab.md").read_text()
    assert "A/B lora: median of 2 per-round ratios" in (out / "check.md").read_text()


@pytest.mark.slow
def test_the_profile_calls_dry_run_traces_our_step_and_groups_its_kernels(carry, tmp_path):  # noqa: F811
    out, rows, stdout = dry_run("profile", carry, tmp_path)
    assert {"profile.json", "profile.md", "check.json", "check.md"} <= {p.name for p in out.iterdir()}
    assert len(list(out.iterdir())) <= 8
    assert rows["profile_ours-eager"]["tokens_per_sec"] > 0
    assert rows["kernel_table"]["status"] == "ok"
    summaries = json.loads((out / "profile.json").read_text())
    ours = summaries["ours-eager"]
    assert ours["device"] == "cpu" and ours["groups"]["matmul"]["ms"] > 0 and ours["groups"]["lora"]["ms"] > 0
    assert ours["groups"]["nf4_dequant"]["kernels"] > 0  # QLoRA: the NF4 linears' own time shows
    md = (out / "profile.md").read_text()
    assert md.startswith("| group | ours-eager ms (share) |")


@pytest.mark.slow
def test_the_grpo_calls_dry_run_interleaves_eager_and_compiled_decode_beside_their_estimates(carry, tmp_path):  # noqa: F811
    """check.py grpo (issue 49 on a GPU): `litqlora grpo` eager against --grpo.compile_decode, interleaved, each
    variant's row with its `litqlora estimate --method grpo` prediction; dry: the tiny checkpoint on the CPU."""
    out, rows, stdout = dry_run("grpo", carry, tmp_path)
    ab = json.loads((out / "ab.json").read_text())
    assert ab["verb"] == "grpo" and [r["variant"] for r in ab["runs"]] == ["eager", "compiled"] * 2
    assert all(r["rc"] == 0 and r["timed_steps"] == 2 for r in ab["runs"])
    assert rows["ab:compiled"]["status"] == "ok" and rows["ab:eager"]["steady_tokens_per_sec"] > 0
    estimates = rows["grpo_estimate"]["result"]
    assert estimates.startswith("eager ") and "; compiled " in estimates
    # the kept KV cache of --grpo.compile_decode on CUDA: the compiled variant's prediction is the larger
    assert rows["ab:compiled"]["predicted_peak_bytes"] > rows["ab:eager"]["predicted_peak_bytes"] > 0


@pytest.mark.slow
def test_the_grpo_peers_calls_dry_run_runs_ours_and_trl_at_one_shape(carry, tmp_path):  # noqa: F811
    """check.py grpo_peers (issue 49 item 7 on a GPU): benchmarks/peers/grpo_trl.py's two sides at the call's shape;
    dry: the tiny checkpoint on the CPU, TRL's side where this machine has its venv (else `not run`, saying why)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    from dpo_trl import TRL_PYTHON

    out, rows, stdout = dry_run("grpo_peers", carry, tmp_path)
    record = json.loads((out / "grpo_trl.json").read_text())
    assert record["device"] == "cpu" and record["shape"]["--max_completion"] == "8"
    assert rows["grpo:ours:qlora"]["status"] == "ok" and rows["grpo:ours:qlora"]["steady_tokens_per_sec"] > 0
    trl = rows["grpo:trl:qlora"]
    if TRL_PYTHON.is_file():
        assert trl["status"] == "ok" and trl["steady_tokens_per_sec"] > 0
        assert record["ratios"]["qlora"]["tokens_per_sec_ratio"] > 0
    else:
        assert trl["status"].startswith("not run: ") and "missing" in trl["status"]
