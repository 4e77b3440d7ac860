"""The stdlib corpus: Python source ("code") and pydoc topic prose ("prose"); chat and SQL requests built on them.

Every Python install carries both, so the embedded pair can be trained anywhere without a
network. Documents are split into train / held-out by *name* (file path or topic key) with a
fixed hash, so the split is the same on every machine with the same Python, independent of the
build seed, and held-out text is never trained on. Later issues use `prompt_stream` over the
held-out split as traffic.
"""

from __future__ import annotations

import hashlib
import random
import re
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path

DOMAINS = ("code", "prose")
SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.1

# Directory names skipped anywhere in the stdlib tree: tests (huge, repetitive, and would leak
# near-copies of library code), third-party packages, generated tables and data-like modules.
_SKIP_DIRS = frozenset({
    "test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__",
    "encodings", "pydoc_data", "ensurepip", "lib-dynload",
})
_SKIP_PREFIXES = ("config-", "_sysconfigdata")


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _skip(rel: Path) -> bool:
    parts = rel.parts
    if any(p in _SKIP_DIRS or p.startswith(_SKIP_PREFIXES) for p in parts[:-1]):
        return True
    return parts[-1].startswith(_SKIP_PREFIXES)


@lru_cache(maxsize=4)
def code_files(root: str | None = None) -> tuple[str, ...]:
    """Sorted stdlib `.py` paths (posix, relative to the stdlib dir) that make up the code domain.

    Empty files and exact duplicates (first name kept) are dropped, so no held-out file has a
    verbatim copy in the train split.
    """
    base = Path(root) if root else stdlib_dir()
    names = sorted(p.relative_to(base).as_posix() for p in base.rglob("*.py")
                   if not _skip(p.relative_to(base)) and p.is_file())
    out, seen = [], set()
    for name in names:
        blob = (base / name).read_bytes()
        digest = hashlib.sha256(blob).digest()
        if blob.strip() and digest not in seen:
            seen.add(digest)
            out.append(name)
    return tuple(out)


@lru_cache(maxsize=1)
def prose_topics() -> dict[str, str]:
    """pydoc's topic texts (the prose domain), keyed by topic name."""
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def _heldout_score(name: str) -> float:
    h = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def split_files(names: Sequence[str], heldout_fraction: float = HELDOUT_FRACTION) -> tuple[list[str], list[str]]:
    """Split document names into (train, heldout) by a fixed hash of each name.

    Deterministic and stable under adding/removing other names; at least one name is held out
    when there are two or more.
    """
    names = sorted(set(names))
    heldout = [n for n in names if _heldout_score(n) < heldout_fraction]
    if not heldout and len(names) >= 2:
        heldout = [min(names, key=_heldout_score)]
    hs = set(heldout)
    return [n for n in names if n not in hs], heldout


