"""Memory accounting: what tensors, modules and the process hold and release (`accounting`: resident bytes with NF4
counted by its packed storage, peak RSS, the free heap given back), and the bytes a step allocates, counted op by op
on fake tensors (`trace`, what `litqlora estimate` runs under). The names of the former lit_qlora/memory.py keep
their path here."""

from lit_qlora import public_names

__getattr__, __all__ = public_names(
    __name__, accounting="tensor_bytes module_bytes peak_rss_bytes rss_bytes peak_memory_stats heap_in_use_bytes "
                         "release_free_memory",
    trace="AllocationTrace StepPhase CATEGORIES profiled_peak")
