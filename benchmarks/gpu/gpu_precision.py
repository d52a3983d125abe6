"""Issue 27 on a real GPU: what `--precision auto` picks, and 16-mixed (fp16 base, fp32 adapters and AdamW state,
dynamic loss scaling) beside bf16-true and 32-true, training a tiny random Llama (SmolLM2's tokenizer) for 6 steps
with QLoRA and LoRA through train.run's setup()/fit() (the path `litqlora finetune` takes).

    python benchmarks/gpu/gpu_precision.py TOKENIZER_DIR   # a folder with SmolLM2's config.json and tokenizer files

Writes $OUT/gpu_check.json (or ./gpu_precision.json); recorded: benchmarks/gpu/results/gpu_precision.json."""
import json
import os
import sys
import time
from pathlib import Path
sys.path[:0] = [".", "tests"]
import torch  # noqa: E402
from helpers import write_tiny_llama  # noqa: E402
from lit_qlora.base.precision import choose_precision  # noqa: E402
from lit_qlora.train.args import DataArgs, LoRAArgs, TrainArgs  # noqa: E402
from lit_qlora.train.run import fit, setup  # noqa: E402
from lit_qlora.train.spec import RunSpec  # noqa: E402

print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability(), "torch", torch.__version__)
print("auto ->", choose_precision("auto", "auto"))
tmp = Path("/tmp/gpucheck")
tmp.mkdir(exist_ok=True)
base = write_tiny_llama(Path(sys.argv[1] if len(sys.argv) > 1 else ".devcarry/kit/smol"), tmp / "tiny")
rows = [{"instruction": f"Add {i} and {i + 3}.", "output": f"{i} + {i + 3} = {2 * i + 3}."} for i in range(40)]
(tmp / "rows.json").write_text(json.dumps(rows))
out = {}
for quantize in ("nf4", "none"):
    for precision in ("bf16-true", "16-mixed", "32-true"):
        t = time.perf_counter()
        run = setup(RunSpec(checkpoint_dir=base, out_dir=tmp / f"{quantize}-{precision}", quantize=quantize, precision=precision,
                    seed=7, accelerator="cuda", devices=1, num_nodes=1, strategy="auto", tensor_parallel=1,
                    nf4_shards=None, resume=False, lora=LoRAArgs(r=4, alpha=8, dropout=0.05),
                    train=TrainArgs(micro_batch_size=2, global_batch_size=4, max_seq_length=64, lr=1e-2,
                                    warmup_steps=1, max_steps=6), data=DataArgs(json_path=tmp / "rows.json", val_split=0.2),
                    ignore_modules=None))
        summary = fit(run)
        params = {str(p.dtype) for p in run.module.model.parameters() if p.requires_grad}
        frozen = {str(p.dtype) for p in run.module.model.parameters() if not p.requires_grad}
        moments = {str(s["exp_avg"].dtype) for s in run.trainer.optimizers[0].state.values()}
        rows_ = [json.loads(line) for line in (tmp / f"{quantize}-{precision}" / "metrics.jsonl").read_text().splitlines()]
        scale = getattr(run.trainer.precision_plugin, "loss_scale", lambda: None)() if run.trainer.precision_plugin else None
        out[f"{quantize}/{precision}"] = dict(losses=[r["loss"] for r in rows_], skipped=[r.get("skipped") for r in rows_ if r.get("skipped")],
            val=(summary["initial_val_loss"], summary["val_loss"]), lora=sorted(params), frozen=sorted(frozen),
            adam=sorted(moments), loss_scale=scale, seconds=round(time.perf_counter() - t, 1),
            peak_alloc_gib=round(summary.get("peak_allocated_bytes", 0) / 2**30, 3))
        print(quantize, precision, json.dumps(out[f"{quantize}/{precision}"]), flush=True)
Path(os.environ.get("OUT", "."), "gpu_check.json" if "OUT" in os.environ else "gpu_precision.json").write_text(
    json.dumps(out, indent=2))
