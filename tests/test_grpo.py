"""`litqlora grpo` (lit_qlora.methods.grpo): for fixed prompts, completions and rewards, the loss and the adapter gradients
equal GRPO's formulas computed here on transformers + peft log-probabilities, for each loss type, with the KL penalty
and with clipping; advantages as the papers scale them; the ratio is exactly 1 with one update per batch of rollouts;
a group of completions decodes as one row at a time does; a run logs TRL's metric names, validates with the reward
functions, and resumes after a kill exactly. fp32 (32-true) on the tiny random Llama with SmolLM2's tokenizer."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lit_qlora.checkpoint.tokenizer import Tokenizer
from lit_qlora.methods.grpo.args import GRPOArgs, GRPODataArgs
from lit_qlora.methods.grpo.command import grpo
from lit_qlora.methods.grpo.loss import StepCounts, advantages, token_terms
from lit_qlora.methods.grpo.module import Rollouts, completion_batch, completion_logps, micro_batches_of, train_on
from lit_qlora.methods.grpo.rollout import sample_group
from lit_qlora.lora.layer import lora_modules
from lit_qlora.model.sampling import generate
from lit_qlora.train.args import LoRAArgs, TrainArgs
from helpers import hf_peft_policy, our_policy

TIMING = {"tokens_per_sec", "peak_memory_bytes", "seconds", "rollout_seconds"}


# ---------------------------------------------------------------------------------------------- 1. advantages

def test_advantages_are_centered_in_each_group_and_scaled_as_asked():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    g1 = [1.0, 0.0, 0.0]  # the second group ties: 2, 2, 2
    mean1, std1 = sum(g1) / 3, (sum((x - 1 / 3) ** 2 for x in g1) / 2) ** 0.5  # unbiased, as torch.std
    want_group = [(x - mean1) / (std1 + 1e-4) for x in g1] + [0.0, 0.0, 0.0]
    assert advantages(rewards, 3, "group").tolist() == pytest.approx(want_group, abs=1e-6)
    batch_std = rewards.std().item()
    assert advantages(rewards, 3, "batch").tolist() == pytest.approx(
        [(x - mean1) / (batch_std + 1e-4) for x in g1] + [0.0] * 3, abs=1e-6)
    assert advantages(rewards, 3, "none").tolist() == pytest.approx([x - mean1 for x in g1] + [0.0] * 3, abs=1e-7)
    # a group whose rewards tie has no advantage: it teaches nothing (frac_reward_zero_std counts such groups)
    assert advantages(torch.ones(4), 2, "group").abs().max() == 0


# ---------------------------------------------------------------------------------------------- 2. exactness

PROMPTS = ["What is 2 + 3?", "Name a color of the sky at noon, please."]
# Two groups of three completions of different lengths (token ids of the tiny model's vocabulary).
COMPLETIONS = [[[17, 42, 99], [5, 6, 7, 8, 9, 10, 11], [300]], [[12, 13], [14, 15, 16, 17, 18], [19, 20, 21, 22]]]
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.9])


def fixed_rollouts(tok: Tokenizer, old_shift: float = 0.0, model=None, temperature: float = 1.0) -> Rollouts:
    prompts = [tok.encode_prompt(p) for p in PROMPTS]
    sequences, plens, clens = [], [], []
    for prompt, group in zip(prompts, COMPLETIONS):
        for c in group:
            sequences.append(torch.tensor(prompt + c))
            plens.append(len(prompt))
            clens.append(len(c))
    r = Rollouts(sequences, plens, clens, torch.ones(6, dtype=torch.bool), REWARDS[:, None], REWARDS,
                 advantages(REWARDS, 3, "group"))
    if old_shift:  # a sampling policy a little off the current one: ratios away from 1, some clipped
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            logps = [completion_logps(model, completion_batch(r, range(i, i + 1), 0, torch.device("cpu")),
                                      temperature)[0] for i in range(6)]
        r.old_logps = [lp + old_shift * torch.randn(len(lp), generator=gen) for lp in logps]
    return r


def plain_loop(parts, loss_of):
    """One process's micro-batch loop, as FinetuneModule.backward_each runs it on one rank."""
    kept = []
    for part in parts:
        loss, keep = loss_of(part)
        loss.backward()
        kept.append(keep)
    return kept


