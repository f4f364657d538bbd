"""A cheap lexical guard against near-misses that embeddings rank as close.

Sentence embeddings place "What is 15% of 80?" and "What is 15% of 60?", or "Is coffee bad for
you?" and "Is coffee not bad for you?", closer than many true paraphrases. `reject_reason`
compares what such pairs differ in — numbers and arithmetic, named entities, negations,
opposite words, members of small closed classes (colours, units, seasons, ...) and word
order — and names the first difference it finds. It errs towards rejecting: a rejected
paraphrase only costs a model run, a wrong hit serves a wrong answer.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_TOKEN = re.compile(r"\d+(?:[.,]\d+)*(?:st|nd|rd|th)?|[^\W\d_][\w'’-]*", re.UNICODE)
_OPERATOR = re.compile(r"(?<=[\d\s])([+*/^×÷=<>-])(?=[\s\d])")

# -- numbers ---------------------------------------------------------------------------------

# "one" is left out: "which one", "one of" are rarely a count.
_NUMBER_WORDS = {
    "zero": 0, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
    "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14,
    "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19,
    "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
    "eighty": 80, "ninety": 90, "dozen": 12, "half": 0.5, "first": 1, "second": 2, "third": 3,
    "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7, "eighth": 8, "ninth": 9, "tenth": 10,
    "twice": 2, "double": 2, "triple": 3,
}
_SCALES = {"hundred": 100, "thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
_ROMAN = {"II": 2, "III": 3, "IV": 4, "VI": 6, "VII": 7, "VIII": 8, "IX": 9, "XI": 11, "XII": 12,
          "XIII": 13, "XIV": 14, "XV": 15, "XVI": 16, "XVII": 17, "XVIII": 18, "XIX": 19,
          "XX": 20}  # "I", "V", "X" alone are too often letters
_OPERATOR_WORDS = {"plus": "+", "minus": "-", "times": "*", "multiplied": "*", "divided": "/",
                   "squared": "^", "cubed": "^", "power": "^"}

# -- negations -------------------------------------------------------------------------------

_NEGATIONS = _words("""
not no never none nobody nothing nowhere neither nor without cannot unable impossible except
excluding fail fails failed failing lack lacks lacking avoid avoiding dont doesnt didnt cant
wont isnt arent wasnt werent shouldnt wouldnt couldnt havent hasnt aint
""")
_NEGATING_PREFIXES = ("un", "dis", "de", "non", "non-", "in", "im", "il", "ir", "anti")

# -- opposites -------------------------------------------------------------------------------

_OPPOSITE_ROOTS = (
    ("more most great increase raise", "less least few decrease reduce low"),
    ("big large long tall high max maximum maximize", "small little short low min minimum "
     "minimize"),
    ("fast quick speed", "slow"),
    ("good better best", "bad worse worst"),
    ("cheap", "expensive costly pricey"),
    ("hot warm heat", "cold cool chill"),
    ("old", "new young"),
    ("before early first", "after late last"),
    ("above over top upper", "below under bottom low"),
    ("install", "uninstall remove"),
    ("add insert", "delete remove drop"),
    ("enable", "disable"),
    ("encrypt encryption", "decrypt decryption"),
    ("encode", "decode"),
    ("start begin", "stop end finish"),
    ("open", "close"),
    ("buy purchase", "sell"),
    ("import", "export"),
    ("input", "output"),
    ("upload", "download"),
    ("push", "pull"),
    ("win", "lose"),
    ("gain profit", "lose loss"),
    ("advantage pros benefit strength", "disadvantage cons drawback risk weakness"),
    ("true", "false"),
    ("left", "right"),
    ("north northern", "south southern"),
    ("east eastern", "west western"),
    ("positive", "negative"),
    ("odd", "even"),
    ("horizontal", "vertical"),
    ("ascending", "descending"),
    ("light", "heavy"),
    ("light bright", "dark dim"),
    ("wet", "dry"),
    ("thick", "thin"),
    ("easy", "hard difficult"),
    ("soft", "hard"),
    ("strong", "weak"),
    ("full", "empty"),
    ("rich", "poor"),
    ("deep", "shallow"),
    ("wide broad", "narrow"),
    ("near close", "far"),
    ("loud", "quiet"),
    ("clean", "dirty"),
    ("sweet", "sour bitter"),
    ("happy", "sad"),
    ("love", "hate"),
    ("accept", "reject"),
    ("allow permit", "forbid ban block prevent"),
    ("include", "exclude"),
    ("pass", "fail"),
    ("success", "failure"),
    ("front", "back"),
    ("inside internal inner", "outside external outer"),
    ("send", "receive"),
    ("show", "hide"),
    ("visible", "hidden invisible"),
    ("public", "private"),
    ("static", "dynamic"),
    ("uppercase", "lowercase"),
    ("borrow", "lend"),
    ("debit", "credit"),
    ("income", "expense"),
    ("arrive", "depart"),
    ("enter", "exit"),
    ("male man men boy", "female woman women girl"),
    ("asleep sleep", "awake"),
    ("alive", "dead"),
    ("day daytime", "night nighttime"),
    ("forward", "backward"),
    ("sunrise", "sunset"),
    ("remember", "forget"),
    ("beginner", "advanced expert"),
    ("up", "down"),
    ("in", "out"),
    ("on", "off"),
)
_PARTICLES = _words("in on up out off down over under")


def _forms(root: str) -> set[str]:
    """A root's likely inflections (over-generating is harmless: non-words never occur)."""
    forms = {root, root + "s"}
    if root in _PARTICLES:
        return forms
    forms |= {root + s for s in ("es", "ed", "ing", "er", "est", "ly", "ness", "ation")}
    if root.endswith("e"):
        forms |= {root + "d", root + "r", root + "st", root[:-1] + "ing"}
    if root.endswith("y"):
        forms |= {root[:-1] + s for s in ("ies", "ied", "ier", "iest", "ily")}
    if re.fullmatch(r"[^aeiou]*[aeiou][bdgklmnprt]", root):  # big, hot, thin, stop
        forms |= {root + root[-1] + s for s in ("ed", "ing", "er", "est")}
    return forms


