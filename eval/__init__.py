"""lit-qlora's evaluation package: the repository's eval/ directory, installed as `lit_qlora.eval`.

- tasks/: lm-eval task templates for TruthfulQA mc1/mc2 read from a local file (`litqlora evaluate
  --data_file`), and utils.py with mc2's scoring.
- data/truthfulqa_mc_sample.jsonl: 20 original questions in TruthfulQA's multiple-choice format (not rows of
  the real benchmark), for tests and demos.
- compare.py: `litqlora compare`, the LoRA-vs-QLoRA harness; report.py renders its report.

pyproject.toml maps this directory to `lit_qlora.eval`, so a plain `pip install .` ships it too.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"
SAMPLE_DATA_FILE = Path(__file__).parent / "data" / "truthfulqa_mc_sample.jsonl"
