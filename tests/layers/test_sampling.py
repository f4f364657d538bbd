"""SamplingParams validation and the Sampler: greedy, seeded draws, filters, penalties."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack.errors import InvalidRequestError
from kvstack.layers.sampler import (
    Sampler,
    SamplingState,
    apply_penalties,
    argmax_rows,
    make_generator,
    top_logprobs,
)
from kvstack.sampling_params import SamplingParams

VOCAB = 64


def state(
    prompt: list[int] | None = None, output: list[int] | None = None, **params: Any
) -> SamplingState:
    return SamplingState(SamplingParams(**params), prompt or [], output or [])


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw_many(logits_row: torch.Tensor, count: int, **params: Any) -> list[int]:
    """`count` independent draws from one logits vector: a batch of differently seeded rows."""
    states = [state(seed=i, **params) for i in range(count)]
    token_ids, _ = Sampler()(logits_row.expand(count, -1), states)
    return token_ids


# --- SamplingParams ---------------------------------------------------------------------------


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.stop, p.stop_token_ids) == (None, 16, [], None)
    assert (p.ignore_eos, p.logprobs, p.skip_special_tokens) == (False, None, True)
    assert not p.include_stop_str_in_output
    assert not p.greedy and not p.has_penalties


def test_stop_is_normalized_to_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]  # type: ignore[arg-type]


def test_greedy_and_penalty_flags() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(frequency_penalty=2).has_penalties


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0), ("n", True), ("best_of", 0), ("best_of", 1.5),
        ("temperature", -0.1), ("temperature", "hot"), ("temperature", float("nan")),
        ("temperature", None), ("temperature", True),
        ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1), ("top_p", "1"),
        ("top_k", -2), ("top_k", 1.5), ("top_k", True),
        ("min_p", -0.01), ("min_p", 1.5),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", 2.5), ("presence_penalty", -2.01),
        ("frequency_penalty", 3), ("frequency_penalty", "0"),
        ("seed", 1.0), ("seed", "42"), ("seed", False),
        ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 3.0), ("max_tokens", True),
        ("stop", ""), ("stop", ["ok", ""]), ("stop", 5), ("stop", ["a", 3]),
        ("stop_token_ids", [1, -1]), ("stop_token_ids", "12"), ("stop_token_ids", [True]),
        ("ignore_eos", 1), ("skip_special_tokens", "yes"), ("include_stop_str_in_output", None),
        ("logprobs", 21), ("logprobs", -1), ("logprobs", 1.0), ("prompt_logprobs", 21),
    ],
)
def test_invalid_params_raise_one_line_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert field in message and "\n" not in message and "must be" in message


@settings(max_examples=50, deadline=None)
@given(
    st.one_of(
        st.tuples(st.just("temperature"), st.floats(max_value=-1e-9)),
        st.tuples(st.just("top_p"), st.floats().filter(lambda x: not 0 < x <= 1)),
        st.tuples(st.just("min_p"), st.floats().filter(lambda x: not 0 <= x <= 1)),
        st.tuples(st.just("top_k"), st.integers(max_value=-2)),
        st.tuples(st.just("max_tokens"), st.integers(max_value=0)),
        st.tuples(st.just("presence_penalty"), st.floats().filter(lambda x: not -2 <= x <= 2)),
        st.tuples(st.just("frequency_penalty"), st.floats().filter(lambda x: not -2 <= x <= 2)),
        st.tuples(st.just("repetition_penalty"), st.floats(max_value=0)),
        st.tuples(st.sampled_from(["temperature", "top_k", "seed"]), st.text(max_size=200)),
    )
)
def test_any_out_of_range_value_is_rejected(field_value: tuple[str, Any]) -> None:
    field, value = field_value
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value) and "\n" not in str(err.value)


@settings(max_examples=50, deadline=None)
@given(
    temperature=st.floats(0, 100),
    top_p=st.floats(1e-6, 1),
    top_k=st.integers(-1, 10**6),
    min_p=st.floats(0, 1),
    penalty=st.floats(-2, 2),
    seed=st.integers(-(2**70), 2**70) | st.none(),
)
def test_in_range_values_are_accepted(
    temperature: float, top_p: float, top_k: int, min_p: float, penalty: float, seed: int | None
) -> None:
    SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        presence_penalty=penalty, frequency_penalty=penalty, seed=seed,
    )
    assert (make_generator(seed) is None) == (seed is None)


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = random_logits(6)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # tie: token 10 must win
    token_ids, logprobs = Sampler()(logits, [state(temperature=0) for _ in range(6)])
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert token_ids[3] == 10
    assert logprobs is None


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 300), seed=st.integers(0, 2**16),
       special=st.sampled_from(["none", "ties", "nan", "inf", "-inf", "strided"]))
def test_argmax_rows_is_torch_argmax(rows: int, vocab: int, seed: int, special: str) -> None:
    """The NumPy fast path keeps torch.argmax's rules: first index on ties, NaN as the max."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (rows, vocab), generator=g).float()  # many exact ties
    marks = torch.rand(rows, vocab, generator=g) < 0.1
    if special in ("nan", "inf", "-inf"):
        logits[marks] = float(special)
    if special == "strided":  # a non-contiguous view (every other column)
        logits = torch.cat([logits, logits], dim=1)[:, ::2]
    assert argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits.double()).tolist() == logits.double().argmax(dim=-1).tolist()


