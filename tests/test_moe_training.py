"""Training a mixture of experts (issue 54 item 5) the ways a dense model trains, on one tiny NF4 Qwen3-MoE (8
experts, 3 a token; SmolLM2's tokenizer) with adapters on `all` (attention, every expert, the head): two DDP or FSDP2
processes equal one process (FSDP2 sharding the stacked NF4 experts and their adapters by expert), a resume after
a kill is bit-exact, and packing, activation checkpointing and activation offload leave the numbers as they were."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from itertools import accumulate
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file

from lit_qlora.checkpoint.loading import load_model
from lit_qlora.data.sft import IGNORE_INDEX, Collate, Sample, pack
from lit_qlora.lora.experts import LoRAExpertLinear
from lit_qlora.lora.layer import apply_lora, lora_modules
from lit_qlora.model.attention_mask import document_ids
from lit_qlora.model.offload import ActivationOffload
from lit_qlora.nf4 import dequantize_nf4, is_nf4, nf4_nbytes
from lit_qlora.train.args import DataArgs, ExportArgs, LoRAArgs, TrainArgs
from lit_qlora.train.finetune import finetune
from lit_qlora.train.loss import lm_loss_sum

from helpers import write_tiny_moe

pytest.importorskip("transformers")  # writes the tiny checkpoint

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 49152  # SmolLM2's tokenizer
EXPERTS, LAYERS = 8, 2
NO_EXPORTS = ExportArgs(merged=False, peft=False)  # the MoE exports are tests/test_moe.py's

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


@pytest.fixture(scope="module")
def moe_dir(smollm2_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen3-moe")
    write_tiny_moe("qwen3_moe", out, vocab_size=VOCAB, tokenizer_dir=smollm2_dir)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> DataArgs:
    path = tmp_path_factory.mktemp("data") / "rows.json"
    path.write_text(json.dumps([{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."}
                                for i in range(24)]))
    return DataArgs(json_path=path, val_split=0.25)


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter.safetensors"))


# ---------------------------------------------------------------------------------------------- DDP and FSDP2

# micro 1 x 2 ranks, global 4: each rank accumulates two micro-batches per step, the 1-process reference four.
TRAIN = dict(micro_batch_size=1, global_batch_size=4, max_seq_length=64, lr=1e-2, warmup_steps=1, max_steps=3)

# `litqlora` whose ranks write, once the model is set up (sharded under FSDP2), what each holds of layer 0's expert
# projections to $SHARDS_DIR/rank<R>.json. Lightning starts the second rank by running it again.
SHARDS_CLI = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
import torch.nn.functional as F
from lit_qlora.nf4 import dequantize_nf4, nf4_nbytes
from lit_qlora.parallel.distributed import local_tensor
from lit_qlora.train.module import FinetuneModule

configure = FinetuneModule.configure_model
def configure_model(self):
    configure(self)
    held = {}
    for name, proj in self.model.model.layers[0].mlp.experts.named_children():
        weight = local_tensor(proj.weight)
        held[name] = {"weight": list(proj.weight.shape), "local": list(weight.shape), "bytes": nf4_nbytes(weight),
                      "codes": weight.quantized_data.numel(), "scalers": weight.quantized_scalers.numel(),
                      "sum": dequantize_nf4(weight).double().sum().item(),
                      "lora_A": list(local_tensor(proj.lora_A).shape), "lora_B": list(local_tensor(proj.lora_B).shape)}
    Path(os.environ["SHARDS_DIR"], f"rank{dist.get_rank()}.json").write_text(json.dumps(held))
FinetuneModule.configure_model = configure_model

from lit_qlora.cli import main
main(sys.argv[1:])
"""


