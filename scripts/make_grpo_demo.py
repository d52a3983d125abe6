"""Write `grpo_demo.jsonl`, the verifiable task shipped with lit-qlora (the `litqlora grpo` demo).

    python scripts/make_grpo_demo.py            # rewrites lit_qlora/data/grpo_demo.jsonl, byte for byte
    python scripts/make_grpo_demo.py --stdout   # prints it instead

Small sums and differences, each a conversational prompt that asks for the result inside <answer></answer> tags
(a format SmolLM2-135M-Instruct does not follow on its own), with the result in an `answer` column: the built-in
rewards `answer_match` and `format` score a completion without any model. Deterministic (a fixed seed), shuffled
with it.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 20261129
OUT = Path(__file__).resolve().parents[1] / "lit_qlora" / "data" / "grpo_demo.jsonl"
ROWS = 320
ASK = "Put only the final number inside <answer></answer>."
QUESTIONS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?", "Calculate {a} {op} {b}.")


def rows() -> list[dict]:
    rng = random.Random(SEED)
    seen, out = set(), []
    while len(out) < ROWS:
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
    return "".join(json.dumps(row) + "\n" for row in rows())


if __name__ == "__main__":
    if "--stdout" in sys.argv:
        sys.stdout.write(render())
    else:
        OUT.write_text(render(), encoding="utf-8")
