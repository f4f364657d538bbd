"""Scheduler + KVCacheManager with fake requests and a fake model: continuous batching,
chunked prefill, preemption and automatic prefix caching, without torch.

The fake model writes each computed token id into its slot (found through the request's
block table) and picks the next token from the context it reads back through the block
table. A wrong block table, a stale prefix hit or a block overwritten while shared changes
the output, so every run is compared with `reference`, which never caches anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstack.config import SchedulerConfig
from kvstack.engine.detokenizer import IncrementalDetokenizer, NullDecoder
from kvstack.engine.request import Request, RequestStatus
from kvstack.engine.scheduler import Scheduler, SchedulerOutput
from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import BlockPool
from kvstack.kv.coordinator import KVCacheCoordinator
from kvstack.kv.manager import KVCacheManager, PrefixHit
from kvstack.kv.no_cache import NoKVCache
from kvstack.sampling_params import SamplingParams

VOCAB = 50


def next_token(context: Sequence[int]) -> int:
    """The fake model: a deterministic function of the whole context, order included."""
    acc = 0
    for t in context:
        acc = (acc * 31 + t + 1) % 1_000_003
    return acc % VOCAB


def reference(prompt: Sequence[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def make_request(
    request_id: str, prompt: Sequence[int], max_tokens: int, cache_salt: str | None = None
) -> Request:
    ids = list(prompt)
    return Request(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=ids,
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        max_tokens=max_tokens,
        detokenizer=IncrementalDetokenizer(NullDecoder(), ids),
        cache_salt=cache_salt,
    )


class FakeEngine:
    """The engine's step loop (schedule -> run -> after_step -> append/finish) over a fake
    model that stores token ids in slots instead of K/V."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        budget: int,
        max_num_seqs: int = 16,
        enable_prefix_caching: bool = True,
        max_pinned_blocks: int | None = None,
    ) -> None:
        self.kv = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching, "fake-model", max_pinned_blocks
        )
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
        self.scheduler = Scheduler(config, KVCacheCoordinator(self.kv))
        self.block_size = block_size
        self.slots: dict[int, int] = {}
        self.requests: list[Request] = []
        self.trace: list[list[tuple[str, int]]] = []
        self.hashed_tokens: dict[BlockHash, list[int]] = {}

    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    def add(
        self, request_id: str, prompt: Sequence[int], max_tokens: int, salt: str | None = None
    ) -> Request:
        request = make_request(request_id, prompt, max_tokens, salt)
        self.requests.append(request)
        self.scheduler.add(request)
        return request

    def _slot(self, request: Request, pos: int) -> int:
        bs = self.block_size
        return self.kv.blocks(request.request_id)[pos // bs].block_id * bs + pos % bs

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.trace.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        self._check_plan(out)
        # Like attention: every new token is written before any context is read.
        for s in out.scheduled:
            r = s.request
            tokens = r.token_ids()
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens):
                block = self.kv.blocks(r.request_id)[pos // self.block_size]
                assert block.block_hash is None, "write into a published (shared) block"
                assert block.ref_cnt == 1, "write into a block another request holds"
                self.slots[self._slot(r, pos)] = tokens[pos]
        sampled: list[int | None] = []
        for s in out.scheduled:
            r = s.request
            end = r.num_computed_tokens + s.num_new_tokens
            reaches_end = end == r.num_tokens
            assert s.samples == reaches_end
            context = [self.slots[self._slot(r, pos)] for pos in range(end)]
            assert context == r.token_ids()[:end], "block table reads the wrong K/V"
            sampled.append(next_token(context) if reaches_end else None)
        self.scheduler.after_step(out)
        self._record_hashes(out)
        for s, token in zip(out.scheduled, sampled, strict=True):
            if token is None:
                continue
            s.request.output_token_ids.append(token)
            if len(s.request.output_token_ids) >= s.request.max_tokens:
                self.scheduler.finish(s.request, "length")
        return out

    def _record_hashes(self, out: SchedulerOutput) -> None:
        """The tokens each block hash was computed from, while the request still holds its
        table (a request's table goes when it finishes)."""
        bs = self.block_size
        for s in out.scheduled:
            r = s.request
            for i, block_hash in enumerate(self.kv.block_hashes(r.request_id)):
                tokens = r.token_ids()[i * bs : (i + 1) * bs]
                assert self.hashed_tokens.setdefault(block_hash, tokens) == tokens

    def _check_plan(self, out: SchedulerOutput) -> None:
        config = self.scheduler.config
        planned = [s.request for s in out.scheduled]
        assert len({id(r) for r in planned}) == len(planned), "a request planned twice"
        assert out.num_tokens <= config.max_num_batched_tokens
        assert all(s.num_new_tokens > 0 for s in out.scheduled)
        assert all(r.status is RequestStatus.RUNNING for r in planned)
        for s in out.scheduled:
            r = s.request
            assert r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
            assert s.block_ids == self.kv.block_ids(r.request_id), "stale block ids planned"
            held = len(s.block_ids) * self.block_size
            assert held >= r.num_computed_tokens + s.num_new_tokens

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
            self.check()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def check(self) -> None:
        """Block accounting across the scheduler, the manager and the pool."""
        pool, sched, bs = self.pool, self.scheduler, self.block_size
        pool.check_integrity()
        assert len(sched.running) <= sched.config.max_num_seqs
        holders: dict[int, int] = {}
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
            blocks = self.kv.blocks(r.request_id)
            assert len({b.block_id for b in blocks}) == len(blocks)
            # Exactly the blocks its computed tokens need: no leak, no over-allocation.
            assert len(blocks) == -(-r.num_computed_tokens // bs)
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert self.kv.blocks(r.request_id) == [] and r.num_computed_tokens == 0
        for r in self.requests:
            if r.finished:
                assert self.kv.blocks(r.request_id) == [] and r not in sched.running
                assert r not in sched.waiting
        # Beyond its running holders a block has at most one reference: a prefix pin.
        pinned = [b.ref_cnt - holders.get(b.block_id, 0) for b in pool.blocks]
        assert set(pinned) <= {0, 1}, "a block's ref count is not its holders (+1 if pinned)"
        assert sum(pinned) == len(self.kv.pins)
        self.kv.pins.check_integrity()
        # A published block holds exactly the tokens its hash was computed from.
        self.kv.check_integrity()
        for b in pool.blocks:
            if b.block_hash is not None:
                content = [self.slots.get(b.block_id * bs + j) for j in range(bs)]
                assert content == self.hashed_tokens[b.block_hash]


# --- continuous batching and chunked prefill ----------------------------------------------


def test_decodes_go_first_and_prefills_are_chunked_to_the_budget() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4, budget=8)
    a = eng.add("A", range(6), 5)
    eng.step()
    b = eng.add("B", range(100, 120), 3)
    eng.run()
    assert eng.trace == [
        [("A", 6)],
        [("A", 1), ("B", 7)],  # A decodes first, B's prefill takes what is left
        [("A", 1), ("B", 7)],
        [("A", 1), ("B", 6)],  # B's last chunk samples its first token
        [("A", 1), ("B", 1)],  # A's fifth token; A finishes
        [("B", 1)],
    ]
    assert a.output_token_ids == reference(range(6), 5)
    assert b.output_token_ids == reference(range(100, 120), 3)
    assert eng.pool.num_in_use == 0
    eng.check()


@pytest.mark.parametrize("budget", [1, 3, 5, 16, 1000])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_outputs_do_not_depend_on_chunk_or_block_size(budget: int, block_size: int) -> None:
    eng = FakeEngine(num_blocks=256, block_size=block_size, budget=budget)
    prompts = [list(range(k, k + n)) for k, n in [(0, 1), (5, 17), (0, 33), (40, 4)]]
    reqs = [eng.add(str(i), p, 6) for i, p in enumerate(prompts)]
    eng.run()
    assert [r.output_token_ids for r in reqs] == [reference(p, 6) for p in prompts]
    assert all(r.finish_reason == "length" for r in reqs)
    assert max(sum(n for _, n in step) for step in eng.trace) <= budget
    assert eng.pool.num_in_use == 0
    eng.check()


def test_max_num_seqs_caps_the_running_batch() -> None:
    eng = FakeEngine(num_blocks=64, block_size=4, budget=100, max_num_seqs=2)
    reqs = [eng.add(str(i), [i] * 5, 3) for i in range(4)]
    eng.run()
    assert max(len(step) for step in eng.trace) == 2
    assert eng.trace[0] == [("0", 5), ("1", 5)]
    assert ("2", 5) in eng.trace[3]  # admitted the step after 0 and 1 finish
    assert [r.output_token_ids for r in reqs] == [reference([i] * 5, 3) for i in range(4)]
    eng.check()


# --- prefix caching -----------------------------------------------------------------------


def test_prefix_hit_reuses_full_blocks_and_counts_queries() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4, budget=64)
    shared = list(range(10))  # two full blocks + 2 tokens
    a = eng.add("A", shared + [20, 21], 2)
    eng.run()
    assert a.num_cached_tokens == 0
    # A computed 13 tokens: three full blocks published, all free again.
    assert eng.pool.num_cached_free == 3 and eng.pool.num_in_use == 0
    b = eng.add("B", shared + [30, 31, 32], 2)
    eng.step()
    assert b.num_cached_tokens == 8 and eng.trace[-1] == [("B", 5)]
    a_hashes = eng.kv.prefix_hashes(a.token_ids(), None)  # A's table went when it finished
    assert [blk.block_hash for blk in eng.kv.blocks(b.request_id)[:2]] == a_hashes[:2]
    eng.run()
    assert b.output_token_ids == reference(shared + [30, 31, 32], 2)
    assert (eng.kv.prefix_cache_query_tokens, eng.kv.prefix_cache_hit_tokens) == (12 + 13, 8)
    eng.check()


