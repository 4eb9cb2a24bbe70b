"""Prompts made on this machine for self-distillation (`python -m specjax.train data`): nothing
is downloaded. Three sources, each deterministic:

- "stdlib": instructions and code tasks written from the Python standard library's own
  docstrings (the installed interpreter's modules: the API's name and its summary line);
- "topics": fixed question forms over a topic list (everyday, science, work, writing, code);
- "code": programming tasks in several languages (general tasks, SQL queries, shell scripts);
- "edits": rewrites of text and code the prompt gives -- the standard library's own short
  functions (rename, annotate, document, port) and docstring paragraphs (correct, simplify,
  translate into several languages): answers that copy much of their context;
- "self-instruct": the target is asked to write a question, a request for help or a programming
  task about a topic; what it writes is then answered like any other prompt
  (`question_requests` / `question_from_answer`).
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

REQUEST_OPENINGS = ("write", "create", "implement", "help", "i ", "i'", "my ", "can you",
                    "could you", "please", "explain", "show", "build", "make", "design", "given")

QUESTION_FORMS = (
    "Write one question that someone might ask an assistant about {topic}. Reply with the "
    "question only.",
    "Write one message in which someone asks an assistant for help with a personal situation "
    "involving {topic}. Reply with the message only.",
    "Write one short programming task related to {topic} that a student could ask an "
    "assistant to solve in {language}. Reply with the task only.",
)

# General tasks go with every general-purpose language; SQL and shell have their own.
LANGUAGES = ("Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "Ruby")
PROGRAM_TASKS = (
    "reverses the words in a sentence", "computes the greatest common divisor of two numbers",
    "tests if a number is prime", "counts the vowels in a string",
    "finds the largest element of an array without a built-in max",
    "converts temperatures from Celsius to Fahrenheit", "rotates a square matrix by 90 degrees",
    "finds the longest common prefix of several strings", "parses a date like 2024-03-15",
    "implements a stack with push, pop and peek", "implements a queue with two stacks",
    "computes a factorial both iteratively and recursively", "tests if a string is a "
    "palindrome", "groups words that are anagrams of each other", "keeps a running average of "
    "incoming numbers", "prints the lines of a text file in reverse order",
    "generates a random password of a given length", "converts an integer to binary",
    "finds the second largest number in a list", "implements insertion sort",
    "implements quicksort", "computes the dot product of two vectors",
    "capitalises the first letter of every word", "finds all pairs of numbers that add up to a "
    "target", "implements a small LRU cache", "parses a URL query string into key-value pairs",
    "computes the median of a list", "transposes a matrix", "merges overlapping intervals",
    "builds a binary search tree with insert and in-order traversal",
    "finds the shortest path through a grid maze with breadth-first search",
    "retries a failing operation with exponential backoff",
    "formats a byte count as a human-readable size", "splits a list into chunks of a given size",
    "computes the edit distance between two strings", "counts the words in a paragraph",
    "shuffles an array in place", "checks whether a year is a leap year",
    "computes simple interest and compound interest", "validates a phone number format",
)
PROGRAM_FORMS = (
    "Write a {language} function that {task}.",
    "How would I write {language} code that {task}? Explain each step.",
    "Show a {language} example that {task}, and mention the edge cases.",
    "Write {language} code that {task}, with a few tests.",
)
SQL_TASKS = (
    "lists the orders placed in the last 30 days", "counts the employees in each department",
    "lists the products that were never ordered", "computes the average salary per job title",
    "detects duplicate email addresses in a users table", "returns the latest order of each "
    "customer", "counts how many students enrolled in each course", "deletes rows older than "
    "one year from a log table", "ranks salespeople by their monthly revenue",
    "shows the months in which sales dropped compared with the month before",
)
SQL_FORMS = ("Write a SQL query that {task}.", "Explain step by step a SQL query that {task}.")
SHELL_TASKS = (
    "finds the ten largest files in a directory", "counts the lines of every .py file in a "
    "project", "backs up a folder into a dated tar.gz archive", "shows the processes using the "
    "most memory", "replaces a word in every text file of a folder", "checks whether a website "
    "is reachable every minute", "deletes log files older than seven days",
    "creates a folder for each day of the current month",
)
SHELL_FORMS = ("Write a bash script that {task}.", "How do I write a shell command that {task}?")


CODE_EDIT_FORMS = (
    "Rename the function `{name}` to `{new}` and return the whole code:\n\n```python\n{code}```",
    "Annotate the parameters and result of this function with type hints; keep the rest as "
    "it is:\n\n```python\n{code}```",
    "Add a comment above each non-trivial line of this function:\n\n```python\n{code}```",
    "Rewrite this Python function in {language}, keeping its names:\n\n```python\n{code}```",
    "Find any bug in this function, then return the corrected function:\n\n```python\n{code}```",
)
TEXT_EDIT_FORMS = (
    "Correct the grammar of this paragraph and return it:\n\n{text}",
    "Rewrite this paragraph in simpler words for a beginner:\n\n{text}",
    "Translate this paragraph into {human}:\n\n{text}",
    "Turn this paragraph into a bulleted list of its points:\n\n{text}",
)
HUMAN_LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese", "Dutch")


def _stdlib_members():
    """(module name, module, attribute name, object) of the public names of `STDLIB_MODULES`
    that import here, in a fixed order (warnings of deprecated modules silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for attr in sorted(vars(module)):
                if not attr.startswith("_"):
                    yield name, module, attr, getattr(module, attr)


def stdlib_snippets(max_lines: int = 24) -> tuple[list[tuple[str, str]], list[str]]:
    """(name, source) of the short pure-Python functions of `STDLIB_MODULES` (3 to `max_lines`
    lines) and their docstrings' longer paragraphs, in a fixed order."""
    functions, paragraphs = [], []
    for _, module, attr, obj in _stdlib_members():
        if not inspect.isfunction(obj) or obj.__module__ != module.__name__:
            continue
        try:
            code = inspect.getsource(obj)
        except (OSError, TypeError):
            continue
        if 3 <= code.count("\n") <= max_lines and not code.startswith((" ", "@")):
            functions.append((attr, code))
        doc = inspect.getdoc(obj) or ""
        paragraphs += [p.replace("\n", " ") for p in doc.split("\n\n")
                       if 200 <= len(p) <= 700 and ">>>" not in p]
    # Functions re-exported under two names and docstrings shared by several: once each.
    return list(dict((code, (name, code)) for name, code in functions).values()), \
        list(dict.fromkeys(paragraphs))


def edit_prompts(rng: random.Random) -> list[str]:
    """Rewrites of the standard library's short functions and docstring paragraphs, a form
    (and target language) picked per snippet."""
    functions, paragraphs = stdlib_snippets()
    prompts = [rng.choice(CODE_EDIT_FORMS).format(
        name=name, new=f"{name}_v2", code=code, language=rng.choice(LANGUAGES[1:]))
        for name, code in functions]
    prompts += [rng.choice(TEXT_EDIT_FORMS).format(text=text, human=rng.choice(HUMAN_LANGUAGES))
                for text in paragraphs]
    return prompts


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
    for name, _, attr, obj in _stdlib_members():
        if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
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
    # Each (task, language) once, in a form picked per pair: every task in every language
    # without every phrasing.
    prompts += [("code", rng.choice(PROGRAM_FORMS).format(language=language, task=task))
                for task in PROGRAM_TASKS for language in LANGUAGES]
    prompts += [("code", form.format(task=task)) for task in SQL_TASKS for form in SQL_FORMS]
    prompts += [("code", form.format(task=task)) for task in SHELL_TASKS for form in SHELL_FORMS]
    prompts += [("edits", text) for text in edit_prompts(rng)]
    rng.shuffle(prompts)
    return prompts


def question_requests(count: int, seed: int = 0) -> list[str]:
    """Self-instruct, first turn: `count` requests for a question about a topic."""
    rng = random.Random(seed + 1)
    return [rng.choice(QUESTION_FORMS).format(topic=rng.choice(TOPICS),
                                              language=rng.choice(LANGUAGES))
            for _ in range(count)]


def question_from_answer(text: str) -> str | None:
    """The target's question, request or task (its answer to a `question_requests` prompt): its
    first line, or None when that is too short or long, or reads as an answer rather than a
    request (no question mark and no imperative opening)."""
    line = text.strip().split("\n")[0].strip().strip('"').strip()
    if not 10 <= len(line) <= 300:
        return None
    if "?" not in line and not line.lower().startswith(REQUEST_OPENINGS):
        return None
    return line
