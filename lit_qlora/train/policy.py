"""What the objectives beyond SFT share (`litqlora dpo`, lit_qlora.methods.dpo; `litqlora grpo`, lit_qlora.methods.grpo): the
log-probability of given tokens under the policy, a chunk of head logits at a time, and the reference policy for
free: the same base the policy trains on with its adapters off, or set back to the adapter the run started from."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lit_qlora.checkpoint.adapter import ADAPTER_WEIGHTS, find_adapter_dir
from lit_qlora.lora.layer import adapters_disabled, lora_modules
from lit_qlora.parallel.distributed import shard_like

# Head logits are made for this many tokens at a time and recomputed in backward: no forward ever holds vocab-sized
# logits for more than one chunk (a group of 8 completions of 256 tokens over a 128K vocabulary would be 1 GiB).
LOGP_CHUNK_ELEMS = 1 << 24


def _chunk_logps(logits_of, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits_of(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logps(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
                ) -> torch.Tensor:
    """log p(target) (fp32) for each row of `hidden` (tokens, n_embd: the final-norm states that predict them),
    with the head's logits divided by `temperature` (GRPO takes log-probs at the sampling temperature). Checkpointed
    only where there is more than one chunk: one chunk's logits are kept for backward rather than made twice."""
    chunk = max(1, LOGP_CHUNK_ELEMS // model.config.vocab_size)
    again = torch.is_grad_enabled() and len(targets) > chunk
    pieces = [checkpoint(_chunk_logps, model.logits, hidden[i : i + chunk], targets[i : i + chunk], temperature,
                         use_reentrant=False)
              if again else _chunk_logps(model.logits, hidden[i : i + chunk], targets[i : i + chunk], temperature)
              for i in range(0, len(targets), chunk)]
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Inside, `model` in eval mode (no dropout); afterwards each module's train/eval mode as it was."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.train(training)


@contextmanager
def reference_policy(model: nn.Module, start: Optional[dict[str, torch.Tensor]]) -> Iterator[None]:
    """Inside, `model` computes the reference: eval mode (no adapter dropout), no gradients, and its adapters off
    (`start` None) or holding `start` (the full adapter tensors the run started from, by lora_state_dict name).
    The training adapter, the modes and the random number generators are as they were afterwards."""
    saved: dict[str, torch.Tensor] = {}
    params = {f"{name}.{leaf}": getattr(layer, leaf) for name, layer in lora_modules(model).items()
              for leaf in ("lora_A", "lora_B")}
    with torch.no_grad(), evaluating(model):
        try:
            if start is None:
                with adapters_disabled(model):
                    yield
            else:
                for name, param in params.items():
                    saved[name] = param.detach().clone()
                    param.copy_(shard_like(start[name].to(param.device, param.dtype), param))
                yield
        finally:
            for name, value in saved.items():
                params[name].copy_(value)


def starting_adapter(init_adapter: Optional[Path]) -> Optional[dict]:
    """The full tensors of --train.init_adapter (the reference's adapter), or None (the reference is the base)."""
    if init_adapter is None:
        return None
    from safetensors.torch import load_file

    return load_file(str(find_adapter_dir(Path(init_adapter)) / ADAPTER_WEIGHTS))