def test_prefix_shared_between_running_requests() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4, budget=64)
    a = eng.add("A", list(range(12)), 6)
    eng.step()
    b = eng.add("B", list(range(12)) + [1], 3)
    eng.step()
    assert b.num_cached_tokens == 12
    assert eng.kv.block_ids(b.request_id)[:3] == eng.kv.block_ids(a.request_id)[:3]
    assert all(blk.ref_cnt == 2 for blk in eng.kv.blocks(a.request_id)[:3])
    eng.check()
    eng.run()
    assert a.output_token_ids == reference(range(12), 6)
    assert b.output_token_ids == reference(list(range(12)) + [1], 3)
    assert eng.pool.num_in_use == 0
    eng.check()


@pytest.mark.parametrize("budget", [64, 5])
def test_a_burst_on_one_new_prefix_computes_it_once(budget: int) -> None:
    eng = FakeEngine(num_blocks=64, block_size=4, budget=budget)
    shared = list(range(12))
    reqs = [eng.add(f"S{i}", shared + [20 + i], 2) for i in range(3)]
    other = eng.add("D", list(range(30, 36)), 2)
    eng.step()
    # S1 and S2 wait for S0's blocks; D, with nothing in flight, goes ahead of them.
    assert [rid for rid, _ in eng.trace[0]] == (["S0", "D"] if budget == 64 else ["S0"])
    eng.run()
    assert [r.num_cached_tokens for r in reqs] == [0, 12, 12]
    computed = sum(n for step in eng.trace for rid, n in step if rid.startswith("S"))
    assert computed == 13 + 2 * 1 + 3 * 1  # the prefix once, each last token, decodes
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 2)
    assert other.output_token_ids == reference(range(30, 36), 2)
    assert eng.pool.num_in_use == 0
    eng.check()