def paper_loss(hf, r: Rollouts, g: GRPOArgs, micro: int, ref_model=None) -> torch.Tensor:
    """The step's loss from the formulas, one unpadded sequence at a time on transformers + peft (fp64 arithmetic
    from fp32 logits), written without lit_qlora's loss code."""
    per_seq, ref_per_seq = [], []
    for i, seq in enumerate(r.sequences):
        p = r.prompt_lengths[i]
        logits = hf(seq[None]).logits[0].double() / g.temperature
        per_seq.append(F.log_softmax(logits[p - 1 : -1], -1).gather(-1, seq[p:, None])[:, 0])
        if g.beta:
            with torch.no_grad(), ref_model():
                ref_logits = hf(seq[None]).logits[0].double() / g.temperature
            ref_per_seq.append(F.log_softmax(ref_logits[p - 1 : -1], -1).gather(-1, seq[p:, None])[:, 0])
    losses = []
    for i, logp in enumerate(per_seq):
        old = logp.detach() if r.old_logps is None else r.old_logps[i].double()
        a = float(r.advantages[i])
        rho = torch.exp(logp - old)
        loss = -torch.minimum(rho * a, torch.clamp(rho, 1 - g.epsilon, 1 + g.eps_high) * a)
        if g.beta:
            d = ref_per_seq[i] - logp
            loss = loss + g.beta * (torch.exp(d) - d - 1)
        losses.append(loss)
    n = len(losses)
    batches = [list(range(k, min(k + micro, n))) for k in range(0, n, micro)]
    if g.loss_type == "grpo":
        return sum(lo.mean() for lo in losses) / n
    if g.loss_type == "dapo":
        return sum(lo.sum() for lo in losses) / sum(len(lo) for lo in losses)
    if g.loss_type == "bnpo":
        return sum(sum(losses[i].sum() for i in b) / sum(len(losses[i]) for i in b) for b in batches) / len(batches)
    return sum(sum(losses[i].sum() for i in b) / (len(b) * g.max_completion_length) for b in batches) / len(batches)


CASES = [  # (loss_type, beta, old_shift, temperature)
    ("grpo", 0.0, 0.0, 1.0), ("bnpo", 0.0, 0.0, 1.0), ("dr_grpo", 0.0, 0.0, 1.0), ("dapo", 0.0, 0.0, 1.0),
    ("dapo", 0.04, 0.3, 0.7), ("grpo", 0.1, 0.3, 1.0), ("bnpo", 0.04, 0.3, 1.0), ("dr_grpo", 0.1, 0.3, 0.9),
]


@pytest.mark.parametrize("loss_type, beta, old_shift, temperature", CASES)
def test_loss_and_adapter_gradients_equal_the_papers_formulas_on_transformers_and_peft(
        loss_type, beta, old_shift, temperature, tiny_llama_dir):

    tok = Tokenizer(tiny_llama_dir)
    ours = our_policy(tiny_llama_dir, "none")
    g = GRPOArgs(loss_type=loss_type, beta=beta, epsilon=0.1, epsilon_high=0.15, max_completion_length=8,
                 temperature=temperature)
    r = fixed_rollouts(tok, old_shift, ours, temperature)
    if beta:  # the reference: the same model with the adapters off
        from lit_qlora.train.policy import reference_policy

        with reference_policy(ours, None):
            r.ref_logps = [completion_logps(ours, completion_batch(r, range(i, i + 1), 0, torch.device("cpu")),
                                            temperature)[0] for i in range(6)]
    micro = 4  # two micro-batches of 4 and 2 completions
    parts = micro_batches_of(6, micro)
    counts = StepCounts(6, float(sum(r.completion_lengths)), len(parts), g.max_completion_length)
    loss_sum, kl_sum, low, high = train_on(ours, r, g, micro, 0, torch.device("cpu"), counts, plain_loop)
    hf = hf_peft_policy(tiny_llama_dir, ours, "none")
    want = paper_loss(hf, r, g, micro, ref_model=hf.disable_adapter)
    want.backward()
    assert loss_sum.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    compared = 0
    for name, layer in lora_modules(ours).items():
        for leaf in ("lora_A", "lora_B"):
            theirs = hf.get_parameter(f"base_model.model.{name}.{leaf}.default.weight").grad
            torch.testing.assert_close(getattr(layer, leaf).grad, theirs.float(), rtol=1e-4, atol=1e-6)
            compared += 1
    assert compared == 28
    assert any(layer.lora_B.grad.abs().max() > 0 for layer in lora_modules(ours).values())
    if old_shift:  # the shifted sampling policy puts some tokens outside the clip range
        assert low.item() + high.item() > 0
    assert (kl_sum.item() > 0) == bool(beta)