_OPPOSITES: tuple[tuple[frozenset[str], frozenset[str]], ...] = tuple(
    (frozenset(f for r in a.split() for f in _forms(r)),
     frozenset(f for r in b.split() for f in _forms(r)))
    for a, b in _OPPOSITE_ROOTS
)

# -- closed classes: both texts name a member, different ones -> different questions ---------


def _kinds() -> dict[str, tuple[str, str]]:
    table = {
        "colour": "red orange yellow green blue purple violet pink brown black white gray=grey "
                  "silver gold",
        "season": "spring summer autumn=fall winter",
        "meal": "breakfast brunch lunch dinner=supper",
        "relative": "mother=mom=mum father=dad son daughter brother sister wife husband "
                    "grandmother grandfather aunt uncle cousin",
        "unit": "millimeter=millimetre=mm centimeter=centimetre=cm meter=metre "
                "kilometer=kilometre=km inch=inches foot=feet=ft yard mile milligram=mg "
                "gram kilogram=kg=kilo pound=lb=lbs ounce=oz ton=tonne milliliter=ml "
                "liter=litre gallon quart pint cup tablespoon=tbsp teaspoon=tsp seconds "
                "minute hour day week month year decade century=centuries dollar euro yen "
                "yuan rupee peso byte kilobyte=kb megabyte=mb gigabyte=gb terabyte=tb "
                "calorie=kcal watt volt amp=ampere joule acre hectare",
    }
    kinds: dict[str, tuple[str, str]] = {}
    for kind, members in table.items():
        for member in members.split():
            names = member.split("=")
            for name in names:
                for form in (name, name + "s", name + "es"):
                    kinds.setdefault(form, (kind, names[0]))
    return kinds


_KINDS = _kinds()

# -- entities and order ----------------------------------------------------------------------

# Words that start sentences in capitals without being names; for other words a capital
# marks a candidate entity (sentence-initial included: "Paris" can start a question).
_COMMON = _words("""
a an the this that these those it its i i'm i've i'd me my mine we our us you your yours he
she they them their his her what whats which who whom whose when where why how is are was
were be been being am do does did done have has had can could will would shall should may
might must please hey hi hello ok okay so and or but if then also just now there here in on
at of for to from by with about into as explain describe tell give list show write summarize
summarise define name compare help translate convert calculate compute find suggest recommend
create make generate provide outline illustrate clarify teach walk let lets say state
identify estimate quick briefly brief simple simply yes any some all each every one
""")
_ARTICLES = _words("a an the")
# Relations whose sides may swap freely: "HTTP vs HTTPS", "how X differs from Y".
_SYMMETRIC = _words("difference differences different differ differs compare compared "
                    "comparison versus vs between")


