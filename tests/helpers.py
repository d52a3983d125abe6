"""Helpers the test modules share (no test module imports another: issue 55 item 6). Fixtures are conftest.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from lit_qlora.checkpoint.loading import random_base
from lit_qlora.lora.layer import apply_lora
from lit_qlora.model.config import Config
from lit_qlora.nf4 import linear
from lit_qlora.train.args import LoRAArgs, TrainArgs
from lit_qlora.train.datamodule import DataArgs
from lit_qlora.train.finetune import finetune

ROOT = Path(__file__).resolve().parents[1]


# -- tiny checkpoints, processes, servers ---------------------------------------------------------------------------

def write_tiny_llama(smollm2_dir: Path, out: Path) -> Path:
    """The tiny Llama's checkpoint (SmolLM2's config, shrunk; random weights, seed 0) with the tokenizer files of
    `smollm2_dir` (which needs only config.json and the tokenizer: no weights)."""
    import torch

    from lit_qlora.checkpoint.hf import copy_tokenizer_files, save_hf_checkpoint
    from lit_qlora.model.config import Config
    from lit_qlora.export.hf import hf_tensor_specs
    from lit_qlora.model.transformer import Transformer

    config = Config.from_checkpoint(smollm2_dir).replace(
        name="tiny", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_dim=16, intermediate_size=128)
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights()
    save_hf_checkpoint(out, config, hf_tensor_specs(model, torch.float32), dtype=torch.float32)
    copy_tokenizer_files(smollm2_dir, out)
    return out


def spawn_ranks(worker, world_size: int, *args, timeout: float = 300) -> dict:
    """Run `worker(rank, *args, queue)` in `world_size` spawned processes; returns {rank: what it queued}.

    Workers must queue plain Python data (tensors would travel as shared memory that dies with the worker) and
    report their exceptions rather than hang their peers."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, *args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def finetune_sums(checkpoint_dir: Path, tmp_path: Path, max_steps: int, dropout: float = 0.0) -> dict:
    """A short QLoRA `finetune` of `checkpoint_dir` on 24 rows of sums (r 4, micro-batches of 2, 4 rows a step) into
    tmp_path / "run"; returns its summary."""
    import json

    from lit_qlora.train.args import DataArgs, LoRAArgs, TrainArgs
    from lit_qlora.train.finetune import finetune

    rows = [{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."} for i in range(24)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    return finetune(checkpoint_dir=checkpoint_dir, out_dir=tmp_path / "run", accelerator="cpu",
                    lora=LoRAArgs(r=4, alpha=8, dropout=dropout),
                    train=TrainArgs(max_steps=max_steps, micro_batch_size=2, global_batch_size=4, max_seq_length=64,
                                    lr=1e-2, warmup_steps=1),
                    data=DataArgs(json_path=tmp_path / "rows.json", val_split=0.25))


# Tiny mixtures of experts, by model_type: 8 experts of which each token takes 2 (Qwen3-MoE: 3, renormalized).
MOE_FAMILIES = {
    "qwen3_moe": dict(head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, clip_qkv=4.0, num_key_value_heads=4),  # (as OLMoE: no GQA)
    # Sliding layers of 4 tokens between full ones, attention sinks, YaRN, the clamped SwiGLU, biases everywhere.
    "gpt_oss": dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4),
}


def write_tiny_moe(model_type: str, out: Path, vocab_size: int = 256, tokenizer_dir: Path | None = None):
    """A tiny random mixture of experts written by transformers (safetensors, the Hub's per-expert keys), its norms
    not all ones and its router decisive (a near-uniform one ties on the top k); returns transformers' model."""
    import torch
    import transformers

    from lit_qlora.checkpoint.hf import copy_tokenizer_files

    torch.manual_seed(0)
    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                 eos_token_id=2)
    config = transformers.AutoConfig.for_model(model_type, **{**shape, **MOE_FAMILIES[model_type]})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "sinks" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return model


