"""Ways a streamed text can arrive: the splits a streaming parser must treat alike (whole, a
character at a time, cut at every point, seeded random pieces, with empty deltas among them as
a token that decodes to nothing yet gives)."""

from __future__ import annotations

import random
from collections.abc import Iterator


def chunkings(text: str, seed: int, rounds: int = 30, longest: int = 8) -> Iterator[list[str]]:
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(rounds):
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, longest)
            chunks.append(text[i:i + n])
            i += n
        yield chunks + [""]
    if len(text) > 3:
        yield [text[:2], "", text[2:]]