def test_a_request_waits_only_for_blocks_in_flight() -> None:
    eng = FakeEngine(num_blocks=64, block_size=4, budget=64)
    a = eng.add("A", list(range(12)), 2)
    b = eng.add("B", list(range(8)) + [90, 91, 92, 93, 94], 2)  # shares two blocks, then not
    c = eng.add("C", list(range(3)), 2)  # shorter than a block: nothing to wait for
    eng.step()
    assert eng.trace[0] == [("A", 12), ("C", 3)]  # B waits: its first block is in flight
    eng.run()
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 0)
    assert [r.output_token_ids for r in (a, b, c)] == [
        reference(r.prompt_token_ids, 2) for r in (a, b, c)]
    eng.check()


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4, budget=64)
    prompt = list(range(8))  # exactly two blocks
    first = eng.add("A", prompt, 3)
    eng.run()
    again = eng.add("B", prompt, 3)
    eng.step()
    assert again.num_cached_tokens == 4  # not 8: the last token must run to sample
    assert eng.trace[-1] == [("B", 4)]
    eng.run()
    assert again.output_token_ids == first.output_token_ids == reference(prompt, 3)
    eng.check()


def test_cache_salt_separates_prefixes() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4, budget=64)
    prompt = list(range(9))
    eng.add("A", prompt, 1, salt="alice")
    eng.run()
    other = eng.add("B", prompt, 1, salt="bob")
    eng.run()
    unsalted = eng.add("C", prompt, 1)
    eng.run()
    same = eng.add("D", prompt, 1, salt="alice")
    eng.run()
    assert (other.num_cached_tokens, unsalted.num_cached_tokens) == (0, 0)
    assert same.num_cached_tokens == 8
    assert len({r.output_token_ids[0] for r in eng.requests}) == 1
    eng.check()