def random_adapter(model, out_dir: Path, quantize: str, targets: list[str] = ["all"], r: int = 4,  # noqa: B006
                   alpha: float = 8):
    """LoRA on `targets` of `model` (fp32) with a random B, so every adapted layer changes the output, saved as a
    fine-tune's adapter in out_dir; returns that folder."""
    import torch

    from lit_qlora.checkpoint.adapter import save_adapter
    from lit_qlora.lora.layer import apply_lora, lora_modules

    apply_lora(model, r=r, alpha=alpha, dtype=torch.float32, targets=targets)
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in lora_modules(model).values():
            layer.lora_B.normal_(0, 0.05)
    return save_adapter(model, out_dir, {"r": r, "alpha": alpha, "targets": targets, "quantize": quantize,
                                         "base_dtype": "float32", "lora_dtype": "float32"})


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a `litqlora serve` a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(url: str, proc, timeout: float = 240) -> None:
    """Poll `url`/health until the server started as `proc` (in its own process group) answers ok; if it exits or
    `timeout` s pass first, kill its group and fail the test with the end of its output."""
    import signal
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200 and r.read() == b"ok":
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            pytest.fail(f"the server did not come up:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.5)


# -- a tiny fine-tune (test_finetune's) -----------------------------------------------------------------------------

def small_data(tmp_path, n=24):
    rows = [{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."} for i in range(n)]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    return DataArgs(json_path=path, val_split=0.25)


def tiny_finetune(tiny_llama_dir, out_dir, data, **train_kw):
    kw = dict(micro_batch_size=2, global_batch_size=4, max_seq_length=64, lr=1e-2, warmup_steps=1, max_steps=3)
    kw.update(train_kw)
    quantize = kw.pop("quantize", "nf4")
    precision = kw.pop("precision", "bf16-true")
    resume = kw.pop("resume", False)
    return finetune(checkpoint_dir=tiny_llama_dir, out_dir=out_dir, quantize=quantize, precision=precision,
                    accelerator="cpu", resume=resume, lora=LoRAArgs(r=4, alpha=8, dropout=0.0), data=data,
                    train=TrainArgs(**kw))


def metrics_rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def tensorboard_events(log_dir):
    """The EventAccumulator of a run's logs/, as TensorBoard reads it (what a resume purged left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def tensorboard_scalars(log_dir):
    """{tag: [(step, value), ...]}, every event TensorBoard shows, in order."""
    events = tensorboard_events(log_dir)
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# -- the same run in several processes (test_distributed's) --------------------------------------------------------

STEPS = 3


# micro 1 x 2 ranks, global 4: each rank accumulates two micro-batches per step, the 1-process reference four.
TRAIN = dict(micro_batch_size=1, global_batch_size=4, max_seq_length=64, lr=1e-2, warmup_steps=1, max_steps=STEPS)


needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


# `litqlora` that writes a line to $COUNT_DIR/rank<R>.txt for every gradient reduction: each bucket all-reduce of DDP
# (through a comm hook) and each reduce-scatter of FSDP2. Lightning starts the second rank by running it again.
COUNTING_CLI = """
import os, sys
from pathlib import Path
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

def record(what):
    with open(Path(os.environ["COUNT_DIR"]) / f"rank{dist.get_rank()}.txt", "a") as f:
        f.write(what + "\\n")

def counting_allreduce(group, bucket):
    record(f"ddp bucket {bucket.index()}")
    return allreduce_hook(group, bucket)

ddp_init = DistributedDataParallel.__init__
def init(self, *args, **kwargs):
    ddp_init(self, *args, **kwargs)
    self.register_comm_hook(None, counting_allreduce)
DistributedDataParallel.__init__ = init

depth = [0]
def counted(collective):
    def call(*args, **kwargs):
        depth[0] += 1  # one of these may call the other: count the outer call only
        try:
            if depth[0] == 1:
                record("fsdp reduce-scatter")
            return collective(*args, **kwargs)
        finally:
            depth[0] -= 1
    return call
for name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # FSDP2 uses one of them, by torch version
    if hasattr(dist, name):
        setattr(dist, name, counted(getattr(dist, name)))

from lit_qlora.cli import main
main(sys.argv[1:])
"""


def cli_run(tiny_llama_dir, out_dir, data, strategy, *extra, devices=2, timeout=600, count_dir=None):
    """`litqlora finetune` in a child process: Lightning launches the second rank itself (no launcher of ours).
    With `count_dir`, every rank records its gradient reductions there (COUNTING_CLI)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cli = [sys.executable, "-m", "lit_qlora.cli"]
    if count_dir is not None:
        count_dir.mkdir(parents=True)
        (count_dir / "cli.py").write_text(COUNTING_CLI)
        cli, env["COUNT_DIR"] = [sys.executable, str(count_dir / "cli.py")], str(count_dir)
    cmd = [*cli, "finetune", "--checkpoint_dir", str(tiny_llama_dir),
           "--out_dir", str(out_dir), "--accelerator", "cpu", "--devices", str(devices), "--strategy", strategy,
           "--precision", "32-true", "--lora.r", "4", "--lora.alpha", "8", "--lora.dropout", "0",
           "--data.json_path", str(data.json_path), "--data.val_split", str(data.val_split),
           *[f"--train.{k}={v}" for k, v in TRAIN.items()], *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def assert_same_final(ref_dir, out):
    """The final adapter (whole tensors) and the merged export (rebuilt from disk under FSDP and tp) equal the
    one-process run's, and the adapter did train."""
    a = load_file(str(ref_dir / "final" / "adapter.safetensors"))
    b = load_file(str(out / "final" / "adapter.safetensors"))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    assert any(b[k].abs().max() > 1e-3 for k in b if k.endswith("lora_B"))
    ma = load_file(str(ref_dir / "final" / "merged" / "model.safetensors"))
    mb = load_file(str(out / "final" / "merged" / "model.safetensors"))
    assert ma.keys() == mb.keys()
    assert all(torch.allclose(ma[k].float(), mb[k].float(), rtol=1e-2, atol=1e-4) for k in ma)


# -- estimate (test_estimate's) -------------------------------------------------------------------------------------

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True}


def config_only_dir(tmp_path: Path, **changes) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**TINY, **changes}))
    return tmp_path / "model"


