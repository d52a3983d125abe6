"""`--device_memory`: a card by name, or a size as written, in bytes, with a line saying what was assumed.

A card's figure is its total memory as `nvidia-smi` reports it (MiB). Of that the CUDA context and cuBLAS's
workspaces take a few hundred MiB before PyTorch's allocator sees any: the fit leaves CUDA_RESERVE (0.5 GiB) aside
for them (lit_qlora.estimate.search.fits), so a card's name means what the allocator gets there.
"""

from __future__ import annotations

import re

from lit_qlora.base.errors import InvalidInput

MiB, GiB = 1 << 20, 1 << 30

CARDS = {
    "t4": 15_360, "l4": 23_034, "a10g": 23_028, "rtx3090": 24_576, "rtx4090": 24_564, "a100-40gb": 40_960,
    "a100-80gb": 81_920, "h100-80gb": 81_559, "h200": 143_771,
}
"""Total memory (MiB, nvidia-smi's figure) of the cards users fine-tune on."""


def parse_bytes(text: str) -> int:
    """A size as written: '24GiB' (2^30), '24GB' (10^9), '80G' (a bare prefix: binary, as cards are quoted),
    '512MiB', '1500000000' or '1500000000B' (bytes)."""
    found = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not found:
        raise InvalidInput(f"--device_memory {text!r} is not a size or a card ({', '.join(CARDS)}); write it like "
                           "rtx4090, 24GiB, 80GB or 512MiB.")
    power = " KMGT".index(found[2].upper() or " ")
    decimal = bool(found[2]) and (found[3] or "").lower() == "b"  # GB: 10^9; GiB, G: 2^30
    return int(float(found[1]) * (1000 if decimal else 1024) ** power)


def device_memory(text: str) -> tuple[int, str]:
    """(the bytes `--device_memory TEXT` means, the line that says so and what it assumed)."""
    card = str(text).strip().lower().replace(" ", "")
    if card in CARDS:
        total = CARDS[card] * MiB
        return total, (f"Device memory: {card} = {CARDS[card]:,} MiB ({total:,} bytes, {total / GiB:.2f} GiB, "
                       "nvidia-smi's total; the CUDA context and cuBLAS workspace take about 0.5 GiB of it, which "
                       "the fit leaves aside)")
    budget = parse_bytes(text)
    line = f"Device memory: {text} = {budget:,} bytes ({budget / GiB:.2f} GiB)"
    if re.search(r"\dG[B]\s*$", str(text).strip(), flags=re.IGNORECASE) and not re.search("GiB", str(text), re.I):
        line += (f"; GB read as 10^9 bytes. A card sold as \"{text.strip()}\" has binary GiB: pass its name (e.g. "
                 f"--device_memory rtx4090: {', '.join(CARDS)}) or write GiB")
    return budget, line
