"""Prompts made on this machine for self-distillation (`python -m specjax.train data`): nothing
is downloaded. Three sources, each deterministic:

- "stdlib": instructions and code tasks written from the Python standard library's own
  docstrings (the installed interpreter's modules: the API's name and its summary line);
- "topics": fixed question forms over a topic list (everyday, science, work, writing, code);
- "self-instruct": the target is asked to write a question about a topic; its question is then
  answered like any other prompt (`question_request` / `question_from_answer`).
"""
from __future__ import annotations

import importlib
import inspect
import random
import warnings

STDLIB_MODULES = (
    "abc", "argparse", "array", "asyncio", "base64", "bisect", "calendar", "collections",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum",
    "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html",
    "http.client", "io", "ipaddress", "itertools", "json", "logging", "math", "mimetypes",
    "operator", "os", "os.path", "pathlib", "pickle", "pprint", "queue", "random", "re",
    "secrets", "shlex", "shutil", "socket", "sqlite3", "statistics", "string", "struct",
    "subprocess", "sys", "tarfile", "tempfile", "textwrap", "threading", "time", "timeit",
    "typing", "unicodedata", "unittest", "urllib.parse", "uuid", "warnings", "weakref",
    "xml.etree.ElementTree", "zipfile", "zlib")

STDLIB_FORMS = (
    "Explain what `{api}` does in Python and show a short example.",
    "Write a Python function that uses `{api}`. The docs say: \"{summary}\" Explain the code.",
    "When would I use `{api}` in Python? Give a practical example.",
    "What does this line from the Python documentation of `{api}` mean: \"{summary}\"?",
    "Show me common mistakes people make with `{api}` and how to avoid them.",
    "Write a small program that demonstrates `{api}` with comments.",
)

TOPICS = (
    "saving money on groceries", "learning a new language", "sleep hygiene", "houseplants",
    "public speaking", "time management", "photosynthesis", "black holes", "the water cycle",
    "volcanoes", "the Roman Empire", "the printing press", "electric cars", "solar panels",
    "recycling", "composting", "marathon training", "stretching", "healthy breakfasts",
    "baking sourdough", "making pasta from scratch", "brewing coffee", "camping", "hiking safety",
    "budget travel", "packing a suitcase", "writing a cover letter", "negotiating a salary",
    "remote work", "team meetings", "giving feedback", "starting a podcast", "learning guitar",
    "drawing portraits", "chess openings", "climate change", "ocean tides", "earthquakes",
    "the human heart", "vitamins", "the immune system", "antibiotics", "meditation",
    "journaling", "writing poetry", "short stories", "email etiquette", "online privacy",
    "password security", "phishing", "how the internet works", "databases", "recursion",
    "object-oriented programming", "unit testing", "version control with git",
    "regular expressions", "sorting algorithms", "hash tables", "linked lists", "web APIs",
    "JSON", "HTML and CSS", "SQL joins", "Linux shell commands", "Docker containers",
    "machine learning", "neural networks", "probability", "prime numbers", "fractions",
    "geometry", "compound interest", "inflation", "supply and demand", "starting a small business",
    "customer service", "raising children", "adopting a pet", "dog training", "bird watching",
    "gardening in small spaces", "home repairs", "painting a room", "moving house",
    "making friends as an adult", "dealing with stress", "the solar system", "the moon landing",
    "ancient Egypt", "the Renaissance", "world war one", "democracy", "the United Nations",
    "renewable energy", "nuclear power", "bees", "dinosaurs", "rainforests", "deserts",
    "the stock market", "credit scores", "writing a resume", "studying for exams",
    "note-taking", "reading more books", "film photography", "video games", "board games",
    "cooking rice", "food allergies", "first aid", "cycling in a city", "learning to swim")

TOPIC_FORMS = (
    "Give me five practical tips about {topic}.",
    "Explain {topic} to a complete beginner.",
    "What are the most common misconceptions about {topic}?",
    "Write a short blog post introduction about {topic}.",
    "I want to learn about {topic}. Where should I start?",
    "Write a short story in which {topic} plays a part.",
    "Summarise the key ideas of {topic} in a few bullet points.",
    "What questions should I ask an expert on {topic}?",
)

QUESTION_FORM = ("Write one question that someone might ask an assistant about {topic}. Reply "
                 "with the question only.")


def _summary(obj) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    # Signature lines ("f(x) -> y") and very long paragraphs make poor instructions.
    if not 12 <= len(line) <= 200 or "(" in line.split(" ")[0]:
        return None
    return line


def stdlib_apis() -> list[tuple[str, str]]:
    """(qualified name, docstring summary) of the public functions and classes of
    `STDLIB_MODULES` that have one, in a fixed order."""
    apis = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for attr in sorted(vars(module)):
                obj = getattr(module, attr)
                if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)
                                                or inspect.isbuiltin(obj)):
                    continue
                if (getattr(obj, "__module__", None) or name).lstrip("_").split(".")[0] != \
                        name.split(".")[0]:
                    continue  # re-exported from another module
                if (summary := _summary(obj)) is not None:
                    apis.append((f"{name}.{attr}", summary))
    return apis


def make_prompts(seed: int = 0) -> list[tuple[str, str]]:
    """(source, prompt) pairs: every stdlib API once (a form picked per API) and every topic
    with every form, shuffled with `seed`."""
    rng = random.Random(seed)
    prompts = [("stdlib", rng.choice(STDLIB_FORMS).format(api=api, summary=summary))
               for api, summary in stdlib_apis()]
    prompts += [("topics", form.format(topic=topic)) for topic in TOPICS for form in TOPIC_FORMS]
    rng.shuffle(prompts)
    return prompts


def question_requests(count: int, seed: int = 0) -> list[str]:
    """Self-instruct, first turn: `count` requests for a question about a topic."""
    rng = random.Random(seed + 1)
    return [QUESTION_FORM.format(topic=rng.choice(TOPICS)) for _ in range(count)]


def question_from_answer(text: str) -> str | None:
    """The target's question (its answer to a `question_requests` prompt), or None when it is
    not a usable question."""
    line = text.strip().split("\n")[0].strip().strip('"').strip()
    if not 10 <= len(line) <= 300 or "?" not in line:
        return None
    return line
