"""A guard against questions that differ by one or two swapped content words.

"How do I sort a dictionary by value in Python?" and "... by key in Python?", or "Give me a
synonym for happy." and "... an antonym for happy.", have sentence embeddings 0.93 apart and
nothing the lexical guard (guard.py) knows: closed word lists cannot cover open vocabulary.
`SwapGuard` finds such pairs and asks the embedding model itself whether the swapped words mean
the same thing where they stand:

1. `find_swap`: the two word sequences are aligned (articles dropped; inflections and British
   spellings are one word: "dictionaries"/"dictionary", "sorting"/"sort", "memorise"/
   "memorize"). The pair is a swap when, stop words aside ("do"/"can", "please"), one or two
   content words per side stand in for others between the same neighbours. Anything else (a
   rewording, an added word) is left to the similarity threshold and the lexical guard.
2. `contrastive_form`: words that end alike but start differently ("synonym"/"antonym",
   "inflation"/"deflation", "teaspoon"/"tablespoon", "phone"/"smartphone") almost never mean
   the same: refused without asking the model.
3. `SwapGuard.similarity`: each question is embedded again with its swapped words replaced by
   the tokenizer's mask (one [MASK] per word piece); the direction from the masked question to
   the question is what the swapped words contribute there. The cosine of the two directions
   is high for synonyms ("fix"/"repair", "car"/"automobile") and low for words that change the
   answer ("value"/"key"). Below `min_similarity` (calibrated by `kvstack eval semantic` on the
   tuning pairs only) the cached answer is refused, reason "swapped_word".

It costs one embedder call on two short texts, and only for candidates over the threshold that
the lexical guard let through and that differ by a swap.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstack.semantic.embedder import Embedder

REASON = "swapped_word"
Word = tuple[str, int, int]  # (lowercased word, start, end) in a text
_ARTICLES = frozenset(("a", "an", "the"))
_CONTRACTIONS = {"what's": ("what", "is"), "whats": ("what", "is"), "how's": ("how", "is"),
                 "who's": ("who", "is"), "where's": ("where", "is"),
                 "there's": ("there", "is"), "it's": ("it", "is"), "that's": ("that", "is"),
                 "i'm": ("i", "am"), "you're": ("you", "are"), "we're": ("we", "are"),
                 "they're": ("they", "are"), "i've": ("i", "have"), "i'd": ("i", "would"),
                 "i'll": ("i", "will"), "let's": ("let", "us")}
MAX_SWAPPED = 2  # content words per side; more is a rewording, not a swap
MIN_DERIVED = 5  # letters of a stem that, beginning a longer one, make them one word family
# Chosen by `kvstack eval semantic` on the tuning pairs only: the highest contextual similarity
# of a labelled near-miss's swapped words there (0.881, "delete"/"deactivate my account"),
# plus a 0.02 margin (it prints the calibration).
DEFAULT_MIN_SIMILARITY = 0.90


def _word_set(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Words (letters, inner apostrophes) and numbers; a hyphen splits ("carry-on" -> carry, on).
_TOKEN = re.compile(r"\d+(?:[.,]\d+)*|[^\W\d_]+(?:['’][^\W\d_]+)*", re.UNICODE)

# Function words, question framing and fillers: a difference in these is never a swap (the
# lexical guard sees negations, opposite particles and word order).
STOP_WORDS = _word_set("""
a an the this that these those it its i i'm i've i'd i'll me my mine myself we we're our ours
us you you're your yours yourself he him his she her hers they they're them their theirs one
ones someone somebody something anything everything
what what's whats which who who's whom whose when where where's why how how's whether
is isn't are aren't was were be been being am do does did doing done have has having had
can could will would shall should may might must
please hey hi hello ok okay so and or but if then than also just really very quite too much
many lot lots there there's here of for to from by with about into onto as at in on
between versus vs
explain describe tell give show let lets kindly
some any all each every other another such
way ways method methods
""")

# Endings whose sharing says nothing about meaning ("ill-ness"/"sick-ness", "quick-est"/...).
_ENDINGS = _word_set("""
s es ed ing er est ly ness ment ments tion tions ation ations sion ity ities able ible ful ous
ive al ial ic ical ism ist ists ize ise ization isation ify ence ance ency ancy ship
hood dom less wise ward wards
""")

_IRREGULAR = {
    "children": "child", "men": "man", "women": "woman", "feet": "foot", "teeth": "tooth",
    "mice": "mouse", "geese": "goose", "people": "person", "lives": "life", "knives": "knife",
    "wives": "wife", "halves": "half", "leaves": "leaf", "wolves": "wolf", "shelves": "shelf",
    "ran": "run", "wrote": "write", "written": "write", "bought": "buy", "took": "take",
    "taken": "take", "made": "make", "went": "go", "gone": "go", "ate": "eat", "eaten": "eat",
    "drank": "drink", "drunk": "drink", "drove": "drive", "driven": "drive", "froze": "freeze",
    "frozen": "freeze", "broke": "break", "broken": "break", "chose": "choose",
    "chosen": "choose", "began": "begin", "begun": "begin", "got": "get", "gotten": "get",
    "gave": "give", "given": "give", "kept": "keep", "lost": "lose", "paid": "pay",
    "sold": "sell", "sent": "send", "spent": "spend", "built": "build", "taught": "teach",
    "thought": "think", "caught": "catch", "brought": "bring", "held": "hold", "met": "meet",
    "said": "say", "seen": "see", "slept": "sleep", "spoke": "speak", "spoken": "speak",
    "stood": "stand", "swam": "swim", "swum": "swim", "told": "tell", "won": "win",
    "grew": "grow", "grown": "grow", "knew": "know", "known": "know", "threw": "throw",
    "thrown": "throw", "flew": "fly", "flown": "fly", "drew": "draw", "drawn": "draw",
    "fallen": "fall", "forgot": "forget", "forgotten": "forget", "hid": "hide",
    "hidden": "hide", "shook": "shake", "shaken": "shake", "stole": "steal",
    "stolen": "steal", "understood": "understand", "wore": "wear", "worn": "wear",
}

# British spellings and other variants, rewritten at the end of a word before stemming.
_SPELLING_ENDINGS = (("isation", "ization"), ("isations", "izations"), ("ise", "ize"),
                     ("ised", "ized"), ("ises", "izes"), ("ising", "izing"), ("yse", "yze"),
                     ("ysed", "yzed"), ("ysing", "yzing"), ("our", "or"), ("ours", "ors"),
                     ("tre", "ter"), ("tres", "ters"), ("ogue", "og"), ("ogues", "ogs"),
                     ("ence", "ense"), ("lled", "led"), ("lling", "ling"))
_SPELLING_WORDS = {"grey": "gray", "mum": "mom", "mums": "moms", "tyre": "tire",
                   "tyres": "tires", "aluminium": "aluminum", "cheque": "check"}


@dataclass(frozen=True)
class Swap:
    """The content words one question has where the other has others, and where they are."""

    query_words: tuple[str, ...]
    cached_words: tuple[str, ...]
    query_spans: tuple[tuple[int, int], ...]  # character spans in the query
    cached_spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SwapCheck:
    """What `SwapGuard.check` found for a swap."""

    swap: Swap
    contrastive: bool  # refused by form alone ("synonym"/"antonym"); similarity not asked
    similarity: float | None  # contextual similarity of the swapped words; None if contrastive


def words(text: str) -> list[Word]:
    """(lowercased word, start, end) of every word and number; "'s" of possessives dropped."""
    found = []
    for m in _TOKEN.finditer(text):
        word = m.group().lower().replace("’", "'")
        end = m.end()
        if word.endswith("'s") and word not in STOP_WORDS:
            word, end = word[:-2], end - 2
        found.append((word, m.start(), end))
    return found


def spelling(word: str) -> str:
    """One spelling for variants: "colour" -> "color", "memorise" -> "memorize"."""
    if word in _SPELLING_WORDS:
        return _SPELLING_WORDS[word]
    for british, american in _SPELLING_ENDINGS:
        if word.endswith(british) and len(word) > len(british) + 2:
            return word[: -len(british)] + american
    return word


def stem(word: str) -> str:
    """A light stemmer: inflections of one word share a stem ("dictionaries"/"dictionary",
    "sorting"/"sorted"/"sort", "baking"/"bake"); it never needs to produce a real word."""
    w = _IRREGULAR.get(word, word)
    w = spelling(w)
    if len(w) > 4 and w.endswith("ies"):
        w = w[:-3] + "y"
    elif len(w) > 4 and w.endswith(("sses", "shes", "ches", "xes", "zes")):
        w = w[:-2]
    elif len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    for suffix in ("ing", "ed"):
        base = w[: -len(suffix)]
        if w.endswith(suffix) and len(base) >= 2 and not base.endswith("e") \
                and any(c in "aeiouy" for c in base):
            w = base
            if len(w) > 2 and w[-1] == w[-2] and w[-1] not in "lsz":  # stopped -> stop
                w = w[:-1]
            break
    w = spelling(w)  # again: "differences" -> "difference" -> "differense"
    if len(w) >= 3 and w.endswith("e"):
        w = w[:-1]
    if len(w) > 3 and w.endswith("y"):
        w = w[:-1] + "i"
    return w


def is_stop(word: str) -> bool:
    return word in STOP_WORDS or word[0].isdigit()


def find_swap(query: str, cached: str) -> Swap | None:
    """The swap between two questions, or None when they do not differ by one.

    The word sequences (articles dropped, words compared by stem) are aligned. Every
    difference must be either stop words only ("do"/"can", an added "please": ignored) or a
    swap: content words replaced by content words between the same neighbours, with any stop
    words among them in the same places on both sides. One or two content words per side
    may be swapped in all. Content words that only moved ("in Python" first or last) are
    set aside, with the stop words before them, and the rest aligned again. A difference of
    any other shape (a content word added or dropped, a rephrasing such as "wrote"/"is the
    author of") is a rewording, not a swap: None, left to the similarity threshold and the
    lexical guard."""
    seq_q, seq_c = _sequence(query), _sequence(cached)
    swap = _aligned_swap(seq_q, seq_c)
    if swap is None:  # content words moved elsewhere: align again without them
        unmatched_q, unmatched_c = _unmatched_content(seq_q, seq_c)
        moved = Counter(stem(seq_q[i][0]) for i in unmatched_q) & \
            Counter(stem(seq_c[j][0]) for j in unmatched_c)
        if moved:
            swap = _aligned_swap(_drop_moved(seq_q, unmatched_q, moved),
                                 _drop_moved(seq_c, unmatched_c, moved))
    return swap



def _aligned_swap(seq_q: list[Word], seq_c: list[Word]) -> Swap | None:
    swapped_q: list[Word] = []
    swapped_c: list[Word] = []
    for op, i1, i2, j1, j2 in _opcodes(seq_q, seq_c):
        part_q, part_c = seq_q[i1:i2], seq_c[j1:j2]
        if op == "equal" or all(is_stop(w) for w, _, _ in part_q + part_c):
            continue
        core_q, core_c = _core(part_q), _core(part_c)
        if core_q is None or core_c is None or core_q[0] != core_c[0]:
            return None  # a content word added or dropped, or a rephrasing
        content_q = [w for w in core_q[1] if not is_stop(w[0])]
        content_c = [w for w in core_c[1] if not is_stop(w[0])]
        _drop_derived(content_q, content_c)
        if bool(content_q) != bool(content_c):
            return None  # a word of one family on both sides, and one more: a rewording
        swapped_q += content_q
        swapped_c += content_c
    if not (1 <= len(swapped_q) <= MAX_SWAPPED and 1 <= len(swapped_c) <= MAX_SWAPPED):
        return None
    return Swap(tuple(w for w, _, _ in swapped_q), tuple(w for w, _, _ in swapped_c),
                tuple((a, b) for _, a, b in swapped_q), tuple((a, b) for _, a, b in swapped_c))


def _opcodes(seq_q: list[Word], seq_c: list[Word]) -> Sequence[tuple[str, int, int, int, int]]:
    return difflib.SequenceMatcher(None, [stem(w) for w, _, _ in seq_q],
                                   [stem(w) for w, _, _ in seq_c],
                                   autojunk=False).get_opcodes()


def _unmatched_content(seq_q: list[Word], seq_c: list[Word]) -> tuple[list[int], list[int]]:
    """Indexes of each side's content words outside the alignment's equal blocks."""
    unmatched_q, unmatched_c = [], []
    for op, i1, i2, j1, j2 in _opcodes(seq_q, seq_c):
        if op != "equal":
            unmatched_q += [i for i in range(i1, i2) if not is_stop(seq_q[i][0])]
            unmatched_c += [j for j in range(j1, j2) if not is_stop(seq_c[j][0])]
    return unmatched_q, unmatched_c


def _drop_moved(seq: list[Word], unmatched: list[int], moved: Counter[str]) -> list[Word]:
    """`seq` without its unaligned occurrences of the `moved` words, each with the stop words
    just before it ("in Python")."""
    left, drop = Counter(moved), set()
    for i in unmatched:
        if left[stem(seq[i][0])] > 0:
            left[stem(seq[i][0])] -= 1
            drop.add(i)
            j = i - 1
            while j >= 0 and is_stop(seq[j][0]) and j not in drop:
                drop.add(j)
                j -= 1
    return [w for i, w in enumerate(seq) if i not in drop]


def _sequence(text: str) -> list[Word]:
    """The words of `text` to align: articles dropped, contractions of stop words expanded
    ("what's" -> "what is")."""
    seq = []
    for word, start, end in words(text):
        if word not in _ARTICLES:
            seq += [(w, start, end) for w in _CONTRACTIONS.get(word, (word,))]
    return seq


def _core(part: list[Word]) -> tuple[tuple[bool, ...], list[Word]] | None:
    """The shape of one side of a swap (where stop words stand among its words; () if
    nowhere) and its words, or None if stop words lead or trail it: the words next to a
    swapped word are the same on both sides ("by value"/"by key"); "is the author of" for
    "wrote" or "how many people live in" for "what is the population of" are rewordings."""
    stops = tuple(is_stop(w) for w, _, _ in part)
    if not part or stops[0] or stops[-1]:
        return None
    return (stops if any(stops) else ()), part


def _drop_derived(part_q: list[Word], part_c: list[Word]) -> None:
    """Remove pairs of one word family ("differ"/"difference") from two swapped spans."""
    for x in list(part_q):
        y = next((y for y in part_c if derived(stem(x[0]), stem(y[0]))), None)
        if y is not None:
            part_q.remove(x)
            part_c.remove(y)


def derived(a: str, b: str) -> bool:
    """Stems of one family: the shorter (5 letters or more) begins the longer ("differ" and
    "differenc", "creat" and "creation", "install" and "installation")."""
    short, long = sorted((a, b), key=len)
    return len(short) >= MIN_DERIVED and long.startswith(short)


def contrastive_form(a: str, b: str) -> bool:
    """`a` and `b` end alike but start differently, and what they share is more than a common
    ending such as "-ness" or "-ation": "synonym"/"antonym", "import"/"export",
    "teaspoon"/"tablespoon", "freezing"/"sneezing", "phone"/"smartphone"."""
    a, b = spelling(a), spelling(b)
    if stem(a) == stem(b) or derived(stem(a), stem(b)):
        return False
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    if n < 4 or a[-n:] in _ENDINGS:
        return False
    return n >= max(len(a), len(b)) - n  # the shared ending is at least as long as the rest


def masked(text: str, spans: Sequence[tuple[int, int]], masks: Sequence[str]) -> str:
    """`text` with each span replaced by its mask."""
    out, last = [], 0
    for (start, end), mask in sorted(zip(spans, masks, strict=True)):
        out += [text[last:start], mask]
        last = end
    out.append(text[last:])
    return "".join(out)


class SwapGuard:
    """Refuses a cached question that differs from the query by a swap of words that the
    embedding model does not show to mean the same thing there."""

    def __init__(self, embedder: Embedder,
                 min_similarity: float = DEFAULT_MIN_SIMILARITY) -> None:
        self.embedder = embedder
        self.min_similarity = min_similarity

    def check(self, query: str, cached: str, query_vector: np.ndarray | None = None,
              cached_vector: np.ndarray | None = None) -> SwapCheck | None:
        """None when the questions do not differ by a swap; otherwise what the test found.
        The vectors are the questions' embeddings if the caller has them (else computed)."""
        swap = find_swap(query, cached)
        if swap is None:
            return None
        if any(contrastive_form(a, b) for a in swap.query_words for b in swap.cached_words):
            return SwapCheck(swap, True, None)
        return SwapCheck(swap, False, self.similarity(query, cached, swap, query_vector,
                                                      cached_vector))

    def reject_reason(self, query: str, cached: str, query_vector: np.ndarray | None = None,
                      cached_vector: np.ndarray | None = None) -> str | None:
        """"swapped_word" if `query` must not get `cached`'s answer, else None."""
        found = self.check(query, cached, query_vector, cached_vector)
        return None if found is None else self.verdict(found)

    def verdict(self, found: SwapCheck) -> str | None:
        if found.contrastive or (found.similarity or 0.0) < self.min_similarity:
            return REASON
        return None

    def similarity(self, query: str, cached: str, swap: Swap,
                   query_vector: np.ndarray | None = None,
                   cached_vector: np.ndarray | None = None) -> float:
        """Cosine of (question - question with its swapped words masked) for both sides."""
        texts = [masked(query, swap.query_spans, self._masks(swap.query_words)),
                 masked(cached, swap.cached_spans, self._masks(swap.cached_words))]
        if query_vector is None or cached_vector is None:
            texts += [query, cached]
        vectors = self.embedder.embed(texts)
        full_q = query_vector if query_vector is not None else vectors[2]
        full_c = cached_vector if cached_vector is not None else vectors[3]
        return direction_similarity(full_q - vectors[0], full_c - vectors[1])

    def _masks(self, swapped: Sequence[str]) -> list[str]:
        """Each word's mask: the embedder's mask token once per tokenizer piece of the word
        (when the embedder tells them), else "[MASK]"."""
        token = getattr(self.embedder, "mask_token", None) or "[MASK]"
        count = getattr(self.embedder, "num_pieces", None)
        return [" ".join([token] * (count(w) if count is not None else 1)) for w in swapped]


def direction_similarity(u: np.ndarray, v: np.ndarray) -> float:
    norm = float(np.linalg.norm(u) * np.linalg.norm(v))
    return float(np.dot(u, v)) / norm if norm > 0 else 0.0  # nothing to compare: refuse
