"""`litqlora estimate`: a fine-tune recipe's peak device memory, predicted before any weights are downloaded or a GPU
is at hand. `step` traces one training step of the real code on fake tensors, `search` finds the largest batch and
the longest sequence that fit a card, `command` is the verb (its checks, the report, estimate.json)."""

from lit_qlora import public_names

__getattr__, __all__ = public_names(
    __name__, command="estimate", step="trace_step cuda_code_paths parallel_bytes resident_tensors")