def test_with_one_update_per_batch_of_rollouts_the_ratio_is_exactly_one(tiny_llama_dir):
    ours = our_policy(tiny_llama_dir, "none")
    r = fixed_rollouts(Tokenizer(tiny_llama_dir))
    batch = completion_batch(r, range(6), 0, torch.device("cpu"))
    logps = completion_logps(ours, batch, 1.0)
    terms = token_terms(logps, logps.detach(), None, r.advantages, batch["mask"], 0.2, 0.2, 0.0)
    ratio = torch.exp(logps - logps.detach())
    assert torch.equal(ratio, torch.ones_like(ratio))
    assert not terms.low_clipped.any() and not terms.high_clipped.any()
    # loss = -A per token: each completion pushed by its advantage alone
    want = -r.advantages[:, None].expand_as(logps) * batch["mask"]
    torch.testing.assert_close(terms.loss, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- 3. rollouts

def test_a_greedy_group_decodes_as_one_row_at_a_time_and_keeps_its_stop_token(tiny_llama_dir):
    model = our_policy(tiny_llama_dir, "nf4").eval()
    tok = Tokenizer(tiny_llama_dir)
    prompt = tok.encode_prompt("Count to three.")
    alone = list(generate(model, prompt, 12))
    group = sample_group(model, prompt, 3, 12, 0.0, None, 1.0, [], torch.Generator())
    assert group.completions == [alone] * 3 and group.stopped == [False] * 3
    stop = alone[4]  # make the fifth token a stop token: each row ends there, the stop token kept
    first = alone.index(stop)
    group = sample_group(model, prompt, 2, 12, 0.0, None, 1.0, [stop], torch.Generator())
    assert group.completions == [alone[: first + 1]] * 2 and group.stopped == [True, True]


def test_sampling_is_seeded_and_rows_differ(tiny_llama_dir):
    model = our_policy(tiny_llama_dir, "nf4").eval()
    prompt = Tokenizer(tiny_llama_dir).encode_prompt("Say something.")
    runs = [sample_group(model, prompt, 4, 10, 1.0, 50, 0.9, [], torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert runs[0].completions == runs[1].completions != runs[2].completions
    assert len({tuple(c) for c in runs[0].completions}) > 1  # the rows of a group are drawn apart
    assert all(len(c) == 10 for c in runs[0].completions)


# ---------------------------------------------------------------------------------------------- 4. a run

REWARD_FILE = '''
def first_token(completions, completion_ids, **kwargs):
    """A reward the tiny random model's samples vary in within a group: its first token id modulo 5."""
    return [(ids[0] % 5) / 4 for ids in completion_ids]


def answer_seen(completions, answer, **kwargs):
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]
'''


@pytest.fixture(scope="module")
def grpo_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo-data")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i + 1}?"}], "answer": str(2 * i + 1)}
            for i in range(12)]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "rewards.py").write_text(REWARD_FILE)
    return tmp


def run_grpo(tiny_llama_dir, out_dir, data_dir, resume=False, **overrides):
    g = dict(num_generations=4, max_completion_length=8, rewards=[f"{data_dir}/rewards.py:first_token",
                                                                   f"{data_dir}/rewards.py:answer_seen", "format"],
             reward_weights=[1.0, 1.0, 0.5], beta=0.04, num_iterations=2)
    g.update(overrides.pop("grpo", {}))
    train = dict(micro_batch_size=4, global_batch_size=8, max_seq_length=64, lr=2e-2, warmup_steps=1, max_steps=4,
                 save_interval=1, eval_interval=2)
    compile_ = overrides.pop("compile", False)
    train.update(overrides)
    return grpo(checkpoint_dir=tiny_llama_dir, out_dir=out_dir, quantize="nf4", precision="32-true",
                accelerator="cpu", resume=resume, lora=LoRAArgs(r=4, alpha=8, dropout=0.1),
                data=GRPODataArgs(path=str(data_dir / "prompts.jsonl"), val_split=0.25),
                train=TrainArgs(**train), grpo=GRPOArgs(**g), logger="csv", compile=compile_)


