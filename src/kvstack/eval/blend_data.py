"""A seeded synthetic multi-document QA set for `kvstack eval blend`.

Each item is a small invented world: people (a profession, a home town, a birth year) and
organizations (a founder, a seat), each described by one document padded with neutral filler
sentences to a drawn length. Questions are single-hop ("In which town was Mira Talvek born?")
or two-hop ("In which town was the founder of the Korrin Guild born?": the guild's document
names the founder, the founder's document the town). Distractor documents describe other
people and organizations with the same kind of facts. Names are invented from syllables, so
the model must read the documents; the answer is asked as a cloze stem ("Answer: Mira Talvek
was born in"), so its first token is the measured one.

Everything derives from `random.Random(seed)`: the same seed gives the same items on every
machine. Documents are measured in the model's tokens (`encode`) while they are built.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "kr", "st", "tr", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "k", "th", "m")
PROFESSIONS = ("carpenter", "physician", "sailor", "astronomer", "baker", "teacher", "weaver",
               "lawyer", "painter", "engineer", "miner", "librarian")
ORG_KINDS = ("Guild", "Company", "Society", "Trust", "Institute", "Brotherhood")
_FILLER = (
    "The weather in the region is mild for most of the year, with rain in late autumn.",
    "Local markets sell bread, cheese and dried fish on most mornings.",
    "Several old roads cross the valley, and a few of them are still paved with stone.",
    "Visitors often remark on the quiet of the evenings and the number of small gardens.",
    "The nearest river floods every few decades, and the townspeople keep records of it.",
    "Records from that period are incomplete, and historians disagree on minor details.",
    "A small museum keeps letters, tools and maps from the last two centuries.",
    "Most families in the area have lived there for several generations.",
    "The annual fair brings traders from the neighbouring provinces each summer.",
    "Public lectures are held in the town hall during the winter months.",
    "The surrounding hills are covered with pine forest and a few abandoned quarries.",
    "Children learn to swim in the shallow lake north of the settlement.",
)


def _name(rng: random.Random, syllables: int) -> str:
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
    return (word + rng.choice(_CODAS)).capitalize()


@dataclass(frozen=True)
class Person:
    name: str
    profession: str
    town: str
    year: int


@dataclass(frozen=True)
class Organization:
    name: str
    founder: Person
    seat: str
    year: int


@dataclass(frozen=True)
class QAItem:
    """One question over its documents (in their first order); `hops` is 1 or 2."""

    documents: tuple[str, ...]
    question: str
    stem: str  # the answer's cloze stem, e.g. "Mira Talvek was born in"
    answer: str  # the answer's text after the stem, with its leading space
    hops: int


def _person(rng: random.Random, used: set[str]) -> Person:
    while True:
        name = f"{_name(rng, 2)} {_name(rng, 2)}"
        town = _name(rng, 3)
        if name not in used and town not in used:
            used.update((name, town))
            return Person(name, rng.choice(PROFESSIONS), town, rng.randrange(1700, 1990))


def _organization(rng: random.Random, used: set[str], founder: Person) -> Organization:
    while True:
        name = f"the {_name(rng, 2)} {rng.choice(ORG_KINDS)}"
        seat = _name(rng, 3)
        if name not in used and seat not in used:
            used.update((name, seat))
            return Organization(name, founder, seat, founder.year + rng.randrange(20, 50))


def _pad(rng: random.Random, facts: list[str], target: int,
         encode: Callable[[str], list[int]]) -> str:
    """The facts with filler sentences between them, grown to about `target` tokens."""
    sentences = list(facts)
    while len(encode(" ".join(sentences))) < target:
        sentences.insert(rng.randrange(1, len(sentences) + 1), rng.choice(_FILLER))
    return " ".join(sentences)


def _person_doc(rng: random.Random, p: Person, target: int,
                encode: Callable[[str], list[int]]) -> str:
    facts = [f"{p.name} was a {p.profession}.", f"{p.name} was born in {p.town} in {p.year}.",
             f"As a {p.profession}, {p.name} was known across the province."]
    return _pad(rng, facts, target, encode)


def _org_doc(rng: random.Random, o: Organization, target: int,
             encode: Callable[[str], list[int]]) -> str:
    title = o.name[4:]
    facts = [f"{title[0].upper() + title[1:]} is an old institution.",
             f"{o.name[0].upper() + o.name[1:]} was founded by {o.founder.name} in {o.year}.",
             f"Its seat is in {o.seat}, where its members meet every spring."]
    return _pad(rng, facts, target, encode)


def make_item(rng: random.Random, encode: Callable[[str], list[int]], num_docs: int,
              doc_tokens: tuple[int, int], hops: int) -> QAItem:
    used: set[str] = set()
    people = [_person(rng, used) for _ in range(num_docs)]
    size = lambda: rng.randrange(doc_tokens[0], doc_tokens[1] + 1)  # noqa: E731
    target = people[0]
    if hops == 1:
        docs = [_person_doc(rng, p, size(), encode) for p in people]
        question = f"In which town was {target.name} born?"
        stem = f"{target.name} was born in"
    else:
        org = _organization(rng, used, target)
        other = _organization(rng, used, people[1])
        docs = [_org_doc(rng, org, size(), encode), _org_doc(rng, other, size(), encode)]
        docs += [_person_doc(rng, p, size(), encode) for p in people[:num_docs - 2]]
        question = f"In which town was the founder of {org.name} born?"
        stem = f"The founder of {org.name} was born in"
    rng.shuffle(docs)
    return QAItem(tuple(docs), question, stem, f" {target.town}", hops)


def make_items(seed: int, num_items: int, encode: Callable[[str], list[int]],
               num_docs: tuple[int, int] = (4, 8), doc_tokens: tuple[int, int] = (150, 400)
               ) -> list[QAItem]:
    """`num_items` items, half single-hop and half two-hop (alternating)."""
    rng = random.Random(seed)
    return [make_item(rng, encode, rng.randint(*num_docs), doc_tokens, 1 + i % 2)
            for i in range(num_items)]
