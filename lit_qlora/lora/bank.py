"""Many LoRA adapters on one base model, chosen per row: what lets `litqlora serve --adapters` answer requests for
different fine-tunes in one batch (the gathered A and B of Punica and S-LoRA).

`AdapterBank(model)` wraps every linear an adapter targets in a `BankedLinear`, which holds each loaded adapter's
factors stacked by slot (slot 0 is no adapter: the model as loaded; a missing layer or a smaller rank is zeros). Before
a forward, `bank.select(slots)` names each row's slot; the forward then adds, for each row, its own adapter's
`scale * x A^T B^T`: one matmul pair when every row has the same adapter (exactly LoRALinear's arithmetic), else
every adapter's down projection in one matmul, each row's columns outside its own adapter zeroed (its scale on its
own), and every up projection in a second: no per-row copies of the factors (gathering them cost 5x as much).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from lit_qlora.base.errors import InvalidInput


class BankedLinear(nn.Module):
    """A linear (plain, NF4, or itself a LoRALinear) plus the bank's adapters on it, each row its own."""

    def __init__(self, base: nn.Module, bank: "AdapterBank") -> None:
        super().__init__()
        self.base, self.bank = base, [bank]  # (a list: the bank is not a submodule of every layer)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.A: Optional[torch.Tensor] = None  # (slots, width, in): slot s's A in its first r rows
        self.B: Optional[torch.Tensor] = None  # (out, slots, width): its B in the first r of its width
        self.ranks: dict[int, int] = {}  # slot -> its adapter's rank here (slots without one here: absent)

    @property
    def weight(self) -> torch.Tensor:  # what code that reads a linear's weight (its dtype, its device) finds
        return self.base.weight

    def put(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot `slot`'s factors here: A (r, in), B (out, r). The stacks are sized first (`resize`)."""
        r = a.size(0)
        self.clear(slot)
        self.A[slot, :r] = a
        self.B[:, slot, :r] = b
        self.ranks[slot] = r

    def clear(self, slot: int) -> None:
        if slot in self.ranks:
            self.A[slot].zero_()
            self.B[:, slot].zero_()
            del self.ranks[slot]

    def resize(self, slots: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        if self.A is not None and self.A.shape[:2] == (slots, width):
            return
        old_a, old_b = self.A, self.B
        self.A = torch.zeros(slots, width, self.in_features, dtype=dtype, device=device)
        self.B = torch.zeros(self.out_features, slots, width, dtype=dtype, device=device)
        if old_a is not None:
            self.A[: old_a.size(0), : old_a.size(1)] = old_a
            self.B[:, : old_b.size(1), : old_b.size(2)] = old_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        bank = self.bank[0]
        if bank.uniform is not None:  # every row the same adapter: LoRALinear's own arithmetic
            slot = bank.uniform
            if slot not in self.ranks:
                return out
            r = self.ranks[slot]
            a, b = self.A[slot, :r].to(x.dtype), self.B[:, slot, :r].to(x.dtype)
            return out + (x @ a.T @ b.T) * bank.scales[slot]
        if not any(s in self.ranks for s in bank.used):
            return out
        # Every adapter's down projection at once, each row keeping its own adapter's columns (scaled), then every
        # up projection at once: two plain matmuls, no per-row gather of the factors.
        slots, width = self.A.shape[:2]
        h = x @ self.A.view(slots * width, -1).T.to(x.dtype)
        h = h * bank.row_mask(x.dtype).view(x.size(0), *[1] * (x.dim() - 2), -1)
        return out + h @ self.B.view(self.out_features, -1).T.to(x.dtype)


class AdapterBank:
    """The adapters loaded on `model`, by name, each in a slot (module doc). Slot 0 is the model as loaded."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names: dict[str, int] = {}
        self.scales: dict[int, float] = {}
        self.layers: dict[str, BankedLinear] = {}
        self.retiring: set[int] = set()  # slots unloaded while rows still decode with them: freed once none does
        self.width = 0  # the largest rank: every layer's stacks hold this many rows per slot
        self.uniform: Optional[int] = 0
        self.used: set[int] = set()
        self.slot_list: list[int] = []
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    @property
    def size(self) -> int:
        """Slots in the stacks: 0 and every slot in use or retiring."""
        return 1 + max([0, *self.names.values(), *self.retiring])

    def add(self, name: str, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> int:
        """Load an adapter: `factors` maps each module it adapts (its name in the model) to its (A, B); returns its
        slot. The modules must be linears of the model."""
        if name in self.names:
            raise InvalidInput(f"an adapter named {name!r} is loaded already")
        modules = dict(self.model.named_modules())
        missing = [m for m in factors if m not in modules and m not in self.layers]
        if missing:
            raise InvalidInput(f"the adapter adapts modules this model does not have: {missing[:3]}")
        for module_name, (a, b) in factors.items():
            module = self.layers.get(module_name) or modules[module_name]
            if not hasattr(module, "in_features") or a.dim() != 2:
                raise InvalidInput(f"{module_name} is not a linear layer: its adapter cannot join the bank")
            if a.shape[1] != module.in_features or b.shape != (module.out_features, a.shape[0]):
                raise InvalidInput(f"{module_name}: the adapter's A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                                 f"its {module.in_features} -> {module.out_features} linear")
        taken = set(self.names.values()) | self.retiring
        slot = next(s for s in range(1, len(taken) + 2) if s not in taken)
        slots = max(self.size, slot + 1)
        self.width = max([self.width, *(a.size(0) for a, _ in factors.values())])
        for module_name in factors:
            if module_name not in self.layers:
                self._wrap(module_name, modules[module_name])
        some = next(iter(factors.values()), None)
        for layer in self.layers.values():  # every stack as deep and as wide as the bank: one row mask fits all
            ref = some[0] if some is not None else layer.A
            layer.resize(slots, self.width, ref.dtype, ref.device)
        for module_name, (a, b) in factors.items():
            self.layers[module_name].put(slot, a, b)
        self.names[name], self.scales[slot] = slot, scale
        return slot

    def remove(self, name: str, in_use: Sequence[int] = ()) -> None:
        """Unload `name`: no new row may use it; its slot is freed now, or once no row in `in_use` decodes with it."""
        slot = self.names.pop(name)
        if slot in in_use:
            self.retiring.add(slot)
        else:
            self._free(slot)

    def select(self, slots: Sequence[int]) -> None:
        """The slot of each row of the next forward (retiring slots no row uses any more are freed)."""
        for slot in [s for s in self.retiring if s not in slots]:
            self.retiring.discard(slot)
            self._free(slot)
        self.slot_list = [int(s) for s in slots]
        self.used = set(self.slot_list)
        first = self.slot_list[0] if self.slot_list else 0
        self.uniform = first if len(self.used) <= 1 else None
        self._masks = {}

    def row_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """(rows, slots * width): each row's adapter scale over its own slot's columns, zeros elsewhere."""
        if dtype not in self._masks:
            layer = next(iter(self.layers.values()))
            slots, width = layer.A.shape[:2]
            mask = torch.zeros(len(self.slot_list), slots, width, dtype=dtype, device=layer.A.device)
            for i, slot in enumerate(self.slot_list):
                mask[i, slot] = self.scales.get(slot, 0.0)
            self._masks[dtype] = mask.view(len(self.slot_list), -1)
        return self._masks[dtype]

    def _free(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear(slot)
        self.scales.pop(slot, None)

    def _wrap(self, module_name: str, module: nn.Module) -> BankedLinear:
        parent_name, _, child = module_name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        layer = BankedLinear(module, self)
        setattr(parent, child, layer)
        self.layers[module_name] = layer
        return layer