def rows_of(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def grpo_run(tiny_llama_dir, grpo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = run_grpo(tiny_llama_dir, out, grpo_data)
    return out, summary, printed.getvalue()


def test_a_run_logs_trls_metric_names_and_validates_with_the_rewards(grpo_run):
    out, summary, printed = grpo_run
    rows = rows_of(out)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    names = {"reward", "reward_std", "rewards/first_token/mean", "rewards/first_token/std", "rewards/answer_seen/mean",
             "rewards/format/mean", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
             "completions/mean_length", "completions/min_length", "completions/max_length",
             "completions/clipped_ratio", "frac_reward_zero_std"}
    for row in train:
        assert names <= row.keys(), names - row.keys()
        assert 1 <= row["completions/min_length"] <= row["completions/mean_length"] <= row["completions/max_length"] <= 8
        assert 0 <= row["frac_reward_zero_std"] <= 1 and row["reward_std"] >= 0
        assert any(row["reward_std"] > 0 for row in train)  # first_token varies within groups: advantages to learn from
    # the weighted sum: first_token + answer_seen + 0.5 x format
        assert row["reward"] == pytest.approx(row["rewards/first_token/mean"] + row["rewards/answer_seen/mean"]
                                              + 0.5 * row["rewards/format/mean"], abs=1e-6)
    # num_iterations 2: steps 1-2 train on one batch of rollouts, 3-4 on the next: same rewards within a batch
    assert train[0]["reward"] == train[1]["reward"] and train[2]["reward"] == train[3]["reward"]
    # generation's seconds: within the step's on the steps that sample, none on those that train on them again
    for row in train[::2]:
        assert 0 < row["rollout_seconds"] < row["tokens"] / row["tokens_per_sec"]
    assert train[1]["rollout_seconds"] == train[3]["rollout_seconds"] == 0.0
    assert abs(train[0]["kl"]) < 1e-6 < train[1]["kl"]  # the first step starts at the reference
    vals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in vals] == [0, 2, 4]
    for row in vals:
        assert row["val_loss"] == pytest.approx(-row["eval_reward"], abs=1e-9)
        assert {"eval_rewards/first_token/mean", "eval_rewards/format/mean"} <= row.keys()
    assert summary["initial_eval_reward"] == vals[0]["eval_reward"] and summary["eval_reward"] == vals[-1]["eval_reward"]
    assert summary["best_step"] in (2, 4) and (out / "best" / "adapter.safetensors").is_file()
    assert "Objective: GRPO (dapo loss), 4 completions per prompt of at most 8 tokens" in printed
    assert re.search(rf"\n  reward \(val, before -> after\) +{vals[0]['eval_reward']:.4f} -> "
                     rf"{vals[-1]['eval_reward']:.4f}\n", printed), printed
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    replies = [s for s in samples if "reply" in s]  # the validations' greedy replies
    assert [s["step"] for s in replies] == [0, 2, 4] and replies[0]["prompt_text"].startswith("What is ")
    # the training steps' completions (log_interval 1; num_iterations 2: logged when sampled, at steps 1 and 3)
    groups = [s for s in samples if "completions" in s]
    assert [s["step"] for s in groups] == [1, 1, 3, 3]
    for group in groups:
        assert len(group["completions"]) == 4 and group["prompt_text"].startswith("What is ")
        for c in group["completions"]:
            assert c["reward"] == pytest.approx(c["rewards"]["first_token"] + c["rewards"]["answer_seen"]
                                                + 0.5 * c["rewards"]["format"], abs=1e-5)
    step1 = [r for r in train if r["step"] == 1][0]  # two prompts per step on one rank: both logged
    logged = [c["reward"] for g in groups[:2] for c in g["completions"]]
    assert sum(logged) / len(logged) == pytest.approx(step1["reward"], abs=1e-5)
    assert (out / "final" / "adapter.safetensors").is_file()
    assert json.loads((out / "final" / "adapter_config.json").read_text())["method"] == "grpo"


def test_resume_after_a_kill_mid_batch_of_rollouts_is_exact(tiny_llama_dir, grpo_data, grpo_run, tmp_path):
    """Killed during step 4 with its step-3 checkpoint the newest: step 4 trains on the rollouts sampled at step 3,
    which the checkpoint kept (the adapter that sampled them is gone)."""
    from safetensors.torch import load_file

    full, _, _ = grpo_run
    out = tmp_path / "run"
    shutil.copytree(full, out)
    full_rows = rows_of(full)
    shutil.rmtree(out / "checkpoints" / "step-000004")
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    kept = [r for r in full_rows if r["step"] <= 3]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert (out / "checkpoints" / "step-000003" / "module.safetensors").is_file()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = run_grpo(tiny_llama_dir, out, grpo_data, resume="auto")
    assert summary["resumed_from_step"] == 3 and "Resuming from" in printed.getvalue()
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip([r for r in rows_of(out) if "loss" in r]) == strip([r for r in full_rows if "loss" in r])
    ours, want = load_file(str(out / "final" / "adapter.safetensors")), load_file(str(full / "final" / "adapter.safetensors"))
    assert all(torch.equal(ours[k], want[k]) for k in want)


@pytest.mark.parametrize("flags, message", [
    (dict(grpo=dict(num_generations=3)), "multiple of --grpo.num_generations"),
    (dict(grpo=dict(num_generations=1)), "--grpo.num_generations must be >= 2"),
    (dict(grpo=dict(rewards=["no_such_reward"])), "no_such_reward"),
    (dict(grpo=dict(reward_weights=[1.0])), "--grpo.reward_weights"),
    (dict(grpo=dict(max_completion_length=64)), "--grpo.max_completion_length"),
    (dict(compile=True), "`litqlora grpo` does not take --compile: its rollouts decode one token at a time"),
])
def test_bad_options_are_refused_before_anything_loads(flags, message, tiny_llama_dir, grpo_data, tmp_path):
    from lit_qlora.base.errors import UserError

    with pytest.raises(UserError, match=re.escape(message)):
        run_grpo(tiny_llama_dir, tmp_path / "bad", grpo_data, **flags)
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------------------------- 5. DDP

def cli_grpo(tiny_llama_dir, out_dir, data_dir, *extra):
    """`litqlora grpo` in a child process on two CPU ranks (gloo): Lightning launches the second rank itself."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lit_qlora.cli", "grpo", "--checkpoint_dir", str(tiny_llama_dir),
           "--out_dir", str(out_dir), "--accelerator", "cpu", "--precision", "32-true", "--lora.r", "4",
           "--lora.alpha", "8", "--lora.dropout", "0", "--data.path", str(data_dir / "prompts.jsonl"),
           "--data.val_split", "0.25", "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
           "--train.max_seq_length", "64", "--train.lr", "0.02", "--train.warmup_steps", "1", "--train.max_steps", "2",
           "--grpo.num_generations", "4", "--grpo.max_completion_length", "8", "--grpo.beta", "0.04",
           "--grpo.rewards", f"[{data_dir}/rewards.py:first_token, {data_dir}/rewards.py:answer_seen]", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_two_ranks_each_sample_their_share_and_train_what_one_process_trains(loss_type, tiny_llama_dir, grpo_data,
                                                                            tmp_path):
    """Each rank samples its half of the step's prompts (seeded by their place in the global batch, so the same
    completions as one process), and the reduced loss, metrics and adapter equal one process's."""
    import torch.distributed as dist

    if not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    one, two = tmp_path / "one", tmp_path / "two"
    cli_grpo(tiny_llama_dir, one, grpo_data, "--grpo.loss_type", loss_type, "--devices", "1")
    cli_grpo(tiny_llama_dir, two, grpo_data, "--grpo.loss_type", loss_type, "--devices", "2", "--strategy", "ddp")
    want, got = (([r for r in rows_of(out) if "loss" in r]) for out in (one, two))
    assert [r["step"] for r in got] == [1, 2]  # written once (rank 0)
    for key in ("reward", "reward_std", "rewards/first_token/mean", "completions/mean_length",
                "completions/max_length", "frac_reward_zero_std"):  # the same completions, reduced over both ranks
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-6, abs=1e-9), key
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5, abs=1e-7)
    assert [r["kl"] for r in got] == pytest.approx([r["kl"] for r in want], rel=1e-4, abs=1e-8)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)
    assert got[0]["grad_norm"] > 0
    from safetensors.torch import load_file

    a, b = (load_file(str(out / "final" / "adapter.safetensors")) for out in (one, two))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


