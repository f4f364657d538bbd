"""Which requests run this step, and how many new tokens each computes.

Each step has a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running decodes are planned first (one token each), then unfinished
prefills, then new arrivals, each prefill chunked to what is left of the budget (but a
blended request's region, `blend/state.py`, which runs whole in one step). When the
pool runs dry the most recently admitted request is preempted (blocks freed, requeued at the
front, recomputed later with its output so far as prompt) — but not one resumed just now.

A waiting request whose next uncached block a running prefill is computing right now waits
(later arrivals go ahead of it) until that block is published, then admits with it as a hit:
a burst of requests on one new document computes the document once, not once per request
(SGLang's in-batch prefix caching does the same).

Requests that share one prompt (parallel samples, `samples/`) enter as one request carrying
its siblings (`pending_forks`); it is admitted only when all of them fit under `max_num_seqs`.
The step that completes its prompt forks them: each shares the prompt's blocks (`fork`) and
is planned right after it with no new token, to sample from its last logits row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstack.config import SchedulerConfig
from kvstack.engine.request import Request, RequestStatus
from kvstack.kv.block_hash import BlockHash
from kvstack.kv.mode import KVBlocks, KVCacheMode
from kvstack.kv.values import PrefixHit


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # positions computed this step, draft tokens included
    blocks: KVBlocks = field(default_factory=KVBlocks)  # its tables as this step runs
    # Draft tokens fed after the known tokens (the last num_draft_tokens of num_new_tokens).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def block_ids(self) -> list[int]:
        return self.blocks.block_ids

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens + self.num_draft_tokens


# The tokens to feed after a request's known ones, at most `room`, in a step that reaches
# their end (`StepHooks.extra_tokens`: drafts, which the step verifies); [] feeds none.
ExtraTokens = Callable[[Request, int], list[int]]


def no_extra_tokens(request: Request, room: int) -> list[int]:
    return []


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Continuous batching with chunked prefill over a KV mode (`kv/mode.py`), whichever it
    is. The scheduler alone advances a request's `num_computed_tokens`. `extra_tokens` says
    what to feed after a request's known tokens (drafts), where a step has room for them."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheMode,
                 extra_tokens: ExtraTokens = no_extra_tokens) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.extra_tokens = extra_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_index = 0
        self.num_preemptions = 0
        self.max_chunk = kv_manager.max_chunk(config.max_num_batched_tokens)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        out = SchedulerOutput()
        budget = self.kv_manager.step_budget(self.config.max_num_batched_tokens)
        for request in self.running:  # what the cache kept of each (no cache: nothing)
            request.num_computed_tokens = self.kv_manager.num_kept_tokens(request)
        # Decodes first so a long prefill never stalls them; then unfinished prefills.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for request in order:
            if request.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            num_new = self._fit(request, request.num_computed_tokens, budget, out)
            if num_new == 0:
                continue
            extra = self._extra(request, request.num_computed_tokens, num_new, budget)
            if extra and self.kv_manager.allocate(request, num_new + len(extra)):
                pass  # room for the extra tokens too, without preempting anyone for them
            elif self._allocate_or_preempt(request, num_new, out):
                extra = []
            else:
                continue
            self._schedule_one(out, request, num_new, extra)
            budget -= num_new + len(extra)
        if out.num_preempted == 0:
            self._admit_waiting(out, budget)
        return out

    def _schedule_one(self, out: SchedulerOutput, request: Request, num_new: int,
                      extra: list[int]) -> None:
        planned = self._plan(request, num_new, extra)
        out.scheduled.append(planned)
        if request.pending_forks and planned.samples:
            self._fork(request, request.num_computed_tokens + num_new, out)

    def _fork(self, leader: Request, num_computed: int, out: SchedulerOutput) -> None:
        """This step completes the leader's prompt: its siblings share its blocks, count the
        prompt as computed and sample their first tokens from the leader's last row."""
        for child in leader.pending_forks:
            self.kv_manager.fork(leader.request_id, child.request_id)
            child.num_computed_tokens = num_computed
            child.num_cached_tokens = leader.num_cached_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            out.scheduled.append(self._plan(child, 0, []))
        leader.pending_forks = []

    def _num_seqs(self) -> int:
        """Running sequences, counting the siblings running requests will fork."""
        return len(self.running) + sum(len(r.pending_forks) for r in self.running)

    def _plan(self, request: Request, num_new: int, extra: list[int]) -> ScheduledRequest:
        return ScheduledRequest(request, num_new + len(extra),
                                self.kv_manager.blocks_of(request.request_id), extra)

    def _fit(self, request: Request, start: int, budget: int, out: SchedulerOutput) -> int:
        """New tokens from `start` this step: what is left of the prompt (or one decode token)
        within the budget and the chunk cap. A request with a step plan (`StepPlan`: a blended
        request computes up to its region in chunks, then the whole region in one step, even
        past the budget) decides itself, one region a step; 0: it waits."""
        rest = request.num_tokens - start
        num_new = min(rest, budget, self.max_chunk)
        plan = request.step_plan
        if plan is None:
            return num_new
        taken = any((p := s.request.step_plan) is not None
                    and p.is_region_step(s.request.num_computed_tokens) for s in out.scheduled)
        return plan.fit(start, num_new, rest, taken)

    def _extra(self, request: Request, start: int, num_new: int, budget: int) -> list[int]:
        """The extra tokens (`extra_tokens`) that fit this step: only when the step reaches the
        end of the request's known tokens, within the token budget and its max_tokens (the
        model's own next token comes on top of the accepted ones)."""
        if start + num_new != request.num_tokens:
            return []
        room = min(budget - num_new, request.max_tokens - len(request.output_token_ids) - 1)
        return self.extra_tokens(request, max(room, 0))

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv_manager.allocate(request, num_new):
            victim = self._pick_victim(exclude=request, out=out)
            if victim is None:
                self._preempt(request, out)
                return False
            self._preempt(victim, out)
        return True

    def _pick_victim(self, exclude: Request, out: SchedulerOutput) -> Request | None:
        """Most recently admitted running request, sparing ones resumed in the last step."""
        planned = {id(s.request) for s in out.scheduled}
        candidates = [r for r in self.running if r is not exclude and id(r) not in planned]
        fresh = [r for r in candidates if r.resumed_at_step < self.step_index - 1]
        pool = fresh or candidates
        return pool[-1] if pool else None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv_manager.free(request.request_id, finished=False)
        request.num_computed_tokens = 0
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        out.num_preempted += 1

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv_manager
        in_flight = self._blocks_in_flight(self.running) if self.waiting else set()
        deferred: list[Request] = []
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self._num_seqs() + 1 + len(request.pending_forks) > self.config.max_num_seqs:
                break
            hit = kv.match_prefix(request)
            if self._joins_in_flight(request, hit, in_flight):
                deferred.append(self.waiting.popleft())
                continue
            if (plan := request.step_plan) is not None:
                plan.admit(hit.num_tokens)
            num_new = self._fit(request, hit.num_tokens, budget, out)
            if num_new == 0:
                break
            extra = self._extra(request, hit.num_tokens, num_new, budget)
            if not (extra and kv.allocate(request, num_new + len(extra), hit)):
                extra = []
                if not kv.allocate(request, num_new, hit):
                    break
            self.waiting.popleft()
            request.num_computed_tokens += hit.num_tokens
            if request.status is RequestStatus.PREEMPTED:
                request.resumed_at_step = self.step_index
            else:
                request.num_cached_tokens = hit.num_tokens
                request.num_restored_tokens = hit.num_restored_tokens
                kv.record_query(request, hit)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule_one(out, request, num_new, extra)
            budget -= num_new + len(extra)
            in_flight |= self._blocks_in_flight([request])
        self.waiting.extendleft(reversed(deferred))

    def _blocks_in_flight(self, requests: list[Request]) -> set[BlockHash]:
        """Hashes of the exact prompt blocks these requests have yet to finish computing."""
        kv = self.kv_manager
        out: set[BlockHash] = set()
        for r in requests:
            end = r.num_exact_tokens if r.num_exact_tokens is not None else r.num_prompt_tokens
            if r.num_computed_tokens < end:
                out.update(kv.block_hashes(r.request_id)[r.num_computed_tokens // kv.block_size:
                                                         end // kv.block_size])
        return out

    def _joins_in_flight(self, request: Request, hit: PrefixHit,
                         in_flight: set[BlockHash]) -> bool:
        """True when the first block past the request's hit is being computed by another
        request (so waiting a step or two turns it into a hit). Only for plain requests: one
        with a step plan plans its own steps."""
        kv = self.kv_manager
        if not in_flight or request.step_plan is not None:
            return False
        # The last token is always computed, so only blocks before it can become a hit.
        max_blocks = (request.num_tokens - 1) // kv.block_size
        index = hit.num_tokens // kv.block_size
        return index < min(max_blocks, len(hit.block_hashes)) and \
            hit.block_hashes[index] in in_flight

    def after_step(self, output: SchedulerOutput, num_rejected: list[int] | None = None) -> None:
        """Advance computed-token counts, then let the KV mode publish newly full blocks and
        free what slid out of a window (`after_step`). `num_rejected[i]`: draft tokens of the i-th
        scheduled request whose K/V this step wrote but the model did not accept; they are not
        counted as computed and the blocks that held only them are freed."""
        for i, s in enumerate(output.scheduled):
            rejected = num_rejected[i] if num_rejected else 0
            s.request.num_computed_tokens += s.num_new_tokens - rejected
            self.kv_manager.after_step(s.request, s.request.num_exact_tokens, rejected > 0)

    def finish(self, request: Request, reason: str) -> None:
        """End a request (done or aborted) and release its blocks at once."""
        if request.status is RequestStatus.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:  # a parallel sample not forked yet
            for leader in (*self.running, *self.waiting):
                if request in leader.pending_forks:
                    leader.pending_forks.remove(request)
        if request.pending_forks:  # ended before its prompt was computed: a sibling takes over
            heir = request.pending_forks[0]
            heir.pending_forks, request.pending_forks = request.pending_forks[1:], []
            self.waiting.appendleft(heir)
        self.kv_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
