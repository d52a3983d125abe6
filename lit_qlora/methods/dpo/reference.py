"""The reference model of DPO and IPO, for free: the same NF4 (or bf16) base the policy trains on, with its adapters
switched off, or, after `--train.init_adapter`, set back to the adapter the run started from. No second copy of the
weights: the reference is the policy's own base under a context manager.

`--dpo.reference adapters_off` computes it in every step (one more forward without gradients); `cached` computes
each pair's reference log-probabilities once, before training, into out_dir/reference_logps.safetensors, which a
resumed run reads back when it was made for the same data, base and starting adapter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lit_qlora.checkpoint.adapter import ADAPTER_WEIGHTS, find_adapter_dir
from lit_qlora.checkpoint.files import TensorSpec, write_safetensors
from lit_qlora.methods.dpo.loss import answer_logps
from lit_qlora.train.policy import reference_policy

CACHE_FILE = "reference_logps.safetensors"
SPLITS = ("train", "val")


def reference_logps(model: nn.Module, batch: dict[str, torch.Tensor],
                    start: Optional[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The reference's summed answer log-probabilities of a batch's 2B rows."""
    with reference_policy(model, start):
        return answer_logps(model, batch)[0]


class Reference:
    """Where a pair's reference log-probabilities come from (`--dpo.reference`).

    `sets` ({"train": dataset, "val": dataset} of PairSamples, and the collate and micro-batch size that batch them)
    is what `cached` precomputes; `fingerprint` what the cache must have been made for to be reused."""

    def __init__(self, mode: str, start: Optional[dict[str, torch.Tensor]], out_dir: Path, sets: dict[str, Any],
                 collate: Any, micro_batch_size: int, fingerprint: dict[str, Any]) -> None:
        self.mode, self.start, self.path = mode, start, Path(out_dir) / CACHE_FILE
        self.sets, self.collate, self.micro_batch_size = sets, collate, micro_batch_size
        self.fingerprint = json.dumps(fingerprint, sort_keys=True)
        self.table: Optional[dict[str, torch.Tensor]] = None  # split -> (n, 2): chosen, rejected

    def logps(self, module: Any, batch: dict[str, torch.Tensor], split: str) -> torch.Tensor:
        if self.mode == "adapters_off":
            return reference_logps(module.model, batch, self.start)
        table = self.cached(module)[split].to(batch["index"].device)
        rows = table[batch["index"]]
        return torch.cat([rows[:, 0], rows[:, 1]])

    def cached(self, module: Any) -> dict[str, torch.Tensor]:
        """The cache: read from out_dir when it was made for this run's data and model, else computed now (every rank
        runs the same forwards, as FSDP needs; rank 0 writes the file)."""
        if self.table is None:
            self.table = self._read() or self._compute(module)
        return self.table

    def _read(self) -> Optional[dict[str, torch.Tensor]]:
        from safetensors import safe_open

        if not self.path.is_file():
            return None
        with safe_open(str(self.path), "pt") as f:
            if (f.metadata() or {}).get("fingerprint") != self.fingerprint:
                return None
            table = {split: f.get_tensor(split) for split in SPLITS}
        if any(len(table[s]) != len(self.sets[s]) for s in SPLITS):
            return None
        print(f"Reference log-probabilities: read from {self.path}")
        return table

    def _compute(self, module: Any) -> dict[str, torch.Tensor]:
        from torch.utils.data import DataLoader

        trainer = module.trainer
        # A validation runs under inference mode; the cache feeds training steps too, so it is made of plain tensors.
        with torch.inference_mode(False):
            table = {}
            for split in SPLITS:
                values = torch.zeros(len(self.sets[split]), 2, dtype=torch.float32)
                # Its own generator: iterating a DataLoader draws a seed from the global RNG, which would shift the
                # dropout masks of every later step (cached would then train otherwise than adapters_off, and a
                # resume that recomputes the cache otherwise than the uninterrupted run).
                loader = DataLoader(self.sets[split], batch_size=self.micro_batch_size, collate_fn=self.collate,
                                    generator=torch.Generator())
                for batch in loader:
                    batch = trainer.strategy.batch_to_device(batch)
                    logps = reference_logps(module.model, batch, self.start).float().cpu()
                    pairs = len(batch["index"])
                    values[batch["index"].cpu()] = torch.stack([logps[:pairs], logps[pairs:]], dim=1)
                table[split] = values
        if trainer.is_global_zero:
            specs = [TensorSpec(s, tuple(t.shape), t.dtype, lambda t=t: t) for s, t in table.items()]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(self.path, specs, metadata={"fingerprint": self.fingerprint})
            print(f"Reference log-probabilities: {sum(len(t) for t in table.values())} pairs, written to {self.path}")
        trainer.strategy.barrier()
        return table


def cache_fingerprint(config: Any) -> dict[str, Any]:
    """What the cached reference log-probabilities depend on: the base and how it is stored, the starting adapter,
    the pairs (data, split, tokenization)."""
    from lit_qlora.data.files import file_sha256

    run = config.as_json()
    init = config.train.init_adapter
    if init is not None:
        init = file_sha256(find_adapter_dir(Path(init)) / ADAPTER_WEIGHTS)
    return {"base": run["checkpoint_dir"], "quantize": run["quantize"], "precision": run["precision"],
            "ignore_modules": run["ignore_modules"], "nf4_shards": run["nf4_shards"], "seed": run["seed"],
            "data": run["data"], "data_sha256": run["data_sha256"], "max_seq_length": config.train.max_seq_length,
            "prompt_style": config.prompt_style, "init_adapter": init}
