"""The base layer: what every other package may use and which imports nothing else of ours (nor torch at import).

* :mod:`~lit_qlora.base.errors`: `UserError` and its kinds, the errors the CLI prints as one paragraph.
* :mod:`~lit_qlora.base.hardware`: the precisions, `--precision auto`, the ISA caps.
* :mod:`~lit_qlora.base.switches`: every `LIT_QLORA_*` environment switch and its one parser (docs/switches.md).
* :mod:`~lit_qlora.base.threads`: OpenMP's spin and the thread count that follows the cores other processes leave.
* :mod:`~lit_qlora.base.quiet`: other libraries' noise off unless `--debug`.
"""
