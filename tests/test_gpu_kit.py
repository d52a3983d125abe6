"""The GPU kit (benchmarks/gpu/, issue 36 item 3) without a GPU: the carry builder downloads what the GPU image lacks
(a few MB from the package index) and SmolLM2's tokenizer; the carry installs offline and imports as on the GPU image
(every module the image lacks hidden unless the carry brings it); the check's dry run goes end to end with its table
and at most 8 result files; a step over its cap is stopped with its children, and the rest still runs; the disk
rule's numbers; gpu_suite.run's extra options and launcher."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(KIT))

import check  # noqa: E402
import gpu_suite  # noqa: E402

GB = 10**9



def test_the_carry_holds_what_the_gpu_image_lacks_at_the_versions_tested_here_and_smollm2s_tokenizer(carry):
    manifest = json.loads((carry / "manifest.json").read_text())
    image = check.image_packages()
    wheels = {check.normalize(name.split("-")[0]): name.split("-")[1] for name in manifest["wheels"]}
    assert {"torchao", "jsonargparse", "gguf", "docstring-parser", "typeshed-client"} <= wheels.keys()
    assert not wheels.keys() & image  # nothing the image has already (numpy, pyyaml, torch, ...)
    assert not wheels.keys() & {"lm-eval", "litserve"}  # evaluation and serving: not run by the kit
    for name, version in wheels.items():
        assert version == md.version(name), name  # what CI tested
    assert sorted(p.name for p in (carry / "whl").iterdir()) == sorted(manifest["wheels"])
    assert any(p.name.startswith("setuptools-") for p in (carry / "build").iterdir())
    assert manifest["sizes"]["kit"] + manifest["sizes"]["working_tree"] < 64 << 20

    from tokenizers import Tokenizer

    from lit_qlora.model.config import Config

    smol = carry / "smol"
    assert not (smol / "model.safetensors").exists()  # the tokenizer only: the weights would not fit the carry
    config = Config.from_checkpoint(smol)
    assert (config.vocab_size, config.n_layer, config.n_embd) == (49152, 30, 576)
    tokenizer = Tokenizer.from_file(str(smol / "tokenizer.json"))
    text = "What is the capital of France?"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text and len(ids) == 7 and max(ids) < config.vocab_size
    assert tokenizer.token_to_id("<|im_start|>") == 1


def test_the_carry_installs_offline_and_the_tree_imports_from_it_as_on_the_gpu_image(carry, tmp_path):
    site = tmp_path / "site"
    check.install(carry, site, tmp_path, tmp_path / "install.txt")  # the GPU machine's commands, no index
    hidden = check.hidden_modules(check.image_packages())
    assert {"torchao", "jsonargparse", "gguf", "lit_qlora"} <= set(hidden)
    assert not {"torch", "numpy", "lightning", "yaml", "pytest"} & set(hidden)
    sim = check.write_image_sim(tmp_path / "sim", site, hidden)
    probe = ("import json, gguf, jsonargparse, lit_qlora.cli, lit_qlora.eval.compare, torchao; "
             "print(json.dumps([m.__file__ for m in (gguf, jsonargparse, lit_qlora, lit_qlora.eval.compare, torchao)]))")
    # From the repository root, as every step runs: the tree's lit_qlora/ (no eval/ inside) must not shadow the kit.
    done = subprocess.run([sys.executable, "-c", probe], env=check.kit_env(site, (sim,)), cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    files = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(f.startswith(str(site)) for f in files), files
    assert (site / "lit_qlora" / "eval" / "tasks").is_dir()  # eval/ with its package data
    # The control: the same image without the carry's site has no jsonargparse (the simulation hides for real).
    bare = check.write_image_sim(tmp_path / "bare", tmp_path / "empty", hidden)
    done = subprocess.run([sys.executable, "-c", "import jsonargparse"], env=check.kit_env(tmp_path / "empty", (bare,)),
                          capture_output=True, text=True)
    assert done.returncode == 1 and "No module named 'jsonargparse'" in done.stderr


def rows(out: Path) -> dict[str, dict]:
    return {r["step"]: r for r in json.loads((out / "check.json").read_text())["rows"]}


def test_the_main_calls_dry_run_goes_end_to_end_with_its_table_and_at_most_8_result_files(carry, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(KIT / "check.py"), "main", "--dry-run", "--carry", str(carry),
                           "--out", str(out), "--work", str(tmp_path / "work")], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["check.json", "check.md", "gpu.txt", "log.txt", "long_context.json", "tests.txt"]
    by_step = rows(out)
    assert list(by_step) == ["install", "machine", *(s.name for s in check.main_steps())]
    for name in ("install", "machine", "tests", "checkpoint"):
        assert by_step[name]["status"] == "ok", by_step[name]
    assert re.fullmatch(r"\d+ tests collected in [\d.]+s", by_step["tests"]["result"])
    assert 16.0 * GB < by_step["checkpoint"]["need_bytes"] < 16.1 * GB  # Llama-3.1-8B in bf16, not written
    gpu_steps = [s for s in by_step if s.startswith(("suite_", "long_"))]
    assert len(gpu_steps) == 10 and all(by_step[s]["status"] == "skipped: dry run (no GPU)" for s in gpu_steps)
    # the long-context rows carry `litqlora estimate`'s predictions (a tiny config in the dry run)
    on, off, card = by_step["long_on"], by_step["long_off"], by_step["long_card"]
    assert on["seq"] == off["seq"] == 1024 and card["seq"] > 1024
    assert on["predicted_offload"] is True and off["predicted_offload"] is False
    assert 0 < on["predicted_peak_bytes"] <= off["predicted_peak_bytes"] and on["predicted_host_bytes"] > 0
    long_context = json.loads((out / "long_context.json").read_text())
    assert long_context["rows"]["long_card"] == card
    assert long_context["estimates"]["card"]["max_seq_length"] == card["seq"]
    assert long_context["estimates"]["card"]["device_memory_bytes"] == 1 << 30
    table = (out / "check.md").read_text()
    assert table.strip() in done.stdout  # the one table, printed at the end
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == len(by_step) + 1
    assert "| long_card | 8B, the estimate's longest for a 24 GiB card" in table
    gpu_txt = (out / "gpu.txt").read_text()
    assert "nvidia-smi: not found" in gpu_txt and f"lit_qlora from {tmp_path / 'work' / 'site'}" in gpu_txt


def test_the_peers_calls_dry_run_records_each_peer_row(carry, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(KIT / "check.py"), "peers", "--dry-run", "--steps", "peers", "--carry",
                           str(carry), "--out", str(out), "--work", str(tmp_path / "work")], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["check.json", "check.md", "gpu.txt", "log.txt", "peers.json"]
    by_step = rows(out)
    assert list(by_step)[:4] == ["install", "machine", "checkpoint", "peers"]  # checkpoint: what peers needs
    assert by_step["peers"]["status"] == "ok"
    peers = json.loads((out / "peers.json").read_text())["rows"]
    assert [f"{r['peer']}:{r['variant']}" for r in peers] == list(by_step)[4:]
    import gpu_peers

    for r in peers:  # a peer whose venv this machine lacks is `not run`; one made here (gpu_peer_envs.sh) runs
        status = by_step[f"{r['peer']}:{r['variant']}"]["status"]
        if not gpu_peers.PYTHONS[r["peer"]].is_file():
            assert status.startswith("not run: gpu-venv-"), status
        else:
            assert status == "ok" or status.startswith(("error", "not run: ")), status


def test_the_decode_calls_dry_run_decodes_the_tiny_checkpoint_through_each_of_our_paths(carry, tmp_path):
    """Call 7 (issue 56's GPU decode): dry, each of our sides decodes the tiny checkpoint's 8 tokens on the CPU, in a
    process of its own; bitsandbytes' side needs CUDA and is left out; the ratios are of the sides that ran."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(KIT / "check.py"), "decode", "--dry-run", "--steps", "decode", "--carry",
                           str(carry), "--out", str(out), "--work", str(tmp_path / "work")], capture_output=True,
                          text=True, cwd=ROOT, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    by_step = rows(out)
    assert by_step["decode"]["status"] == "ok", by_step["decode"]
    record = json.loads((out / "decode.json").read_text())
    assert list(record["summary"]) == ["ours nf4", "ours nf4 dequant", "ours bf16"]
    for name, side in record["summary"].items():
        assert len(side["first_tokens"]) == 8 and side["rounds"] == 1 and side["tokens_per_sec"] > 0, name
        assert by_step[f"decode:{name}"]["status"] == "ok"
    assert set(record["ratios"]) == {"ours nf4 / ours nf4 dequant", "ours nf4 / ours bf16"}


