"""`litqlora dpo` (lit_qlora.methods.dpo): the loss and every metric equal the papers' formulas computed here on
transformers + peft log-probabilities (sigmoid, conservative DPO, IPO, ORPO; LoRA and QLoRA); log 2 at the start;
accumulation, resume after a kill, the cached reference, --train.init_adapter, DDP and FSDP2 give the numbers one
uninterrupted process gives; bad options are refused; the metrics reach metrics.jsonl, csv, summary.json and best/.
Every test asserts numbers. fp32 (32-true) throughout, on the tiny random Llama with SmolLM2's tokenizer."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file

from lit_qlora.checkpoint.tokenizer import Tokenizer
from lit_qlora.data.preference import PairCollate, shared_prompt_length, to_pairs, tokenize_pairs
from lit_qlora.data.prompts import get_prompt_style
from lit_qlora.data.sft import IGNORE_INDEX
from lit_qlora.methods.dpo.args import DPOArgs, PreferenceDataArgs
from lit_qlora.methods.dpo.command import dpo
from lit_qlora.methods.dpo.loss import METRICS, Objective
from lit_qlora.methods.dpo.module import PreferenceModule
from lit_qlora.methods.dpo.reference import CACHE_FILE, Reference
from lit_qlora.train.args import LoRAArgs, TrainArgs
from lit_qlora.train.datamodule import pad_id_of
from helpers import hf_peft_policy, our_policy

ROOT = Path(__file__).resolve().parents[1]
LOG2 = math.log(2)
# metrics.jsonl's keys that are not numbers of the run's arithmetic (timings, memory): left out of "identical".
TIMING = {"tokens_per_sec", "peak_memory_bytes", "seconds"}


# ---------------------------------------------------------------------------------------------- 1. exactness

# Three pairs of different prompt and answer lengths (one an implicit raw-text pair): the collated batch pads.
EXACT_ROWS = [
    {"prompt": "What is the capital of Austria?", "chosen": "The capital of Austria is Vienna.",
     "rejected": "Madrid, I believe, though I am not at all sure about that one."},
    {"prompt": "Name a prime number larger than ten, and say in a few words why it is prime.",
     "chosen": "13: no whole number between 1 and 13 divides it.", "rejected": "12."},
    {"chosen": "The sky looks blue because air scatters blue light the most.",
     "rejected": "The sky looks green."},
]


@pytest.fixture(scope="module")
def exact_batch(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    pairs, counts = to_pairs(EXACT_ROWS, "auto", "rows")
    assert counts == {"explicit": 2, "implicit": 1}
    samples = tokenize_pairs(pairs, get_prompt_style("auto", tok), tok, 256)
    batch = PairCollate(pad_id_of(tok))(samples)
    lengths = [len(s.chosen) for s in samples] + [len(s.rejected) for s in samples]
    assert len(set(lengths)) == 6  # six answers of six lengths
    # one row per pair: its prompt once, then both answers (padded to the longest row)
    rows = [len(s.chosen) + len(s.rejected) - shared_prompt_length(s) for s in samples]
    assert batch["input_ids"].shape == (3, max(rows)) and min(shared_prompt_length(s) for s in samples) > 1
    return samples, batch


def our_numbers(model, batch, objective, tmp_path, reference="adapters_off", sets=None):
    """The loss and metrics of one micro-batch through PreferenceModule's own code (micro_sums: the reference, the
    policy's answer log-probabilities, pair_sums; reduce: what a training step and a validation report)."""
    import lightning as L

    ref = Reference(reference, None, tmp_path, sets or {}, PairCollate(0), 2, {"test": 1}) \
        if objective.uses_reference else None
    module = PreferenceModule(model, TrainArgs(), 1, objective=objective, reference=ref)
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                               enable_model_summary=False, enable_checkpointing=False)
    with torch.enable_grad():
        sums = module.micro_sums(batch, "train")
    assert sums.pair_loss.requires_grad  # what training backpropagates
    loss, metrics = module.reduce([sums])
    return loss.item(), metrics


