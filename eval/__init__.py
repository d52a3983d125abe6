"""lit-qlora's evaluation package: the repository's eval/ directory, installed as `lit_qlora.eval`.

- lm.py: `LitQLoRALM`, the lm-eval model over a lit-qlora `Transformer`.
- truthfulqa.py: checks a local TruthfulQA multiple-choice file and fills it into the offline task templates.
- evaluate.py: `litqlora evaluate`, lm-eval tasks on a checkpoint or a base + LoRA adapter.
- compare.py: `litqlora compare`, the LoRA-vs-QLoRA harness; report.py renders its report.
- tasks/: lm-eval task templates for TruthfulQA mc1/mc2 read from a local file (`litqlora evaluate
  --data_file`), and utils.py with mc2's scoring.
- data/truthfulqa_mc_sample.jsonl: 20 original questions in TruthfulQA's multiple-choice format (not rows of
  the real benchmark), for tests and demos.

This package may import `lit_qlora.*`; nothing in `lit_qlora` imports it but the CLI's command table.
pyproject.toml maps this directory to `lit_qlora.eval`, so a plain `pip install .` ships it too.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"
SAMPLE_DATA_FILE = Path(__file__).parent / "data" / "truthfulqa_mc_sample.jsonl"
