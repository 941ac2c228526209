"""Generate the two sample data sets deterministically: `python data_samples/make_samples.py`.

generation.jsonl      instruction -> response, three turns per conversation (group = conversation)
classification.jsonl  short texts with a class name, an author (group) and a timestamp
classification_labels.json  the explicit class name -> id map
"""

import json
import random
from datetime import datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"


def word(rng: random.Random) -> str:
    return "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.randint(2, 3)))


def generation(conversations: int = 1450, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    rows, used = [], set()
    for c in range(conversations):
        w = word(rng)
        while w in used:  # one word per conversation, so no input repeats across groups
            w = word(rng)
        used.add(w)
        turns = [("upper", w.upper()), ("reverse", w[::-1]), ("repeat", f"{w} {w}")]
        rng.shuffle(turns)
        for t, (op, response) in enumerate(turns):
            rows.append({"id": f"g{c:05d}-{t}", "conversation": f"conv{c:05d}",
                         "instruction": f"{op}: {w}", "response": response})
    return rows


TOPICS = {
    "weather": ["rain", "storm", "sunny", "forecast", "wind", "cloudy", "snow", "humid"],
    "sports": ["match", "goal", "team", "score", "coach", "league", "player", "season"],
    "finance": ["market", "stock", "price", "bank", "loan", "profit", "shares", "budget"],
    "cooking": ["recipe", "oven", "garlic", "simmer", "flour", "bake", "sauce", "spice"],
    "recall": ["recall", "defect", "unsafe", "withdrawn", "hazard", "refund"],  # the rare class
}
FILLER = ["today", "the", "new", "local", "report", "says", "again", "very", "our", "this",
          "week", "big", "after", "news", "people", "city"]


def classification(n: int = 2400, authors: int = 240, seed: int = 11) -> list[dict]:
    rng = random.Random(seed)
    common = [name for name in TOPICS if name != "recall"]
    start = datetime(2024, 1, 1)
    rows, used = [], set()
    for i in range(n):
        label = "recall" if rng.random() < 0.04 else rng.choice(common)
        text = ""
        while not text or text in used:  # unique texts: a repeat could cross splits
            words = rng.sample(TOPICS[label], 2) + rng.sample(FILLER, rng.randint(3, 6))
            rng.shuffle(words)
            text = " ".join(words)
        used.add(text)
        stamp = start + timedelta(minutes=rng.randint(0, 60 * 24 * 365))
        rows.append({"id": f"c{i:05d}", "author": f"author{rng.randrange(authors):03d}",
                     "timestamp": stamp.isoformat(timespec="minutes"),
                     "text": text, "label": label})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


if __name__ == "__main__":
    write_jsonl(HERE / "generation.jsonl", generation())
    write_jsonl(HERE / "classification.jsonl", classification())
    labels = {name: i for i, name in enumerate(sorted(TOPICS))}
    (HERE / "classification_labels.json").write_text(json.dumps(labels, indent=1) + "\n")
    print("wrote", *(p.name for p in sorted(HERE.glob("*.json*"))))