def hf_logps(model, samples):
    """Per sequence (chosen rows, then rejected, as PairCollate orders them), unpadded, one at a time: the summed
    log-probability (fp64 from fp32 logits) of its trained tokens, each predicted from the position before, and the
    tokens themselves."""
    sums, tokens = [], []
    for seq in [s.chosen for s in samples] + [s.rejected for s in samples]:
        with torch.no_grad():
            logits = model(seq.input_ids[None]).logits[0].double()
        trained = seq.labels[1:] != IGNORE_INDEX
        assert torch.equal(seq.labels[1:][trained], seq.input_ids[1:][trained]) and trained.any()
        token = F.log_softmax(logits[:-1], -1).gather(-1, seq.input_ids[1:, None])[:, 0][trained]
        sums.append(token.sum().item())
        tokens.append(int(trained.sum()))
    return sums, tokens


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def paper_numbers(objective, policy, reference, tokens):
    """The loss and TRL's metrics from the papers' formulas: DPO (Rafailov et al., eq. 7) on summed answer
    log-probabilities, conservative DPO with label smoothing e, IPO (Azar et al., eq. 17) on mean token log-probs,
    ORPO (Hong et al., eq. 6-7): chosen NLL (over all chosen tokens of the batch) + lambda * -log sigmoid(log OR)."""
    n = len(policy) // 2
    beta, eps, lam = objective.beta, objective.label_smoothing, objective.orpo_lambda
    if objective.loss == "sigmoid":
        pc, pr, rc, rr = policy[:n], policy[n:], reference[:n], reference[n:]
    else:  # mean token log-probabilities
        per_token = [lp / t for lp, t in zip(policy, tokens)]
        pc, pr = per_token[:n], per_token[n:]
        if reference is not None:
            ref_per_token = [lp / t for lp, t in zip(reference, tokens)]
            rc, rr = ref_per_token[:n], ref_per_token[n:]
    out = {}
    if objective.loss == "orpo":
        def log_odds(lp):  # log(p / (1 - p)), p = exp(mean token log-prob)
            return lp - math.log(1 - math.exp(lp))

        ratios = [log_sigmoid(log_odds(c) - log_odds(r)) for c, r in zip(pc, pr)]
        nll = -sum(policy[:n]) / sum(tokens[:n])
        loss = nll + lam * mean(-x for x in ratios)
        reward_c, reward_r = [beta * c for c in pc], [beta * r for r in pr]
        out.update({"nll_loss": nll, "log_odds_ratio": mean(ratios)})
    else:
        h = [(c - r) - (c0 - r0) for c, r, c0, r0 in zip(pc, pr, rc, rr)]
        if objective.loss == "ipo":
            loss = mean((x - 1 / (2 * beta)) ** 2 for x in h)
        else:
            loss = mean(-(1 - eps) * log_sigmoid(beta * x) - eps * log_sigmoid(-beta * x) for x in h)
        reward_c = [beta * (c - c0) for c, c0 in zip(pc, rc)]
        reward_r = [beta * (r - r0) for r, r0 in zip(pr, rr)]
    out.update({
        "rewards/chosen": mean(reward_c), "rewards/rejected": mean(reward_r),
        "rewards/accuracies": mean(float(c > r) for c, r in zip(reward_c, reward_r)),
        "rewards/margins": mean(c - r for c, r in zip(reward_c, reward_r)),
        "logps/chosen": mean(pc), "logps/rejected": mean(pr),
        "logps/accuracies": mean(float(c > r) for c, r in zip(pc, pr)),
    })
    return loss, out


def assert_close(ours, theirs, tol, what):
    """Within `tol` absolute or relative: a summed answer log-probability (about -130 here) is exact to a few fp32
    ulps (1.5e-5 each at 130; measured 1.6e-5), the loss and the rewards to a few 1e-6 (LoRA) absolute."""
    assert ours == pytest.approx(theirs, rel=tol, abs=tol), f"{what}: ours {ours!r}, from the formula {theirs!r}"


