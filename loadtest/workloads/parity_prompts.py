"""The parity prompt set: fixed, varied prompts the engine tests and the accuracy gate use
(written for this project)."""

from __future__ import annotations

SHORT = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "List three primary colors:",
    "Translate to French: good morning",
    "2 + 2 =",
    "The theory of relativity says that",
    "Ingredients for pancakes:",
    "In 1969, astronauts",
    "Q: Why is the sky blue?\nA:",
    "import numpy as np\n",
    "Dear hiring manager,",
]

CHAT = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in one sentence.",
    "Give me two tips for sleeping better.",
    "How many legs does a spider have?",
]

PARAGRAPH = (
    "Serving a language model well is mostly a matter of moving memory. Each request "
    "builds a cache of keys and values for every layer, and that cache grows with every "
    "token the model reads or writes. A scheduler that packs many requests into one batch "
    "keeps the arithmetic units busy, but only if the cache fits; when it does not, some "
    "request must wait or give its blocks back and compute them again later. Splitting "
    "the prompt phase from the generation phase lets each run on hardware sized for it, "
    "at the price of shipping the cache from one machine to another. "
)


def long_prompt(repeats: int = 9) -> str:
    """About 100 tokens per repeat; 9 repeats is well over 1,000 tokens."""
    return "".join(f"Section {i + 1}. {PARAGRAPH}" for i in range(repeats)) + "Summary:"
