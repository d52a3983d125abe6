"""Training: `litqlora finetune` (`finetune`: the verb's checks) and the run it starts (`run`: setup() builds the
Trainer, module and data; fit() validates, trains, exports, reports). Beside them: the LightningModule (`module`),
the LightningDataModule (`datamodule`) and its one data order (`sampler`), the NF4 precision plugin for the Trainer
and Fabric (`precision`), regional torch.compile (`compile`), the Lightning callbacks (`callbacks`: metrics file,
resumable checkpoints, stop on signal, heap release), the arguments (`args`), resumable train state (`state`), the
chunked loss (`loss`), signal handling (`signals`), the end-of-run report (`report`) and the import guard that keeps
what a fine-tune never calls out of its process (`lean_imports`)."""