OBJECTIVES = {
    "sigmoid": Objective("sigmoid", beta=0.3),
    "sigmoid-smoothed": Objective("sigmoid", beta=0.3, label_smoothing=0.1),
    "ipo": Objective("ipo", beta=0.3),
    "orpo": Objective("orpo", beta=0.3, orpo_lambda=0.5),
}


@pytest.mark.parametrize("quantize, name, tol", [("none", "sigmoid", 1e-5), ("none", "sigmoid-smoothed", 1e-5),
                                                 ("none", "ipo", 1e-5), ("none", "orpo", 1e-5),
                                                 ("nf4", "sigmoid", 1e-4)])
def test_loss_and_metrics_equal_the_papers_formulas_on_transformers_and_peft(quantize, name, tol, tiny_llama_dir,
                                                                             exact_batch, tmp_path):
    samples, batch = exact_batch
    objective = OBJECTIVES[name]
    ours = our_policy(tiny_llama_dir, quantize)
    loss, metrics = our_numbers(ours, batch, objective, tmp_path)
    hf = hf_peft_policy(tiny_llama_dir, ours, quantize)
    policy, tokens = hf_logps(hf, samples)
    with hf.disable_adapter():
        reference, _ = hf_logps(hf, samples)
    assert max(abs(p - r) for p, r in zip(policy, reference)) > 0.2  # the adapter moves the policy off the reference
    want_loss, want = paper_numbers(objective, policy, None if objective.loss == "orpo" else reference, tokens)
    assert set(metrics) == set(want) == set(objective.metric_names)
    assert_close(loss, want_loss, tol, "loss")
    for key in want:
        assert_close(metrics[key], want[key], tol, key)
    # Not a degenerate batch: the loss is off log 2 and the rewards are not zero.
    assert abs(loss - LOG2) > 1e-3 and abs(want["rewards/chosen"] - want["rewards/rejected"]) > 1e-3


def test_cached_reference_table_equals_the_adapters_off_reference(tiny_llama_dir, exact_batch, tmp_path):
    """`cached` computes the table once (here from the same three pairs, batched two at a time) and looks pairs up
    by index: the same loss and metrics as the reference computed in the step."""
    samples, batch = exact_batch
    objective = OBJECTIVES["sigmoid"]
    ours = our_policy(tiny_llama_dir, "none")
    off = our_numbers(ours, batch, objective, tmp_path / "off")
    cached = our_numbers(ours, batch, objective, tmp_path / "cached", "cached", {"train": samples, "val": samples[:1]})
    assert (tmp_path / "cached" / CACHE_FILE).is_file()
    table = load_file(str(tmp_path / "cached" / CACHE_FILE))
    assert table["train"].shape == (3, 2) and table["val"].shape == (1, 2)
    assert_close(cached[0], off[0], 1e-6, "loss")
    for key in off[1]:
        assert_close(cached[1][key], off[1][key], 1e-6, key)


# ---------------------------------------------------------------------------------------------- runs