def test_greedy_rows_in_a_mixed_batch_stay_argmax() -> None:
    logits = random_logits(4, seed=1)
    states = [state(temperature=0), state(seed=3), state(temperature=0), state(seed=4)]
    token_ids, _ = Sampler()(logits, states)
    assert token_ids[0] == int(logits[0].argmax()) and token_ids[2] == int(logits[2].argmax())


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = random_logits(16, seed=2)
    greedy = logits.argmax(dim=-1).tolist()
    for params in ({"top_k": 1}, {"top_p": 1e-9}, {"top_k": 1, "top_p": 0.5}):
        states = [state(seed=i, temperature=1.5, **params) for i in range(16)]
        assert Sampler()(logits, states)[0] == greedy, params


def test_shape_mismatch_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(random_logits(2), [state()])


# --- seeds ------------------------------------------------------------------------------------


def run_steps(states: list[SamplingState], steps: int, row: int = 0) -> list[int]:
    """Sample `steps` tokens; return row `row`'s tokens.

    Each row's logits depend only on its position in the sequence and its own output so far
    (like a model's), never on its place in the batch.
    """
    sampler, tokens = Sampler(), []
    for step in range(steps):
        logits = torch.cat(
            [random_logits(1, seed=step * 1000 + sum(s.output_token_ids)) * 0.3 for s in states]
        )
        token_ids, _ = sampler(logits, states)
        for s, token in zip(states, token_ids, strict=True):
            s.output_token_ids.append(token)
        tokens.append(token_ids[row])
    return tokens


def test_same_seed_reproduces_and_different_seeds_differ() -> None:
    first = run_steps([state(seed=7)], 40)
    again = run_steps([state(seed=7)], 40)
    other = run_steps([state(seed=8)], 40)
    assert first == again
    assert first != other
    assert len(set(first)) > 5  # nearly flat logits: really sampling, not argmax


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    alone = run_steps([state(seed=11, top_p=0.9, repetition_penalty=1.2)], 30)
    neighbours = [
        state(),  # unseeded: uses the global RNG
        state(seed=11, top_p=0.9, repetition_penalty=1.2),
        state(temperature=0),
        state(seed=5, top_k=3, min_p=0.1),
    ]
    torch.manual_seed(1234)
    batched = run_steps(neighbours, 30, row=1)
    assert batched == alone


def test_seeded_draws_do_not_touch_the_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    run_steps([state(seed=1), state(seed=2)], 5)
    assert torch.equal(torch.rand(3), expected)


# --- filters and temperature, checked on distributions ------------------------------------------


CONTROLLED_PROBS = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])