def test_without_prefix_caching_nothing_is_published_or_hit() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4, budget=64, enable_prefix_caching=False)
    eng.add("A", range(12), 2)
    eng.run()
    b = eng.add("B", range(12), 2)
    eng.run()
    assert b.num_cached_tokens == 0 and eng.pool.num_cached_free == 0
    kv = eng.kv
    assert (kv.prefix_cache_query_tokens, kv.prefix_cache_hit_tokens) == (24, 0)  # hit rate 0
    assert b.output_token_ids == reference(range(12), 2)
    eng.check()


def test_reset_prefix_cache_forgets_free_blocks() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4, budget=64)
    eng.add("A", range(12), 2)
    eng.run()
    assert eng.pool.num_cached_free == 3
    assert eng.kv.reset_prefix_cache() == 3
    assert eng.pool.num_cached_free == 0
    b = eng.add("B", range(12), 2)
    eng.run()
    assert b.num_cached_tokens == 0
    eng.check()


# --- preemption ---------------------------------------------------------------------------


def test_preemption_requeues_the_latest_request_and_recomputes_it() -> None:
    eng = FakeEngine(num_blocks=6, block_size=4, budget=64)
    a = eng.add("A", range(10), 8)
    b = eng.add("B", range(20, 30), 8)
    for _ in range(3):
        eng.step()
        eng.check()
    assert eng.scheduler.num_preemptions == 0
    eng.step()  # A needs a fourth block; none is free: B, admitted last, gives its three back
    eng.check()
    assert eng.trace[-1] == [("A", 1)]
    assert eng.scheduler.num_preemptions == 1 and b.num_preemptions == 1
    assert b.status is RequestStatus.PREEMPTED and list(eng.scheduler.waiting) == [b]
    assert len(b.output_token_ids) == 3  # output so far is kept and becomes prompt
    eng.run()
    # A's fifth block evicted B's cached block 1, so B recomputes from token 4 (13 - 4 = 9).
    assert eng.trace[7:9] == [[("A", 1)], [("B", 9)]]
    assert a.output_token_ids == reference(range(10), 8)
    assert b.output_token_ids == reference(range(20, 30), 8)
    assert b.num_cached_tokens == 0  # reported from first admission only
    assert eng.pool.num_in_use == 0
    eng.check()


def test_request_preempts_itself_when_every_other_is_planned() -> None:
    # D is last in line and needs a second block while A, B, C (already planned this step)
    # hold the rest: it gives its own block back and waits.
    eng = FakeEngine(num_blocks=6, block_size=4, budget=64)
    eng.add("A", [1], 8)
    eng.add("B", range(10, 18), 5)
    eng.add("C", [30, 31], 3)
    d = eng.add("D", range(40, 44), 5)
    eng.step()
    eng.step()
    assert eng.trace[-1] == [("A", 1), ("B", 1), ("C", 1)]
    assert d.status is RequestStatus.PREEMPTED and eng.kv.blocks(d.request_id) == []
    assert eng.scheduler.num_preemptions == 1
    eng.check()