def pair_rows(n: int = 16) -> list[dict]:
    """Explicit pairs of different prompt and answer lengths; the chosen answer is the right sum."""
    return [{"prompt": f"What is {i} plus {i + 3}?" + " Explain." * (i % 3),
             "chosen": f"{i} + {i + 3} = {2 * i + 3}." + " Adding the ones gives it." * (i % 2),
             "rejected": f"{i} + {i + 3} = {2 * i + 4}, I think" + "." * (1 + i % 4)} for i in range(n)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> PreferenceDataArgs:
    """16 pairs, 4 held out for validation."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in pair_rows()))
    return PreferenceDataArgs(path=str(path), val_split=0.25)


# micro 2, global 4: two accumulated micro-batches a step.
TRAIN = dict(micro_batch_size=2, global_batch_size=4, max_seq_length=64, lr=1e-2, warmup_steps=1, max_steps=2)


def run_dpo(tiny_llama_dir, out_dir, data, quantize="none", dropout=0.0, lora=None, logger="tensorboard",
            resume=False, nf4_shards=None, dpo_args=None, **train_kw):
    return dpo(checkpoint_dir=tiny_llama_dir, out_dir=out_dir, quantize=quantize, precision="32-true",
               accelerator="cpu", resume=resume, nf4_shards=nf4_shards,
               lora=lora or LoRAArgs(r=4, alpha=8, dropout=dropout), data=data,
               train=TrainArgs(**{**TRAIN, **train_kw}), dpo=dpo_args or DPOArgs(), logger=logger)


def rows_of(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def train_rows(out_dir: Path) -> list[dict]:
    return [r for r in rows_of(out_dir) if "loss" in r]


def numbers(row: dict) -> dict:
    """A metrics row without its timings and memory."""
    return {k: v for k, v in row.items() if k not in TIMING}


def adapter_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "adapter.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_rows_close(got: list[dict], want: list[dict], tol: float) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert numbers(g).keys() == numbers(w).keys()
        for key, value in numbers(w).items():
            if isinstance(value, float):
                assert g[key] == pytest.approx(value, rel=tol, abs=tol), (g["step"], key, g[key], value)
            else:
                assert g[key] == value, (g["step"], key)


@pytest.fixture(scope="module")
def validated(tiny_llama_dir, pairs, tmp_path_factory):
    """A 2-step sigmoid run validating every step, with the csv logger."""
    out = tmp_path_factory.mktemp("validated") / "run"
    summary = run_dpo(tiny_llama_dir, out, pairs, logger="csv", eval_interval=1)
    return out, summary


# ---------------------------------------------------------------------------------------------- 2. log 2 at the start

def test_with_the_adapter_at_its_initial_state_the_loss_is_log_2_and_rewards_are_zero(validated):
    out, summary = validated
    rows = rows_of(out)
    first_val, first_step = rows[0], rows[1]
    assert first_val["step"] == 0 and first_step["step"] == 1
    assert first_val["val_loss"] == pytest.approx(LOG2, abs=1e-6)
    assert summary["initial_val_loss"] == pytest.approx(LOG2, abs=1e-6)
    for prefix, row in (("initial_eval_", summary), ("eval_", first_val), ("", first_step)):
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
            assert row[prefix + key] == 0.0, (prefix, key)  # B = 0: the policy is the reference, exactly
    # Before any step the policy still tells the pairs apart by its own log-probabilities (a number, not 0/0).
    assert first_step["loss"] == pytest.approx(LOG2, abs=1e-6) and first_step["logps/chosen"] < 0
    assert 0 <= first_val["eval_logps/accuracies"] <= 1
    # And the run learns: the rewards separate the pairs after two steps.
    assert summary["val_loss"] < LOG2 - 1e-3 and summary["eval_rewards/margins"] > 0


# ---------------------------------------------------------------------------------------------- 9. where metrics go

def test_metrics_jsonl_csv_summary_and_best_hold_trls_names(validated):
    out, summary = validated
    rows = rows_of(out)
    trained, validations = [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in trained] == [1, 2] and [r["step"] for r in validations] == [0, 1, 2]
    ours = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "peak_memory_bytes", "tokens"}
    assert all(set(r) == ours | set(METRICS) for r in trained)
    assert all(set(r) == {"step", "val_loss"} | {f"eval_{m}" for m in METRICS} for r in validations)
    assert METRICS == ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                       "logps/rejected", "logps/accuracies")
    # margins = chosen - rejected, in every row
    for r in trained:
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-6)
    # The csv logger: train/<name> at each step, eval/<name> at each validation, the same numbers.
    import csv

    with (out / "csv" / "metrics.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert {f"train/{m}" for m in METRICS} | {f"eval/{m}" for m in METRICS} <= set(table[0])
    logged_train = {int(float(r["step"])): r for r in table if r["train/rewards/chosen"]}
    logged_eval = {int(float(r["step"])): r for r in table if r["eval/rewards/accuracies"]}
    assert sorted(logged_train) == [1, 2] and sorted(logged_eval) == [0, 1, 2]
    for r in trained:
        assert float(logged_train[r["step"]]["train/rewards/chosen"]) == pytest.approx(r["rewards/chosen"], abs=1e-6)
    for r in validations:
        assert float(logged_eval[r["step"]]["eval/rewards/accuracies"]) == r["eval_rewards/accuracies"]
    # summary.json: the last step's, the last validation's and the first validation's numbers.
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["eval_rewards/accuracies"] == validations[-1]["eval_rewards/accuracies"]
    assert on_disk["initial_eval_rewards/accuracies"] == validations[0]["eval_rewards/accuracies"] == 0.0
    assert on_disk["rewards/margins"] == trained[-1]["rewards/margins"]
    assert on_disk["val_loss"] == validations[-1]["val_loss"]
    # best/: the adapter of the lowest validation loss after a step.
    best = min(validations[1:], key=lambda r: r["val_loss"])
    assert json.loads((out / "best" / "best.json").read_text())["step"] == best["step"] == on_disk["best_step"]
    assert (out / "best" / "adapter.safetensors").is_file()
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["method"] == "dpo"


def test_orpo_rows_add_nll_loss_and_log_odds_ratio(tiny_llama_dir, pairs, tmp_path):
    summary = run_dpo(tiny_llama_dir, tmp_path / "orpo", pairs, max_steps=1,
                      dpo_args=DPOArgs(loss="orpo", orpo_lambda=0.5))
    [row] = train_rows(tmp_path / "orpo")
    assert set(METRICS) | {"nll_loss", "log_odds_ratio"} <= set(row)
    # The loss is the NLL plus lambda x -(the mean log sigmoid of the log odds ratio), in the same row.
    assert row["loss"] == pytest.approx(row["nll_loss"] - 0.5 * row["log_odds_ratio"], rel=1e-6)
    # Rewards are beta x the mean token log-probabilities.
    assert row["rewards/chosen"] == pytest.approx(0.1 * row["logps/chosen"], rel=1e-6)
    assert summary["val_loss"] == pytest.approx(summary["eval_nll_loss"] - 0.5 * summary["eval_log_odds_ratio"],
                                                rel=1e-6)


# ---------------------------------------------------------------------------------------------- 3. accumulation

@pytest.mark.parametrize("loss", ["sigmoid", "orpo"])
def test_accumulated_step_equals_one_large_batch(loss, tiny_llama_dir, pairs, tmp_path):
    """Four micro-batches of one pair and one batch of four give the same steps (orpo: its NLL token-weighted over
    the whole global batch, not averaged per micro-batch)."""
    args = DPOArgs(loss=loss)
    run_dpo(tiny_llama_dir, tmp_path / "a", pairs, micro_batch_size=1, global_batch_size=4, dpo_args=args)
    run_dpo(tiny_llama_dir, tmp_path / "b", pairs, micro_batch_size=4, global_batch_size=4, dpo_args=args)
    a, b = train_rows(tmp_path / "a"), train_rows(tmp_path / "b")
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-5)
    assert a[0]["grad_norm"] == pytest.approx(b[0]["grad_norm"], rel=1e-5)  # the step-1 gradient
    assert_rows_close(a, b, 1e-5)  # step 2 too: loss, gradient, rewards and log-probs
    # Updates are ~lr = 1e-2; the micro-batches sum in another order (the SFT accumulation test's tolerance).
    # fp32 sums in another order, through two AdamW steps
    assert max_diff(adapter_of(tmp_path / "a" / "final"), adapter_of(tmp_path / "b" / "final")) < 1e-5
    assert b[1]["loss"] != a[0]["loss"]  # the second step is another one


# ---------------------------------------------------------------------------------------------- 4, 5. resume, cached

@dataclass
class Resumed:
    full_rows: list[dict]
    full_adapter: dict
    rows: list[dict]
    adapter: dict
    printed: str
    first_printed: str
    cache_mtime: tuple  # (after the full run, after the resume), or None without a cache file


@pytest.fixture(scope="module")
def resumed(tiny_llama_dir, pairs, tmp_path_factory):
    """For each --dpo.reference: a 4-step QLoRA run (NF4 base, adapter dropout 0.1: the resumed RNG matters too,
    a checkpoint every 2 steps) and, turned into the same run killed during step 4 (its step-4 row logged, its
    step-4 checkpoint, final/ and summary.json never written), its resume with --resume auto. `recomputed`: the
    cached run's killed state without its reference_logps.safetensors, which the resume then computes again."""
    runs, killed = {}, None
    for mode in ("adapters_off", "cached", "recomputed"):
        if mode == "recomputed":
            out = tmp_path_factory.mktemp(mode) / "run"
            shutil.copytree(killed, out)
            (out / CACHE_FILE).unlink()
            full_rows, full_adapter, printed = runs["cached"].full_rows, runs["cached"].full_adapter, None
        else:
            out = tmp_path_factory.mktemp(mode) / "run"
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                run_dpo(tiny_llama_dir, out, pairs, **resume_kw(mode))
            full_rows, full_adapter = rows_of(out), adapter_of(out / "final")
            assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
            shutil.rmtree(out / "checkpoints" / "step-000004")
            shutil.rmtree(out / "final")
            (out / "summary.json").unlink()
            (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full_rows[:3]))  # steps 1-3
            if mode == "cached":
                killed = tmp_path_factory.mktemp("killed") / "run"
                shutil.copytree(out, killed)
        cache = out / CACHE_FILE
        before = cache.stat().st_mtime_ns if cache.exists() else None
        again = io.StringIO()
        with contextlib.redirect_stdout(again):
            summary = run_dpo(tiny_llama_dir, out, pairs, resume="auto", **resume_kw(mode))
        assert summary["resumed_from_step"] == 2
        mtimes = (before, cache.stat().st_mtime_ns) if before else None
        runs[mode] = Resumed(full_rows, full_adapter, rows_of(out), adapter_of(out / "final"), again.getvalue(),
                             printed.getvalue() if printed else "", mtimes)
    return runs


