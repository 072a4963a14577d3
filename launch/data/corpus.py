"""A small generated English-like corpus (no network) for tests and the README example.

    python -m launch.data.corpus OUT.jsonl [--docs N] [--seed S]

Writes JSON-lines, one document per line (`{"text": ...}`): short stories made from a seeded
grammar (subjects, verbs, objects, places, numbers and punctuation), so a BPE has words to merge
and a small model has structure to learn. The same (docs, seed) gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import List

NAMES = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Ken", "Margaret", "Linus", "Frances"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "rabbit", "sparrow", "otter", "badger", "heron"]
ADJECTIVES = ["quick", "lazy", "brown", "quiet", "clever", "small", "old", "bright", "patient", "curious"]
VERBS = ["sees", "follows", "finds", "watches", "meets", "helps", "chases", "greets", "remembers", "counts"]
PLACES = ["the river", "the old mill", "a green field", "the library", "the market", "the hill", "the station",
          "a narrow bridge", "the garden", "the harbour"]
TIMES = ["In the morning", "At noon", "Later that day", "In the evening", "Before dawn", "After the rain"]
OBJECTS = ["a red apple", "three stones", "an open book", "the lantern", "a silver key", "the letter", "two boats"]


def _subject(r: random.Random) -> str:
    if r.random() < 0.4:
        return r.choice(NAMES)
    return f"the {r.choice(ADJECTIVES)} {r.choice(ANIMALS)}"


def _sentence(r: random.Random) -> str:
    kind = r.random()
    if kind < 0.35:
        s = f"{_subject(r)} {r.choice(VERBS)} {_subject(r)} near {r.choice(PLACES)}."
    elif kind < 0.6:
        s = f"{r.choice(TIMES)}, {_subject(r)} carries {r.choice(OBJECTS)} to {r.choice(PLACES)}."
    elif kind < 0.8:
        n = r.randint(2, 99)
        s = f"{_subject(r)} counts {n} {r.choice(ANIMALS)}s, then {n + r.randint(1, 9)}."
    else:
        s = f'"Where is {r.choice(OBJECTS)}?" asks {r.choice(NAMES)}; {_subject(r)} {r.choice(VERBS)} nobody.'
    return s[0].upper() + s[1:]


def document(seed: int, index: int) -> str:
    r = random.Random(f"{seed}/{index}")
    paragraphs: List[str] = []
    for _ in range(r.randint(1, 4)):
        paragraphs.append(" ".join(_sentence(r) for _ in range(r.randint(2, 7))))
    return f"Story {index}\n\n" + "\n\n".join(paragraphs) + "\n"


def write(out: str | Path, docs: int = 2000, seed: int = 0) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for i in range(docs):
            f.write(json.dumps({"text": document(seed, i)}, ensure_ascii=False) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m launch.data.corpus", description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    p = write(a.out, a.docs, a.seed)
    print(f"wrote {a.docs} documents ({p.stat().st_size:,} bytes) to {p}")


if __name__ == "__main__":
    main()
