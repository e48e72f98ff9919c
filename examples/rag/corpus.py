"""The RAG agent's world: a made-up encyclopedia of short passages, its BM25 index, and two-hop questions about it.

    make_tasks("train", 2000)      # [{"id", "question", "answer", "supporting": [two passages], "kind"}, ...]
    make_tasks("validation", 64)
    search("Glilstan Rerus")       # the TOP_K passages BM25 ranks first
    search("Ada Lovelace", corpus="my_docs.jsonl")   # ... in a corpus of your own (``load_corpus``)

Two separate worlds are generated, one per split, each with its own people, cities, countries and companies (names
from a syllable generator, so the model cannot know any answer): a validation question never names an entity that
any training question or answer names. The encyclopedia holds the passages of both worlds, so retrieval works as
in open-domain QA. Every question needs two retrievals, MuSiQue style:

- ``birth_country``: "In which country was P born?" (P was born in C; C is a city in K) → K
- ``founder_city``: "In which city was the founder of Co born?" (Co was founded by P; P was born in C) → C

Each person also has a passage about their job, a distractor that shares their name. Deterministic: seeded
``random.Random`` generators, no ``hash()``; the index is built once per process (about 10 ms).
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

TOP_K = 2
"""Passages a search returns."""
SEEDS = {"train": 11, "validation": 22}
PEOPLE = {"train": 400, "validation": 160}
"""People per world: with half as many companies, 600 training and 240 validation questions."""
ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr", "st", "gl"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
CODAS = ["", "", "n", "r", "l", "s", "k", "m"]
JOBS = ["a baker", "a pilot", "a painter", "a doctor", "a farmer", "a teacher", "a singer", "a lawyer"]


@dataclass(frozen=True)
class World:
    born: dict[str, str]
    """person → city of birth"""
    country: dict[str, str]
    """city → country"""
    founder: dict[str, str]
    """company → founder (a person)"""
    job: dict[str, str]
    """person → job"""


def _world(seed: int, people: int, used: set[str]) -> World:
    rng = random.Random(seed)

    def name(syllables: int) -> str:
        while True:
            word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                           for _ in range(syllables)).capitalize()
            if len(word) > 3 and word.lower() not in used:
                used.add(word.lower())
                return word

    countries = [name(2) for _ in range(12)]
    cities = [name(2) for _ in range(40)]
    persons = [f"{name(2)} {name(2)}" for _ in range(people)]
    companies = [name(3) for _ in range(people // 2)]
    return World(born={p: rng.choice(cities) for p in persons},
                 country={c: rng.choice(countries) for c in cities},
                 founder=dict(zip(companies, persons, strict=False)),
                 job={p: rng.choice(JOBS) for p in persons})


@functools.cache
def worlds() -> dict[str, World]:
    """The two worlds; no name is in both (one set of used names across them)."""
    used: set[str] = set()
    return {split: _world(SEEDS[split], PEOPLE[split], used) for split in ("train", "validation")}


def born_in(person: str, city: str) -> str:
    return f"{person} was born in {city}."


def city_in(city: str, country: str) -> str:
    return f"{city} is a city in {country}."


def founded_by(company: str, person: str) -> str:
    return f"{company} was founded by {person}."


def passages(world: World) -> list[str]:
    out = []
    for person, city in world.born.items():
        out += [born_in(person, city), f"{person} works as {world.job[person]}."]
    out += [city_in(city, country) for city, country in world.country.items()]
    out += [founded_by(company, person) for company, person in world.founder.items()]
    return out


@functools.cache
def encyclopedia() -> list[str]:
    return [p for world in worlds().values() for p in passages(world)]


@dataclass(frozen=True)
class Corpus:
    """Passages and their BM25 index."""

    passages: list[str]
    index: object


def _corpus_of(passages: list[str]) -> Corpus:
    import bm25s

    index = bm25s.BM25()
    index.index(bm25s.tokenize(passages, show_progress=False), show_progress=False)
    return Corpus(passages, index)


@functools.cache
def _built_in() -> Corpus:
    return _corpus_of(encyclopedia())


@functools.lru_cache(maxsize=8)
def load_corpus(path: str) -> Corpus:
    """A corpus of your own, indexed once per process: a JSONL file of ``{"text": ...}`` lines (an optional
    ``"title"`` goes before the text), or a folder whose ``.txt`` and ``.md`` files are split into passages at
    blank lines. A task names it in its ``"corpus"`` field; ValueError saying what is wrong otherwise."""
    where = Path(path).expanduser()
    if where.is_dir():
        files = sorted(f for f in where.rglob("*") if f.suffix.lower() in _TEXT_SUFFIXES and f.is_file())
        passages = [" ".join(block.split()) for f in files for block in re.split(r"\n\s*\n", _text_of(f))]
    elif where.is_file():
        passages = []
        for number, line in enumerate(_text_of(where).split("\n"), 1):  # U+2028 may sit inside a string
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text, title = record["text"], record.get("title")
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ValueError(f"corpus {where}, line {number}: not a JSON object with a \"text\"") from None
            if not isinstance(text, str) or not isinstance(title, (str, type(None))):
                raise ValueError(f"corpus {where}, line {number}: \"text\" (and \"title\", if given) must be text, "
                                 f"got {type(text).__name__}" + (f" and {type(title).__name__}" if title else ""))
            passages.append(f"{title}: {text}" if title else text)
    else:
        raise ValueError(f"the task's corpus {str(where)!r} does not exist: give a JSONL file of {{\"text\": ...}} "
                         "lines or a folder of .txt/.md files (task field \"corpus\")")
    passages = [p for p in passages if p.strip()]
    if not passages:
        raise ValueError(f"the corpus {str(where)!r} holds no passage (a folder's {', '.join(_TEXT_SUFFIXES)} files "
                         "are read, split at blank lines; a JSONL file's \"text\" fields)")
    return _corpus_of(passages)


_TEXT_SUFFIXES = (".txt", ".md")
"""The files of a corpus folder that are read."""


def _text_of(path: Path) -> str:
    """A corpus file's text (UTF-8, a BOM allowed); ValueError naming the file and line where it is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ValueError(f"corpus file {path}, line {line}: not UTF-8 (byte {data[exc.start]:#04x}): save it as "
                         "UTF-8") from None


