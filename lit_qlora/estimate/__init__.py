"""`litqlora estimate`: a fine-tune recipe's peak device memory, predicted before any weights are downloaded or a GPU
is at hand, from one training step of the real code traced on fake tensors."""