def real_model(config: Config, quantize: str, lora: LoRAArgs, train: TrainArgs) -> tuple:
    """A real model as a fine-tune builds it, in training mode: (model, its trainable parameters, their AdamW)."""
    linear._scratch.__dict__.clear()  # as in a fresh process: earlier tests' larger NF4 scratch buffers are not its
    torch.manual_seed(0)
    model = apply_lora(random_base(config, quantize, torch.bfloat16), lora.r, lora.alpha, lora.dropout,
                       dtype=torch.bfloat16)
    model.checkpoint_blocks = config.n_layer if train.activation_checkpointing else 0
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, params, torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), fused=True)


# -- prompt formats (test_data's) -------------------------------------------------------------------------------

CHAT = {"messages": [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "4 + 4 = 8"},
    {"role": "user", "content": "Thanks!"},  # after the last reply: dropped, nothing to train
]}


# -- fused projections (test_fused_projections') -------------------------------------------------------------------

FUSED_TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def lora_model(quantize: str, dropout: float, bias: bool = False, targets="all", dtype=torch.bfloat16,
               model_type: str = "llama"):
    config = Config.from_hf_config({**FUSED_TINY, "attention_bias": bias, "model_type": model_type})
    torch.manual_seed(0)
    model = apply_lora(random_base(config, quantize, dtype), r=4, alpha=8, dropout=dropout,
                       targets=targets, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or name.endswith("bias"):  # B starts at zero: give every adapter a term to check
                p.normal_(std=0.05)
    return model.train()


# -- a policy with a random adapter, ours and transformers + peft's (the methods' exactness tests) ----------------

PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def our_policy(tiny_llama_dir, quantize):
    """The model as a `dpo` run builds it (32-true: fp32 base or NF4 codes, fp32 adapters), with a random non-zero
    adapter (B != 0) so that the policy is not the reference."""
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.lora.layer import lora_modules

    model = load_model(tiny_llama_dir, quantize, "32-true").train()
    torch.manual_seed(7)
    apply_lora(model, r=4, alpha=8, dropout=0.0, targets="all", dtype=torch.float32)
    with torch.no_grad():
        for layer in lora_modules(model).values():
            layer.lora_B.normal_(0, 0.2)
    return model


def hf_peft_policy(tiny_llama_dir, ours, quantize):
    """transformers' Llama with the same weights (quantize none: read from the checkpoint; nf4: dequant(NF4(W)) of
    our model's NF4 weights; the tied head is the embedding, as in the checkpoint) and our adapter tensors in a peft
    LoRA model."""
    from lit_qlora.lora.layer import lora_modules
    from lit_qlora.nf4 import dequantize_nf4, is_nf4

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    if quantize == "none":
        hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    else:
        config = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
        hf = transformers.LlamaForCausalLM(config).to(torch.float32)
        state = {name: (dequantize_nf4(p) if is_nf4(p) else p.detach()).float()
                 for name, p in ours.named_parameters(remove_duplicate=False) if "lora_" not in name}
        assert ours.lm_head.weight is ours.model.embed_tokens.weight and is_nf4(ours.model.layers[0].mlp.down_proj.weight)
        hf.load_state_dict(state, strict=True)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PEFT_TARGETS))
    copied = 0
    with torch.no_grad():
        for name, layer in lora_modules(ours).items():
            for leaf in ("lora_A", "lora_B"):
                model.get_parameter(f"base_model.model.{name}.{leaf}.default.weight").copy_(getattr(layer, leaf))
                copied += 1
    assert copied == 2 * len(PEFT_TARGETS) * 2  # 2 blocks
    return model.eval()