def test_min_p_excludes_tokens_below_min_p_times_max_prob() -> None:
    # min_p * max = 0.075: tokens 3 (0.06) and 4 (0.04) are out, 2 (0.1) is in.
    draws = draw_many(CONTROLLED_PROBS.log(), 3000, min_p=0.15)
    assert set(draws) == {0, 1, 2}
    assert abs(draws.count(2) / 3000 - 0.1 / 0.9) < 0.03


def test_top_k_keeps_the_k_most_likely() -> None:
    draws = draw_many(CONTROLLED_PROBS.log(), 2000, top_k=2)
    assert set(draws) == {0, 1}
    assert abs(draws.count(1) / 2000 - 0.3 / 0.8) < 0.04


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    # 0.5 + 0.3 reaches 0.75: the nucleus is {0, 1}; 0.85 needs token 2 too. (Exactly 0.8
    # is left out: 0.5 + 0.3 sums to just under 0.8 in float32.)
    assert set(draw_many(CONTROLLED_PROBS.log(), 2000, top_p=0.75)) == {0, 1}
    assert set(draw_many(CONTROLLED_PROBS.log(), 2000, top_p=0.85)) == {0, 1, 2}
    assert set(draw_many(CONTROLLED_PROBS.log(), 2000, top_p=0.45)) == {0}


def test_unfiltered_sampling_follows_the_tempered_distribution() -> None:
    logits = CONTROLLED_PROBS.log()
    draws = draw_many(logits, 4000, temperature=2.0)
    expected = torch.softmax(logits / 2.0, dim=-1)
    for token in range(5):
        assert abs(draws.count(token) / 4000 - float(expected[token])) < 0.03
    assert set(draw_many(logits, 2000)) == {0, 1, 2, 3, 4}


def test_masked_tokens_are_never_drawn() -> None:
    logits = torch.full((VOCAB,), float("-inf"))
    logits[[3, 9]] = 0.0
    assert set(draw_many(logits, 500)) == {3, 9}


# --- penalties --------------------------------------------------------------------------------


def test_penalties_follow_the_formulas_exactly() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0], [2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    original = logits.clone()
    states = [
        # prompt {0, 1}; output 2 twice, 3 once.
        state(prompt=[0, 1], output=[2, 2, 3], repetition_penalty=2.0,
              frequency_penalty=0.5, presence_penalty=0.25),
        state(prompt=[0, 1], output=[2, 2, 3]),  # no penalties: unchanged
    ]
    out = apply_penalties(logits, states)
    rep, freq, pres = 2.0, 0.5, 0.25
    expected = [
        2.0 / rep,  # prompt, positive: divided
        -2.0 * rep,  # prompt, negative: multiplied
        1.0 / rep - freq * 2 - pres,  # output twice
        -1.0 * rep - freq * 1 - pres,  # output once
        0.5,  # never seen
        3.0,
    ]
    assert out[0].tolist() == pytest.approx(expected)
    assert torch.equal(out[1], original[1])
    assert torch.equal(logits, original)  # the input is not modified


def test_penalty_bookkeeping_follows_appended_tokens() -> None:
    logits = random_logits(1, seed=5)
    grown = state(prompt=[1, 2], output=[], frequency_penalty=1.0, repetition_penalty=1.5)
    for token in [4, 4, 9, 2, 4]:
        apply_penalties(logits, [grown])  # builds, then updates, the incremental counts
        grown.output_token_ids.append(token)
    fresh = state(prompt=[1, 2], output=[4, 4, 9, 2, 4], frequency_penalty=1.0,
                  repetition_penalty=1.5)
    assert torch.equal(apply_penalties(logits, [grown]), apply_penalties(logits, [fresh]))
    seen, counts = grown.penalty_tensors(VOCAB, logits.device)
    assert seen.nonzero().flatten().tolist() == [1, 2, 4, 9]
    assert counts[4] == 3 and counts[2] == 1 and counts[1] == 0


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    assert Sampler()(logits, [state(temperature=0)])[0] == [0]
    penalized = state(prompt=[0], temperature=0, repetition_penalty=2.0)  # 5 -> 2.5 < 4
    assert Sampler()(logits, [penalized])[0] == [1]
    presence = state(output=[0], temperature=0, presence_penalty=1.5)  # 5 -> 3.5 < 4
    assert Sampler()(logits, [presence])[0] == [1]


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_at_the_chosen_token() -> None:
    logits = random_logits(4, seed=9)
    states = [
        state(temperature=0, logprobs=1),
        state(seed=1, temperature=0.7, top_k=5, repetition_penalty=1.3, prompt=[1, 2, 3]),
        state(seed=2, min_p=0.2, logprobs=0),
        state(temperature=0, frequency_penalty=1.0, output=[int(logits[3].argmax())]),
    ]
    token_ids, logprobs = Sampler()(logits, states)
    assert logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)
    for row, token in enumerate(token_ids):
        assert math.isclose(logprobs[row], float(raw[row, token]), abs_tol=1e-6)


