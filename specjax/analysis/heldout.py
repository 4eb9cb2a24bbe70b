"""Held-out chat and code prompts for measuring drafters on a chat model (`python -m
specjax.bench spec --model smollm2`). Written for the bench, in no training set:
`python -m specjax.train data` drops any generated prompt sharing a 6-word run with one of them
(`overlaps_heldout`), and its manifest records how many it dropped."""
from __future__ import annotations

import re

CHAT = (
    "My neighbour's dog barks every night around midnight. How can I bring this up with them "
    "politely?",
    "I have a job interview for a junior accountant position on Monday. What should I prepare?",
    "Plan a three-day visit to Lisbon for someone who likes food markets and old trams.",
    "Why does bread go stale faster in the fridge than on the counter?",
    "Write a short thank-you note to a colleague who covered my shifts while I was ill.",
    "What are the pros and cons of renting versus buying a flat in a big city?",
    "Summarise the causes of the French Revolution in a few paragraphs.",
    "How do noise-cancelling headphones work?",
    "Suggest a weekly exercise routine for a beginner who only has a pair of dumbbells.",
    "Explain the difference between weather and climate to a ten-year-old.",
    "I keep procrastinating on my thesis. Give me a practical plan for the next two weeks.",
    "Write a limerick about a cat who learns to play the piano.",
    "What should I check before buying a used bicycle?",
    "Compare tea and coffee in terms of caffeine, taste and culture.",
    "How can a small bakery attract more customers on weekday mornings?",
    "Describe how vaccines train the immune system.",
)

CODE = (
    "Write a Python function that merges two sorted lists into one sorted list without using "
    "sort().",
    "Write a Python class for a bank account with deposit, withdraw and a running balance that "
    "refuses overdrafts.",
    "Write a Python script that counts how often each word appears in a text file and prints "
    "the ten most common.",
    "Implement binary search in Python and explain its time complexity.",
    "Write a Python function that checks whether a string of brackets like '([]{})' is "
    "balanced.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Show how to read a CSV file of temperatures in Python and compute the monthly averages.",
    "Write a Python generator that yields the Fibonacci numbers below a limit.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Write a Python function that removes duplicate entries from a list while keeping the "
    "original order.",
    "Write a JavaScript function that debounces another function.",
    "Write a SQL query that finds the three customers with the highest total order amount.",
    "Write a Python decorator that measures and prints how long a function takes.",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "How do I handle a missing key in a Python dictionary? Show three ways.",
    "Write a bash script that renames every .jpeg file in a folder to .jpg.",
)

SPAN = 6


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _spans(text: str) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i:i + SPAN]) for i in range(len(words) - SPAN + 1)}


HELDOUT_SPANS = frozenset(s for text in CHAT + CODE for s in _spans(text))


def overlaps_heldout(text: str) -> bool:
    """Whether `text` shares a run of `SPAN` words with a held-out prompt (or is one)."""
    if any(_words(text) == _words(p) for p in CHAT + CODE):
        return True
    return not HELDOUT_SPANS.isdisjoint(_spans(text))