@dataclass(frozen=True)
class Features:
    numbers: Counter[str]  # normalized values: "10,000" and "ten thousand" agree
    operators: frozenset[str]
    entities: tuple[str, ...]  # lowercased, in order of first appearance
    sequence: tuple[str, ...]  # every lowercased word in order, possessives stripped
    words: frozenset[str]  # the sequence's words, and the parts of hyphenated ones
    kinds: dict[str, frozenset[str]]  # closed class -> canonical members named
    num_negations: int


def features(text: str) -> Features:
    numbers: Counter[str] = Counter()
    operators = {m.group(1).replace("×", "*").replace("÷", "/")
                 for m in _OPERATOR.finditer(text)}
    sequence: list[str] = []
    entities: list[str] = []
    kinds: dict[str, set[str]] = {}
    negations = 0
    pending: list[float] = []  # a run of number words: "twenty five thousand"

    def flush() -> None:
        if pending:
            numbers[_spelled_value(pending)] += 1
            pending.clear()

    for token in _TOKEN.findall(text):
        if token[0].isdigit() or token in _ROMAN:
            flush()
            numbers[_number(_ROMAN[token]) if token in _ROMAN else _digits_value(token)] += 1
            continue
        word = _strip_possessive(token.lower().replace("’", "'"))
        sequence.append(word)
        if word in _NUMBER_WORDS or word in _SCALES:
            pending.append(_NUMBER_WORDS.get(word) or _SCALES[word])
            continue
        if word != "and" or not pending:
            flush()
        if word in _OPERATOR_WORDS:
            operators.add(_OPERATOR_WORDS[word])
        if word in _NEGATIONS or word.endswith("n't") or word.startswith("non-"):
            negations += 1
        if word in _KINDS:
            kind, canonical = _KINDS[word]
            kinds.setdefault(kind, set()).add(canonical)
        if _is_capitalized(token) and word not in _COMMON and word not in entities:
            entities.append(word)
    flush()
    words = set(sequence)
    for word in sequence:
        if "-" in word:  # "highest-paying" says "highest"
            words.update(part for part in word.split("-") if part)
    return Features(numbers, frozenset(operators), tuple(entities), tuple(sequence),
                    frozenset(words), {k: frozenset(v) for k, v in kinds.items()}, negations)


def reject_reason(query: str, cached: str) -> str | None:
    """Why `query` must not be answered with the answer to `cached`, or None if nothing
    lexical tells them apart. Reasons: number, entity, negation, opposite, kind, order."""
    a, b = features(query), features(cached)
    if a.numbers != b.numbers or (a.operators != b.operators and (a.numbers or b.numbers)):
        return "number"
    if any(e not in b.words for e in a.entities) or any(e not in a.words for e in b.entities):
        return "entity"
    if a.num_negations != b.num_negations:
        return "negation"
    if _opposite(a.words, b.words) or _opposite(b.words, a.words):
        return "opposite"
    if any(kind in b.kinds and b.kinds[kind] != members for kind, members in a.kinds.items()):
        return "kind"
    if _swapped(a, b):
        return "order"
    return None


def _opposite(a: frozenset[str], b: frozenset[str]) -> bool:
    """`a` says one pole of an opposite pair and `b` only the other ("install"/"uninstall",
    "fastest"/"slowest"), or `b` negates a word of `a` by prefix ("mount"/"unmount")."""
    for pos, neg in _OPPOSITES:
        if a & pos and not a & neg and b & neg and not b & pos:
            return True
    return any(p + w in b and p + w not in a and w not in b
               for w in a if len(w) >= 4 for p in _NEGATING_PREFIXES)


def _swapped(a: Features, b: Features) -> bool:
    """The same words in another order ("miles to km" / "km to miles"), or shared entities
    in another order ("Paris ... London" / "London ... Paris") unless the relation is
    symmetric ("difference between X and Y")."""
    seq_a = [w for w in a.sequence if w not in _ARTICLES]
    seq_b = [w for w in b.sequence if w not in _ARTICLES]
    if seq_a != seq_b and Counter(seq_a) == Counter(seq_b):
        return True
    if a.words & _SYMMETRIC or b.words & _SYMMETRIC:
        return False
    shared = [e for e in a.entities if e in b.sequence]  # in a's order
    return len(shared) >= 2 and shared != sorted(shared, key=b.sequence.index)


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
