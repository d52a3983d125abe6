"""Tutorials run as written: their code blocks are extracted and executed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def code_blocks(tutorial: str, language: str) -> list[str]:
    text = (REPO / "tutorials" / tutorial).read_text(encoding="utf-8")
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


@pytest.mark.slow
def test_fabric_tutorial_trains_nf4_lora_and_its_adapter_reloads_exactly(smollm2_dir, tmp_path, monkeypatch):
    """tutorials/fabric.md: NF4Precision in a user's own Fabric loop quantizes every linear, the loss drops on the
    second pass, and the saved adapter rebuilds the very model the loop trained (same logits)."""
    from lit_qlora.checkpoint.loading import load_model

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "SmolLM2-135M-Instruct").symlink_to(smollm2_dir)
    monkeypatch.chdir(tmp_path)
    (script,) = code_blocks("fabric.md", "python")
    namespace: dict = {"__name__": "__main__"}
    exec(compile(script, "fabric_qlora.py", "exec"), namespace)  # noqa: S102 (the tutorial, as written)

    precision, losses, model = namespace["precision"], namespace["losses"], namespace["model"]
    assert (precision.quantized_linears, precision.total_linears) == (210, 210)
    first, second = sum(losses[:8]) / 8, sum(losses[8:]) / 8
    assert second < first - 0.3, losses

    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    model.eval()
    with torch.no_grad():
        trained = model(ids)
        reloaded = load_model(Path("checkpoints/SmolLM2-135M-Instruct"), "nf4", precision.precision,
                                 adapter_dir=Path("out/fabric-qlora"))
        assert torch.equal(reloaded(ids), trained)

    (command,) = [b for b in code_blocks("fabric.md", "bash") if "generate" in b]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "× 9/5 + 32" in done.stdout  # the form of the rows it trained on (the base explains instead)


def run_finetune_block(marker: str, smollm2_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """The bash block of tutorials/finetune.md that mentions `marker`, run as written in `tmp_path` (where the
    default checkpoint is the real SmolLM2)."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "SmolLM2-135M-Instruct").symlink_to(smollm2_dir)
    (block,) = [b for b in code_blocks("finetune.md", "bash") if marker in b]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-ec", block], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1200)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.slow
