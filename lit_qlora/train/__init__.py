"""Training: the LightningModule (`module`), resumable train state (`state`), the chunked loss (`loss`) and
stopping on signals (`signals`)."""
