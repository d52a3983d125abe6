"""Helpers the test modules share (no test module imports another: issue 55 item 6). Fixtures are conftest.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from lit_qlora.checkpoint.loading import random_base
from lit_qlora.lora.layer import apply_lora
from lit_qlora.model.batch_decode import Row
from lit_qlora.model.config import Config
from lit_qlora.nf4 import linear, quantize_nf4
from lit_qlora.nf4.native import triton_available
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


# -- tiny random models of every family, transformers' and ours (test_model, test_attention, test_packing) --------

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

FAMILY_BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=5000.0)

FAMILY_CASES = {
    "llama-untied": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama-tied-llama3-rope": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling=LLAMA3_SCALING)),
    "llama-linear-rope-bias": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                   attention_bias=True, mlp_bias=True)),
    "llama-head-dim": ("LlamaConfig", dict(head_dim=32)),
    "mistral-sliding-window": ("MistralConfig", dict(sliding_window=5)),
    "qwen2-qkv-bias-tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen2-untied-llama3": ("Qwen2Config", dict(tie_word_embeddings=False, rope_scaling=LLAMA3_SCALING)),
    "qwen3-tied": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "qwen3-untied-head-dim-bias": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32, attention_bias=True)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5)),
    "gemma2-tight-softcaps": ("Gemma2Config", dict(head_dim=32, sliding_window=7, attn_logit_softcapping=0.005,
                                                    final_logit_softcapping=1.5, num_hidden_layers=3)),
    # Gemma 3: a full layer between sliding ones, each kind with its own RoPE base (the full one scaled).
    "gemma3-local-rope-scaled": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
                                                          num_hidden_layers=3, rope_theta=50000.0,
                                                          rope_local_base_freq=700.0,
                                                          rope_scaling={"rope_type": "linear", "factor": 4.0},
                                                          layer_types=["sliding_attention", "full_attention",
                                                                       "sliding_attention"])),
    "gemma3-untied-softcapped": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=6, tie_word_embeddings=False,
                                                          attn_logit_softcapping=0.5, final_logit_softcapping=2.0)),
    "phi3-sliding": ("Phi3Config", dict(sliding_window=5, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # Past the pretraining length (16 < 40 tokens): the long factors and sqrt(1 + ln 4 / ln 16) on cos and sin.
    "phi3-partial-longrope": ("Phi3Config", dict(partial_rotary_factor=0.5, max_position_embeddings=64,
                                                 original_max_position_embeddings=16, tie_word_embeddings=True,
                                                 bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                                 rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5, 2, 3],
                                                               "long_factor": [2.0, 5.0, 9.0, 20.0]})),
}

def reference_and_ours(kind, extra, seed=0):
    """transformers' tiny random model of a family case (non-trivial norms and biases) and ours with its weights."""
    import transformers

    from lit_qlora.model.config import Config
    from lit_qlora.model.hf_layout import split_fused
    from lit_qlora.model.transformer import Transformer

    torch.manual_seed(seed)
    hf_config = getattr(transformers, kind)(**{**FAMILY_BASE, **extra})
    hf_config._attn_implementation = "eager"
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    # Non-trivial norms and biases so a wrong mapping cannot hide behind ones and zeros.
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    config = Config.from_hf_config(hf_config.to_dict())
    ours = Transformer(config).eval()
    state = dict(part for item in hf_model.state_dict().items() for part in split_fused(config, *item))
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}
    return hf_model, ours, config


PACKED_DOCS = [7, 19, 4, 11, 9]  # packed into 30 tokens: [7, 19, 4] | [11, 9] + 10 padding; 19, 11 and 9 pass every window

def packable_documents(vocab: int, lengths=PACKED_DOCS) -> list:
    """Random documents of `lengths` tokens whose first third is a masked prompt."""
    from lit_qlora.data.sft import IGNORE_INDEX, Sample

    g = torch.Generator().manual_seed(3)
    samples = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = IGNORE_INDEX  # a prompt
        samples.append(Sample(ids, labels))
    return samples