def resume_kw(mode: str) -> dict:
    reference = "adapters_off" if mode == "adapters_off" else "cached"
    return dict(quantize="nf4", dropout=0.1, max_steps=4, save_interval=2, dpo_args=DPOArgs(reference=reference))


@pytest.mark.parametrize("mode", ["adapters_off", "cached", "recomputed"])
def test_resume_after_a_kill_is_exact(mode, resumed):
    run = resumed[mode]
    assert "Resuming from" in run.printed
    assert [r["step"] for r in run.rows] == [1, 2, 3, 4]
    # Bit for bit: loss, gradient norm, rewards and log-probabilities of every step.
    assert [numbers(r) for r in run.rows] == [numbers(r) for r in run.full_rows]
    assert run.adapter.keys() == run.full_adapter.keys()
    assert all(torch.equal(run.adapter[k], run.full_adapter[k]) for k in run.adapter)
    assert run.rows[-1]["rewards/margins"] != 0.0  # trained: the resumed steps are not trivially equal
    if mode == "cached":
        # Computed once, by the first run; the resumed run reads it back and does not recompute it.
        assert "Reference log-probabilities: 16 pairs, written to" in run.first_printed
        assert "Reference log-probabilities: read from" in run.printed and "written to" not in run.printed
        assert run.cache_mtime[0] == run.cache_mtime[1]
    elif mode == "recomputed":
        # Computed again inside the resumed run's first step: that must not move the dropout masks (the RNG).
        assert "Reference log-probabilities: 16 pairs, written to" in run.printed and run.cache_mtime is None
    else:
        assert "Reference log-probabilities" not in run.first_printed + run.printed and run.cache_mtime is None


