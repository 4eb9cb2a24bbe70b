"""Held-out chat, code and edit prompts for measuring drafters on a chat model (`python -m
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

# Edit-shaped requests: the answer rewrites text or code the prompt gives, so most of it is
# already in the context (what prompt lookup, NGram and SA draft from).
EDIT = (
    "Rename the variable `total` to `running_sum` everywhere in this function and return the "
    "whole function:\n\n```python\ndef average(values):\n    total = 0\n    for v in values:\n"
    "        total += v\n    if not values:\n        return 0.0\n    return total / len(values)\n```",
    "Add a type hint to every parameter and return value of this function, changing nothing "
    "else:\n\n```python\ndef clamp(value, low, high):\n    if value < low:\n        return low\n"
    "    if value > high:\n        return high\n    return value\n```",
    "Fix the syntax errors in this JSON and print the corrected JSON:\n\n{\"name\": \"Ada\", "
    "\"age\": 36, \"languages\": [\"English\", \"French\",], \"city\": \"London\" "
    "\"active\": true}",
    "Change the price of the kettle to 24.99 in this JSON and return the full JSON:\n\n"
    "{\"items\": [{\"name\": \"kettle\", \"price\": 19.99, \"stock\": 4}, {\"name\": "
    "\"toaster\", \"price\": 34.5, \"stock\": 2}, {\"name\": \"blender\", \"price\": 49.0, "
    "\"stock\": 7}]}",
    "Rewrite this paragraph with every occurrence of 'car' replaced by 'bicycle':\n\nMy car is "
    "old but reliable. Every morning I drive the car to the station, park the car near the "
    "bakery and take the train. On weekends the car takes us to the lake.",
    "Correct the spelling mistakes in this text and return the corrected text:\n\nThe "
    "comittee will recieve the final reprot on Wensday. Please make shure that every "
    "departmant sends its numbres before the deadline.",
    "Convert this list of names to a numbered list, one per line, keeping the order:\n\n"
    "Maria Lopez, Tom Becker, Aiko Tanaka, Samuel Okafor, Priya Nair, Lucas Martin, Elena "
    "Petrova, Omar Haddad",
    "Rewrite this Python loop as a list comprehension and show the result:\n\n"
    "```python\nsquares = []\nfor n in range(20):\n    if n % 3 == 0:\n"
    "        squares.append(n * n)\n```",
    "Rename the class `Rect` to `Rectangle` in this code and return all of it:\n\n```python\n"
    "class Rect:\n    def __init__(self, width, height):\n        self.width = width\n"
    "        self.height = height\n\n    def area(self):\n        return self.width * "
    "self.height\n\n\nbox = Rect(3, 4)\nprint(box.area())\n```",
    "Put this shopping list in alphabetical order, one item per line:\n\nmilk, eggs, "
    "bread, apples, butter, cheese, rice, onions, carrots, yoghurt",
    "Convert this CSV to a Markdown table:\n\ncity,country,population\nLyon,France,522000\n"
    "Porto,Portugal,232000\nGraz,Austria,291000\nTurin,Italy,848000",
    "Add a docstring to this function and return the whole function:\n\n```python\n"
    "def word_lengths(sentence):\n    words = sentence.split()\n    return {w: len(w) for w in "
    "words}\n```",
    "Replace the print calls with logging.info calls in this code and return it:\n\n"
    "```python\nimport logging\n\ndef load(path):\n    print('loading', path)\n"
    "    with open(path) as f:\n        data = f.read()\n    print('read', len(data), 'bytes')\n"
    "    return data\n```",
    "Translate these three sentences into French, one per line:\n\nThe museum opens at nine. "
    "Tickets are cheaper on Tuesdays. Children under six enter for free.",
    "Make this email more polite without changing its content:\n\nSend me the invoice today. "
    "You forgot it last week. I need it for the accounts, so do not be late again.",
    "Rewrite this SQL query with the keywords in upper case and one clause per line:\n\n"
    "select name, email from customers where country = 'Spain' and active = 1 order by name "
    "limit 20",
)

SPAN = 6


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _spans(text: str) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i:i + SPAN]) for i in range(len(words) - SPAN + 1)}


HELDOUT_SPANS = frozenset(s for text in CHAT + CODE + EDIT for s in _spans(text))


def overlaps_heldout(text: str) -> bool:
    """Whether `text` shares a run of `SPAN` words with a held-out prompt (or is one)."""
    if any(_words(text) == _words(p) for p in CHAT + CODE + EDIT):
        return True
    return not HELDOUT_SPANS.isdisjoint(_spans(text))
