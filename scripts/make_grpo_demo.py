"""Write `grpo_demo.jsonl`, the verifiable task shipped with lit-qlora (the `litqlora grpo` demo).

    python scripts/make_grpo_demo.py            # rewrites lit_qlora/data/grpo_demo.jsonl and grpo_sft_demo.jsonl
    python scripts/make_grpo_demo.py --stdout   # prints the GRPO prompts instead

Small sums and differences, each a conversational prompt that asks for the result inside <answer></answer> tags
(a format SmolLM2-135M-Instruct does not follow on its own), with the result in an `answer` column: the built-in
rewards `answer_match` and `format` score a completion without any model. Deterministic (a fixed seed), shuffled
with it.

`grpo_sft_demo.jsonl` holds other questions of the same kind with a reply in the asked form (`<answer>N</answer>`):
a short SFT on it shows the model the format (the base never writes the tag, so a group of its completions would all
score 0 for it: nothing to learn from), and GRPO then raises how often it is followed and right.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 20261129
DATA = Path(__file__).resolve().parents[1] / "lit_qlora" / "data"
OUT, SFT_OUT = DATA / "grpo_demo.jsonl", DATA / "grpo_sft_demo.jsonl"
ROWS, SFT_ROWS = 320, 96
ASK = "Put only the final number inside <answer></answer>."
QUESTIONS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?", "Calculate {a} {op} {b}.")


def rows(count: int = ROWS + SFT_ROWS) -> list[dict]:
    """The task's rows: the first ROWS are GRPO's prompts, the rest the SFT rows' questions (no question twice)."""
    rng = random.Random(SEED)
    seen, out = set(), []
    while len(out) < count:
        op = rng.choice("+-")
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        if op == "-" and b > a:
            a, b = b, a
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        question = rng.choice(QUESTIONS).format(a=a, op=op, b=b)
        out.append({"prompt": [{"role": "user", "content": f"{question} {ASK}"}],
                    "answer": str(a + b if op == "+" else a - b)})
    return out


def render() -> str:
    return "".join(json.dumps(row) + "\n" for row in rows()[:ROWS])


def render_sft() -> str:
    return "".join(json.dumps({"messages": [*row["prompt"], {"role": "assistant",
                                                             "content": f"<answer>{row['answer']}</answer>"}]}) + "\n"
                   for row in rows()[ROWS:])


if __name__ == "__main__":
    if "--stdout" in sys.argv:
        sys.stdout.write(render())
    else:
        OUT.write_text(render(), encoding="utf-8")
        SFT_OUT.write_text(render_sft(), encoding="utf-8")