def search(query: str, k: int = TOP_K, corpus: str | None = None) -> list[str]:
    """The ``k`` best passages for ``query`` by BM25 (fewer when fewer share a word with it), in the generated
    encyclopedia or, with ``corpus``, in that one (``load_corpus``)."""
    import bm25s

    source = load_corpus(corpus) if corpus else _built_in()
    tokens = bm25s.tokenize([query], show_progress=False)
    if not tokens.vocab:
        return []
    ids, scores = source.index.retrieve(tokens, k=min(k, len(source.passages)), show_progress=False)
    return [source.passages[i] for i, score in zip(ids[0], scores[0], strict=True) if score > 0]


def questions(world: World) -> list[dict]:
    out = []
    for person, city in world.born.items():
        country = world.country[city]
        out.append({"question": f"In which country was {person} born?", "answer": country, "kind": "birth_country",
                    "supporting": [born_in(person, city), city_in(city, country)]})
    for company, person in world.founder.items():
        city = world.born[person]
        out.append({"question": f"In which city was the founder of {company} born?", "answer": city,
                    "kind": "founder_city", "supporting": [founded_by(company, person), born_in(person, city)]})
    return out


def make_tasks(split: str, n: int) -> list[dict]:
    """Up to ``n`` questions of ``split`` ("train" or "validation"), shuffled once with a fixed seed."""
    if split not in SEEDS:
        raise ValueError(f"split must be one of {sorted(SEEDS)}, got {split!r}")
    tasks = questions(worlds()[split])
    random.Random(SEEDS[split]).shuffle(tasks)
    return [{"id": f"{split}-{i}", **task} for i, task in enumerate(tasks[:n])]