def test_bfloat16_logits_are_accepted() -> None:
    logits = random_logits(3, seed=4).to(torch.bfloat16)
    states = [state(temperature=0, logprobs=0), state(seed=1), state(seed=2, top_p=0.5)]
    token_ids, logprobs = Sampler()(logits, states)
    assert token_ids[0] == int(logits[0].argmax())
    assert logprobs is not None and all(lp <= 0 for lp in logprobs)


# --- top logprobs and guides ------------------------------------------------------------------


def test_top_logprobs_are_the_k_most_likely_of_the_raw_distribution() -> None:
    logits = random_logits(3, seed=5)
    top = top_logprobs(logits, [3, 0, 1])
    raw = torch.log_softmax(logits, dim=-1)
    values, ids = raw.topk(3, dim=-1)
    assert [t for t, _ in top[0]] == ids[0].tolist()
    assert all(math.isclose(v, float(w), abs_tol=1e-6) for (_, v), w in zip(top[0], values[0],
                                                                            strict=True))
    assert top[1] == [] and len(top[2]) == 1 and top[2][0][0] == int(ids[2, 0])
    assert top_logprobs(logits, [0, 0, 0]) == [[], [], []]


class OnlyThese:
    """A guide that allows a fixed set of tokens."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.allowed] = True
        return mask


@pytest.mark.parametrize("params", [
    {"temperature": 0}, {"temperature": 0, "repetition_penalty": 1.5},
    {"seed": 3}, {"seed": 4, "top_k": 3}, {"seed": 5, "top_p": 0.2, "min_p": 0.5},
])
def test_a_guided_row_only_ever_takes_an_allowed_token(params: dict[str, Any]) -> None:
    logits = random_logits(2, seed=8)
    allowed = torch.argsort(logits[0])[:3].tolist()  # the three least likely tokens
    guided = state(prompt=[int(logits[0].argmax())], **params)
    guided.guide = OnlyThese(allowed)
    for _ in range(20):
        (token, free), logprobs = Sampler()(logits, [guided, state(temperature=0, logprobs=0)])
        assert token in allowed and free == int(logits[1].argmax())
    if params == {"temperature": 0}:
        assert token == max(allowed, key=lambda t: float(logits[0, t]))
        assert logprobs is not None  # raw distribution: the masked token's own log-prob
        assert math.isclose(logprobs[0], float(torch.log_softmax(logits[0], -1)[token]),
                            abs_tol=1e-6)


def test_a_guide_that_allows_the_greedy_token_changes_nothing() -> None:
    logits = random_logits(4, seed=6)
    plain = Sampler()(logits, [state(temperature=0) for _ in range(4)])[0]
    states = [state(temperature=0) for _ in range(4)]
    for s, token in zip(states, plain, strict=True):
        s.guide = OnlyThese([token, (token + 1) % VOCAB])
    assert Sampler()(logits, states)[0] == plain
    seeded = [state(seed=i, temperature=0.8) for i in range(4)]
    free = Sampler()(logits, seeded)[0]
    again = [state(seed=i, temperature=0.8) for i in range(4)]
    again[1].guide = OnlyThese(list(range(VOCAB)))  # a guide elsewhere leaves seeded rows alone
    assert Sampler()(logits, again)[0] == free
