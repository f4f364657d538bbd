"""Parallel samples at the scheduler level, with a fake model (no torch): one prefill, forks
that share the prompt's blocks, copy-on-write of the shared tail, and everything that can
happen to one sample (chunked prefill, preemption, abort) while the pool stays consistent.

The fake model writes each computed token id into its slot and reads the context back
through the request's block table; sample i's next token is a function of that context plus
i, so samples diverge at once and a block written while shared, or a copy that missed, shows
up as a wrong context or a wrong output. Every run is compared with `reference`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack.config import SchedulerConfig
from kvstack.engine.detokenizer import IncrementalDetokenizer, NullDecoder
from kvstack.engine.request import Request
from kvstack.engine.scheduler import Scheduler
from kvstack.kv.coordinator import KVCacheCoordinator
from kvstack.kv.manager import KVCacheManager
from kvstack.samples.groups import sample_ids
from kvstack.sampling_params import SamplingParams

VOCAB = 50


def next_token(context: Sequence[int], index: int) -> int:
    acc = 0
    for t in context:
        acc = (acc * 31 + t + 1) % 1_000_003
    return (acc + index) % VOCAB


def reference(prompt: Sequence[int], max_tokens: int, index: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq, index))
    return seq[len(prompt):]


class ForkEngine:
    """schedule -> write/read slots -> after_step -> append/finish, over the fake model."""

    def __init__(self, num_blocks: int, block_size: int, budget: int,
                 prefix_caching: bool = True) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching, "fake",
                                 on_copy=self._copy)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=16,
                                                   max_num_batched_tokens=budget),
                                   KVCacheCoordinator(self.kv))
        self.bs = block_size
        self.slots: dict[int, int] = {}
        self.requests: list[Request] = []
        self.num_prefill_tokens = 0

    def _copy(self, src: int, dst: int) -> None:
        for j in range(self.bs):
            if src * self.bs + j in self.slots:
                self.slots[dst * self.bs + j] = self.slots[src * self.bs + j]

    def add_group(self, name: str, prompt: list[int], n: int, max_tokens: int) -> list[Request]:
        samples = [Request(rid, None, list(prompt),
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           max_tokens, IncrementalDetokenizer(NullDecoder(), prompt),
                           parent_request_id=name, sample_index=i)
                   for i, rid in enumerate(sample_ids(name, n))]
        samples[0].pending_forks = samples[1:]
        self.scheduler.add(samples[0])
        self.requests += samples
        return samples

    def _slot(self, request: Request, pos: int) -> int:
        return self.kv.blocks(request.request_id)[pos // self.bs].block_id * self.bs + pos % self.bs

    def step(self) -> None:
        out = self.scheduler.schedule()
        for s in out.scheduled:
            r = s.request
            if s.num_new_tokens == 0:  # a fork follows its leader, sharing its prompt
                assert r.num_computed_tokens == r.num_tokens == r.num_prompt_tokens
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens):
                block = self.kv.blocks(r.request_id)[pos // self.bs]
                # Only the prefill that forks writes blocks its forks already hold (the prompt
                # they share); any other write into a shared block is a missed copy.
                forking = pos < r.num_prompt_tokens and not r.output_token_ids
                assert block.ref_cnt == 1 or forking, "write into a block another sample holds"
                self.slots[self._slot(r, pos)] = r.token_ids()[pos]
            self.num_prefill_tokens += s.num_new_tokens if not r.output_token_ids else 0
        sampled = []
        for s in out.scheduled:
            r = s.request
            end = r.num_computed_tokens + s.num_new_tokens
            context = [self.slots[self._slot(r, pos)] for pos in range(end)]
            assert context == r.token_ids()[:end], "block table reads the wrong K/V"
            sampled.append(next_token(context, r.sample_index) if s.samples else None)
        self.scheduler.after_step(out)
        for s, token in zip(out.scheduled, sampled, strict=True):
            if token is not None and not s.request.finished:
                s.request.output_token_ids.append(token)
                if len(s.request.output_token_ids) >= s.request.max_tokens:
                    self.scheduler.finish(s.request, "length")
        self.kv.check_integrity()

    def run(self, abort: tuple[int, str] | None = None) -> None:
        for step in range(3000):
            if not self.scheduler.has_unfinished():
                return
            if abort is not None and step == abort[0]:
                victim = next(r for r in self.requests if r.request_id == abort[1])
                self.scheduler.finish(victim, "abort")
            self.step()
        raise AssertionError("unfinished")


def test_one_prefill_then_forks_share_every_prompt_block() -> None:
    eng = ForkEngine(num_blocks=64, block_size=4, budget=64)
    prompt = list(range(10))  # 2 full blocks + 2 tokens of a third
    samples = eng.add_group("g", prompt, 4, 5)
    eng.step()  # the prefill: sample 0 computes, the other 3 fork from it
    assert all(eng.kv.block_ids(r.request_id) == eng.kv.block_ids("g#0") for r in samples)
    assert eng.kv.pool.num_in_use == 3 and eng.num_prefill_tokens == 10
    assert all(b.ref_cnt == 4 for b in eng.kv.blocks("g#0"))
    eng.step()  # each writes its first token into the shared tail: 3 copies, one in place
    assert eng.kv.num_copied_blocks == 3
    full = eng.kv.blocks("g#0")[:2]
    assert all(eng.kv.blocks(r.request_id)[:2] == full for r in samples)
    assert len({eng.kv.block_ids(r.request_id)[2] for r in samples}) == 4
    eng.run()
    assert [r.output_token_ids for r in samples] == [reference(prompt, 5, i) for i in range(4)]
    assert eng.kv.pool.num_in_use == 0 and eng.kv.num_copied_blocks == 3


def test_a_prompt_ending_on_a_block_boundary_copies_nothing() -> None:
    eng = ForkEngine(num_blocks=64, block_size=4, budget=64)
    samples = eng.add_group("g", list(range(8)), 3, 4)
    eng.run()
    assert eng.kv.num_copied_blocks == 0
    assert [r.output_token_ids for r in samples] == [reference(range(8), 4, i) for i in range(3)]


@settings(max_examples=60, deadline=None)
@given(
    prompt_len=st.integers(1, 23),
    n=st.integers(2, 5),
    max_tokens=st.integers(1, 9),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(3, 40),
    spare_blocks=st.integers(0, 12),
    prefix_caching=st.booleans(),
    abort=st.one_of(st.none(), st.tuples(st.integers(0, 12), st.integers(0, 4))),
    other=st.booleans(),
)
def test_samples_are_exact_under_chunking_preemption_and_abort(
        prompt_len: int, n: int, max_tokens: int, block_size: int, budget: int,
        spare_blocks: int, prefix_caching: bool, abort: tuple[int, int] | None,
        other: bool) -> None:
    per_sample = -(-(prompt_len + max_tokens) // block_size)
    # Tight pools force preemption; the largest sample always fits alone.
    eng = ForkEngine(num_blocks=per_sample + spare_blocks, block_size=block_size,
                     budget=budget, prefix_caching=prefix_caching)
    prompt = [(7 * i + 3) % VOCAB for i in range(prompt_len)]
    samples = eng.add_group("g", prompt, n, max_tokens)
    if other:  # a second group competing for blocks
        eng.add_group("h", prompt[: max(1, prompt_len // 2)], 2, max_tokens)
    victim = f"g#{abort[1] % n}" if abort else None
    eng.run((abort[0], victim) if abort and victim else None)
    for r in samples:
        if r.request_id == victim and r.finish_reason == "abort":
            assert r.output_token_ids == reference(prompt, max_tokens, r.sample_index)[
                :len(r.output_token_ids)]
        else:
            assert r.output_token_ids == reference(prompt, max_tokens, r.sample_index)
    assert eng.kv.pool.num_in_use == 0
    eng.kv.check_integrity()