def make_kit(tmp_path: Path, budget: float) -> check.Kit:
    out = tmp_path / "out"
    out.mkdir()
    kit = check.Kit("test", out, tmp_path / "work", tmp_path, tmp_path, False, time.monotonic() + budget)
    kit.env = dict(os.environ)
    return kit


def test_a_step_over_its_cap_is_stopped_with_its_children_and_the_steps_after_it_still_run(tmp_path):
    kit = make_kit(tmp_path, budget=60)
    pid_file = tmp_path / "grandchild"

    def slow(kit, cap):
        rc, _ = kit.run("slow", ["bash", "-c", f"sleep 300 & echo $! > {pid_file}; wait"], cap)
        return {"status": "stopped" if rc is None else f"rc {rc}"}

    def broken(kit, cap):
        raise RuntimeError("boom")

    def fine(kit, cap):
        rc, text = kit.run("fine", [sys.executable, "-c", "print('done')"], cap)
        return {"result": text.strip()}

    started = time.monotonic()
    check.run_steps(kit, [
        check.Step("slow", "sleeps", cap=1, need=0, fn=slow, gpu=False),
        check.Step("broken", "raises", cap=10, need=0, fn=broken, gpu=False),
        check.Step("greedy", "needs more than is left", cap=10, need=1000, fn=fine, gpu=False),
        check.Step("after", "needs greedy", cap=10, need=0, fn=fine, gpu=False, requires=("greedy",)),
        check.Step("fine", "prints", cap=10, need=0, fn=fine, gpu=False),
    ])
    assert time.monotonic() - started < 20
    status = {r["step"]: r["status"] for r in kit.rows}
    assert re.fullmatch(r"not run: time budget \(\d+ s left, needs 1000\)", status.pop("greedy"))
    assert status == {"slow": "stopped", "broken": "error: RuntimeError: boom", "after": "not run: needs greedy",
                      "fine": "ok"}
    assert kit.rows[0]["cap_seconds"] == 1 and kit.rows[-1]["result"] == "done"
    grandchild = int(pid_file.read_text())
    state = Path(f"/proc/{grandchild}/stat")
    assert not state.exists() or state.read_text().split()[2] == "Z"  # killed with its group
    assert json.loads((kit.out / "check.json").read_text())["rows"] == kit.rows  # written as each step ends
    for i in range(8 - len(kit.files)):
        kit.result(f"extra{i}.txt")
    with pytest.raises(RuntimeError, match="already writes 8 result files"):
        kit.result("ninth.txt")


