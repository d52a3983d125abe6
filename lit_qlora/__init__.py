"""lit-qlora: QLoRA fine-tuning on Lightning (the `litqlora` command is lit_qlora/cli.py)."""

import os

# OpenMP workers spin ~10 us for the next op before they sleep, not libgomp's ~3 ms. Beside another busy process,
# long-spinning workers take the cores that descheduled ones need to reach the next barrier: the demo beside one
# 2-thread job kept 0.27x its quiet tokens/s at libgomp's 300000 spins and 0.63x at 1000, and ran 14% faster quiet
# than sleeping at once (OMP_WAIT_POLICY=PASSIVE; benchmarks/README, issue 16). libgomp reads this once, when torch
# loads it, hence here, before anything imports torch; a user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"
