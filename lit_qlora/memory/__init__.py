"""Memory accounting: what tensors, modules and the process hold and release (`accounting`: resident bytes with NF4
counted by its packed storage, peak RSS, the free heap given back), and the bytes a step allocates, counted op by op
on fake tensors (`trace`, what `litqlora estimate` runs under)."""