def test_cached_reference_equals_adapters_off(resumed):
    """The same numbers, dropout included: computing the cache before training leaves the RNG where it was."""
    off, cached = resumed["adapters_off"].full_rows, resumed["cached"].full_rows
    assert_rows_close(cached, off, 1e-5)
    assert [r["step"] for r in off if "loss" in r] == [1, 2, 3, 4]
    assert max_diff(resumed["adapters_off"].full_adapter, resumed["cached"].full_adapter) < 1e-5


# ---------------------------------------------------------------------------------------------- 6. init_adapter

def test_dpo_from_an_sft_adapter_uses_it_as_the_reference(tiny_llama_dir, pairs, validated, tmp_path):
    from lit_qlora.train.finetune import finetune

    from helpers import small_data

    sft = tmp_path / "sft"
    finetune(checkpoint_dir=tiny_llama_dir, out_dir=sft, quantize="none", precision="32-true", accelerator="cpu",
             lora=LoRAArgs(r=4, alpha=8, dropout=0.0), data=small_data(tmp_path),
             train=TrainArgs(**{**TRAIN, "max_steps": 3}))
    sft_adapter = adapter_of(sft / "final")
    assert max(v.abs().max().item() for k, v in sft_adapter.items() if k.endswith("lora_B")) > 1e-3
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        # --lora.r, alpha and targets given otherwise: the adapter's own shape wins.
        summary = run_dpo(tiny_llama_dir, tmp_path / "dpo", pairs,
                          lora=LoRAArgs(r=2, alpha=3, dropout=0.0, targets=["q"]), init_adapter=sft)
    assert f"reference: the base with the adapter of {sft}" in printed.getvalue()
    style = json.loads((sft / "final" / "adapter_config.json").read_text())["prompt_style"]
    assert f"Prompt style: {style} (from the starting adapter, --train.init_adapter {sft})" in printed.getvalue()
    # Step 0: the policy is the SFT adapter and so is the reference: log 2, rewards 0...
    assert summary["initial_val_loss"] == pytest.approx(LOG2, abs=1e-6)
    assert summary["initial_eval_rewards/chosen"] == summary["initial_eval_rewards/rejected"] == 0.0
    # ... while the SFT adapter's log-probabilities are not the base's (a base reference would not give log 2).
    base_logps = validated[1]["initial_eval_logps/chosen"]
    assert abs(summary["initial_eval_logps/chosen"] - base_logps) > 0.5
    config = json.loads((tmp_path / "dpo" / "final" / "adapter_config.json").read_text())
    sft_config = json.loads((sft / "final" / "adapter_config.json").read_text())
    assert (config["r"], config["alpha"], config["targets"]) == (4, 8, sft_config["targets"])
    assert len(sft_config["targets"]) == 7
    final = adapter_of(tmp_path / "dpo" / "final")
    assert max_diff(final, sft_adapter) > 1e-4  # the same shapes (checked), trained on
    assert summary["val_loss"] < LOG2


