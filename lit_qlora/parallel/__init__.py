"""Several processes: DDP/FSDP2 helpers (`distributed`) and tensor parallelism (`tensor_parallel`)."""
