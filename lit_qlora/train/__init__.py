"""Training: the LightningModule (`module`), its Lightning callbacks (`callbacks`: metrics file, resumable
checkpoints, stop on signal, heap release), the arguments (`args`), the one data order (`sampler`), resumable train
state (`state`), the chunked loss (`loss`), signal handling (`signals`) and the end-of-run report (`report`)."""
