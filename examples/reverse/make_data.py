"""Writes words.csv, the dataset of this example: 600 made-up three-letter words and their reversal.

Run it again to remake the file (it is deterministic: seed 0). `python make_data.py`
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

LETTERS = "abcdefghij"


def main() -> None:
    rng = random.Random(0)
    words = sorted({"".join(rng.choice(LETTERS) for _ in range(3)) for _ in range(2000)})[:600]
    rng.shuffle(words)
    with (Path(__file__).parent / "words.csv").open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["word", "reversed"])
        for w in words:
            out.writerow([f"{w}>", w[::-1]])


if __name__ == "__main__":
    main()