def test_a_request_resumed_last_step_is_spared() -> None:
    eng = FakeEngine(num_blocks=6, block_size=4, budget=64)
    reqs = [
        eng.add("A", [1], 8),
        eng.add("B", range(10, 18), 5),
        eng.add("C", [30, 31], 3),
        eng.add("D", range(40, 44), 5),
    ]
    eng.run()
    assert eng.trace == [
        [("A", 1), ("B", 8), ("C", 2), ("D", 4)],  # 5 of 6 blocks in use
        [("A", 1), ("B", 1), ("C", 1)],  # B takes the last block; D preempts itself
        [("A", 1), ("B", 1), ("C", 1)],  # C finishes
        [("A", 1), ("B", 1), ("D", 1)],  # D resumes on its cached block + C's freed one
        # A needs a block. D is the newest but resumed last step, so B is preempted.
        [("A", 1), ("D", 1)],
        [("A", 1), ("D", 1)],
        [("A", 1), ("D", 1)],  # D finishes
        [("A", 1), ("B", 4)],  # B resumes with 8 of its 12 tokens cached; both finish
    ]
    assert [r.num_preemptions for r in reqs] == [0, 1, 0, 1]
    assert eng.scheduler.num_preemptions == 2
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.max_tokens)
    eng.check()


# --- finishing and aborting ---------------------------------------------------------------


def test_finish_frees_blocks_of_running_waiting_and_preempted_requests() -> None:
    eng = FakeEngine(num_blocks=6, block_size=4, budget=64)
    a = eng.add("A", range(10), 8)
    b = eng.add("B", range(20, 30), 8)
    for _ in range(4):
        eng.step()
    assert b.status is RequestStatus.PREEMPTED
    late = eng.add("C", [7, 7], 4)
    held = len(eng.kv.blocks(a.request_id))
    assert eng.pool.num_in_use == held == 4
    eng.scheduler.finish(b, "abort")
    eng.scheduler.finish(late, "abort")
    assert eng.pool.num_in_use == held and not eng.scheduler.waiting
    eng.scheduler.finish(a, "abort")
    assert eng.pool.num_in_use == 0 and not eng.scheduler.has_unfinished()
    assert [r.finish_reason for r in (a, b, late)] == ["abort"] * 3
    eng.scheduler.finish(a, "length")  # finishing twice changes nothing
    assert a.finish_reason == "abort"
    eng.check()


def test_no_kv_cache_baseline_recomputes_every_token() -> None:
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8)
    sched = Scheduler(config, kv_manager=NoKVCache())
    a, b, c = (make_request(n, range(5), 4) for n in "abc")
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 5), ("b", 5)]
    assert all(s.samples for s in out.scheduled)
    sched.after_step(out)
    a.output_token_ids.append(0)
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [6, 5]  # from token 0 every step
    sched.finish(a, "length")
    assert [r.request_id for r in sched.running] == ["b"] and list(sched.waiting) == [c]


# --- property: random arrivals, steps, aborts, cache resets and pins ---------------------

PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
# 1-3 prompts, most sharing a prefix so later arrivals hit blocks earlier ones computed.
PROMPTS = st.lists(
    st.builds(
        lambda prefix, tail: prefix + tail,
        st.sampled_from(PREFIXES),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    ),
    min_size=1,
    max_size=3,
)


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, steps, aborts, cache resets, prefix pins and pin expiry. After every
    operation the block accounting must hold, every scheduled step must respect the plan's
    contracts, and every finished request must have produced the uncached reference output."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        capacity=st.integers(12, 40),
        budget=st.sampled_from([1, 2, 5, 8, 16, 64]),
        max_num_seqs=st.sampled_from([1, 2, 4, 16]),
        enable_prefix_caching=st.booleans(),
        prompts=PROMPTS,
    )
    def setup(
        self,
        block_size: int,
        capacity: int,
        budget: int,
        max_num_seqs: int,
        enable_prefix_caching: bool,
        prompts: list[list[int]],
    ) -> None:
        num_blocks = capacity // block_size  # a small pool (12..40 tokens) forces preemption
        # Pins may hold the whole pool: they must still give way to every request.
        self.eng = FakeEngine(
            num_blocks, block_size, budget, max_num_seqs, enable_prefix_caching, num_blocks
        )
        self.capacity = num_blocks * block_size
        self.num_added = 0
        self.now = 0.0
        self.add(prompts, max_tokens=8, salt=None)

    @rule(prompts=PROMPTS, max_tokens=st.integers(1, 10), salt=st.sampled_from([None, "s"]))
    def add(self, prompts: list[list[int]], max_tokens: int, salt: str | None) -> None:
        for prompt in prompts:
            # The engine refuses (CapacityError) what can never fit; shrink instead.
            prompt = prompt[: self.capacity - 1]
            num_out = min(max_tokens, self.capacity - len(prompt))
            self.eng.add(str(self.num_added), prompt, num_out, salt)
            self.num_added += 1

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            if not self.eng.scheduler.has_unfinished():
                return
            self.eng.step()
            self.eng.check()

    @precondition(lambda self: any(not r.finished for r in self.eng.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [r for r in self.eng.requests if not r.finished]
        request = data.draw(st.sampled_from(live))
        self.eng.scheduler.finish(request, "abort")

    @rule()
    def reset_prefix_cache(self) -> None:
        self.eng.kv.reset_prefix_cache()
        assert self.eng.pool.num_cached_free == 0

    @rule(data=st.data(), ttl=st.integers(1, 6))
    def pin(self, data: st.DataObject, ttl: int) -> None:
        # Pin some request's prompt: pins hold cached blocks by deadline, and must yield to
        # requests short of blocks rather than stall or preempt them.
        request = data.draw(st.sampled_from(self.eng.requests))
        prompt = request.prompt_token_ids
        new, refreshed = self.eng.kv.pin_prefix(prompt, request.cache_salt, self.now + ttl)
        assert new % self.eng.block_size == refreshed % self.eng.block_size == 0
        assert new + refreshed <= len(prompt)

    @rule(dt=st.integers(1, 3))
    def tick(self, dt: int) -> None:
        self.now += dt
        self.eng.kv.pins.expire(self.now)

    @invariant()
    def accounting_holds(self) -> None:
        self.eng.check()

    def teardown(self) -> None:
        eng = self.eng
        eng.run()
        assert eng.pool.num_in_use == len(eng.kv.pins)
        eng.kv.pins.expire(float("inf"))
        for r in eng.requests:
            assert r.finished
            if r.finish_reason == "length":
                assert r.output_token_ids == reference(r.prompt_token_ids, r.max_tokens)
            else:
                assert r.finish_reason == "abort"
                expected = reference(r.prompt_token_ids, r.max_tokens)
                assert r.output_token_ids == expected[: len(r.output_token_ids)]
        assert eng.pool.num_in_use == 0 and eng.pool.num_free == eng.pool.num_blocks
        eng.check()


SchedulerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None, derandomize=True
)
TestSchedulerStateMachine = SchedulerMachine.TestCase


class KVCacheManagerMachine(RuleBasedStateMachine):
    """The manager alone: admit (match_prefix + allocate), compute and publish, append output
    tokens, free, reset, pin and expire. A refused allocate must change nothing (pins
    included); a prefix hit must hand back blocks holding exactly the request's tokens."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(2, 16),
        enable_prefix_caching=st.booleans(),
    )
    def setup(self, block_size: int, num_blocks: int, enable_prefix_caching: bool) -> None:
        self.kv = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching, "fake-model", num_blocks
        )
        self.bs = block_size
        self.slots: dict[int, int] = {}
        self.held: list[Request] = []  # requests holding blocks (admitted, not freed)
        self.prompts: list[list[int]] = []
        self.num_added = 0
        self.now = 0.0

    def _snapshot(self) -> tuple[object, ...]:
        pool = self.kv.pool
        return (
            pool.num_free, pool.num_cached_free, [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks], self.kv.prefix_cache_query_tokens,
            len(self.kv.pins),
        )

    def _allocate(self, request: Request, num_new: int, hit: PrefixHit | None = None) -> bool:
        before = self._snapshot()
        blocks, computed = list(self.kv.blocks(request.request_id)), request.num_computed_tokens
        if not self.kv.allocate(request, num_new, hit):
            assert self._snapshot() == before, "a refused allocate changed the pool"
            assert self.kv.blocks(request.request_id) == blocks
            assert request.num_computed_tokens == computed
            return False
        if hit is not None:  # the caller (the scheduler) counts a hit as computed
            request.num_computed_tokens += hit.num_tokens
        # Compute: write the new tokens into their slots, then publish full blocks.
        tokens = request.token_ids()
        start = request.num_computed_tokens
        for pos in range(start, start + num_new):
            block = self.kv.blocks(request.request_id)[pos // self.bs]
            assert block.block_hash is None and block.ref_cnt == 1
            self.slots[block.block_id * self.bs + pos % self.bs] = tokens[pos]
        request.num_computed_tokens += num_new
        self.kv.cache_computed_blocks(request)
        return True

    @rule(prompt=PROMPTS.map(lambda ps: ps[0]), salt=st.sampled_from([None, "s"]),
          data=st.data())
    def admit(self, prompt: list[int], salt: str | None, data: st.DataObject) -> None:
        request = make_request(str(self.num_added), prompt, 4, salt)
        self.num_added += 1
        self.prompts.append(prompt)
        hit = self.kv.match_prefix(request)
        assert hit.num_tokens == len(hit.blocks) * self.bs < request.num_tokens
        for i, block in enumerate(hit.blocks):
            assert block.block_hash == hit.block_hashes[i]
            content = [self.slots[block.block_id * self.bs + j] for j in range(self.bs)]
            assert content == prompt[i * self.bs : (i + 1) * self.bs]
        num_new = data.draw(st.integers(1, request.num_tokens - hit.num_tokens))
        if self._allocate(request, num_new, hit):
            self.kv.record_query(request, hit)
            self.held.append(request)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), num_out=st.integers(0, 3))
    def extend(self, data: st.DataObject, num_out: int) -> None:
        request = data.draw(st.sampled_from(self.held))
        request.output_token_ids.extend(range(num_out))
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining:
            self._allocate(request, data.draw(st.integers(1, remaining)))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0  # as the scheduler does
        assert self.kv.blocks(request.request_id) == []
        assert self.kv.block_hashes(request.request_id) == []  # the table went with it

    @rule()
    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), ttl=st.integers(1, 6))
    def pin(self, data: st.DataObject, ttl: int) -> None:
        self.kv.pin_prefix(data.draw(st.sampled_from(self.prompts)), None, self.now + ttl)

    @rule(dt=st.integers(1, 3))
    def tick(self, dt: int) -> None:
        self.now += dt
        self.kv.pins.expire(self.now)

    @invariant()
    def accounting_holds(self) -> None:
        pool = self.kv.pool
        pool.check_integrity()
        holders: dict[int, int] = {}
        for r in self.held:
            assert len(self.kv.blocks(r.request_id)) == -(-r.num_computed_tokens // self.bs)
            for b in self.kv.blocks(r.request_id):
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        pinned = [b.ref_cnt - holders.get(b.block_id, 0) for b in pool.blocks]
        assert set(pinned) <= {0, 1} and sum(pinned) == len(self.kv.pins)
        self.kv.pins.check_integrity()
        if not self.kv.enable_prefix_caching:
            assert all(b.block_hash is None for b in pool.blocks)
        assert self.kv.prefix_cache_hit_tokens <= self.kv.prefix_cache_query_tokens

    def teardown(self) -> None:
        for request in self.held:
            self.kv.free(request.request_id)
        self.kv.check_integrity()
        self.kv.pins.expire(float("inf"))
        self.kv.pool.check_integrity()
        assert self.kv.pool.num_in_use == 0


KVCacheManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None, derandomize=True
)
TestKVCacheManagerStateMachine = KVCacheManagerMachine.TestCase