@pytest.mark.slow
def test_two_ranks_resume_mid_batch_of_rollouts_exactly(tiny_llama_dir, grpo_data, tmp_path):
    """Two DDP ranks, num_iterations 2, killed during step 4 with the step-3 checkpoint the newest: step 4 trains on
    the rollouts both ranks sampled at step 3, which the checkpoint kept per rank (gathered to rank 0's file), so the
    resumed run's step 4 and final adapter are bit for bit the uninterrupted run's."""
    import shutil

    import torch.distributed as dist
    from safetensors.torch import load_file

    if not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    flags = ("--grpo.num_iterations", "2", "--train.max_steps", "4", "--train.save_interval", "1", "--devices", "2",
             "--strategy", "ddp")
    full, out = tmp_path / "full", tmp_path / "resumed"
    cli_grpo(tiny_llama_dir, full, grpo_data, *flags)
    saved = load_file(str(full / "checkpoints" / "step-000003" / "module.safetensors"))
    assert int(saved["ranks"]) == 2 and {k.split(".")[0] for k in saved if k != "ranks"} == {"rank0", "rank1"}
    assert not torch.equal(saved["rank0.sequences"], saved["rank1.sequences"])  # each rank's own share
    shutil.copytree(full, out)
    shutil.rmtree(out / "checkpoints" / "step-000004")
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_of(full) if r["step"] <= 3))
    cli_grpo(tiny_llama_dir, out, grpo_data, *flags, "--resume", "auto")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip([r for r in rows_of(out) if "loss" in r]) == strip([r for r in rows_of(full) if "loss" in r])
    ours, want = (load_file(str(d / "final" / "adapter.safetensors")) for d in (out, full))
    assert all(torch.equal(ours[k], want[k]) for k in want)


