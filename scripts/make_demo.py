"""Write `demo.jsonl`, the small instruction set shipped with lit-qlora (the fine-tuning demo).

    python scripts/make_demo.py            # rewrites lit_qlora/data/demo.jsonl, byte for byte the same
    python scripts/make_demo.py --stdout   # prints it instead

Every row is generated here from short hand-written word lists: formulaic tasks (unit conversions, arithmetic
word problems with the working shown, capitals, opposites, plurals, sorting, parity, comparisons, days and
months, spelling, temperatures, percentages, areas, polite rewrites, JSON extraction), each with exact answers
in one fixed, short answer style. A small model picks up the style within a few dozen optimizer steps, which
shows as a clear drop in validation loss."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Callable, Iterator

SEED = 20240611
OUT = Path(__file__).resolve().parents[1] / "lit_qlora" / "data" / "demo.jsonl"

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Kenya": "Nairobi", "Egypt": "Cairo",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia", "Argentina": "Buenos Aires",
    "Peru": "Lima", "Chile": "Santiago", "Australia": "Canberra", "Norway": "Oslo", "Sweden": "Stockholm",
    "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara", "Russia": "Moscow",
    "Ireland": "Dublin", "Austria": "Vienna", "Hungary": "Budapest", "Thailand": "Bangkok",
    "Vietnam": "Hanoi", "South Korea": "Seoul", "Indonesia": "Jakarta", "Morocco": "Rabat",
    "Nigeria": "Abuja", "Ghana": "Accra", "Ethiopia": "Addis Ababa", "Cuba": "Havana", "Colombia": "Bogota",
    "Denmark": "Copenhagen", "Belgium": "Brussels", "Netherlands": "Amsterdam", "Switzerland": "Bern",
    "Czechia": "Prague", "Iceland": "Reykjavik", "New Zealand": "Wellington", "Philippines": "Manila",
}
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("early", "late"), ("light", "dark"),
    ("open", "closed"), ("full", "empty"), ("strong", "weak"), ("rich", "poor"), ("young", "old"),
    ("loud", "quiet"), ("wet", "dry"), ("hard", "soft"), ("high", "low"), ("thick", "thin"), ("easy", "difficult"),
    ("clean", "dirty"), ("cheap", "expensive"), ("wide", "narrow"), ("near", "far"), ("first", "last"),
    ("begin", "end"), ("buy", "sell"), ("win", "lose"), ("push", "pull"), ("remember", "forget"),
    ("accept", "refuse"), ("arrive", "leave"), ("inside", "outside"), ("above", "below"), ("always", "never"),
    ("safe", "dangerous"), ("true", "false"), ("heavy", "light"), ("sharp", "dull"),
]
PLURALS = [
    ("mouse", "mice"), ("child", "children"), ("tooth", "teeth"), ("foot", "feet"), ("man", "men"),
    ("woman", "women"), ("person", "people"), ("goose", "geese"), ("leaf", "leaves"), ("knife", "knives"),
    ("wolf", "wolves"), ("city", "cities"), ("baby", "babies"), ("box", "boxes"), ("bus", "buses"),
    ("church", "churches"), ("potato", "potatoes"), ("hero", "heroes"), ("sheep", "sheep"), ("fish", "fish"),
    ("cactus", "cacti"), ("ox", "oxen"), ("day", "days"), ("key", "keys"), ("bench", "benches"),
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [("January", 31), ("February", 28), ("March", 31), ("April", 30), ("May", 31), ("June", 30),
          ("July", 31), ("August", 31), ("September", 30), ("October", 31), ("November", 30), ("December", 31)]
UNITS = [  # (from singular, from plural, to singular, to plural, factor)
    ("kilometer", "kilometers", "meter", "meters", 1000), ("meter", "meters", "centimeter", "centimeters", 100),
    ("kilogram", "kilograms", "gram", "grams", 1000), ("hour", "hours", "minute", "minutes", 60),
    ("minute", "minutes", "second", "seconds", 60), ("day", "days", "hour", "hours", 24),
    ("liter", "liters", "milliliter", "milliliters", 1000), ("week", "weeks", "day", "days", 7),
    ("foot", "feet", "inch", "inches", 12), ("yard", "yards", "foot", "feet", 3),
    ("centimeter", "centimeters", "millimeter", "millimeters", 10), ("year", "years", "month", "months", 12),
]
WORDS = ["apple", "river", "planet", "garden", "window", "pencil", "orange", "tiger", "bridge", "candle",
         "forest", "rocket", "silver", "basket", "dragon", "island", "jacket", "lemon", "marble", "needle",
         "ocean", "puzzle", "rabbit", "saddle", "ticket", "violin", "wallet", "yellow", "zebra", "cloud",
         "banana", "castle", "desert", "engine", "feather", "guitar", "hammer", "kettle", "ladder", "mirror"]
NAMES = ["Maria", "Ahmed", "Lena", "Tom", "Priya", "Kenji", "Sofia", "Omar", "Chloe", "Diego", "Anna", "Yusuf",
         "Mei", "Lucas", "Nora", "Ivan", "Zara", "Felix", "Amara", "Leo"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Seoul", "Dublin", "Vienna", "Hanoi", "Accra", "Prague",
          "Manila", "Havana", "Bogota", "Cairo", "Madrid"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells", "cards", "coins"]
COMMANDS = ["Close the door.", "Send me the report.", "Turn off the lights.", "Call me tomorrow.",
            "Wait here.", "Pass the salt.", "Check the numbers again.", "Bring your notes.", "Speak more slowly.",
            "Lock the gate.", "Water the plants.", "Print two copies.", "Sign this form.", "Move your car.",
            "Answer the phone.", "Clean the kitchen.", "Book a table for four.", "Read this page.",
            "Fix the broken chair.", "Feed the cat.", "Open the window.", "Take out the trash.",
            "Write down the address.", "Share the slides.", "Repeat the question.", "Hold the ladder."]


def plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def units(r: random.Random) -> Iterator[dict]:
    for _ in range(40):
        one, many, to_one, to_many, factor = r.choice(UNITS)
        n = r.randint(1, 12)
        question = r.choice([f"Convert {plural(n, one, many)} to {to_many}.",
                             f"How many {to_many} are in {plural(n, one, many)}?",
                             f"Express {plural(n, one, many)} in {to_many}."])
        yield {"instruction": question,
               "output": f"{plural(n, one, many)} = {n} × {factor} {to_many} = {plural(n * factor, to_one, to_many)}."}


def word_problems(r: random.Random) -> Iterator[dict]:
    for k in range(60):
        name, item = r.choice(NAMES), r.choice(ITEMS)
        kind = k % 4
        if kind == 0:
            a, b = r.randint(5, 60), r.randint(2, 40)
            text = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
            work, answer = f"{a} + {b} = {a + b}", a + b
        elif kind == 1:
            a = r.randint(20, 90)
            b = r.randint(2, a - 1)
            text = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
            work, answer = f"{a} - {b} = {a - b}", a - b
        elif kind == 2:
            a, b = r.randint(2, 9), r.randint(3, 12)
            text = f"{name} has {a} boxes with {b} {item} in each box. How many {item} is that in total?"
            work, answer = f"{a} × {b} = {a * b}", a * b
        else:
            b, q = r.randint(2, 8), r.randint(2, 12)
            text = f"{name} shares {b * q} {item} equally among {b} friends. How many {item} does each friend get?"
            work, answer = f"{b * q} ÷ {b} = {q}", q
        yield {"instruction": text, "output": f"{work}\nAnswer: {answer} {item}"}


def capitals(r: random.Random) -> Iterator[dict]:
    countries = sorted(CAPITALS)
    r.shuffle(countries)
    for i, country in enumerate(countries):
        city = CAPITALS[country]
        if i % 3 == 2:
            yield {"instruction": f"{city} is the capital of which country?",
                   "output": f"{city} is the capital of {country}."}
        else:
            yield {"instruction": r.choice([f"What is the capital of {country}?", f"Name the capital of {country}."]),
                   "output": f"The capital of {country} is {city}."}


def opposites(r: random.Random) -> Iterator[dict]:
    for word, opposite in OPPOSITES:
        if r.random() < 0.5:
            word, opposite = opposite, word
        yield {"instruction": r.choice([f'What is the opposite of "{word}"?', f'Give an antonym of "{word}".']),
               "output": f'The opposite of "{word}" is "{opposite}".'}


def plurals(r: random.Random) -> Iterator[dict]:
    for word, many in PLURALS:
        yield {"instruction": r.choice([f'What is the plural of "{word}"?', f'Write the plural form of "{word}".']),
               "output": f'The plural of "{word}" is "{many}".'}


def sort_numbers(r: random.Random) -> Iterator[dict]:
    for k in range(30):
        numbers = r.sample(range(1, 100), r.randint(4, 7))
        descending = k % 3 == 2
        order = "from largest to smallest" if descending else "from smallest to largest"
        result = sorted(numbers, reverse=descending)
        yield {"instruction": f"Sort these numbers {order}: {', '.join(map(str, numbers))}",
               "output": ", ".join(map(str, result))}


def sort_words(r: random.Random) -> Iterator[dict]:
    for _ in range(25):
        words = r.sample(WORDS, r.randint(3, 6))
        yield {"instruction": "Sort the following words alphabetically.", "input": ", ".join(words),
               "output": ", ".join(sorted(words))}


def parity(r: random.Random) -> Iterator[dict]:
    for n in r.sample(range(3, 200), 20):
        half, rest = divmod(n, 2)
        if rest:
            output = f"{n} is odd, because {n} = 2 × {half} + 1."
        else:
            output = f"{n} is even, because {n} = 2 × {half}."
        yield {"instruction": f"Is {n} even or odd?", "output": output}


def compare(r: random.Random) -> Iterator[dict]:
    for _ in range(20):
        a, b = r.sample(range(10, 1000), 2)
        yield {"instruction": r.choice([f"Which is larger: {a} or {b}?", f"Which number is bigger, {a} or {b}?"]),
               "output": f"{max(a, b)} is larger than {min(a, b)}."}


def calendar(r: random.Random) -> Iterator[dict]:
    for k in range(24):
        if k % 3 == 0:
            i = r.randrange(7)
            yield {"instruction": f"What day comes after {DAYS[i]}?",
                   "output": f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}."}
        elif k % 3 == 1:
            i = r.randrange(12)
            yield {"instruction": f"What month comes before {MONTHS[i][0]}?",
                   "output": f"The month before {MONTHS[i][0]} is {MONTHS[i - 1][0]}."}
        else:
            month, days = MONTHS[r.randrange(12)]
            note = " (29 in a leap year)" if month == "February" else ""
            yield {"instruction": f"How many days are there in {month}?", "output": f"{month} has {days} days{note}."}


def spelling(r: random.Random) -> Iterator[dict]:
    for word in r.sample(WORDS, 20):
        question = r.choice([f'How many letters are in the word "{word}"?', f'Spell "{word}" letter by letter.'])
        yield {"instruction": question,
               "output": f'"{word}" has {len(word)} letters: {"-".join(word)}.'}


def temperatures(r: random.Random) -> Iterator[dict]:
    for c in r.sample(range(-20, 45, 5), 13):
        f = c * 9 // 5 + 32
        yield {"instruction": f"Convert {c} °C to Fahrenheit.",
               "output": f"{c} × 9/5 + 32 = {f}, so {c} °C is {f} °F."}


def percentages(r: random.Random) -> Iterator[dict]:
    for _ in range(20):
        p = r.choice([10, 20, 25, 50, 75, 5, 40])
        n = r.choice([20, 40, 60, 80, 100, 120, 200, 300, 400, 500])
        yield {"instruction": f"What is {p}% of {n}?", "output": f"{p}% of {n} = {n} × {p} / 100 = {n * p // 100}."}


def areas(r: random.Random) -> Iterator[dict]:
    for _ in range(15):
        a, b = r.randint(2, 15), r.randint(2, 15)
        yield {"instruction": f"A rectangle is {a} m long and {b} m wide. What is its area?",
               "output": f"Area = {a} × {b} = {a * b} square meters."}


def polite(r: random.Random) -> Iterator[dict]:
    for command in COMMANDS:
        request = command[0].lower() + command[1:-1]
        yield {"instruction": "Rewrite this command as a polite request.", "input": command,
               "output": f"Could you please {request}?"}


def extract_json(r: random.Random) -> Iterator[dict]:
    for _ in range(25):
        name, age, city = r.choice(NAMES), r.randint(18, 80), r.choice(CITIES)
        sentence = r.choice([f"{name} is {age} years old and lives in {city}.",
                             f"Living in {city}, {name} turned {age} this year.",
                             f"{name}, age {age}, moved to {city} last spring."])
        yield {"instruction": "Extract the name, age and city as JSON.", "input": sentence,
               "output": json.dumps({"name": name, "age": age, "city": city})}


TASKS: list[Callable[[random.Random], Iterator[dict]]] = [
    units, word_problems, capitals, opposites, plurals, sort_numbers, sort_words, parity, compare, calendar,
    spelling, temperatures, percentages, areas, polite, extract_json,
]


def make_rows(seed: int = SEED) -> list[dict]:
    r = random.Random(seed)
    rows, seen = [], set()
    for task in TASKS:
        for row in task(r):
            key = (row["instruction"], row.get("input", ""))
            if key not in seen:  # the same question twice would leak between train and validation
                seen.add(key)
                rows.append(row)
    r.shuffle(rows)
    return rows


def main() -> None:
    rows = make_rows()
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if "--stdout" in sys.argv[1:]:  # lets a test compare without touching the shipped file
        sys.stdout.write(text)
        return
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {len(rows)} rows to {OUT}")


if __name__ == "__main__":
    main()
