"""Write `preference_demo.jsonl`, the small preference set shipped with lit-qlora (the `litqlora dpo` demo).

    python scripts/make_preference_demo.py            # rewrites lit_qlora/data/preference_demo.jsonl, byte for byte
    python scripts/make_preference_demo.py --stdout   # prints it instead

One explicit pair per row of `demo.jsonl` (see scripts/make_demo.py): `prompt` is the row's instruction (and, after a
blank line, its input), `chosen` its exact short answer, and `rejected` either

- a WRONG answer in the very sentence template of the right one and about its length (another capital, a number off
  by a plausible slip, odd and even swapped, a misspelling, the wrong opposite, numbers mis-sorted, ...), for about
  70% of the rows: told apart from the chosen one only by being wrong; or
- a RAMBLING one: the right answer buried in filler and hedging, for the rest: the fine-tune's terse style is preferred.

Deterministic (a fixed seed), and shuffled with it.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from typing import Callable, Optional

from make_demo import CAPITALS, CITIES, DAYS, MONTHS, NAMES, OPPOSITES

SEED = 20250301
DATA = Path(__file__).resolve().parents[1] / "lit_qlora" / "data"
DEMO, OUT = DATA / "demo.jsonl", DATA / "preference_demo.jsonl"
RAMBLING_SHARE = 0.3
ALWAYS_WRONG = ("What is the capital of Austria?", "Name the capital of Austria.")  # the demo's before/after prompt

# The regular-looking plural a learner would guess, for each of make_demo's PLURALS.
WRONG_PLURALS = {
    "mouse": "mouses", "child": "childs", "tooth": "tooths", "foot": "foots", "man": "mans", "woman": "womans",
    "person": "persons", "goose": "gooses", "leaf": "leafs", "knife": "knifes", "wolf": "wolfs", "city": "citys",
    "baby": "babys", "box": "boxs", "bus": "buss", "church": "churchs", "potato": "potatos", "hero": "heros",
    "sheep": "sheeps", "fish": "fishes", "cactus": "cactuses", "ox": "oxes", "day": "daies", "key": "keies",
    "bench": "benchs",
}
PREAMBLES = [
    "Good question! Let me think about this carefully before I answer.",
    "Hmm, this is the kind of question people often get wrong, so let me be careful here.",
    "I'm not completely sure about this one, but I believe the answer is the following.",
    "Sure! Here is what I think, although you may want to check it somewhere else.",
    "Well, there are a few ways to look at this, and it depends a little on how you read the question.",
]
AFTERTHOUGHTS = [
    "I hope that helps! Let me know if you have any other questions.",
    "Then again, I could be mistaken, so please double-check this before relying on it.",
    "There are other ways to think about it, of course, but that is what I would say.",
    "Does that make sense? I can explain it in more detail if you like.",
    "At least, that is my understanding; sources sometimes disagree on details like this.",
]

Wrong = Callable[[re.Match, random.Random], str]


def other(r: random.Random, options, *exclude) -> str:
    return r.choice([o for o in sorted(set(options)) if o not in exclude])


def slip(r: random.Random, value: int, deltas=(-10, -2, -1, 1, 2, 10), least: int = 0) -> int:
    """A plausible arithmetic slip: `value` off by one of `deltas`, never below `least`."""
    return value + r.choice([d for d in deltas if value + d >= least])


def swap_neighbours(r: random.Random, items: list[str]) -> list[str]:
    i = r.randrange(len(items) - 1)
    return items[:i] + [items[i + 1], items[i]] + items[i + 2:]


def units(m: re.Match, r: random.Random) -> str:
    n, factor = int(m[3]), int(m[4])
    if r.random() < 0.5:  # the wrong conversion factor, worked through consistently
        factor = other(r, [3, 7, 10, 12, 24, 60, 100, 1000], factor)
        return f"{m[1]} {m[2]} = {n} × {factor} {m[5]} = {n * factor} {m[7]}."
    return f"{m[1]} {m[2]} = {n} × {factor} {m[5]} = {slip(r, n * factor, (-factor, factor), least=2)} {m[7]}."


def word_problem(m: re.Match, r: random.Random) -> str:
    wrong = slip(r, int(m[4]), least=1)
    return f"{m[1]} {m[2]} {m[3]} = {wrong}\nAnswer: {wrong} {m[6]}"


def capital_city(m: re.Match, r: random.Random) -> str:
    return f"The capital of {m[1]} is {other(r, CAPITALS.values(), m[2])}."


def capital_country(m: re.Match, r: random.Random) -> str:
    return f"{m[1]} is the capital of {other(r, CAPITALS, m[2])}."


def opposite(m: re.Match, r: random.Random) -> str:
    return f'The opposite of "{m[1]}" is "{other(r, [w for pair in OPPOSITES for w in pair], m[1], m[2])}".'


def plural(m: re.Match, r: random.Random) -> str:
    return f'The plural of "{m[1]}" is "{WRONG_PLURALS[m[1]]}".'


def mis_sorted(m: re.Match, r: random.Random) -> str:
    return ", ".join(swap_neighbours(r, m[0].split(", ")))


def parity(m: re.Match, r: random.Random) -> str:
    n = int(m[1])
    if m[2] == "odd":
        return f"{n} is even, because {n} = 2 × {(n + 1) // 2}."
    return f"{n} is odd, because {n} = 2 × {n // 2} + 1."


def larger(m: re.Match, r: random.Random) -> str:
    return f"{m[2]} is larger than {m[1]}."


def day_after(m: re.Match, r: random.Random) -> str:
    i = DAYS.index(m[1])
    return f"The day after {m[1]} is {DAYS[(i + r.choice([-1, 2])) % 7]}."


def month_before(m: re.Match, r: random.Random) -> str:
    names = [name for name, _ in MONTHS]
    i = names.index(m[1])
    return f"The month before {m[1]} is {names[(i + r.choice([1, -2])) % 12]}."


def month_days(m: re.Match, r: random.Random) -> str:
    return f"{m[1]} has {({31: 30, 30: 31, 28: 30})[int(m[2])]} days{m[3]}."


def misspelled(m: re.Match, r: random.Random) -> str:
    letters = list(m[1])
    how = r.choice(["drop", "double", "swap"])
    i = r.randrange(len(letters) - 1)
    if how == "swap" and letters[i] != letters[i + 1]:
        letters[i], letters[i + 1] = letters[i + 1], letters[i]
    elif how == "double":
        letters.insert(i, letters[i])
    else:
        del letters[i]
    return f'"{m[1]}" has {len(letters)} letters: {"-".join(letters)}.'


def fahrenheit(m: re.Match, r: random.Random) -> str:
    f = slip(r, int(m[2]), (-10, -4, -2, 2, 4, 10), least=-100)
    return f"{m[1]} × 9/5 + 32 = {f}, so {m[3]} °C is {f} °F."


def percentage(m: re.Match, r: random.Random) -> str:
    p, n, value = int(m[1]), int(m[2]), int(m[5])
    slips = (value * 2, value // 2, value + n // 10, value - n // 10, n * p // 10)  # x2, /2, +-10% of n, x10
    wrong = other(r, [v for v in slips if v > 0], value)
    return f"{p}% of {n} = {n} × {p} / 100 = {wrong}."


def area(m: re.Match, r: random.Random) -> str:
    a, b, ab = int(m[1]), int(m[2]), int(m[3])
    return f"Area = {a} × {b} = {other(r, [2 * (a + b), ab + a, ab - b, ab + 10], ab)} square meters."


def polite(requests: list[str]) -> Wrong:
    return lambda m, r: f"Could you please {other(r, requests, m[1])}?"


def extracted(m: re.Match, r: random.Random) -> str:
    record = json.loads(m[0])
    field = r.choice(["name", "age", "city"])
    if field == "age":
        record["age"] = slip(r, record["age"], (-10, -5, -1, 1, 5, 10))
    else:
        record[field] = other(r, NAMES if field == "name" else CITIES, record[field])
    return json.dumps(record)


def wrong_answers(rows: list[dict]) -> list[tuple[re.Pattern, Wrong]]:
    """Each answer template of the demo set, and how to get a wrong answer in it."""
    requests = [m[1] for row in rows if (m := re.match(r"Could you please (.+)\?$", row["output"]))]
    return [(re.compile(pattern, re.S), wrong) for pattern, wrong in [
        (r"^(\d+) (\w+) = (\d+) × (\d+) (\w+) = (\d+) (\w+)\.$", units),
        (r"^(\d+) ([-+×÷]) (\d+) = (\d+)\nAnswer: (\d+) (\w+)$", word_problem),
        (r"^The capital of (.+) is (.+)\.$", capital_city),
        (r"^(.+) is the capital of (.+)\.$", capital_country),
        (r'^The opposite of "(.+)" is "(.+)"\.$', opposite),
        (r'^The plural of "(.+)" is "(.+)"\.$', plural),
        (r"^\d+(, \d+)+$", mis_sorted),
        (r"^[a-z]+(, [a-z]+)+$", mis_sorted),
        (r"^(\d+) is (odd|even), because ", parity),
        (r"^(\d+) is larger than (\d+)\.$", larger),
        (r"^The day after (\w+) is (\w+)\.$", day_after),
        (r"^The month before (\w+) is (\w+)\.$", month_before),
        (r"^(\w+) has (\d+) days(.*)\.$", month_days),
        (r'^"(\w+)" has (\d+) letters: ([a-z-]+)\.$', misspelled),
        (r"^(-?\d+) × 9/5 \+ 32 = (-?\d+), so (-?\d+) °C is (-?\d+) °F\.$", fahrenheit),
        (r"^(\d+)% of (\d+) = (\d+) × (\d+) / 100 = (\d+)\.$", percentage),
        (r"^Area = (\d+) × (\d+) = (\d+) square meters\.$", area),
        (r"^Could you please (.+)\?$", polite(requests)),
        (r"^\{.*\}$", extracted),
    ]]


def wrong_answer(output: str, templates: list[tuple[re.Pattern, Wrong]], r: random.Random) -> str:
    for pattern, wrong in templates:
        if (m := pattern.match(output)):
            return wrong(m, r)
    raise ValueError(f"no wrong-answer template matches the demo answer {output!r}: add one to wrong_answers()")


def rambling(output: str, r: random.Random) -> str:
    """The right answer buried in filler: a preamble, an afterthought or both, hedging it."""
    sep = " " if output.endswith((".", "?")) and "\n" not in output else "\n\n"  # lists, JSON, working: apart
    parts = {0: [r.choice(PREAMBLES), output], 1: [output, r.choice(AFTERTHOUGHTS)],
             2: [r.choice(PREAMBLES), output, r.choice(AFTERTHOUGHTS)]}[r.randrange(3)]
    return sep.join(parts)


def make_pairs(seed: int = SEED, demo: Optional[Path] = None) -> list[dict]:
    rows = [json.loads(line) for line in (demo or DEMO).read_text(encoding="utf-8").splitlines() if line.strip()]
    templates = wrong_answers(rows)
    r = random.Random(seed)
    pairs = []
    for row in rows:
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        ramble = r.random() < RAMBLING_SHARE and prompt not in ALWAYS_WRONG
        rejected = rambling(row["output"], r) if ramble else wrong_answer(row["output"], templates, r)
        assert rejected != row["output"], row
        pairs.append({"prompt": prompt, "chosen": row["output"], "rejected": rejected})
    r.shuffle(pairs)
    return pairs


def main() -> None:
    pairs = make_pairs()
    text = "".join(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs)
    if "--stdout" in sys.argv[1:]:  # lets a test compare without touching the shipped file
        sys.stdout.write(text)
        return
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {len(pairs)} pairs to {OUT}")


if __name__ == "__main__":
    main()
