"""The flash_mc items: simple multiple-choice questions written for this project (Apache-2.0), and their loader.

The items are made from templates (arithmetic, number ordering, opposites, capitals, sequences, plurals) with a
fixed seed and stored in `flash_mc.jsonl` beside this file, so the task never needs a network and its data never
changes under a user. `python flash_mc_items.py` writes the file again; the tests check it is the same.
`load_dataset` is the task's `custom_dataset` (see flash_mc.yaml): lm-eval calls it with the task's metadata.
"""

import json
import random
from pathlib import Path
from typing import Any


ITEMS_PATH = Path(__file__).with_name("flash_mc.jsonl")
SEED = 20260118
SPLIT_SIZES = {"test": 250, "train": 20}  # train: the few-shot examples (--num_fewshot)

OPPOSITES = [
    ("hot", "cold"),
    ("big", "small"),
    ("tall", "short"),
    ("fast", "slow"),
    ("early", "late"),
    ("light", "dark"),
    ("open", "closed"),
    ("full", "empty"),
    ("happy", "sad"),
    ("hard", "soft"),
    ("wet", "dry"),
    ("old", "young"),
    ("rich", "poor"),
    ("strong", "weak"),
    ("loud", "quiet"),
    ("thick", "thin"),
    ("high", "low"),
    ("near", "far"),
    ("clean", "dirty"),
    ("sharp", "blunt"),
    ("first", "last"),
    ("inside", "outside"),
    ("up", "down"),
    ("left", "right"),
    ("day", "night"),
    ("north", "south"),
    ("east", "west"),
    ("begin", "end"),
    ("buy", "sell"),
    ("win", "lose"),
    ("push", "pull"),
    ("give", "take"),
    ("true", "false"),
    ("sweet", "sour"),
    ("brave", "afraid"),
    ("deep", "shallow"),
    ("wide", "narrow"),
    ("cheap", "expensive"),
    ("friend", "enemy"),
    ("arrive", "leave"),
]
CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Portugal", "Lisbon"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Canada", "Ottawa"),
    ("Australia", "Canberra"),
    ("Argentina", "Buenos Aires"),
    ("Mexico", "Mexico City"),
    ("Russia", "Moscow"),
    ("India", "New Delhi"),
    ("Greece", "Athens"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
    ("Poland", "Warsaw"),
    ("Austria", "Vienna"),
    ("Hungary", "Budapest"),
    ("Ireland", "Dublin"),
    ("Belgium", "Brussels"),
    ("Peru", "Lima"),
    ("Chile", "Santiago"),
    ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"),
    ("South Korea", "Seoul"),
    ("Turkey", "Ankara"),
    ("Iran", "Tehran"),
    ("Morocco", "Rabat"),
    ("Nigeria", "Abuja"),
    ("Ethiopia", "Addis Ababa"),
    ("Cuba", "Havana"),
    ("the Czech Republic", "Prague"),
    ("Ukraine", "Kyiv"),
    ("the Philippines", "Manila"),
    ("New Zealand", "Wellington"),
]
PLURALS = [
    ("mouse", "mice"),
    ("child", "children"),
    ("foot", "feet"),
    ("tooth", "teeth"),
    ("man", "men"),
    ("woman", "women"),
    ("goose", "geese"),
    ("person", "people"),
    ("knife", "knives"),
    ("leaf", "leaves"),
    ("wolf", "wolves"),
    ("box", "boxes"),
    ("city", "cities"),
    ("baby", "babies"),
    ("bus", "buses"),
    ("cat", "cats"),
    ("dog", "dogs"),
    ("book", "books"),
    ("church", "churches"),
    ("potato", "potatoes"),
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December",
]  # fmt: skip


def _item(rng: random.Random, category: str, question: str, answer: str, wrong: list[str]) -> dict[str, Any]:
    """Four distinct choices in a random order; `answer` is the index of the correct one."""
    distractors = list(dict.fromkeys(choice for choice in wrong if choice != answer))
    choices = [answer, *rng.sample(distractors, 3)]
    rng.shuffle(choices)
    return {"category": category, "question": question, "choices": choices, "answer": choices.index(answer)}