# ------------------------------------------------------------------------------------ 3b. the compiled decode step

def counting_backend(counts: list):
    """aot_eager (the graph dynamo traces, run without code generation), counting each compilation."""
    from torch._dynamo.backends.common import aot_autograd  # noqa: F401 - (registers the backends)
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        counts.append(len(example_inputs))
        return lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def test_the_compiled_decode_step_draws_the_eager_groups_and_compiles_once(tiny_llama_dir):
    """--grpo.compile_decode: one fullgraph compilation of the decode step serves prompts of every length (the cache
    has one length, the positions are a tensor), and its groups are the eager decoder's: greedy, and sampled from the
    same seeds."""
    from lit_qlora.methods.grpo.rollout import Decoder

    model = our_policy(tiny_llama_dir, "nf4").eval()
    tok = Tokenizer(tiny_llama_dir)
    counts: list = []
    decoder = Decoder(cache_len=64, backend=counting_backend(counts))
    for text in ("Count to three.", "Say something about the weather today, please."):
        prompt = tok.encode_prompt(text)
        for temperature, top_k, top_p in ((0.0, None, 1.0), (1.0, 50, 0.9)):
            eager = sample_group(model, prompt, 4, 10, temperature, top_k, top_p, [], torch.Generator().manual_seed(3))
            compiled = sample_group(model, prompt, 4, 10, temperature, top_k, top_p, [],
                                    torch.Generator().manual_seed(3), decoder)
            assert compiled.completions == eager.completions and compiled.stopped == eager.stopped
    assert len(counts) == 1  # two prompt lengths, greedy and sampled: one graph
    assert model.max_cache_len == 0 and all(b.self_attn.kv_cache is None for b in model.model.layers)  # detached
    with pytest.raises(ValueError, match="exceed the compiled decode's cache"):
        sample_group(model, list(range(60)), 2, 10, 0.0, None, 1.0, [], torch.Generator(), decoder)


def test_a_run_with_the_compiled_decode_trains_what_the_eager_one_trains(tiny_llama_dir, grpo_data, grpo_run,
                                                                        tmp_path, monkeypatch):
    from lit_qlora.methods.grpo import rollout

    counts: list = []
    monkeypatch.setattr(rollout, "COMPILE_BACKEND", counting_backend(counts))
    full, _, _ = grpo_run
    out = tmp_path / "compiled"
    with contextlib.redirect_stdout(io.StringIO()):
        run_grpo(tiny_llama_dir, out, grpo_data, grpo=dict(compile_decode=True))
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(rows_of(out)) == strip(rows_of(full))
    assert 1 <= len(counts) <= 2  # the groups' rows, and validation's greedy single rows