def test_other_formats_tutorial_runs_as_written(smollm2_dir, tmp_path):
    """tutorials/finetune.md, "Other formats and sources": the CSV block as written, columns renamed, its own
    validation file."""
    import json

    done = run_finetune_block("data/capitals.csv", smollm2_dir, tmp_path)
    assert "Data: data/capitals.csv: 4 alpaca rows (detected from their columns)" in done.stdout
    assert "Data: data/capitals-val.csv: 2 alpaca rows (detected from their columns)" in done.stdout
    summary = json.loads((tmp_path / "out" / "tutorial" / "capitals" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["val_loss"] is not None


@pytest.mark.slow
def test_own_data_tutorial_runs_as_written_and_both_losses_fall(smollm2_dir, tmp_path):
    """tutorials/finetune.md, "Your own data": the block as written; what the text says to expect holds."""
    import json

    run_finetune_block("data/mine.jsonl", smollm2_dir, tmp_path)
    out = tmp_path / "out" / "tutorial" / "mine"
    summary = json.loads((out / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0] - 3  # "train loss per step 10.05 ... 3.23"
    assert summary["val_loss"] < summary["initial_val_loss"] - 0.5  # "validation 7.58 -> 6.04"


@pytest.mark.slow
def test_one_example_per_format_tutorial_runs_as_written(smollm2_dir, tmp_path):
    """tutorials/finetune.md, "One example per format": five files, five formats detected, two steps on each."""
    import json

    done = run_finetune_block("data/alpaca.json", smollm2_dir, tmp_path)
    for file, fmt in (("alpaca.json", "alpaca"), ("messages.jsonl", "messages"), ("sharegpt.json", "sharegpt"),
                      ("completions.parquet", "prompt_completion"), ("notes.jsonl", "text")):
        assert f"Data: data/{file}: 6 {fmt} rows (detected from their columns)" in done.stdout, done.stdout[-2000:]
        summary = json.loads((tmp_path / "out" / "tutorial" / "formats" / file.split(".")[0] / "summary.json")
                             .read_text())
        assert summary["steps"] == 2 and summary["val_loss"] is not None


@pytest.mark.slow
def test_deploy_tutorial_runs_as_written(smollm2_dir, tmp_path):
    """tutorials/deploy.md, every block in order (the last: the fine-tune served by name beside its base): train and
    export to GGUF at q8_0 and read it back (the answer the
    text promises), chat through a pipe, serve and call the server with the `openai` client."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "SmolLM2-135M-Instruct").symlink_to(smollm2_dir)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    gguf, chat, serve, adapters = (subprocess.run(["bash", "-ec", block], capture_output=True, text=True, env=env,
                                                  cwd=tmp_path, timeout=1200)
                                   for block in code_blocks("deploy.md", "bash"))
    assert gguf.returncode == 0, gguf.stderr
    assert 'FROM ./smollm2-q8_0.gguf\nPARAMETER stop "<|im_end|>"' in gguf.stdout
    assert "Paris" in gguf.stdout.splitlines()[-1]
    assert chat.returncode == 0 and "(new conversation)" in chat.stdout, chat.stderr
    assert serve.returncode == 0, serve.stderr
    replies = [line for line in serve.stdout.splitlines()
               if line.strip() and not line.startswith(("INFO", "20", "Serving ", "Stopped serving"))]
    # the first reply (temperature 0: one line naming Paris), then the streamed one, sampled: it may span lines
    assert "Paris" in replies[0] and len(replies) >= 2, serve.stdout
    assert "Stopped serving (SIGTERM)." in serve.stdout  # `kill $!`: one line, the server's last
    assert adapters.returncode == 0, adapters.stderr
    assert "['SmolLM2-135M-Instruct', 'deploy']" in adapters.stdout, adapters.stdout
    answered = [line for line in adapters.stdout.splitlines() if " -> " in line]
    assert [line.split(" -> ")[0] for line in answered] == ["deploy", "SmolLM2-135M-Instruct"], adapters.stdout
    assert "Paris" in answered[1], adapters.stdout  # the base, served under its own name beside the fine-tune


@pytest.mark.slow
def test_preference_tutorial_runs_as_written(smollm2_dir, tmp_path):
    """tutorials/preference.md, every block in order: SFT, DPO from its adapter (the reference is that adapter: the
    first validation loss is log 2 and every reward 0; the held-out pairs' reward accuracy rises well above chance),
    evaluate the merged result, chat with it, then the own-pairs block (conversational and implicit rows, IPO), and
    KTO on the demo's unpaired rows (the held-out rewards of desirable rows rise above the undesirable ones')."""
    import json
    import math

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "SmolLM2-135M-Instruct").symlink_to(smollm2_dir)
    (tmp_path / "eval").symlink_to(REPO / "eval")
    (tmp_path / "config_hub").symlink_to(REPO / "config_hub")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    sft, dpo, evaluate, own, kto = (subprocess.run(["bash", "-ec", block], capture_output=True, text=True, env=env,
                                                   cwd=tmp_path, timeout=1800)
                                    for block in code_blocks("preference.md", "bash"))
    assert sft.returncode == 0, sft.stderr
    assert dpo.returncode == 0, dpo.stderr[-3000:]
    assert "reference: the base with the adapter of out/tutorial/preference/sft" in dpo.stdout
    summary = json.loads((tmp_path / "out/tutorial/preference/dpo/summary.json").read_text())
    assert summary["initial_val_loss"] == pytest.approx(math.log(2), abs=1e-4)  # bf16 on AMX CPUs, fp32 elsewhere
    assert summary["initial_eval_rewards/accuracies"] == 0 and summary["initial_eval_rewards/margins"] == 0
    assert summary["eval_rewards/accuracies"] > 0.6, summary  # chance is 0.5; the full preset: benchmarks/preference
    assert summary["val_loss"] < summary["initial_val_loss"]
    held_out = dpo.stdout.split("A held-out prompt (validation): ")[1].splitlines()[0]
    assert "<|im_start|>" not in held_out and len(held_out) > 10, held_out  # the user's text, not the template's
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    results = json.loads((tmp_path / "out/tutorial/preference/eval/results.json").read_text())
    assert 0 < results["results"]["truthfulqa_mc2"]["acc,none"] < 1
    assert "children" in evaluate.stdout  # the chat's greedy answer
    assert own.returncode == 0, own.stderr[-3000:]
    assert "Data: data/pairs.jsonl: 2 explicit, 2 implicit rows (detected from their columns)" in own.stdout
    assert "Objective: IPO" in own.stdout
    assert kto.returncode == 0, kto.stderr[-3000:]
    assert "Data: " in kto.stdout and "desirable and" in kto.stdout and "Objective: KTO, beta 0.1" in kto.stdout
    summary = json.loads((tmp_path / "out/tutorial/preference/kto/summary.json").read_text())
    assert summary["initial_eval_rewards/margins"] == 0 and summary["initial_val_loss"] == pytest.approx(0.5, abs=1e-4)
    assert summary["eval_rewards/margins"] > 0, summary  # held-out desirable rows gain on undesirable ones


@pytest.mark.slow
def test_grpo_tutorial_runs_as_written(smollm2_dir, tmp_path):
    """tutorials/grpo.md, every block in order: the short SFT, GRPO from its adapter with the reader's own reward
    function beside the built-ins (its metrics logged under its name; the held-out format reward rises), then chat
    and a GGUF export of the result."""
    import json

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "SmolLM2-135M-Instruct").symlink_to(smollm2_dir)
    for name in ("config_hub", "lit_qlora"):  # the presets, and the SFT preset's data file by its relative path
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    sft, grpo, deploy = (subprocess.run(["bash", "-ec", block], capture_output=True, text=True, env=env,
                                        cwd=tmp_path, timeout=1800)
                         for block in code_blocks("grpo.md", "bash"))
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert grpo.returncode == 0, grpo.stderr[-3000:]
    assert "Objective: GRPO (dapo loss), 8 completions per prompt" in grpo.stdout
    out = tmp_path / "out/tutorial/grpo/run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert len(train) == 8 and all(0 <= r["rewards/brevity/mean"] <= 1 for r in train)
    summary = json.loads((out / "summary.json").read_text())
    # the form is learned: the held-out greedy completions follow it more often than the SFT adapter's did
    assert summary["eval_rewards/format/mean"] > summary["initial_eval_rewards/format/mean"], summary
    assert "reward (val, before -> after)" in grpo.stdout
    held_out = grpo.stdout.split("A held-out prompt (validation): ")[1].splitlines()[0]
    assert held_out.endswith("Put only the final number inside <answer></answer>.'"), held_out  # the user's text
    assert deploy.returncode == 0, deploy.stderr[-3000:]
    assert (tmp_path / "out/tutorial/grpo/model-q8_0.gguf").stat().st_size > 100_000_000