def cli_run(base: Path, out_dir: Path, data: DataArgs, strategy: str, shards_dir: Path, *extra) -> None:
    """`litqlora finetune` on 2 processes (Lightning launches the second) with SHARDS_CLI's record in shards_dir."""
    shards_dir.mkdir(parents=True)
    (shards_dir / "cli.py").write_text(SHARDS_CLI)
    env = {**os.environ, "SHARDS_DIR": str(shards_dir),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(shards_dir / "cli.py"), "finetune", "--checkpoint_dir", str(base),
           "--out_dir", str(out_dir), "--accelerator", "cpu", "--devices", "2", "--strategy", strategy,
           "--nf4_shards", "2", "--precision", "32-true", "--lora.r", "4", "--lora.alpha", "8", "--lora.dropout", "0",
           "--data.json_path", str(data.json_path), "--data.val_split", str(data.val_split),
           "--export.merged", "false", "--export.peft", "false", *[f"--train.{k}={v}" for k, v in TRAIN.items()],
           *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def one_process(moe_dir, data, tmp_path_factory) -> Path:
    """The reference: one process, the whole global batch (four accumulated micro-batches), quantized in the NF4
    layout of a 2-way FSDP run (`nf4_shards=2`, which DDP is given too): every run has the same bits."""
    out = tmp_path_factory.mktemp("one") / "run"
    finetune(checkpoint_dir=moe_dir, out_dir=out, precision="32-true", accelerator="cpu", nf4_shards=2,
             lora=LoRAArgs(r=4, alpha=8, dropout=0.0), data=data, train=TrainArgs(**TRAIN), export=NO_EXPORTS)
    return out


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_equal_one_process_with_fsdp_sharding_the_experts(strategy, moe_dir, data, one_process,
                                                                        tmp_path):
    """`--devices 2` under DDP and FSDP2 trains the NF4 MoE's adapters (attention, every expert, the head) as one
    process does on the same global batch; each DDP rank holds every expert, each FSDP2 rank half of them: its
    experts' NF4 codes and scales and their adapters' A and B."""
    out = tmp_path / strategy
    cli_run(moe_dir, out, data, strategy, tmp_path / "shards")
    ref, got = metrics(one_process), metrics(out)
    assert [r["step"] for r in got] == [1, 2, 3]
    # The token-weighted loss of the whole global batch, and the gradients' norm as one process's (not half of it).
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4)
    # The router's load over both ranks' tokens, as one process saw the whole batch (rank 0's alone was 0.4% off at
    # step 1). Not exact: padded positions are routed and counted too, and each rank pads its rows to its own longest.
    for key in ("router/max_load", "router/min_load", "router/layer1_max_load"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in ref], rel=3e-3), key
    a, b = adapter(one_process / "final"), adapter(out / "final")
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    experts_b = [k for k in b if ".mlp.experts." in k and k.endswith("lora_B")]
    assert len(experts_b) == LAYERS * 3 and all(b[k].abs().max() > 1e-3 for k in experts_b)  # every expert trained
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quantized_linears"] == summary["total_linears"] == LAYERS * (4 + 3 * EXPERTS) + 1

    # What each rank holds of layer 0's experts. The whole stack, dequantized, from the same NF4 layout:
    model = load_model(moe_dir, "nf4", "32-true", nf4_world_size=2)
    held = [json.loads((tmp_path / "shards" / f"rank{r}.json").read_text()) for r in range(2)]
    for name in ("gate_proj", "up_proj", "down_proj"):
        proj = getattr(model.model.layers[0].mlp.experts, name)
        rows, cols = proj.out_features, proj.in_features
        full = dequantize_nf4(proj.weight).double().view(EXPERTS, rows, cols)
        whole_bytes = nf4_nbytes(proj.weight)
        codes, scalers = proj.weight.quantized_data.numel(), proj.weight.quantized_scalers.numel()
        assert codes == EXPERTS * rows * cols // 2  # two 4-bit codes a byte
        shared = proj.weight.nf4.nbytes + proj.weight.scaler_mean.nbytes  # the 16 levels and one mean: every rank's
        for rank, shard in enumerate(h[name] for h in held):
            assert shard["weight"] == [EXPERTS * rows, cols]  # one NF4 tensor per projection, all experts
            if strategy == "ddp":  # every rank holds every expert and every adapter
                assert shard["local"] == shard["weight"] and shard["bytes"] == whole_bytes
                assert (shard["codes"], shard["scalers"]) == (codes, scalers)
                assert shard["lora_A"] == [EXPERTS, 4, cols] and shard["lora_B"] == [EXPERTS, rows, 4]
                assert shard["sum"] == pytest.approx(full.sum().item(), rel=1e-9)
                continue
            # FSDP2: rank r holds experts 4r..4r+3: their NF4 codes and scales (half the bytes) and their adapters.
            half = EXPERTS // 2
            assert shard["local"] == [half * rows, cols]
            assert (shard["codes"], shard["scalers"]) == (codes // 2, scalers // 2)
            assert shard["bytes"] - shared == (whole_bytes - shared) // 2
            assert shard["lora_A"] == [half, 4, cols] and shard["lora_B"] == [half, rows, 4]
            assert shard["sum"] == pytest.approx(full[rank * half:(rank + 1) * half].sum().item(), rel=1e-9)
        if strategy == "fsdp":
            assert held[0][name]["sum"] != pytest.approx(held[1][name]["sum"])


# ---------------------------------------------------------------------------------------------- resume

def test_resume_after_a_kill_reaches_the_uninterrupted_adapter_bit_for_bit(moe_dir, data, tmp_path, monkeypatch):
    """A 4-step QLoRA run with dropout (so the resumed RNG matters), a checkpoint every step; the same run killed
    after step 2 (its later checkpoints and final/ never written) and resumed with `--resume auto` trains steps 3
    and 4 to the same bits: checkpoint, optimizer state, adapter, losses and the router's load."""
    # The thread count fixed, as OMP_NUM_THREADS fixes it: the governor lowering it beside other busy processes
    # (a test run in parallel) changes the float sums' order, and then no two runs are bitwise equal.
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    out = tmp_path / "run"

    def run(resume=False):
        return finetune(checkpoint_dir=moe_dir, out_dir=out, precision="32-true", accelerator="cpu", resume=resume,
                        lora=LoRAArgs(r=4, alpha=8, dropout=0.1), data=data, export=NO_EXPORTS,
                        train=TrainArgs(micro_batch_size=2, global_batch_size=4, max_seq_length=64, lr=1e-2,
                                        warmup_steps=1, max_steps=4, save_interval=1, keep_last=4))

    run()
    first_rows = metrics(out)
    final, step3 = adapter(out / "final"), adapter(out / "checkpoints" / "step-000003")
    optimizer3 = load_file(str(out / "checkpoints" / "step-000003" / "optimizer.safetensors"))
    for step in (3, 4):
        shutil.rmtree(out / "checkpoints" / f"step-{step:06d}")
    shutil.rmtree(out / "final")
    summary = run(resume="auto")
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 4
    resumed = adapter(out / "final")
    assert final.keys() == resumed.keys() and all(torch.equal(final[k], resumed[k]) for k in final)
    assert any(".mlp.experts." in k and final[k].abs().max() > 0 for k in final if k.endswith("lora_B"))
    again = adapter(out / "checkpoints" / "step-000003")
    assert all(torch.equal(step3[k], again[k]) for k in step3)
    optimizer = load_file(str(out / "checkpoints" / "step-000003" / "optimizer.safetensors"))
    assert optimizer.keys() == optimizer3.keys() and all(torch.equal(optimizer3[k], optimizer[k]) for k in optimizer3)
    same = ("step", "loss", "grad_norm", "lr", "tokens", "router/max_load", "router/min_load")
    assert [{k: r[k] for k in same} for r in metrics(out)] == [{k: r[k] for k in same} for r in first_rows]


# ---------------------------------------------------------------------------------------------- packing, checkpointing, offload

DOCS = [7, 19, 4, 11, 9]  # packed into 30 tokens: [7, 19, 4] | [11, 9] + 10 padding


def documents() -> list[Sample]:
    """Random documents of DOCS tokens, the first third of each a prompt (no loss)."""
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, VOCAB, (n,), generator=g) for n in DOCS]
    return [Sample(x, torch.where(torch.arange(len(x)) < len(x) // 3, IGNORE_INDEX, x)) for x in ids]


def spans(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document of a packed batch, found as the model finds them
    (lit_qlora.model.attention_mask.document_ids); the padding (each token a document of its own) left out."""
    out = []
    for row, ids in enumerate(document_ids(positions)):
        sizes = torch.unique_consecutive(ids, return_counts=True)[1].tolist()
        out += [(row, start, start + n) for start, n in zip(accumulate([0] + sizes[:-1]), sizes) if n > 1]
    return out


@torch.no_grad()
def packed_and_alone(model, batch: dict, docs: list[tuple[int, int, int]]) -> tuple[float, float, list]:
    """A packed batch's summed loss, the same rows' without their positions (the documents seeing each other), and
    each document run alone: (its logits, its summed loss, its target count)."""
    total = lm_loss_sum(model, batch["input_ids"], batch["labels"], batch["positions"]).item()
    leaky = lm_loss_sum(model, batch["input_ids"], batch["labels"]).item()
    alone = []
    for row, start, end in docs:
        ids, labels = batch["input_ids"][row, start:end], batch["labels"][row, start:end]
        logits = model(ids[None])[0]
        targets = labels[1:]  # (a document's first label is no target, packed or alone)
        loss = F.cross_entropy(logits[:-1], targets, ignore_index=IGNORE_INDEX, reduction="sum").item()
        alone.append((logits, loss, int((targets != IGNORE_INDEX).sum())))
    return total, leaky, alone


@pytest.fixture(scope="module")
def adapted(moe_dir):
    """The NF4 MoE with adapters on `all`, B random (every adapter changes the output), LoRA dropout 0.1."""
    model = load_model(moe_dir, "nf4", "32-true")
    apply_lora(model, r=4, alpha=8, dropout=0.1, dtype=torch.float32, targets="all")
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in lora_modules(model).values():
            layer.lora_B.normal_(0, 0.05)
    assert sum(isinstance(m, LoRAExpertLinear) for m in model.modules()) == LAYERS * 3
    assert is_nf4(model.model.layers[0].mlp.experts.down_proj.weight)
    return model


def test_each_packed_document_is_routed_and_scored_as_it_is_alone(adapted):
    """Routing is per token, so a packed document's logits (through every expert it is routed to) and loss are
    those it has alone."""
    batch = Collate(pad_id=0)(pack(documents(), max_seq_length=30))
    docs = spans(batch["positions"])
    assert [(row, end - start) for row, start, end in docs] == [(0, 7), (0, 19), (0, 4), (1, 11), (1, 9)]
    adapted.eval()
    with torch.no_grad():
        logits = adapted(batch["input_ids"], positions=batch["positions"])
    total, leaky, alone = packed_and_alone(adapted, batch, docs)
    for (logits_alone, _, _), (row, start, end) in zip(alone, docs):
        assert (logits[row, start:end] - logits_alone).abs().max() <= 1e-5, (row, start)
    assert total == pytest.approx(sum(loss for _, loss, _ in alone), rel=1e-5)
    assert abs(leaky - total) > 1e-3 * total  # without positions the documents see each other: the check can fail


def test_checkpointed_and_offloaded_blocks_give_the_same_loss_and_gradients(adapted):
    """A packed batch's loss and every adapter's gradient (attention, experts, head), dropout on: the same with both
    blocks checkpointed (the routing and the dropout masks recomputed alike), and with their inputs offloaded too."""
    batch = Collate(pad_id=0)(pack(documents(), max_seq_length=30))
    adapted.train()

    def loss_and_grads(checkpoint_blocks, offload=None):
        adapted.zero_grad(set_to_none=True)
        adapted.checkpoint_blocks, adapted.activation_offload = checkpoint_blocks, offload
        torch.manual_seed(7)  # the same dropout masks
        try:
            loss = lm_loss_sum(adapted, batch["input_ids"], batch["labels"], batch["positions"])
            loss.backward()
        finally:
            adapted.checkpoint_blocks, adapted.activation_offload = 0, None
        return loss.item(), {n: p.grad.clone() for n, p in adapted.named_parameters() if p.grad is not None}

    loss, expected = loss_and_grads(0)
    assert len(expected) == 2 * (LAYERS * (4 + 3) + 1)  # A and B of q, k, v, o, the 3 expert stacks, lm_head
    assert all(g.abs().max() > 0 for n, g in expected.items() if ".mlp.experts." in n)
    offload = ActivationOffload()
    for checkpointed, offloaded in ((LAYERS, None), (LAYERS, offload)):
        got_loss, got = loss_and_grads(checkpointed, offloaded)
        assert got_loss == pytest.approx(loss, rel=1e-6)
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    assert offload.offloaded == LAYERS and offload.peak_host_bytes == LAYERS * 2 * 30 * 64 * 4  # B x T x C fp32
    adapted.zero_grad(set_to_none=True)


def test_a_checkpointed_blocks_recompute_multiplies_no_expert_again_on_the_cpu(adapted, monkeypatch):
    """On the CPU a checkpointed block's recompute takes every expert projection's product (base and adapter) from
    its first run: the step runs as many grouped matmuls as without checkpointing (the gradients equal: the test
    above). Where the products are not kept (a GPU's choice: their memory), the recompute runs the forward's again."""
    from lit_qlora.nf4 import grouped

    batch = Collate(pad_id=0)(pack(documents(), max_seq_length=30))
    calls = [0]
    real = grouped.grouped_mm

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(grouped, "grouped_mm", counted)
    adapted.train()

    def products(checkpoint_blocks, backward=True):
        calls[0], adapted.checkpoint_blocks = 0, checkpoint_blocks
        try:
            with torch.set_grad_enabled(backward):
                loss = lm_loss_sum(adapted, batch["input_ids"], batch["labels"], batch["positions"])
            if backward:
                loss.backward()
        finally:
            adapted.checkpoint_blocks = 0
            adapted.zero_grad(set_to_none=True)
        return calls[0]

    forward = products(0, backward=False)
    plain = products(0)
    assert forward == LAYERS * 3 * 3 and plain > forward  # 3 projections: the base and the adapter's 2 products
    assert products(LAYERS) == plain
    monkeypatch.setattr(grouped, "keeps_expert_products", lambda x: False)
    assert products(LAYERS) == plain + forward


def test_a_packed_checkpointed_finetune_steps_loss_is_the_token_weighted_mean_of_its_documents_alone(
        moe_dir, data, tmp_path):
    """`--data.packing true` with `--train.activation_checkpointing` on the NF4 MoE: the first step (B at zero,
    no dropout: the base) has the loss of its packed documents each run alone through the NF4 experts."""
    from dataclasses import replace

    from lit_qlora.checkpoint.tokenizer import Tokenizer
    from lit_qlora.train.datamodule import SFTDataModule

    packed = replace(data, packing=True)
    settings = dict(micro_batch_size=2, global_batch_size=2, max_seq_length=192)
    out = tmp_path / "run"
    finetune(checkpoint_dir=moe_dir, out_dir=out, precision="32-true", accelerator="cpu",
             lora=LoRAArgs(r=4, alpha=8, dropout=0.0), data=packed, export=NO_EXPORTS,
             train=TrainArgs(max_steps=1, activation_checkpointing=LAYERS, lr=1e-2, **settings))
    (row,) = metrics(out)

    dm = SFTDataModule(packed, Tokenizer(moe_dir), settings["max_seq_length"], 2, seed=1337)
    dm.setup()
    (batch,) = next(iter(dm.step_dataloader(2, 0, 1, rank=0, world_size=1)))  # step 1's micro-batch, as trained
    docs = spans(batch["positions"])
    assert len(docs) > len(batch["input_ids"])  # the rows hold several documents each
    _, leaky, alone = packed_and_alone(load_model(moe_dir, "nf4", "32-true"), batch, docs)
    targets = sum(n for _, _, n in alone)
    assert row["loss"] == pytest.approx(sum(loss for _, loss, _ in alone) / targets, rel=1e-5)
    assert abs(leaky / targets - row["loss"]) > 1e-4  # attending across documents would be another loss