# -- tiny checkpoints transformers writes (test_families, test_gguf_export, test_llama_cpp) --------------------

VOCAB = 49152  # SmolLM2's tokenizer, so `litqlora finetune` can tokenize text for these models


def hf_checkpoint(kind: str, extra: dict, out: Path, tokenizer_dir: Path | None = None):
    """A tiny random model written by transformers (safetensors), with non-trivial norms and biases."""
    import transformers

    from lit_qlora.checkpoint.hf import copy_tokenizer_files

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                 bos_token_id=1, eos_token_id=2)
    config = getattr(transformers, kind)(**{**shape, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return model

def tokens(shape: tuple[int, ...], seed: int = 2, vocab: int = VOCAB) -> torch.Tensor:
    """Seeded random token ids below `vocab`."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# -- two tensor-parallel ranks against one process (test_tensor_parallel, test_families) ---------------------------

def gather_shards(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)

def lm_step(model, idx):
    logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    return logits.detach(), loss.detach()

def tensor_parallel_worker(rank: int, ckpt: str, quantize: str, init_file: str, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import lit_qlora.parallel.tensor_parallel as tp
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.lora.layer import apply_lora, lora_modules
    from lit_qlora.checkpoint.adapter import full_lora_state_dict
    from lit_qlora.nf4 import dequantize_nf4

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        group = mesh["tensor_parallel"].get_group()
        model = load_model(ckpt, quantize, "32-true", shard=tp.TensorParallelShard(rank, 2)).train()
        torch.manual_seed(100 + rank)  # another init per rank: parallelize must start all from rank 0's
        apply_lora(model, 4, 8.0, 0.0, HEAD_TOO, dtype=torch.float32)
        for m in lora_modules(model).values():
            torch.nn.init.normal_(m.lora_B, std=0.05)  # B = 0 would leave A without gradient
        tp.parallelize(model, mesh["tensor_parallel"])
        init = full_lora_state_dict(model)

        ref = load_model(ckpt, quantize, "32-true", nf4_tensor_parallel=2).train()  # NF4: every shard's own bits
        apply_lora(ref, 4, 8.0, 0.0, HEAD_TOO, dtype=torch.float32)
        ref.load_state_dict(init, strict=False)
        out = {"lora_params": len(init), "head_adapted": "lm_head" in lora_modules(ref)}

        # The base each rank trains against, put together, is the one-process base (bit for bit).
        layer = model.model.layers[1]
        for name in ("self_attn.k_proj", "mlp.down_proj"):
            local = layer.get_submodule(name).weight
            local = dequantize_nf4(local) if quantize == "nf4" else local.detach()
            whole = gather_shards(local, 0 if tp.tp_style(name) == "column" else 1, group)
            out[f"base_equal.{name}"] = torch.equal(whole, ref.model.layers[1].get_submodule(name).weight.detach())

        torch.manual_seed(0)
        idx = torch.randint(0, model.config.vocab_size, (2, 24))
        logits, loss = lm_step(model, idx)
        ref_logits, ref_loss = lm_step(ref, idx)
        out["logits_diff"] = (logits - ref_logits).abs().max().item()
        out["logits_scale"] = ref_logits.abs().max().item()
        out["loss"], out["ref_loss"] = loss.item(), ref_loss.item()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        out["grad_names_equal"] = sorted(grads) == sorted(ref_grads) and len(grads) == len(init)
        out["grad_rel_diff"] = max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item() for n in grads)
        out["min_grad_norm"] = min(g.norm().item() for g in ref_grads.values())
        # Replicated parameters get the same gradient on every rank.
        replicated = [p for p in model.parameters() if p.grad is not None and p.placements[0].is_replicate()]
        out["replicated_grad_spread"] = max((gather_shards(p.grad.to_local()[None], 0, group).diff(dim=0)).abs().max().item()
                                            for p in replicated)

        # One clipped AdamW step: the global gradient norm over mixed placements, then equal parameters.
        norms = []
        for net in (model, ref):
            params = [p for p in net.parameters() if p.requires_grad]
            norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
            norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
            torch.optim.AdamW(params, lr=1e-2, foreach=True).step()
        out["grad_norm"], out["ref_grad_norm"] = norms
        after, ref_after = full_lora_state_dict(model), {k: v for k, v in ref.state_dict().items() if "lora_" in k}
        out["param_diff_after_step"] = max((after[k] - ref_after[k]).abs().max().item() for k in after)
        # Merged weights of this rank's shard, put together, equal the one-process merge.
        diffs = []
        for name, m in lora_modules(model).items():
            merged = m.merged_weight(torch.float32)
            if m.style != "replicate":
                merged = gather_shards(merged, 0 if m.style == "column" else 1, group)
            diffs.append((merged - ref.get_submodule(name).merged_weight(torch.float32)).abs().max().item())
        out["merged_diff"] = max(diffs)

        # The same gradients without the group sum in column-parallel layers: they must come out wrong.
        model.zero_grad(set_to_none=True)
        tp.copy_to_group = lambda x, group: x
        ref.zero_grad(set_to_none=True)
        lm_step(model, idx)
        lm_step(ref, idx)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        out["unreduced_grad_rel_diff"] = max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item()
                                             for n in grads)
        queue.put((rank, out))
    except Exception as e:  # report, do not hang the parent
        import traceback

        queue.put((rank, {"error": traceback.format_exc() + f"{type(e).__name__}: {e}"}))
    finally:
        dist.destroy_process_group()

HEAD_TOO = ["all", "lm_head"]  # the tiny models tie their heads, which `all` leaves out: the head-parallel path too

def assert_equals_one_process(results: dict) -> None:
    """What `tensor_parallel_worker` measured on two ranks of a 2-block model matches one process."""
    for rank in (0, 1):
        r = results[rank]
        assert "error" not in r, r.get("error")
        # q, k, v, o, gate, up, down x 2 layers + lm_head (unless tied: `all` leaves it out): A and B each
        assert r["lora_params"] == 2 * (14 + r["head_adapted"])
        assert r["base_equal.self_attn.k_proj"] and r["base_equal.mlp.down_proj"]
        assert r["logits_diff"] < 1e-5 * max(1.0, r["logits_scale"])
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
        assert r["grad_names_equal"] and r["min_grad_norm"] > 0
        assert r["grad_rel_diff"] < 1e-5
        assert r["replicated_grad_spread"] == 0.0
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
        # Adam: ~lr (1e-2) per element, tiny gradients amplified: an element whose gradient is near 0 moves by up to lr
        # on a rounding difference (1.35e-4 measured, in layer 0's q_proj lora_A, since the tied head computes with the
        # fp32 embedding instead of an NF4 copy; 1.4% of one step's update)
        assert r["param_diff_after_step"] < 3e-4
        # fp32 rounding: the one-process model runs q/k/v and gate/up fused (fused_projections), the ranks each
        # projection on its own, so sums run in another order (Qwen3 tied: 1.6e-6 measured)
        # (and the merged weights follow that element: 4.0e-5 measured in the same q_proj)
        assert r["merged_diff"] < 1e-4
        # Without the tensor-parallel sum A's (and the inputs') gradients miss the other rank's share.
        assert r["unreduced_grad_rel_diff"] > 1e-2
    assert results[0]["loss"] == results[1]["loss"]


# -- GGUF files written as llama.cpp writes them (test_gguf_import, test_gguf_export, test_llama_cpp) -------------

GGML = gguf.GGMLQuantizationType  # the quant types, by name

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (printable latin-1 maps to itself, the rest to 256+)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]

def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows (rotate-half pairs -> adjacent pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

def k_quant_bytes(rng: np.random.Generator, rows: int, cols: int, qtype: GGML) -> np.ndarray:
    """Random but valid Q4_K / Q6_K blocks (gguf cannot quantize to them): random bits, finite fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(data.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == GGML.Q4_K:
        data[:, :4] = scales  # d, dmin
    else:
        data[:, -2:] = scales[:, :2]  # d is the last field of a Q6_K block
    return data.reshape(rows, -1)

# Quant type per tensor kind: all types the converter must read. K-quants need rows of 256.
QTYPES = {"token_embd": GGML.F16, "attn_q": GGML.Q8_0, "attn_k": GGML.Q4_0, "attn_v": GGML.Q4_1, "attn_output": GGML.BF16,
          "ffn_gate": GGML.Q5_0, "ffn_up": GGML.Q6_K, "ffn_down": GGML.Q4_K, "output": GGML.Q8_0}

def write_gpt2_tokenizer(w: gguf.GGUFWriter, add_bos: bool = False) -> int:
    """A byte-level BPE vocabulary (SmolLM2's kind) with a chat template; returns the vocabulary size."""
    tokens = SPECIAL + byte_alphabet() + ["Ġt", "he", "Ġthe"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}")
    return len(tokens)

def write_tiny_gguf(path: Path, tied: bool = False, add_bos: bool = False, arch: str = "llama",
                     raw: dict[str, tuple[np.ndarray, GGML]] | None = None,
                     tokenizer: Callable[[gguf.GGUFWriter], int] | None = None,
                     ) -> tuple[Config, dict[str, np.ndarray]]:
    """A 2-layer llama GGUF with random weights; returns its Config and the HF-layout weights we expect back.
    `raw` writes the given (data, type) under a name instead of the generated tensor (or in addition to them).
    arch="qwen3" adds per-head q/k norms and heads narrower than hidden / heads, as Qwen3-0.6B has.
    `tokenizer` writes the vocabulary metadata and returns its size (default: `write_gpt2_tokenizer`)."""
    raw = dict(raw or {})
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, arch)
    n_vocab = tokenizer(w) if tokenizer else write_gpt2_tokenizer(w, add_bos)
    qwen3 = arch == "qwen3"
    config = Config(vocab_size=n_vocab, n_layer=2, n_embd=256, n_head=4, n_query_groups=2,
                    head_dim=32 if qwen3 else None, intermediate_size=256, norm_eps=1e-5, rope_base=500000.0,
                    max_seq_length=512, tie_embeddings=tied, qk_norm=qwen3, bos_token_id=1, eos_token_id=2)
    hd = config.head_dim
    shapes = {"token_embd": (config.vocab_size, 256), "attn_q": (4 * hd, 256), "attn_k": (2 * hd, 256),
              "attn_v": (2 * hd, 256), "attn_output": (256, 4 * hd), "ffn_gate": (256, 256), "ffn_up": (256, 256),
              "ffn_down": (256, 256), "output": (config.vocab_size, 256)}
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(hd)
    if qwen3:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf: str, value: np.ndarray, qtype: GGML, n_heads: int | None = None) -> None:
        if qtype in (GGML.Q4_K, GGML.Q6_K):
            data = k_quant_bytes(rng, *value.shape, qtype)
            value = gguf.quants.dequantize(data, qtype)
        else:
            data = gguf.quants.quantize(value, qtype)
            value = gguf.quants.dequantize(data, qtype)  # what the file really holds
        expected[hf] = value
        if n_heads is not None:  # store rows permuted as llama.cpp does (quant blocks never span rows)
            data = llama_cpp_permute(data, n_heads)
        if gguf_name in raw:
            data, qtype = raw.pop(gguf_name)
        w.add_tensor(gguf_name, data, raw_dtype=None if qtype in (GGML.F32, GGML.F16) else qtype)

    def rand(kind: str) -> np.ndarray:
        return rng.standard_normal(shapes[kind]).astype(np.float32) * 0.05

    hf_names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
    add("token_embd.weight", "model.embed_tokens.weight", rand("token_embd"), QTYPES["token_embd"])
    for i in range(2):
        for kind, hf in hf_names.items():
            heads = {"attn_q": 4, "attn_k": 2}.get(kind) if arch == "llama" else None
            add(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{hf}.weight", rand(kind), QTYPES[kind], heads)
        for kind, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            add(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{hf}.weight", 1 + rand("ffn_up")[0], GGML.F32)
        if qwen3:
            for kind, hf in (("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")):
                add(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{hf}.weight", 1 + rand("ffn_up")[0, :hd], GGML.F32)
    add("output_norm.weight", "model.norm.weight", 1 + rand("ffn_up")[0], GGML.F32)
    if not tied:
        add("output.weight", "lm_head.weight", rand("output"), QTYPES["output"])
    for name, (data, qtype) in raw.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config, expected

# -- SentencePiece vocabularies (tokenizer.ggml.model "llama": Llama 2, TinyLlama, Mistral, Gemma) ------------------
SPM_USER_DEFINED, SPM_CONTROL = ["<|user|>", "<sep>"], ["<|ctrl|>"]

SPM_WORDS = ("the quick brown fox jumps over lazy dog tokenizer model vocabulary merge byte fallback llama mistral "
             "gemma sentence piece hello world python code function return value numbers data science learning "
             "deep neural network attention naïve café résumé über straße Paris France capital").split()

# Spaces (leading, trailing, runs), newlines and tabs (absent from the training text: bytes), digits, punctuation,
# unicode and emoji (bytes), words never seen, the control and user-defined symbols (and text glued to them).
SPM_TEXTS = [
    "Hello world", "the quick brown fox jumps over the lazy dog.", " leading space", "  two leading", "trailing ",
    "multiple   spaces    inside", " ", "   ", "", "line one\nline two\n\n", "tabs\tand\r\nwindows",
    "digits 0123456789 and 3.14159, 2024-01-31", "punctuation: (a), [b]; {c}! ?¿ — “quotes” 'single' \"double\"",
    "naïve café résumé über straße", "日本語のテキスト", "emoji 😀🚀 mixed🤖text", "unseenwordzzz qwertyuiop xylophone",
    "UPPER CASE THE QUICK", "e\u0301 vs é, non\u00a0breaking", "<|user|>hello<sep> world<|ctrl|>bye", "a<sep>b",
    "<sep>", "x <|user|> y", "Paris</s> <s><unk> x", "<|ctrl|>\n<|user|>  spaced",
]

def train_sentencepiece(tmp_path: Path, add_dummy_prefix: bool) -> Path:
    """A tiny SentencePiece BPE model trained as Llama's was: byte fallback, digits split, whitespace kept as is."""
    spm = pytest.importorskip("sentencepiece")
    rng = np.random.default_rng(0)
    lines = []
    for i in range(300):
        words = list(rng.choice(SPM_WORDS, size=rng.integers(3, 14)))
        if i % 7 == 0:
            words.append(str(rng.integers(0, 99999)))
        lines.append(str(rng.choice([" ", " ", "  ", "    ", ", "])).join(words) + str(rng.choice([".", "!", "?", ""])))
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "spm"), model_type="bpe", vocab_size=500,
        byte_fallback=True, split_digits=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, add_dummy_prefix=add_dummy_prefix,
        user_defined_symbols=SPM_USER_DEFINED, control_symbols=SPM_CONTROL, num_threads=1, minloglevel=2)
    return tmp_path / "spm.model"

def sentencepiece_gguf_vocab(model_file: Path, add_dummy_prefix: bool) -> Callable[[gguf.GGUFWriter], int]:
    """Writes the vocabulary as llama.cpp's converter does: pieces, scores, types from the piece kinds."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if sp.id_to_piece(i) in SPM_USER_DEFINED else 1

    def write(w: gguf.GGUFWriter) -> int:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list([sp.id_to_piece(i) for i in range(sp.vocab_size())])
        w.add_token_scores([sp.get_score(i) for i in range(sp.vocab_size())])
        w.add_token_types([kind(i) for i in range(sp.vocab_size())])
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(add_dummy_prefix)
        w.add_chat_template("{% for m in messages %}<|user|>{{ m['content'] }}</s>{% endfor %}")
        return sp.vocab_size()

    return write


# -- every family through a GGUF export (test_gguf_export, test_llama_cpp) ---------------------------------------

# Every family llama.cpp runs, in shapes it runs as we do (gguf_families.py): Gemma's query scale is head_dim, Gemma 2's
# head stays tied (so its adapter leaves lm_head out), Gemma 3's six layers slide but the last.
NO_HEAD = ["q", "k", "v", "o", "gate", "up", "down"]

GGUF_FAMILIES = {"llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
            "mistral": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False)),
            "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
            "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32)),
            "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                            attn_logit_softcapping=0.5, final_logit_softcapping=3.0)),
            "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                                num_hidden_layers=6, tie_word_embeddings=False)),
            "phi3": ("Phi3Config", dict(pad_token_id=0, tie_word_embeddings=False)),
            # Phi-4-mini's RoPE: partial, longrope (its long factors past 16 tokens)
            "phi3-longrope": ("Phi3Config", dict(partial_rotary_factor=0.5, original_max_position_embeddings=16,
                                                 pad_token_id=0, tie_word_embeddings=True,
                                                 rope_scaling={"type": "longrope",
                                                               "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                               "long_factor": [2.0, 5.0, 9.0, 20.0]}))}

def family_export(family: str, quantize: str, tmp_path, smollm2_dir, dtype: str = "f32"):
    """A tiny random model of `family` with a random adapter: (base dir, adapter dir, the merged model, the GGUF)."""
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.export.gguf import export_gguf

    kind, extra = GGUF_FAMILIES[family]
    hf_checkpoint(kind, extra, tmp_path / "base", smollm2_dir)
    model = load_model(tmp_path / "base", quantize, "32-true")
    adapter = random_adapter(model, tmp_path / "adapter", quantize, NO_HEAD if family == "gemma2" else ["all"])
    merged = load_model(tmp_path / "base", quantize, "32-true", adapter_dir=adapter)
    path = export_gguf(tmp_path / "base", tmp_path / "model.gguf", adapter_dir=adapter, dtype=dtype)
    return tmp_path / "base", adapter, merged, path


# ---- continuous batching (tests of lit_qlora.model.batch_decode and of the C decode step over it)

def rows_of(prompts, **settings) -> list[Row]:
    """One Row per prompt, keys r0, r1, ...; a list-valued setting gives each row its own value."""
    return [Row(key=f"r{i}", prompt=p, **{k: v[i] if isinstance(v, list) else v for k, v in settings.items()})
            for i, p in enumerate(prompts)]


def run_batch(batch, joins: dict[int, list[Row]]) -> tuple[dict, dict, int]:
    """Step until every row is done, adding joins[i] before step i; the tokens and finish reason of each row."""
    tokens, finish, widest = {}, {}, 0
    step = 0
    while batch.rows or any(i >= step for i in joins):
        for row in joins.get(step, []):
            batch.add(row)
            tokens[row.key] = []
        widest = max(widest, len(batch.rows))
        for t in batch.step():
            if t.token is not None:
                tokens[t.key].append(t.token)
            if t.finish:
                finish[t.key] = t.finish
        step += 1
    return tokens, finish, widest


needs_interpreter = pytest.mark.skipif(not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="needs triton and TRITON_INTERPRET=1 (tests/conftest.py sets it)")
"""The Triton kernels' tests on the CPU: Triton's interpreter runs them."""


def nf4_test_weight(shape, dtype, seed=0, block_size=64):
    """An NF4 weight of random rows each scaled by its own random factor (the blocks' scales differ)."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen)).to(dtype)
    return quantize_nf4(w, block_size)
