"""A cheap lexical guard against near-misses that embeddings rank as close.

Sentence embeddings place "What is 15% of 80?" and "What is 15% of 60?", or "Is coffee bad for
you?" and "Is coffee not bad for you?", closer than many true paraphrases. `reject_reason`
compares what such pairs differ in — numbers and arithmetic, named entities, negations,
opposite words, and the order of entities — and names the first difference it finds.
It errs towards rejecting: a rejected paraphrase only costs a model run.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_TOKEN = re.compile(r"\d+(?:[.,]\d+)*(?:st|nd|rd|th)?|[^\W\d_][\w'’-]*", re.UNICODE)
_OPERATOR = re.compile(r"(?<=[\d\s])([+*/^×÷=<>-])(?=[\s\d])")

# "one" is left out: "which one", "one of" are rarely a count.
_UNITS = {"zero": 0, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
          "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
          "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
          "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
          "seventy": 70, "eighty": 80, "ninety": 90, "dozen": 12, "half": 0.5,
          "first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6,
          "seventh": 7, "eighth": 8, "ninth": 9, "tenth": 10, "twice": 2, "double": 2,
          "triple": 3}
_SCALES = {"hundred": 100, "thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
_OPERATOR_WORDS = {"plus": "+", "minus": "-", "times": "*", "multiplied": "*", "divided": "/",
                   "squared": "^", "cubed": "^", "power": "^"}

_NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "nowhere", "neither", "nor",
              "without", "cannot", "unable", "impossible", "except", "excluding", "fail",
              "fails", "failed", "failing", "lack", "lacks", "lacking", "avoid", "avoiding",
              "dont", "doesnt", "didnt", "cant", "wont", "isnt", "arent", "wasnt", "werent",
              "shouldnt", "wouldnt", "couldnt", "havent", "hasnt", "aint"}

# Opposite poles; a pair rejects when both texts use the group but on different sides.
_OPPOSITES: tuple[tuple[frozenset[str], frozenset[str]], ...] = tuple(
    (_words(a), _words(b)) for a, b in (
        ("more most greater greatest increase increases increasing raise", "less least fewer "
         "fewest lower lowest decrease decreases decreasing reduce"),
        ("big bigger biggest large larger largest long longer longest tall taller tallest "
         "high higher highest max maximum", "small smaller smallest little short shorter "
         "shortest low min minimum"),
        ("fast faster fastest quick quicker quickest speed", "slow slower slowest"),
        ("good better best", "bad worse worst"),
        ("cheap cheaper cheapest", "expensive costly pricier"),
        ("hot hotter hottest warm warmer heat", "cold colder coldest cool cooler"),
        ("old older oldest", "new newer newest young younger youngest"),
        ("before earlier first", "after later last"),
        ("above over", "below under"),
        ("install installing installed", "uninstall uninstalling uninstalled remove removing"),
        ("add adding insert", "delete deleting remove removing drop"),
        ("enable enabling enabled", "disable disabling disabled"),
        ("encrypt encrypting encryption", "decrypt decrypting decryption"),
        ("encode encoding", "decode decoding"),
        ("start starting begin", "stop stopping end finish"),
        ("open opening", "close closing"),
        ("buy buying", "sell selling"),
        ("import importing", "export exporting"),
        ("upload uploading", "download downloading"),
        ("push pushing", "pull pulling"),
        ("win winning", "lose losing"),
        ("gain gaining", "lose losing loss"),
        ("advantages pros benefits", "disadvantages cons drawbacks risks"),
        ("true", "false"),
        ("left", "right"),
        ("north northern", "south southern"),
        ("east eastern", "west western"),
        ("lock locking", "unlock unlocking"),
        ("compress compressing compression", "decompress decompressing decompression"),
        ("serialize serialization", "deserialize deserialization"),
        ("positive", "negative"),
        ("safe safely", "unsafe dangerous"),
        ("healthy", "unhealthy"),
        ("legal legally", "illegal illegally"),
        ("odd", "even"),
        ("horizontal horizontally", "vertical vertically"),
        ("ascending", "descending"),
        ("maximize", "minimize"),
        ("increment", "decrement"),
        ("inside internal", "outside external"),
        ("male men man", "female women woman"),
    )
)

# Words that start sentences in capitals without being names; for other words a capital
# marks a candidate entity (sentence-initial included: "Paris" can start a question).
_COMMON = _words("""
a an the this that these those it its i i'm i've i'd me my mine we our us you your yours he
she they them their his her what what's whats which who who's whom whose when where where's
why how how's is are was were be been being am do does did done have has had can could will
would shall should may might must please hey hi hello ok okay so and or but if then also just
now there there's here in on at of for to from by with about into as
explain describe tell give list show write summarize summarise define name compare help
translate convert calculate compute find suggest recommend create make generate tell
provide outline illustrate clarify teach walk let lets let's say state identify estimate
quick briefly brief simple simply yes any some all each every one
""")


@dataclass(frozen=True)
class Features:
    numbers: Counter[str]  # normalized values: "10,000" and "ten thousand" agree
    operators: frozenset[str]
    entities: tuple[str, ...]  # lowercased, in order of first appearance
    words: frozenset[str]  # every lowercased word, possessives stripped
    num_negations: int


def features(text: str) -> Features:
    tokens = _TOKEN.findall(text)
    words: list[str] = []
    entities: list[str] = []
    numbers: Counter[str] = Counter()
    operators = {m.group(1).replace("×", "*").replace("÷", "/")
                 for m in _OPERATOR.finditer(text)}
    negations = 0
    pending: list[float] = []  # a run of number words: "twenty five thousand"

    def flush() -> None:
        if pending:
            numbers[_spelled_value(pending)] += 1
            pending.clear()

    for token in tokens:
        if token[0].isdigit():
            flush()
            numbers[_digits_value(token)] += 1
            continue
        word = _strip_possessive(token.lower().replace("’", "'"))
        words.append(word)
        if "-" in word:  # "highest-paying" says "highest"
            words.extend(part for part in word.split("-") if part)
        if word in _UNITS or word in _SCALES:
            pending.append(_UNITS.get(word) or _SCALES[word])
            continue
        if word != "and" or not pending:
            flush()
        if word in _OPERATOR_WORDS:
            operators.add(_OPERATOR_WORDS[word])
        if word in _NEGATIONS or word.endswith("n't") or word.startswith("non-"):
            negations += 1
        if _is_capitalized(token) and word not in _COMMON and word not in entities:
            entities.append(word)
    flush()
    return Features(numbers, frozenset(operators), tuple(entities), frozenset(words),
                    negations)


def reject_reason(query: str, cached: str) -> str | None:
    """Why `query` must not be answered with the answer to `cached`, or None if nothing
    lexical tells them apart. Reasons: number, entity, negation, opposite, order."""
    a, b = features(query), features(cached)
    if a.numbers != b.numbers or (a.operators != b.operators and (a.numbers or b.numbers)):
        return "number"
    if any(e not in b.words for e in a.entities) or any(e not in a.words for e in b.entities):
        return "entity"
    if a.num_negations != b.num_negations:
        return "negation"
    for pos, neg in _OPPOSITES:
        sides_a = (bool(a.words & pos), bool(a.words & neg))
        sides_b = (bool(b.words & pos), bool(b.words & neg))
        if any(sides_a) and any(sides_b) and sides_a != sides_b:
            return "opposite"
    if _order(a, b.words) != _order(b, a.words):
        return "order"
    return None


def _order(f: Features, other_words: frozenset[str]) -> list[str]:
    """Entities that both texts name, in this text's order ("Paris to Rome" vs "Rome to
    Paris")."""
    shared = [e for e in f.entities if e in other_words]
    return shared if len(shared) >= 2 else []


def _is_capitalized(token: str) -> bool:
    return token[0].isupper() or any(c.isupper() for c in token[1:])


def _strip_possessive(word: str) -> str:
    return word[:-2] if word.endswith("'s") else word


def _digits_value(token: str) -> str:
    token = re.sub(r"(st|nd|rd|th)$", "", token)
    if re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d+)?", token):  # 10,000 and 1,234.5
        token = token.replace(",", "")
    token = token.replace(",", ".")  # a decimal comma: 1,5
    try:
        return _number(float(token))
    except ValueError:  # "1.2.3": a version, compared as written
        return token


def _number(value: float) -> str:
    return f"{value:.12g}"


def _spelled_value(values: list[float]) -> str:
    total, current = 0.0, 0.0
    for v in values:
        if v >= 100:
            current = (current or 1) * v
            if v >= 1000:
                total, current = total + current, 0.0
        else:
            current += v
    return _number(total + current)
