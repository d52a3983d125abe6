"""Write lit_qlora/data/kto_demo.jsonl, the demo rows of `litqlora kto`, from the preference demo: each pair gives one
unpaired row, alternately its right answer (label true) and its wrong one (false), so every prompt appears once, as
in a log of thumbs-up/down feedback, and the split's held-out prompts are never trained on."""

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "lit_qlora" / "data"

if __name__ == "__main__":
    pairs = [json.loads(line) for line in (DATA / "preference_demo.jsonl").read_text(encoding="utf-8").splitlines()]
    with open(DATA / "kto_demo.jsonl", "w", encoding="utf-8") as f:
        for i, pair in enumerate(pairs):
            good = i % 2 == 0
            row = {"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"Wrote {len(pairs)} rows to {DATA / 'kto_demo.jsonl'}")
