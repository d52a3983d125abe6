"""Training: the LightningModule (`module`), its Lightning callbacks (`callbacks`: metrics file, resumable
checkpoints, stop on signal, heap release), the arguments (`args`), the one data order (`sampler`), resumable train
state (`state`), the chunked loss (`loss`), signal handling (`signals`), the end-of-run report (`report`) and the
import guard that keeps what a fine-tune never calls out of its process (`lean_imports`)."""
