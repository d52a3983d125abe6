"""`litqlora kto`: unpaired rows read as TRL reads them, the KL estimate's mismatched pairs, the loss and adapter
gradients equal to the paper's formula on transformers + peft log-probabilities, and a run's metrics under TRL's
names. fp32 throughout, on the tiny random Llama with SmolLM2's tokenizer."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import hf_peft_policy, our_policy
from lit_qlora.base.errors import UserError
from lit_qlora.checkpoint.tokenizer import Tokenizer
from lit_qlora.data.errors import DataError
from lit_qlora.data.prompts import get_prompt_style
from lit_qlora.data.unpaired import UnpairedCollate, kl_partner, to_unpaired, tokenize_unpaired
from lit_qlora.lora.layer import lora_modules
from lit_qlora.methods.kto.args import METRICS, KTOArgs, KTODataArgs
from lit_qlora.methods.kto.command import kto
from lit_qlora.methods.kto.loss import kto_sums
from lit_qlora.methods.kto.module import KTOModule
from lit_qlora.train.args import TrainArgs
from lit_qlora.train.datamodule import pad_id_of

ROWS = [
    {"prompt": "Name the capital of Norway.", "completion": "The capital of Norway is Oslo.", "label": True},
    {"prompt": "What is 7 times 8?", "completion": "7 times 8 is 54, give or take.", "label": False},
    {"prompt": [{"role": "user", "content": "Spell 'cat' backwards."}],
     "completion": [{"role": "assistant", "content": "tac"}], "label": "true"},
    {"prompt": "Translate 'hello' to French.", "completion": "Hola, that is the word.", "label": 0},
]


@pytest.fixture(scope="module")
def exact_batch(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    rows = to_unpaired(ROWS, "rows")
    assert [r["label"] for r in rows] == [True, False, True, False]
    samples = tokenize_unpaired(rows, get_prompt_style("auto", tok), tok, 256)
    return samples, UnpairedCollate(pad_id_of(tok))(samples)


def test_preference_pairs_become_two_rows_and_bad_rows_are_named():
    rows = to_unpaired([{"prompt": "Q?", "chosen": "right", "rejected": "wrong"}], "pairs.jsonl")
    assert [(r["completion"], r["label"]) for r in rows] == [("right", True), ("wrong", False)]
    with pytest.raises(DataError) as e:
        to_unpaired([ROWS[0], {"prompt": "Q?", "completion": "A", "label": "maybe"}, {"prompt": "Q?"}], "log.jsonl",
                    lines=[1, 2, 5])
    message = str(e.value)
    assert "log.jsonl" in message and "row 2: `label` is missing or not true/false" in message
    assert "row 3 (line 5): missing `completion`" in message


def test_each_kl_row_is_its_prompt_with_the_previous_rows_completion(exact_batch):
    samples, batch = exact_batch
    n = len(samples)
    assert [kl_partner(i, n) for i in range(n)] == [3, 0, 1, 2]
    for i, sample in enumerate(samples):
        partner = samples[kl_partner(i, n)]
        for key, completion in (("input_ids", sample.completion), ("kl", partner.completion)):
            row = (batch if key == "input_ids" else batch["kl"])["input_ids"][i]
            assert torch.equal(row[: len(sample.prompt) + len(completion)], torch.cat([sample.prompt, completion]))
    assert batch["label"].tolist() == [True, False, True, False]
    # every completion token is scored, and no prompt token
    assert len(batch["tgt"]) == sum(int(s.trained.sum()) for s in samples)


def hf_sequence_logps(model, pieces):
    """Summed log-probability of each (prompt, completion, trained) sequence's scored completion tokens, one sequence
    at a time through transformers (fp64 from fp32 logits)."""
    out = []
    for prompt, completion, trained in pieces:
        ids = torch.cat([prompt, completion])
        logits = model(ids[None]).logits[0].double()
        token = F.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        out.append(token[len(prompt) - 1:][trained].sum())
    return torch.stack(out)


def paper_loss(kto_args, policy, reference, kl_policy, kl_reference, desirable, kl=None):
    """KTO (Ethayarajh et al. 2024, eq. 8) with TRL's choices: z0 = max(0, mean of the mismatched pairs' log-ratios),
    no gradient through it; the mean over rows of w_d (1 - sigmoid(beta (r - z0))) or w_u (1 - sigmoid(beta (z0 - r)))."""
    if kl is None:
        kl = max(0.0, float((kl_policy - kl_reference).mean()))
    beta, r = kto_args.beta, policy - reference
    losses = [kto_args.desirable_weight * (1 - torch.sigmoid(beta * (x - kl))) if good else
              kto_args.undesirable_weight * (1 - torch.sigmoid(beta * (kl - x))) for x, good in zip(r, desirable)]
    return torch.stack(losses).mean(), kl


@pytest.mark.parametrize("quantize, forced_kl, tol", [("none", None, 1e-5), ("none", 0.7, 1e-5), ("nf4", None, 1e-4)])
def test_loss_and_adapter_gradients_equal_the_papers_formula_on_transformers_and_peft(
        quantize, forced_kl, tol, tiny_llama_dir, exact_batch):
    import lightning as L

    samples, batch = exact_batch
    args = KTOArgs(beta=0.3, desirable_weight=1.2, undesirable_weight=0.8)
    ours = our_policy(tiny_llama_dir, quantize)
    module = KTOModule(ours, TrainArgs(), 1, kto=args)
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                               enable_model_summary=False, enable_checkpointing=False)
    kl, (reference,) = module.kl_and_reference([batch])
    if forced_kl is not None:  # the KL estimate inside the loss (the random adapter's estimate may clamp to 0)
        kl = torch.tensor(forced_kl)
    sums = kto_sums(args, module._logps(batch), reference, batch["label"], kl)
    (sums.loss / len(samples)).backward()
    loss, metrics = module.reduce([sums], kl)

    hf = hf_peft_policy(tiny_llama_dir, ours, quantize)
    rows = [(s.prompt, s.completion, s.trained) for s in samples]
    n = len(samples)
    kl_rows = [(s.prompt, samples[kl_partner(i, n)].completion, samples[kl_partner(i, n)].trained)
               for i, s in enumerate(samples)]
    with torch.no_grad():
        kl_policy = hf_sequence_logps(hf, kl_rows)
        with hf.disable_adapter():
            want_reference, kl_reference = hf_sequence_logps(hf, rows), hf_sequence_logps(hf, kl_rows)
    policy = hf_sequence_logps(hf, rows)
    assert (policy - want_reference).abs().max() > 0.2  # the adapter moves the policy off the reference
    want, want_kl = paper_loss(args, policy, want_reference, kl_policy, kl_reference, [s.label for s in samples],
                               forced_kl)
    want.backward()
    assert float(kl) == pytest.approx(want_kl, abs=tol)
    assert loss.item() == pytest.approx(want.item(), rel=tol, abs=tol)
    rewards = args.beta * (policy.detach() - want_reference)
    assert metrics["rewards/chosen"] == pytest.approx(float(rewards[[0, 2]].mean()), rel=tol, abs=tol)
    assert metrics["rewards/rejected"] == pytest.approx(float(rewards[[1, 3]].mean()), rel=tol, abs=tol)
    assert metrics["logps/chosen"] == pytest.approx(float(policy.detach()[[0, 2]].mean()), rel=tol, abs=tol)
    assert set(metrics) == set(METRICS)
    compared = 0
    for name, layer in lora_modules(ours).items():
        for leaf in ("lora_A", "lora_B"):
            theirs = hf.get_parameter(f"base_model.model.{name}.{leaf}.default.weight").grad
            torch.testing.assert_close(getattr(layer, leaf).grad, theirs.float(), rtol=tol * 10, atol=1e-6)
            compared += 1
    assert compared == 28 and any(layer.lora_B.grad.abs().max() > 0 for layer in lora_modules(ours).values())


def write_rows(path, n=24):
    rows = [{"prompt": f"What is {i} plus {i}?", "completion": f"{i} plus {i} is {2 * i + (i % 2)}.",
             "label": i % 2 == 0} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_run_logs_trls_metric_names_and_moves_the_rewards_apart(tiny_llama_dir, tmp_path):
    data = write_rows(tmp_path / "feedback.jsonl")
    summary = kto(checkpoint_dir=tiny_llama_dir, out_dir=tmp_path / "out", precision="32-true", seed=3,
                  data=KTODataArgs(path=str(data), val_split=0.25), kto=KTOArgs(beta=0.5),
                  train=TrainArgs(max_steps=6, micro_batch_size=2, global_batch_size=6, max_seq_length=64, lr=5e-3,
                                  warmup_steps=1, eval_interval=3))
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 6 and all(set(METRICS) <= set(r) for r in steps if r["count/chosen"] and r["count/rejected"])
    assert all(r["count/chosen"] + r["count/rejected"] == 6 for r in steps)
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 3, 6] and evals[0]["eval_rewards/margins"] == 0.0
    assert evals[0]["val_loss"] == pytest.approx(0.5 * (1 + 1) / 2 * 1.0, abs=1e-6)  # sigmoid(0) = 1/2 on every row
    assert summary["eval_rewards/margins"] > 0  # held-out desirable rows gain on undesirable ones
    assert summary["eval_rewards/chosen"] > summary["eval_rewards/rejected"]
    config = json.loads((tmp_path / "out" / "final" / "adapter_config.json").read_text())
    assert config["method"] == "kto" and math.isfinite(summary["train_loss"])


@pytest.mark.parametrize("flags, message", [
    (dict(train=TrainArgs(micro_batch_size=1, global_batch_size=4)), "--train.micro_batch_size of at least 2"),
    (dict(kto=KTOArgs(beta=0)), "--kto.beta must be > 0"),
    (dict(strategy="tp"), "runs with --strategy auto, ddp or fsdp, not tp"),
])
def test_bad_options_are_refused_before_anything_loads(flags, message, tmp_path):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kto(checkpoint_dir=tmp_path / "no-model-needed", out_dir=tmp_path / "out", **flags)