def test_the_disk_rule_keeps_the_kit_within_half_the_disk_and_leaves_a_margin(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "held").write_bytes(b"x" * 1000)
    total, ckpt = 64 * 2**30, 16_060_522_496  # a 64 GiB disk, Llama-3.1-8B in bf16
    assert check.disk_refusal(work, ckpt, total, free=60 * GB) is None
    assert check.disk_refusal(work, 2 * ckpt + 2 * GB, total, free=60 * GB) is None  # 34.1 of 68.7 GB: half
    refused = check.disk_refusal(work, 2 * ckpt + 3 * GB, total, free=60 * GB)
    assert "to 35.1 GB, over 50% of the 69 GB disk" in refused
    refused = check.disk_refusal(work, ckpt, total, free=17 * GB)  # fits, but not with 2 GiB to spare
    assert refused == "16.1 GB does not fit the 17.0 GB free (with 2 GB to spare)"
    assert check.disk_refusal(work, 0, 2000, free=100, margin=0) is None  # 1000 bytes held: half
    assert check.disk_refusal(work, 0, 1999, free=100, margin=0) is not None  # over half


def test_gpu_suite_run_puts_extra_options_last_and_runs_them_through_the_launcher(tmp_path):
    fake = tmp_path / "fake_cli.py"  # writes what a finetune run leaves, and the arguments it got
    fake.write_text(
        "import json, sys, pathlib\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out_dir') + 1]); out.mkdir(parents=True)\n"
        "(out / 'argv.json').write_text(json.dumps(sys.argv[1:]))\n"
        "(out / 'summary.json').write_text(json.dumps({'peak_allocated_train_bytes': 3, 'offload_activations': True,"
        " 'offload_host_bytes': 5, 'wall_seconds': 1}))\n"
        "(out / 'metrics.jsonl').write_text('\\n'.join(json.dumps({'tokens_per_sec': t, 'tokens': 60, 'loss': 1.0})"
        " for t in (10, 20, 30)))\n")
    out = tmp_path / "run"
    row = gpu_suite.run(tmp_path / "ckpt", tmp_path / "data.json", out, "nf4", 1, 65536, 3, None, True, "true",
                        extra=["--data.val_split", "0", "--lora.dropout", "0"], launcher=[sys.executable, str(fake)])
    argv = json.loads((out / "argv.json").read_text())
    assert argv[0] == "finetune" and argv[-4:] == ["--data.val_split", "0", "--lora.dropout", "0"]
    assert argv.index("--data.val_split") < len(argv) - 4  # gpu_suite's own 0.02 comes first: the extra wins
    assert row["steady_tokens_per_sec"] == 25 and row["first_step_tokens_per_sec"] == 10
    assert row["step_seconds"] == [6.0, 3.0, 2.0]  # tokens / tokens_per_sec of every step, warm-up included
    assert row["timed_steps"] == 2 and row["tokens_per_sec_spread"]["min"] == 20  # 3 steps: all but the first
    assert row["offload_activations"] is True and row["offload_host_bytes"] == 5 and "wall_seconds" in row