# ---------------------------------------------------------------------------------------------- 7. DDP and FSDP2

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
# micro 1 x 2 ranks, global 4: each rank accumulates two micro-batches per step, the 1-process reference four.
DIST_TRAIN = dict(micro_batch_size=1, global_batch_size=4, max_seq_length=64, lr=1e-2, warmup_steps=1, max_steps=2)


def cli_dpo(tiny_llama_dir, out_dir, data, strategy, *extra, devices=2, timeout=600):
    """`litqlora dpo` in a child process: Lightning launches the second rank itself."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lit_qlora.cli", "dpo", "--checkpoint_dir", str(tiny_llama_dir),
           "--out_dir", str(out_dir), "--accelerator", "cpu", "--devices", str(devices), "--strategy", strategy,
           "--precision", "32-true", "--lora.r", "4", "--lora.alpha", "8", "--lora.dropout", "0",
           "--data.path", str(data.path), "--data.val_split", str(data.val_split), "--nf4_shards", "2",
           *[f"--train.{k}={v}" for k, v in DIST_TRAIN.items()], *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir, pairs, tmp_path_factory):
    """The reference: one process, the whole global batch, the NF4 layout of a 2-way FSDP run."""
    out = tmp_path_factory.mktemp("one") / "run"
    run_dpo(tiny_llama_dir, out, pairs, quantize="nf4", nf4_shards=2, **DIST_TRAIN)
    return out


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("strategy, reference", [("ddp", "adapters_off"), ("fsdp", "cached")])
def test_two_processes_equal_one_process(strategy, reference, tiny_llama_dir, pairs, one_process, tmp_path):
    out = tmp_path / strategy
    cli_dpo(tiny_llama_dir, out, pairs, strategy, "--dpo.reference", reference)
    want, got = train_rows(one_process), train_rows(out)
    assert [r["step"] for r in got] == [1, 2]  # written once (rank 0), not once per rank
    # The SFT distributed tests' tolerances: the first loss 1e-6, every loss 1e-5, the gradient norm 1e-4.
    assert got[0]["loss"] == pytest.approx(want[0]["loss"], rel=1e-6)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)
    for key in METRICS:  # the pairs of both ranks, reduced before dividing
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5, abs=1e-5), key
    assert got[1]["rewards/margins"] != 0.0
    ours = json.loads((out / "summary.json").read_text())
    theirs = json.loads((one_process / "summary.json").read_text())
    assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)
    assert ours["eval_rewards/margins"] == pytest.approx(theirs["eval_rewards/margins"], rel=1e-4, abs=1e-5)
    assert max_diff(adapter_of(out / "final"), adapter_of(one_process / "final")) < 1e-4
    assert (out / CACHE_FILE).is_file() == (reference == "cached")


# ---------------------------------------------------------------------------------------------- 8. bad input

@pytest.mark.parametrize("args, message", [
    (["--data.packing", "true"], "litqlora: error: `litqlora dpo` does not take --data.packing true: packing puts "
                                 "several samples into one sequence, and a preference pair is scored as a whole"),
    (["--dpo.loss", "ipo", "--dpo.label_smoothing", "0.1"],
     "litqlora: error: --dpo.label_smoothing applies to --dpo.loss sigmoid (conservative DPO), and this run uses ipo"),
    (["--dpo.beta", "0"], "litqlora: error: --dpo.beta must be > 0"),
    (["--dpo.beta", "-0.1"], "litqlora: error: --dpo.beta must be > 0"),
])
def test_bad_options_are_refused_with_their_message(args, message, tiny_llama_dir, tmp_path, capsys):
    from lit_qlora.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["dpo", "--checkpoint_dir", str(tiny_llama_dir), "--out_dir", str(tmp_path / "out"),
              "--accelerator", "cpu", *args])
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_loss_registry_is_what_the_cli_the_objective_and_the_estimate_read():
    import typing

    from lit_qlora.methods.dpo.estimate import reference_pass
    from lit_qlora.methods.dpo.args import DPO_LOSSES, DPOArgs
    from lit_qlora.methods.dpo.loss import Objective

    assert typing.get_args(typing.get_type_hints(DPOArgs)["loss"]) == tuple(DPO_LOSSES)
    for name, kind in DPO_LOSSES.items():
        args = DPOArgs(loss=name)
        objective = Objective.from_args(args)
        assert (objective.loss, objective.beta, objective.orpo_lambda) == (name, args.beta, args.orpo_lambda)
        assert objective.uses_reference is kind.uses_reference and objective.mean_logps is kind.mean_logps
        assert (reference_pass(args) is None) is (not kind.uses_reference)
