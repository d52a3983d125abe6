"""What a checkpointed block's recompute takes from its first run instead of computing it again.

``torch.utils.checkpoint`` runs a block's forward twice: once for its output (keeping nothing), once in backward to
rebuild what the block's gradients need. Both runs execute the same ops in the same order (it restores the RNG state),
so a value the first run stashes is the next one the recompute asks for: LoRA dropout's r-wide ``down`` products
(lit_qlora.lora.dropout: the hashing pass over x is not repeated) and, on the CPU, a mixture of experts' projections
(lit_qlora.nf4.grouped: no expert matmul runs twice). A stashed value is held from the forward to the block's
backward: a cost in memory, paid where time is what is short.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Hashable

_block_run = threading.local()  # .state: (the checkpointed block's stash, whether this run is its recompute)


def reusing_first_run(block: Callable) -> Callable:
    """`block` for ``torch.utils.checkpoint``: its recompute takes the values `first_run_value` stashed in its first
    run (a new wrapper per forward: each holds its own stash)."""
    stash: deque = deque()
    runs = [0]

    def run(*args, **kwargs):
        previous = getattr(_block_run, "state", None)
        _block_run.state = (stash, runs[0] > 0)
        runs[0] += 1
        try:
            return block(*args, **kwargs)
        finally:
            _block_run.state = previous

    return run


def first_run_value(key: Hashable, compute: Callable[[], Any]) -> Any:
    """`compute()`, stashed in a checkpointed block's first run and returned again to its recompute (when the
    recompute's next stashed value has the same `key`: another key means the recompute took another path, and from
    there on it computes everything). Outside a block wrapped by `reusing_first_run`: just `compute()`."""
    state = getattr(_block_run, "state", None)
    if state is not None and state[1]:
        stash = state[0]
        if stash and stash[0][0] == key:
            return stash.popleft()[1]
        stash.clear()
    value = compute()
    if state is not None and not state[1]:
        state[0].append((key, value))
    return value
