"""Realistic English sentences of mixed length, for demos and benchmarks (deterministic).

Sentences are built from a few hundred common words in grammatical templates, 5 to 60
words long, in topics that give an embedding model real structure to find (sentences on
the same topic are closer to each other than to the rest).
"""

from __future__ import annotations

import random

__all__ = ["TOPICS", "labelled_sentences", "sentences"]

TOPICS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "cooking": (
        ["the chef", "my grandmother", "a home cook", "the baker", "our neighbour"],
        ["roasted", "simmered", "seasoned", "baked", "chopped", "served", "tasted"],
        [
            "fresh tomatoes",
            "a loaf of sourdough bread",
            "garlic and onions",
            "the vegetable soup",
            "a chocolate cake",
            "pasta with basil",
            "the spicy curry",
            "grilled salmon",
        ],
    ),
    "weather": (
        ["the storm", "a cold front", "the summer heat", "heavy rain", "the morning fog"],
        ["flooded", "covered", "swept across", "cooled", "delayed", "battered", "darkened"],
        [
            "the coastal towns",
            "the valley",
            "the city streets",
            "the mountain pass",
            "the harbour",
            "the farmland",
            "the airport runways",
            "the northern hills",
        ],
    ),
    "software": (
        ["the developer", "our build server", "the database", "a junior engineer", "the team"],
        ["deployed", "refactored", "debugged", "tested", "profiled", "rewrote", "reviewed"],
        [
            "the payment service",
            "a memory leak",
            "the login page",
            "the search index",
            "an old API",
            "the release branch",
            "the caching layer",
            "a flaky unit test",
        ],
    ),
    "sports": (
        ["the striker", "the home team", "our goalkeeper", "the young sprinter", "the coach"],
        ["scored against", "defeated", "trained with", "outran", "celebrated with", "tackled"],
        [
            "the league champions",
            "a rival club",
            "the national side",
            "the crowd",
            "the visiting team",
            "the referee",
            "the defenders",
            "the final whistle",
        ],
    ),
    "finance": (
        ["the central bank", "investors", "the stock market", "a small business", "the lender"],
        ["raised", "cut", "reported", "borrowed", "invested in", "forecast", "reviewed"],
        [
            "interest rates",
            "quarterly earnings",
            "the bond yields",
            "a new loan",
            "the housing market",
            "its annual budget",
            "inflation figures",
            "the exchange rate",
        ],
    ),
}

_TIME = [
    "yesterday",
    "this morning",
    "last week",
    "after a long delay",
    "on Monday",
    "late at night",
    "during the holidays",
    "before the deadline",
    "again",
]
_LINK = ["because", "while", "although", "after", "so that", "even though", "and then"]
_EXTRA = [
    "which surprised everyone in the room",
    "as expected by most of the experts",
    "despite several warnings from the staff",
    "for the first time in many years",
    "with a calm and careful approach",
    "in front of a very large audience",
    "according to a short report published later",
    "without any clear explanation",
]


def _clause(rng: random.Random, topic: str) -> str:
    subjects, verbs, objects = TOPICS[topic]
    return f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}"


def _sentence(rng: random.Random, target: int) -> tuple[str, str]:
    topic = rng.choice(list(TOPICS))
    words = _clause(rng, topic).split()
    while len(words) < target:
        pick = rng.random()
        if pick < 0.4:
            words += [rng.choice(_LINK), *_clause(rng, topic).split()]
        elif pick < 0.7:
            words += rng.choice(_EXTRA).split()
        else:
            words += rng.choice(_TIME).split()
    text = " ".join(words[:target])
    return topic, text[0].upper() + text[1:] + "."


def labelled_sentences(
    count: int, *, seed: int = 0, min_words: int = 5, max_words: int = 60
) -> list[tuple[str, str]]:
    """``count`` (topic, sentence) pairs of ``min_words`` to ``max_words`` words."""
    rng = random.Random(seed)
    return [_sentence(rng, rng.randint(min_words, max_words)) for _ in range(count)]


def sentences(count: int, *, seed: int = 0, min_words: int = 5, max_words: int = 60) -> list[str]:
    """``count`` sentences of ``min_words`` to ``max_words`` words (lengths uniform)."""
    pairs = labelled_sentences(count, seed=seed, min_words=min_words, max_words=max_words)
    return [text for _, text in pairs]