def _check(domain: str, split: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


def doc_names(domain: str, split: str) -> list[str]:
    """Names (relative file paths or topic keys) of the documents in one domain/split, sorted."""
    _check(domain, split)
    names = code_files() if domain == "code" else tuple(prose_topics())
    train, heldout = split_files(names)
    return train if split == "train" else heldout


@lru_cache(maxsize=8)
def _load_docs(domain: str, split: str) -> tuple[tuple[str, str], ...]:
    out = []
    if domain == "code":
        base = stdlib_dir()
        for name in doc_names(domain, split):
            text = (base / name).read_text(encoding="utf-8", errors="replace")
            if text.strip():
                out.append((name, text))
    else:
        topics = prose_topics()
        out = [(k, topics[k]) for k in doc_names(domain, split) if topics[k].strip()]
    return tuple(out)


def load_docs(domain: str, split: str) -> list[tuple[str, str]]:
    """(name, text) for every non-empty document of one domain/split, in name order."""
    _check(domain, split)
    return list(_load_docs(domain, split))


def load_texts(domain: str, split: str) -> list[str]:
    """Texts of one domain/split, in name order."""
    return [t for _, t in load_docs(domain, split)]


def held_out_docs(domain: str) -> list[str]:
    """Held-out texts of a domain (never trained on)."""
    return load_texts(domain, "heldout")


def sample_docs(domain: str, split: str, max_chars: int | None, seed: int = 0) -> list[str]:
    """A deterministic subset of whole documents totalling about `max_chars` (all if None).

    Documents are taken in a seeded shuffled order so a cap still covers many files.
    """
    docs = load_texts(domain, split)
    if max_chars is None:
        return docs
    order = list(range(len(docs)))
    random.Random(f"{domain}/{split}/{seed}").shuffle(order)
    out, total = [], 0
    for i in order:
        if total >= max_chars:
            break
        out.append(docs[i])
        total += len(docs[i])
    return out


def corpus_stats() -> dict:
    """Files and chars per domain and split (recorded in the bootstrap manifest)."""
    stats: dict = {}
    for domain in DOMAINS:
        stats[domain] = {}
        for split in SPLITS:
            texts = load_texts(domain, split)
            stats[domain][split] = {"files": len(texts), "chars": sum(map(len, texts))}
    return stats


def prompt_stream(
    domain: str,
    tokenizer,
    split: str = "heldout",
    prompt_tokens: tuple[int, int] = (32, 128),
    seed: int = 0,
) -> Iterator[list[int]]:
    """Endless prompts (token-id lists) cut from `split` documents of `domain`: traffic for demos.

    Each prompt starts at a line start of a randomly chosen document and has a uniformly drawn
    length in `prompt_tokens` (inclusive; shorter only if no document is long enough). Same seed
    and tokenizer give the same stream.
    """
    _check(domain, split)
    lo, hi = prompt_tokens
    if not (1 <= lo <= hi):
        raise ValueError(f"prompt_tokens must satisfy 1 <= lo <= hi, got {prompt_tokens}")
    rng = random.Random(f"prompts/{domain}/{split}/{seed}")
    texts = load_texts(domain, split)
    # Line-start offsets per document, tokenized lazily: only the documents actually drawn.
    encoded: dict[int, tuple[list[int], list[int]]] = {}

    def enc(i: int) -> tuple[list[int], list[int]]:
        if i not in encoded:
            e = tokenizer(texts[i], add_special_tokens=False, return_offsets_mapping=True, verbose=False)
            ids, offs = e["input_ids"], e["offset_mapping"]
            starts = [0] + [j for j in range(1, len(ids)) if texts[i][offs[j][0] - 1: offs[j][0]] == "\n"]
            encoded[i] = (ids, starts)
        return encoded[i]

    weights = [len(t) for t in texts]
    while True:
        i = rng.choices(range(len(texts)), weights=weights)[0]
        ids, starts = enc(i)
        n = rng.randint(lo, hi)
        fits = [s for s in starts if s + n <= len(ids)]
        if not fits:
            if len(ids) >= lo:
                yield list(ids[:n])
            continue
        s = rng.choice(fits)
        yield list(ids[s: s + n])


# ---------------------------------------------------------------------------------------------
# chat: instructions built from the corpus, rendered with the tokenizer's chat template

CHAT_TASKS = ("explain", "write", "summarise", "answer")
_DEF_RE = re.compile(r"^def (\w+)\((.*?)\)[^:\n]*:\n((?:[ \t]+.*\n|\n)+)", re.M)
_DOC_RE = re.compile(r'^[ \t]+(?:"""|\'\'\')\s*(.+?)\s*$', re.M)


def _functions(text: str, max_lines: int = 30) -> list[tuple[str, str, str, str]]:
    """(name, args, source, docstring first line) of the top-level functions of a module."""
    out = []
    for m in _DEF_RE.finditer(text):
        body = m.group(0).rstrip("\n")
        if body.count("\n") > max_lines:
            continue
        doc = _DOC_RE.search(m.group(3))
        first = doc.group(1).strip().strip('"\'').rstrip(".") if doc else ""
        out.append((m.group(1), m.group(2), body, first))
    return out


def _paragraphs(text: str, lo: int = 200, hi: int = 900) -> list[str]:
    paras = [" ".join(p.split()) for p in text.split("\n\n")]
    return [p for p in paras if lo <= len(p) <= hi]


def chat_instructions(split: str = "heldout", seed: int = 0) -> Iterator[list[dict]]:
    """Endless single-turn chats (`[{"role": "user", "content": ...}]`) built from `split` documents:
    explain a function, write a function from its docstring, summarise or answer a question about a
    prose paragraph. The instructions the chat domain of demos, benchmarks and distillation uses."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    rng = random.Random(f"chat/{split}/{seed}")
    funcs = [f for t in load_texts("code", split) for f in _functions(t)]
    documented = [f for f in funcs if len(f[3]) >= 12]
    paras = [p for t in load_texts("prose", split) for p in _paragraphs(t)]
    while True:
        task = rng.choice(CHAT_TASKS)
        if task == "explain" and funcs:
            name, _, src, _ = rng.choice(funcs)
            text = f"Explain what this Python function does:\n\n```python\n{src}\n```"
        elif task == "write" and documented:
            name, args, _, doc = rng.choice(documented)
            text = f"Write a Python function `{name}({args})` that does the following: {doc}."
        elif task == "summarise" and paras:
            text = f"Summarize the following text in two sentences:\n\n{rng.choice(paras)}"
        elif paras:
            text = f"Read the text below and answer: what is its main point?\n\n{rng.choice(paras)}"
        else:
            continue
        yield [{"role": "user", "content": text}]


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` ready for the assistant's reply: the tokenizer's chat template, or
    (for tokenizers without one, like the self-trained test pair) one `role: content` line per
    message followed by `assistant:`."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    text = "".join(FALLBACK_CHAT_FORMAT.format(role=m["role"], content=m["content"]) for m in messages)
    return tokenizer.encode(text + FALLBACK_CHAT_SUFFIX, add_special_tokens=True)


# The chat format for tokenizers without a chat template (also what the server renders): one line per
# message, "<role>: <content>", then "assistant:" so the model continues as the assistant.
FALLBACK_CHAT_FORMAT = "{role}: {content}\n"
FALLBACK_CHAT_SUFFIX = "assistant:"


def chat_prompt_stream(tokenizer, split: str = "heldout", seed: int = 0, max_tokens: int = 384) -> Iterator[list[int]]:
    """`chat_instructions` rendered to token ids (longer than `max_tokens`: skipped)."""
    for msgs in chat_instructions(split, seed):
        ids = render_chat(tokenizer, msgs)
        if len(ids) <= max_tokens:
            yield ids


# ---------------------------------------------------------------------------------------------
# code cuts: a function's surroundings, the shape of a served code prompt (benchmarks' unseen pip cuts, the
# device build's on-policy continuations of stdlib cuts)


def def_cut(text: str, rng: random.Random, tok) -> list[int] | None:
    """The tokens around a random `def` line of `text`: from two lines before it, up to 96 tokens, cut at the end
    of its fourth line (at least 48 tokens); None where `text` has no `def` or too little around it."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
    if not starts:
        return None
    i = rng.choice(starts)
    ids = tok.encode("".join(lines[max(0, i - 2): i + 12]), add_special_tokens=False)
    if len(ids) < 48:
        return None
    cut = len(tok.encode("".join(lines[max(0, i - 2): i + 4]), add_special_tokens=False))
    return ids[: max(48, min(96, cut))]


def def_cuts(texts: Iterable[str], rng: random.Random, tok, n: int) -> list[list[int]]:
    """Up to n `def_cut`s, one per text, in the order given."""
    out = []
    for text in texts:
        ids = def_cut(text, rng, tok)
        if ids is not None:
            out.append(ids)
        if len(out) == n:
            break
    return out


def code_cut_prompts(tokenizer, split: str, n: int, seed: int = 0) -> list[list[int]]:
    """n `def_cut`s of `split` stdlib code (the files cycled in seeded random order, a random `def` each time)."""
    texts = load_texts("code", split)
    rng = random.Random(f"cuts/{split}/{seed}")
    if not texts:
        return []
    return def_cuts((rng.choice(texts) for _ in range(50 * n)), rng, tokenizer, n)


# ---------------------------------------------------------------------------------------------
# sql: natural-language requests for SQLite queries over generated schemas (a domain the build never
# trains on: its text is stdlib code, pydoc prose and chat about those). The split is by *table theme*,
# so a held-out request never names a table or column the train split uses.

SQL_THEMES: dict[str, tuple[str, ...]] = {
    "employees": ("name TEXT", "department TEXT", "salary REAL", "hire_date TEXT", "manager_id REAL"),
    "orders": ("customer_id REAL", "order_date TEXT", "total REAL", "status TEXT", "shipping_city TEXT"),
    "products": ("name TEXT", "category TEXT", "price REAL", "stock REAL", "supplier TEXT"),
    "students": ("name TEXT", "grade REAL", "age REAL", "school TEXT", "gpa REAL"),
    "books": ("title TEXT", "author TEXT", "year REAL", "genre TEXT", "pages REAL"),
    "movies": ("title TEXT", "director TEXT", "release_year REAL", "rating REAL", "duration REAL"),
    "flights": ("origin TEXT", "destination TEXT", "departure_time TEXT", "airline TEXT", "seats REAL"),
    "patients": ("name TEXT", "birth_date TEXT", "doctor TEXT", "ward TEXT", "age REAL"),
    "invoices": ("customer TEXT", "amount REAL", "due_date TEXT", "paid REAL", "currency TEXT"),
    "songs": ("title TEXT", "artist TEXT", "album TEXT", "length_seconds REAL", "plays REAL"),
    "cars": ("make TEXT", "model TEXT", "year REAL", "mileage REAL", "price REAL"),
    "hotels": ("name TEXT", "city TEXT", "stars REAL", "rooms REAL", "nightly_rate REAL"),
    "tickets": ("subject TEXT", "priority REAL", "status TEXT", "opened_at TEXT", "assignee TEXT"),
    "recipes": ("name TEXT", "cuisine TEXT", "prep_minutes REAL", "calories REAL", "servings REAL"),
    "players": ("name TEXT", "team TEXT", "position TEXT", "goals REAL", "matches REAL"),
    "sensors": ("location TEXT", "reading REAL", "unit TEXT", "recorded_at TEXT", "battery REAL"),
    "courses": ("title TEXT", "instructor TEXT", "credits REAL", "semester TEXT", "capacity REAL"),
    "accounts": ("owner TEXT", "balance REAL", "opened_on TEXT", "branch TEXT", "account_type TEXT"),
    "shipments": ("carrier TEXT", "weight_kg REAL", "sent_on TEXT", "delivered_on TEXT", "destination TEXT"),
    "restaurants": ("name TEXT", "cuisine TEXT", "city TEXT", "rating REAL", "price_level REAL"),
    "vehicles": ("plate TEXT", "owner TEXT", "color TEXT", "seats REAL", "fuel_type TEXT"),
    "events": ("name TEXT", "venue TEXT", "event_date TEXT", "attendees REAL", "ticket_price REAL"),
    "repositories": ("name TEXT", "language TEXT", "stars REAL", "forks REAL", "created_at TEXT"),
    "loans": ("borrower TEXT", "principal REAL", "interest_rate REAL", "start_date TEXT", "term_months REAL"),
}
SQL_TASKS = ("filter", "aggregate", "order", "group", "count", "join", "update")


def _sql_schema(theme: str) -> str:
    return f"CREATE TABLE {theme} (id INTEGER PRIMARY KEY, " + ", ".join(SQL_THEMES[theme]) + ");"


def _sql_cols(theme: str, sql_type: str | None = None) -> list[str]:
    """Column names of `theme` (of one SQL type if `sql_type`)."""
    return [c.split()[0] for c in SQL_THEMES[theme] if sql_type is None or c.endswith(sql_type)]


def _sql_request(rng: random.Random, theme: str, other: str) -> str:
    """One natural-language request over `theme` (and `other` for joins)."""
    text, num = rng.choice(_sql_cols(theme, "TEXT")), rng.choice(_sql_cols(theme, "REAL"))
    n = rng.choice((3, 5, 10, 20, 100, 1000))
    word = rng.choice(("alpha", "north", "basic", "gold", "open", "red"))
    task = rng.choice(SQL_TASKS)
    if task == "filter":
        return f"List the {text} of every row in {theme} whose {num} is greater than {n}."
    if task == "aggregate":
        return f"What is the average {num} in {theme} for each {text}?"
    if task == "order":
        return f"Show the {n} rows of {theme} with the highest {num}, including their {text}."
    if task == "group":
        return f"For each {text} in {theme}, count the rows and the maximum {num}, largest count first."
    if task == "count":
        return f"How many rows in {theme} have {text} equal to '{word}'?"
    if task == "join":
        return (f"Join {theme} with {other} on {theme}.id = {other}.id and list {theme}.{text} with "
                f"{other}.{_sql_cols(other)[0]}.")
    return f"Set {num} to 0 in {theme} for every row whose {text} is '{word}'."


def sql_instructions(split: str = "heldout", seed: int = 0) -> Iterator[list[dict]]:
    """Endless single-turn chats asking for one SQLite query: a schema (one or two generated tables of
    `split`'s themes) and a request. The new domain the real pair's drift and soak benchmarks use."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    train, heldout = split_files(list(SQL_THEMES), heldout_fraction=0.25)
    themes = train if split == "train" else heldout
    rng = random.Random(f"sql/{split}/{seed}")
    while True:
        theme = rng.choice(themes)
        other = rng.choice([t for t in themes if t != theme] or [theme])
        request = _sql_request(rng, theme, other)
        tables = [theme, other] if other != theme and f"{other}." in request else [theme]
        schema = "\n".join(_sql_schema(t) for t in tables)
        text = f"Given this SQLite schema:\n\n```sql\n{schema}\n```\n\nWrite one SQL query: {request}"
        yield [{"role": "user", "content": text}]


def sql_prompt_stream(tokenizer, split: str = "heldout", seed: int = 0, max_tokens: int = 384) -> Iterator[list[int]]:
    """`sql_instructions` rendered to token ids (longer than `max_tokens`: skipped)."""
    for msgs in sql_instructions(split, seed):
        ids = render_chat(tokenizer, msgs)
        if len(ids) <= max_tokens:
            yield ids


# agentic: a coding agent's turns over a few files (issue 26's third workload, where history repeats)

AGENTIC_EDITS = (
    "add type hints to its signature",
    "add a docstring that describes its arguments",
    "raise ValueError when an argument is invalid",
    "log its arguments with logging.debug",
    "give its local variables clearer names",
)


def agentic_instructions(split: str = "heldout", seed: int = 0, files: int = 3,
                         per_file: int = 4) -> Iterator[list[dict]]:
    """Endless single-turn chats in which an agent edits the same few functions again and again: each
    shows one of `per_file` functions of one of `files` `split` modules and asks for it back with one
    of a few edits. Functions and edits recur, so replies repeat earlier replies and their prompts,
    as agent traffic that reworks the same files does."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    rng = random.Random(f"agentic/{split}/{seed}")
    docs = [(n, fs) for n, t in load_docs("code", split) if len(fs := _functions(t, max_lines=20)) >= per_file]
    picked = rng.sample(docs, min(files, len(docs)))
    funcs = [(name, f) for name, fs in picked for f in rng.sample(fs, per_file)]
    if not funcs:
        raise ValueError(f"no module of the {split} split has {per_file} short functions")
    while True:
        name, (fname, _, src, _) = rng.choice(funcs)
        text = (f"You are editing `{name}`. This is its function `{fname}`:\n\n```python\n{src}\n```\n\n"
                f"Rewrite `{fname}` to {rng.choice(AGENTIC_EDITS)}. Reply with the complete function only.")
        yield [{"role": "user", "content": text}]


def agentic_prompt_stream(tokenizer, split: str = "heldout", seed: int = 0, max_tokens: int = 448) -> Iterator[list[int]]:
    """`agentic_instructions` rendered to token ids (longer than `max_tokens`: skipped)."""
    for msgs in agentic_instructions(split, seed):
        ids = render_chat(tokenizer, msgs)
        if len(ids) <= max_tokens:
            yield ids