def _numbers_near(rng: random.Random, value: int, spread: int) -> list[str]:
    """Plausible wrong numbers: close to the answer, never negative."""
    candidates = {value + delta for delta in range(-spread, spread + 1) if delta} | {value + 10, value - 10}
    return [str(number) for number in sorted(candidates) if number >= 0]


def _arithmetic(rng: random.Random) -> dict[str, Any]:
    operation = rng.choice(["plus", "minus", "times"])
    if operation == "times":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        value = a * b
    else:
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        if operation == "minus" and b > a:
            a, b = b, a
        value = a + b if operation == "plus" else a - b
    return _item(rng, "arithmetic", f"What is {a} {operation} {b}?", str(value), _numbers_near(rng, value, 3))


def _ordering(rng: random.Random) -> dict[str, Any]:
    numbers = rng.sample(range(1, 100), 4)
    extreme = rng.choice(["largest", "smallest"])
    answer = max(numbers) if extreme == "largest" else min(numbers)
    listed = ", ".join(str(number) for number in numbers)
    question = f"Which of the numbers {listed} is the {extreme}?"
    return _item(rng, "ordering", question, str(answer), [str(number) for number in numbers])


def _opposite(rng: random.Random) -> dict[str, Any]:
    word, opposite = rng.choice(OPPOSITES)
    if rng.random() < 0.5:
        word, opposite = opposite, word
    others = [item for pair in OPPOSITES for item in pair if item not in (word, opposite)]
    return _item(rng, "opposites", f"What is the opposite of '{word}'?", opposite, others)


def _capital(rng: random.Random) -> dict[str, Any]:
    country, capital = rng.choice(CAPITALS)
    others = [city for _, city in CAPITALS if city != capital]
    return _item(rng, "capitals", f"What is the capital of {country}?", capital, others)


def _sequence(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["day", "month", "letter"])
    if kind == "day":
        names, index = DAYS, rng.randrange(len(DAYS))
    elif kind == "month":
        names, index = MONTHS, rng.randrange(len(MONTHS))
    else:
        names, index = [chr(code) for code in range(ord("A"), ord("Z") + 1)], rng.randrange(25)
    answer = names[(index + 1) % len(names)]
    return _item(rng, "sequences", f"Which {kind} comes right after {names[index]}?", answer, names)


def _plural(rng: random.Random) -> dict[str, Any]:
    word, plural = rng.choice(PLURALS)
    wrong = [word + "s", word + "es", word, plural + "s", word + "en", plural + "es"]
    return _item(rng, "plurals", f"What is the plural of '{word}'?", plural, wrong)


TEMPLATES = (_arithmetic, _ordering, _opposite, _capital, _sequence, _plural)


def generate_items(seed: int = SEED) -> list[dict[str, Any]]:
    """The whole set: distinct questions, the templates taking turns, the test split first, then the train split."""
    rng = random.Random(seed)
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    attempts = 0
    for split, size in SPLIT_SIZES.items():
        count = 0
        while count < size:
            item = TEMPLATES[attempts % len(TEMPLATES)](rng)
            attempts += 1
            if item["question"] in seen:  # a repeat; small templates (plurals, capitals) run out first
                continue
            seen.add(item["question"])
            items.append({"id": f"{split}-{count:03d}", "split": split, **item})
            count += 1
    return items


def items_text(items: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)


def load_dataset(**metadata: Any) -> Any:
    """The task's DatasetDict (test and train splits) from the shipped file; lm-eval passes its metadata, unused."""
    import datasets

    items = [json.loads(line) for line in ITEMS_PATH.read_text(encoding="utf-8").splitlines() if line]
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_list([item for item in items if item["split"] == split])
            for split in SPLIT_SIZES
        }
    )


if __name__ == "__main__":
    ITEMS_PATH.write_text(items_text(generate_items()), encoding="utf-8")
    print(f"Wrote {ITEMS_PATH}")
