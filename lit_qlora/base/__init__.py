"""The base layer: what every other package may use and which imports nothing else of ours (nor torch at import).

* :mod:`~lit_qlora.base.errors`: `UserError` and its kinds, the errors the CLI prints as one paragraph.
* :mod:`~lit_qlora.base.precision`: the precisions, their dtypes (built on first use) and `--precision auto`, in one home.
* :mod:`~lit_qlora.base.hardware`: what the CPU or GPU computes natively; the ISA caps.
* :mod:`~lit_qlora.base.spec`: `CommandSpec`, a command's options as one dataclass (its fields are the flags).
* :mod:`~lit_qlora.base.switches`: every `LIT_QLORA_*` environment switch and its one parser (docs/switches.md).
* :mod:`~lit_qlora.base.threads`: OpenMP's spin and the thread count that follows the cores other processes leave.
* :mod:`~lit_qlora.base.quiet`: other libraries' noise off unless `--debug`.
"""
