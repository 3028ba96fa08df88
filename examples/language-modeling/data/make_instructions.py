"""Generate the small instruction-tuning dataset ``instructions.jsonl`` that sits next to this script.

The dataset is written for this project (Apache-2.0). Every answer that can be computed (arithmetic, unit
conversions, sorting, word counts) is computed here so that it is exact; the facts (capitals, antonyms, plurals,
past tenses, sentiment labels, short explanations) are hand-written tables below.

Each task type has one fixed answer format so that a small model can pick it up in a few dozen LoRA steps.

Usage:
    python examples/language-modeling/data/make_instructions.py
"""

import json
import random
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from pathlib import Path


SEED = 1234
OUTPUT_PATH = Path(__file__).resolve().parent / "instructions.jsonl"

# --------------------------------------------------------------------------------------------------------------------
# Hand-written tables
# --------------------------------------------------------------------------------------------------------------------

# Only countries with a single, uncontroversial capital.
CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Portugal", "Lisbon"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("India", "New Delhi"),
    ("Canada", "Ottawa"),
    ("Australia", "Canberra"),
    ("Brazil", "Brasilia"),
    ("Mexico", "Mexico City"),
    ("Argentina", "Buenos Aires"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Nigeria", "Abuja"),
    ("Russia", "Moscow"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
    ("Poland", "Warsaw"),
    ("Greece", "Athens"),
    ("Turkey", "Ankara"),
    ("Ireland", "Dublin"),
    ("Austria", "Vienna"),
    ("Hungary", "Budapest"),
    ("the Czech Republic", "Prague"),
    ("Belgium", "Brussels"),
    ("South Korea", "Seoul"),
    ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"),
    ("the Philippines", "Manila"),
    ("Peru", "Lima"),
    ("Chile", "Santiago"),
    ("Colombia", "Bogota"),
    ("Cuba", "Havana"),
    ("Morocco", "Rabat"),
    ("Ethiopia", "Addis Ababa"),
    ("Ghana", "Accra"),
    ("Iran", "Tehran"),
    ("Iraq", "Baghdad"),
    ("Saudi Arabia", "Riyadh"),
    ("Pakistan", "Islamabad"),
    ("Bangladesh", "Dhaka"),
    ("New Zealand", "Wellington"),
    ("Iceland", "Reykjavik"),
    ("Ukraine", "Kyiv"),
    ("Romania", "Bucharest"),
    ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"),
    ("Venezuela", "Caracas"),
    ("the United Kingdom", "London"),
    ("Ecuador", "Quito"),
    ("Uruguay", "Montevideo"),
    ("Nepal", "Kathmandu"),
    ("Estonia", "Tallinn"),
    ("Latvia", "Riga"),
    ("Lithuania", "Vilnius"),
    ("Slovakia", "Bratislava"),
    ("Slovenia", "Ljubljana"),
]

# (word, antonym); each input word has one clear opposite.
ANTONYMS = [
    ("hot", "cold"),
    ("big", "small"),
    ("fast", "slow"),
    ("happy", "sad"),
    ("up", "down"),
    ("early", "late"),
    ("full", "empty"),
    ("young", "old"),
    ("strong", "weak"),
    ("rich", "poor"),
    ("wet", "dry"),
    ("clean", "dirty"),
    ("tall", "short"),
    ("push", "pull"),
    ("win", "lose"),
    ("buy", "sell"),
    ("inside", "outside"),
    ("true", "false"),
    ("always", "never"),
    ("thick", "thin"),
    ("heavy", "light"),
    ("cheap", "expensive"),
    ("ancient", "modern"),
    ("accept", "reject"),
    ("increase", "decrease"),
    ("include", "exclude"),
    ("maximum", "minimum"),
    ("love", "hate"),
    ("north", "south"),
    ("east", "west"),
    ("top", "bottom"),
    ("above", "below"),
    ("before", "after"),
    ("first", "last"),
    ("asleep", "awake"),
    ("visible", "invisible"),
    ("possible", "impossible"),
    ("correct", "incorrect"),
]

# (singular, plural)
PLURALS = [
    ("child", "children"),
    ("mouse", "mice"),
    ("tooth", "teeth"),
    ("foot", "feet"),
    ("goose", "geese"),
    ("man", "men"),
    ("woman", "women"),
    ("person", "people"),
    ("ox", "oxen"),
    ("box", "boxes"),
    ("city", "cities"),
    ("leaf", "leaves"),
    ("knife", "knives"),
    ("wolf", "wolves"),
    ("bus", "buses"),
    ("baby", "babies"),
    ("tomato", "tomatoes"),
    ("potato", "potatoes"),
    ("hero", "heroes"),
    ("dish", "dishes"),
    ("church", "churches"),
    ("fox", "foxes"),
    ("key", "keys"),
    ("day", "days"),
    ("sheep", "sheep"),
    ("deer", "deer"),
    ("crisis", "crises"),
    ("analysis", "analyses"),
    ("phenomenon", "phenomena"),
    ("criterion", "criteria"),
    ("half", "halves"),
    ("shelf", "shelves"),
    ("life", "lives"),
    ("party", "parties"),
    ("story", "stories"),
    ("glass", "glasses"),
    ("watch", "watches"),
    ("photo", "photos"),
    ("piano", "pianos"),
    ("roof", "roofs"),
]

# (present tense sentence, past tense sentence)
PAST_TENSE = [
    ("I walk to school.", "I walked to school."),
    ("She reads a book.", "She read a book."),
    ("They play football after lunch.", "They played football after lunch."),
    ("He writes a letter to his aunt.", "He wrote a letter to his aunt."),
    ("We eat dinner at seven.", "We ate dinner at seven."),
    ("The dog runs in the park.", "The dog ran in the park."),
    ("My sister sings in a choir.", "My sister sang in a choir."),
    ("The train leaves at noon.", "The train left at noon."),
    ("I drink a cup of tea.", "I drank a cup of tea."),
    ("He drives to work.", "He drove to work."),
    ("The children swim in the lake.", "The children swam in the lake."),
    ("She buys fresh bread.", "She bought fresh bread."),
    ("We see the mountains from our window.", "We saw the mountains from our window."),
    ("The baby sleeps all afternoon.", "The baby slept all afternoon."),
    ("I forget my keys.", "I forgot my keys."),
    ("They build a small house.", "They built a small house."),
    ("The teacher explains the lesson.", "The teacher explained the lesson."),
    ("He catches the ball.", "He caught the ball."),
    ("The wind blows hard.", "The wind blew hard."),
    ("She teaches mathematics.", "She taught mathematics."),
    ("We watch a movie together.", "We watched a movie together."),
    ("The cat jumps onto the table.", "The cat jumped onto the table."),
    ("I think about the problem.", "I thought about the problem."),
    ("He is tired.", "He was tired."),
    ("They are at home.", "They were at home."),
    ("The model learns quickly.", "The model learned quickly."),
    ("She finds her glasses.", "She found her glasses."),
    ("We carry the boxes upstairs.", "We carried the boxes upstairs."),
    ("The sun rises over the hills.", "The sun rose over the hills."),
    ("My friend brings a cake.", "My friend brought a cake."),
]

POSITIVE_SENTENCES = [
    "I love this phone, it works perfectly.",
    "The food was delicious and the staff were wonderful.",
    "What a fantastic movie, I enjoyed every minute.",
    "This is the best book I have read all year.",
    "The hotel was clean, quiet and very comfortable.",
    "I am so happy with my new bike.",
    "The concert was amazing and the crowd was great.",
    "Our teacher is kind, patient and inspiring.",
    "The update made the app much faster, great job.",
    "I had a wonderful time at the party.",
    "The service was excellent and the prices were fair.",
    "This coffee tastes great.",
    "The garden looks beautiful in the spring.",
    "I highly recommend this course to everyone.",
    "The team did a brilliant job on the project.",
    "My new shoes are very comfortable and stylish.",
]

NEGATIVE_SENTENCES = [
    "I hate this phone, it crashes all the time.",
    "The food was cold and the staff were rude.",
    "What a terrible movie, I wanted to leave early.",
    "This is the worst book I have ever read.",
    "The hotel room was dirty and noisy.",
    "I am very disappointed with my new bike.",
    "The concert was boring and the sound was awful.",
    "The delivery was late and the box was broken.",
    "The update made the app slow and buggy.",
    "I had a miserable time at the party.",
    "The service was horrible and far too expensive.",
    "This coffee tastes awful.",
    "The instructions were confusing and useless.",
    "I would never recommend this course to anyone.",
    "The printer broke after two days, what a waste of money.",
    "My new shoes hurt my feet and fell apart quickly.",
]

# Sentences used for the word counting task; the counts are computed.
COUNT_SENTENCES = [
    "The cat sat on the mat.",
    "Rain fell all night.",
    "We planted three apple trees in the garden.",
    "She opened the window.",
    "Learning a new language takes time and practice.",
    "The quick brown fox jumps over the lazy dog.",
    "Please close the door.",
    "My brother works at a small bakery near the station.",
    "Birds sing in the morning.",
    "The library opens at nine.",
    "He forgot his umbrella on the bus again.",
    "Coffee helps me wake up.",
    "The river flows slowly through the quiet valley.",
    "They finished the puzzle together.",
    "A small model can still learn simple tasks.",
    "Snow covered the roofs of the old town.",
    "I like green tea.",
    "The meeting was moved to Thursday afternoon.",
    "Our neighbors have two friendly dogs and a cat.",
    "The lamp is on the desk.",
    "Every student brought a pencil and a notebook to class.",
    "The bread smells wonderful.",
    "Trains are faster than buses on this route.",
    "She painted the fence white.",
    "We walked along the beach at sunset.",
    "Attention lets tokens share information.",
    "The old bridge was repaired last summer.",
    "Water boils at one hundred degrees Celsius.",
]

# Short, modest explanations about the topics of this project.
EXPLANATIONS = [
    (
        "What does the attention mechanism do in a transformer?",
        "Attention lets each token build its new representation as a weighted sum of value vectors from other "
        "tokens, with weights given by a softmax over query-key dot products.",
    ),
    (
        "What are queries, keys and values in attention?",
        "They are three linear projections of the token representations. Queries are compared with keys to produce "
        "attention weights, and those weights are used to average the values.",
    ),
    (
        "Why are attention scores divided by the square root of the key dimension?",
        "Scaling keeps the dot products from growing with the dimension, so the softmax does not saturate and the "
        "gradients stay useful.",
    ),
    (
        "What is multi-head attention?",
        "Multi-head attention runs several attention operations in parallel on smaller projections and concatenates "
        "their outputs, so different heads can focus on different relationships.",
    ),
    (
        "What is a causal mask in a language model?",
        "A causal mask blocks each token from attending to later tokens, so the model can only use past context when "
        "predicting the next token.",
    ),
    (
        "How does the memory of standard attention grow with sequence length?",
        "Standard attention stores an N-by-N score matrix for a sequence of N tokens, so its memory grows "
        "quadratically, as O(N^2).",
    ),
    (
        "What is a KV cache?",
        "During generation, a KV cache stores the keys and values of earlier tokens, so each new token can attend to "
        "them without recomputing them.",
    ),
    (
        "What is flash attention?",
        "Flash attention is an algorithm that computes exact attention in tiles held in fast on-chip memory, so it "
        "never materializes the full N-by-N score matrix.",
    ),
    (
        "Is flash attention an approximation of attention?",
        "No. Flash attention computes exact attention; its results match standard attention up to floating-point "
        "rounding.",
    ),
    (
        "How does flash attention reduce memory use?",
        "It never stores the N-by-N score matrix, which cuts the extra memory for attention from O(N^2) to O(N) in "
        "the sequence length.",
    ),
    (
        "Why is flash attention often faster than standard attention?",
        "It fuses the attention steps into one kernel that works on tiles in fast on-chip memory, which greatly "
        "reduces slow reads and writes to main GPU memory.",
    ),
    (
        "What is the online softmax used by flash attention?",
        "Online softmax processes the scores block by block, keeping a running maximum and a running sum, and "
        "rescales earlier partial results so the final softmax is exact.",
    ),
    (
        "What does flash attention keep for the backward pass?",
        "It keeps the output and the softmax statistics for each row, and recomputes the attention scores in the "
        "backward pass instead of saving the full score matrix.",
    ),
    (
        "What is LoRA?",
        "LoRA, or Low-Rank Adaptation, freezes the pretrained weights and trains small low-rank adapter matrices "
        "added to chosen layers, so only a small fraction of parameters is updated.",
    ),
    (
        "How does LoRA change a weight matrix?",
        "LoRA adds a low-rank update B times A to a frozen weight W, where A and B have a small rank r, and scales "
        "the update by alpha divided by r.",
    ),
    (
        "Why does LoRA use less memory than full fine-tuning?",
        "Only the small adapter matrices need gradients and optimizer states, so training needs much less memory than "
        "updating every weight of the model.",
    ),
    (
        "What does the rank r control in LoRA?",
        "The rank r sets the size of the adapter matrices. A larger rank gives the adapter more capacity but adds "
        "more trainable parameters.",
    ),
    (
        "How are LoRA adapters initialized?",
        "Matrix A is initialized randomly and matrix B with zeros, so the adapter starts as a zero update and the "
        "model first behaves exactly like the base model.",
    ),
    (
        "Can LoRA adapters be merged into the base model?",
        "Yes. After training, the low-rank update can be added into the frozen weights, so inference has no extra "
        "cost.",
    ),
    (
        "Which layers is LoRA usually applied to?",
        "LoRA is usually applied to the attention projections, such as the query and value matrices, and sometimes "
        "also to the MLP layers.",
    ),
    (
        "What is parameter-efficient fine-tuning?",
        "Parameter-efficient fine-tuning adapts a pretrained model by training only a small number of new or selected "
        "parameters, while most of the original weights stay frozen.",
    ),
    (
        "What is a causal language model trained to do?",
        "A causal language model is trained to predict the next token from the tokens before it, using a "
        "cross-entropy loss.",
    ),
    (
        "What is Intel Gaudi?",
        "Gaudi is a family of AI accelerators from Intel, first developed by Habana Labs, built for training and "
        "running deep learning models.",
    ),
    (
        "What compute engines does a Gaudi accelerator have?",
        "Gaudi combines Matrix Multiplication Engines for dense matrix math with programmable Tensor Processor Cores "
        "for other operations.",
    ),
    (
        "How does PyTorch run on Gaudi?",
        "PyTorch runs on Gaudi through the Intel Gaudi software stack, which exposes the accelerator as the hpu "
        "device.",
    ),
    (
        "What is lazy mode on Gaudi?",
        "In lazy mode, operations are collected into a graph that is compiled and executed when results are needed, "
        "for example at a mark_step call.",
    ),
    (
        "How do Gaudi accelerators scale to many devices?",
        "Gaudi chips have integrated RDMA over Converged Ethernet ports, so many devices can be connected for "
        "distributed training over standard Ethernet.",
    ),
    (
        "Why use bfloat16 for training?",
        "bfloat16 keeps the same exponent range as float32 with fewer mantissa bits, so it halves memory and speeds up "
        "math while rarely overflowing.",
    ),
]

SORT_WORDS = [
    "apple",
    "banana",
    "cherry",
    "grape",
    "lemon",
    "mango",
    "orange",
    "peach",
    "pear",
    "plum",
    "river",
    "mountain",
    "forest",
    "desert",
    "island",
    "valley",
    "ocean",
    "tiger",
    "zebra",
    "horse",
    "rabbit",
    "eagle",
    "whale",
    "koala",
    "violin",
    "guitar",
    "drum",
    "flute",
    "piano",
    "table",
    "chair",
    "window",
    "lamp",
    "book",
    "yellow",
    "silver",
    "nickel",
    "jacket",
    "umbrella",
    "quilt",
]

# (source unit, target unit, factor); the factor is exact.
UNIT_CONVERSIONS = [
    ("kilometers", "meters", Fraction(1000)),
    ("meters", "centimeters", Fraction(100)),
    ("centimeters", "millimeters", Fraction(10)),
    ("meters", "kilometers", Fraction(1, 1000)),
    ("kilograms", "grams", Fraction(1000)),
    ("grams", "kilograms", Fraction(1, 1000)),
    ("liters", "milliliters", Fraction(1000)),
    ("hours", "minutes", Fraction(60)),
    ("minutes", "seconds", Fraction(60)),
    ("days", "hours", Fraction(24)),
    ("weeks", "days", Fraction(7)),
    ("feet", "inches", Fraction(12)),
    ("yards", "feet", Fraction(3)),
    ("inches", "centimeters", Fraction(254, 100)),
    ("miles", "feet", Fraction(5280)),
    ("pounds", "ounces", Fraction(16)),
]

# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def example(instruction: str, input_text: str, output: str) -> dict:
    return {"instruction": instruction, "input": input_text, "output": output}


def format_number(value: Fraction) -> str:
    """Format an exact number with a finite decimal expansion without trailing zeros."""
    decimal = Decimal(value.numerator) / Decimal(value.denominator)
    if value != Fraction(decimal):
        raise ValueError(f"{value} has no short exact decimal form")
    return format(decimal.normalize(), "f")


# --------------------------------------------------------------------------------------------------------------------
# Task generators
# --------------------------------------------------------------------------------------------------------------------


def capitals(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for country, capital in rng.sample(CAPITALS, n):
        rows.append(example(f"What is the capital of {country}?", "", f"The capital of {country} is {capital}."))
    return rows


def arithmetic(rng: random.Random, n: int) -> list[dict]:
    rows = []
    seen = set()
    ops = ["+", "-", "*", "/"]
    while len(rows) < n:
        op = ops[len(rows) % len(ops)]
        if op == "+":
            a, b = rng.randint(2, 999), rng.randint(2, 999)
            result = a + b
        elif op == "-":
            a, b = rng.randint(10, 999), rng.randint(2, 999)
            a, b = max(a, b), min(a, b)
            result = a - b
        elif op == "*":
            a, b = rng.randint(2, 99), rng.randint(2, 12)
            result = a * b
        else:
            b, result = rng.randint(2, 12), rng.randint(2, 99)
            a = b * result
        if a == b or (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        rows.append(example(f"What is {a} {op} {b}?", "", f"{a} {op} {b} = {result}"))
    return rows


def unit_conversions(rng: random.Random, n: int) -> list[dict]:
    rows = []
    seen = set()
    n_temperature = 6
    while len(rows) < n - n_temperature:
        units, target, factor = rng.choice(UNIT_CONVERSIONS)
        if factor < 1:
            value = rng.choice([250, 500, 1500, 2000, 2500, 3000, 4500, 7000, 12000])
        elif factor == Fraction(254, 100):
            value = rng.randint(2, 20)
        else:
            value = rng.randint(2, 15)
        if (value, units, target) in seen:
            continue
        seen.add((value, units, target))
        result = format_number(value * factor)
        rows.append(example(f"Convert {value} {units} to {target}.", "", f"{value} {units} = {result} {target}"))
    for celsius in rng.sample(range(-20, 105, 5), n_temperature):
        fahrenheit = format_number(Fraction(celsius) * Fraction(9, 5) + 32)
        rows.append(
            example(
                f"Convert {celsius} degrees Celsius to Fahrenheit.",
                "",
                f"{celsius} degrees Celsius = {fahrenheit} degrees Fahrenheit",
            )
        )
    return rows


def antonyms(rng: random.Random, n: int) -> list[dict]:
    return [example("Give the antonym of the word.", word, opposite) for word, opposite in rng.sample(ANTONYMS, n)]


def plurals(rng: random.Random, n: int) -> list[dict]:
    return [example("Give the plural form of the noun.", word, plural) for word, plural in rng.sample(PLURALS, n)]


def sort_words(rng: random.Random, n: int) -> list[dict]:
    rows = []
    seen = set()
    while len(rows) < n:
        words = rng.sample(SORT_WORDS, rng.randint(3, 6))
        key = tuple(sorted(words))
        if key in seen or words == sorted(words):
            continue
        seen.add(key)
        rows.append(example("Sort these words alphabetically.", ", ".join(words), ", ".join(sorted(words))))
    return rows


def sort_numbers(rng: random.Random, n: int) -> list[dict]:
    rows = []
    seen = set()
    while len(rows) < n:
        numbers = rng.sample(range(1, 100), rng.randint(3, 7))
        key = tuple(sorted(numbers))
        if key in seen or numbers == sorted(numbers):
            continue
        seen.add(key)
        rows.append(
            example(
                "Sort these numbers in ascending order.",
                ", ".join(map(str, numbers)),
                ", ".join(map(str, sorted(numbers))),
            )
        )
    return rows


def count_words(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for sentence in rng.sample(COUNT_SENTENCES, n):
        count = len(sentence.split())
        rows.append(example("Count the words in this sentence.", sentence, f"The sentence has {count} words."))
    return rows


def past_tense(rng: random.Random, n: int) -> list[dict]:
    return [
        example("Rewrite the sentence in the past tense.", present, past)
        for present, past in rng.sample(PAST_TENSE, n)
    ]


def sentiment(rng: random.Random, n: int) -> list[dict]:
    labelled = [(s, "Positive") for s in POSITIVE_SENTENCES] + [(s, "Negative") for s in NEGATIVE_SENTENCES]
    return [
        example("Classify the sentiment of the sentence as Positive or Negative.", sentence, label)
        for sentence, label in rng.sample(labelled, n)
    ]


def explanations(rng: random.Random, n: int) -> list[dict]:
    return [example(question, "", answer) for question, answer in rng.sample(EXPLANATIONS, n)]


# task name -> (generator, number of examples)
TASKS = {
    "capital": (capitals, 50),
    "arithmetic": (arithmetic, 60),
    "unit_conversion": (unit_conversions, 36),
    "antonym": (antonyms, 34),
    "plural": (plurals, 34),
    "sort_words": (sort_words, 20),
    "sort_numbers": (sort_numbers, 20),
    "count_words": (count_words, 26),
    "past_tense": (past_tense, 28),
    "sentiment": (sentiment, 30),
    "explanation": (explanations, 28),
}


def build_dataset(seed: int = SEED) -> tuple[list[dict], Counter]:
    rng = random.Random(seed)
    rows = []
    counts = Counter()
    for name, (generator, n) in TASKS.items():
        task_rows = generator(rng, n)
        assert len(task_rows) == n, name
        rows.extend(task_rows)
        counts[name] = n
    keys = [(r["instruction"], r["input"]) for r in rows]
    assert len(keys) == len(set(keys)), "duplicate prompts"
    rng.shuffle(rows)
    return rows, counts


def main() -> None:
    rows, counts = build_dataset()
    with OUTPUT_PATH.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    for name, n in counts.items():
        print(f"{name:16s} {n}")
    print(f"{'total':16s} {len(rows)}")
    print(f"wrote {OUTPUT_PATH}")


if __name__ == "__main__":
    main()
