"""`bench drafts`: what suffix drafts buy on agent sessions that repeat themselves, against no
drafts and prompt lookup, and what they cost on plain chat.

Arms, interleaved turn by turn (greedy, `ignore_eos`, a fixed number of output tokens): no
drafts, prompt lookup (LOOKUP tokens a step), suffix trees (`suffix_drafts`, the engine's
default tree knobs), and suffix trees on a second engine that cuts each draft to the step cost
measured first (`draft_row_cost`). Sessions run at batch 1 (one after another) and at batch 4
(four sessions' turns in one `generate`). Batch 1, batch 4 and the control are three tenants
(cache salts), shared by the arms: the suffix arms' later turns draft from their earlier
answers, no run from another's. Every output is scored up to its first repeated 32-token span
(`drafts_workloads.loop_start`): decode tok/s from the first token to there, accepted draft
tokens per step there, and the share of all accepted tokens that came after it (from loops).
Outputs must be identical across arms. Measured first: what a step of 1 + k tokens costs
against a step of 1 on this CPU (one request, k rejected draft tokens).
"""

from __future__ import annotations

from typing import Any

from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow, progress
from kvstack.bench.drafts_workloads import (
    Session,
    agent_sessions,
    chat_sessions,
    loop_start,
    prompt_ids,
)
from kvstack.bench.format import fmt, fmt_x, median, ratio
from kvstack.engine.llm import LLM
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams

LOOKUP = 8  # prompt_lookup draft length (as `bench verify`)
SUFFIX = 32  # suffix_drafts: the most tokens a step's draft may hold
ARMS = {"off": {}, "lookup": {"prompt_lookup": LOOKUP}, "suffix": {"suffix_drafts": SUFFIX},
        "suffix-cut": {"suffix_drafts": SUFFIX}}  # on an engine cutting drafts to step cost
STEP_DRAFTS = (1, 3, 7, 15)


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    kv_bytes = subject.kv_shape().bytes_for(4096, 4)  # two engines: 4 sequences each
    llm = subject.llm(kv_cache_memory=kv_bytes)
    step_cost = _step_cost(subject, llm, 3 if options.quick else 7)
    # A draft row's cost as a share of a 1-token step, from the 1 + 7-token step measured here.
    row_cost = max(0.0, ((step_cost["step_over_1_at_8"] or 1.0) - 1) / 7)
    step_cost["row_cost"] = row_cost
    cut = subject.llm(kv_cache_memory=kv_bytes, speculative_config={
        "method": "suffix", "suffix_decoding_draft_row_cost": row_cost})
    engines = {arm: cut if arm == "suffix-cut" else llm for arm in ARMS}
    tokens = 32 if options.quick else 128
    num = 2 if options.quick else 3
    results: dict[str, Any] = {}
    with progress(options, len(ARMS) * (2 * num + 2 * 4 + num), "drafts") as bar:
        for name, sessions, batch in (("agent, batch 1", agent_sessions(num), 1),
                                      ("agent, batch 4", agent_sessions(4), 4),
                                      ("plain chat, batch 1", chat_sessions(num), 1)):
            results[name] = _run_sessions(subject, engines, sessions, batch, tokens, name, bar)
    llm.close()
    cut.close()
    return CaseResult(
        case="drafts", summary=_summary(results, step_cost),
        config={"model": options.model, "quick": options.quick, "output_tokens": tokens,
                "prompt_lookup": LOOKUP, "suffix_drafts": SUFFIX, "threads": options.threads,
                "scored": "each output up to its first repeated 32-token span"},
        results={"sessions": results, "step_cost": step_cost},
        table=_table(results, step_cost))


def _run_sessions(subject: Subject, engines: dict[str, LLM], sessions: list[Session], batch: int,
                  tokens: int, tenant: str, bar: Any) -> dict[str, Any]:
    """Each arm's scored figures over every turn of `sessions`, `batch` sessions at a time,
    as one tenant (the cache salt: prefix hits across arms, one suffix store)."""
    outs: dict[str, list[RequestOutput]] = {arm: [] for arm in ARMS}
    groups: dict[str, list[list[RequestOutput]]] = {arm: [] for arm in ARMS}
    identical = True
    for first in range(0, len(sessions), batch):
        group = sessions[first:first + batch]
        for turn in range(len(group[0].user_turns)):
            # A short-context model (a tiny test one) sees the end of each conversation.
            room = subject.max_model_len - tokens
            prompts = [{"prompt_token_ids": prompt_ids(subject, s.messages(turn))[-room:]}
                       for s in group]
            texts = None
            for arm, extra in ARMS.items():
                params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                        **extra)  # type: ignore[arg-type]
                got = engines[arm].generate(prompts, params, cache_salt=tenant)
                bar.update(len(group))
                outs[arm] += got
                groups[arm].append(got)
                ids = [o.outputs[0].token_ids for o in got]
                identical &= texts is None or ids == texts
                texts = ids
            for session, out in zip(group, groups["off"][-1], strict=True):
                session.answers.append(out.outputs[0].text)
    return {arm: _score(groups[arm], outs[arm]) for arm in ARMS} | {"identical": identical}


def _score(groups: list[list[RequestOutput]], outs: list[RequestOutput]) -> dict[str, Any]:
    tokens = seconds = 0.0
    accepted = model = looped = 0
    for group in groups:
        ends = []
        for out in group:
            cut = loop_start(out.outputs[0].token_ids)
            ends.append(_time_at(out, cut))
            tokens += max(cut - 1, 0)
            before, after, steps = _sources(out, cut)
            accepted, looped, model = accepted + before, looped + after, model + steps
        firsts = [o.metrics.first_token_time or 0.0 for o in group]
        seconds += max(ends) - min(firsts)
    drafted = sum(o.num_draft_tokens for o in outs)
    all_accepted = sum(o.num_accepted_tokens for o in outs)
    return {"decode_tok_s": tokens / seconds if seconds > 0 else None,
            "scored_tokens": int(tokens),
            "accepted_per_step": accepted / model if model else 0.0,
            "acceptance_rate": all_accepted / drafted if drafted else None,
            "drafted": drafted, "accepted": all_accepted,
            "loop_share": looped / all_accepted if all_accepted else 0.0}


def _time_at(out: RequestOutput, cut: int) -> float:
    """When the output's token `cut - 1` (the last one scored) arrived."""
    first = out.metrics.first_token_time or 0.0
    return first + sum(out.metrics.inter_token_latencies[:max(cut - 1, 0)])


def _sources(out: RequestOutput, cut: int) -> tuple[int, int, int]:
    """Accepted draft tokens before `cut` and from it on, and model tokens before it (one a
    step: every step ends with the model's own token)."""
    before = after = model = pos = 0
    for source, count in out.provenance.output:
        inside = max(0, min(pos + count, cut) - pos)
        if source == "draft":
            before, after = before + inside, after + count - inside
        else:
            model += inside
        pos += count
    return before, after, model


def _step_cost(subject: Subject, llm: LLM, repeats: int) -> dict[str, Any]:
    """Seconds of a step computing 1 token + k (rejected) draft tokens over one computing 1,
    median of `repeats`: a prompt whose blocks are all cached but its last token, so its
    first step is that token and the caller's draft, on a ~300-token context."""
    prompt = subject.chat_prompt("Tell me about the sea. " * 40)
    block = llm.engine.config.cache.block_size
    fit = min(len(prompt), subject.max_model_len - 2 * max(STEP_DRAFTS)) - 1
    prompt = prompt[-(fit // block * block + 1):]  # whole blocks and one token
    bad = [subject.encode(" zebra")[0]] * max(STEP_DRAFTS)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))  # cache it
    seconds: dict[int, list[float]] = {k: [] for k in (0, *STEP_DRAFTS)}
    for _ in range(repeats):
        for k in seconds:
            out = llm.generate({"prompt_token_ids": prompt, "draft_token_ids": bad[:k] or None},
                               SamplingParams(temperature=0, max_tokens=k + 1, ignore_eos=True))
            m = out[0].metrics
            seconds[k].append((m.first_token_time or 0.0) - (m.first_scheduled_time or 0.0))
    one = median(seconds[0])
    return {"step_s_1": one, **{f"step_over_1_at_{1 + k}": ratio(median(seconds[k]), one)
                                for k in STEP_DRAFTS}}


def _summary(results: dict[str, Any], step_cost: dict[str, Any]) -> str:
    parts = ["drafts: decode tok/s off/lookup/suffix/suffix cut to step cost, suffix accepted "
             "per step"]
    for name, r in results.items():
        off, lookup, suffix, cut = (r[a]["decode_tok_s"] for a in ARMS)
        parts.append(f"{name} {fmt(off)}/{fmt(lookup)}/{fmt(suffix)}/{fmt(cut)} (suffix "
                     f"{fmt_x(ratio(suffix, off))} vs off, {fmt_x(ratio(suffix, lookup))} vs "
                     f"lookup; {fmt(r['suffix']['accepted_per_step'], 2)} accepted/step, "
                     f"{fmt(100 * r['suffix']['loop_share'], 0)}% from loops; identical "
                     f"{r['identical']})")
    costs = ", ".join(f"1+{k}: {fmt_x(step_cost[f'step_over_1_at_{1 + k}'])}"
                      for k in STEP_DRAFTS)
    parts.append(f"step cost over 1 token: {costs} (row cost {fmt(step_cost['row_cost'], 2)})")
    return " | ".join(parts)


def _table(results: dict[str, Any], step_cost: dict[str, Any]) -> list[TableRow]:
    rows = []
    for name, r in results.items():
        off, suffix = r["off"]["decode_tok_s"], r["suffix"]["decode_tok_s"]
        cut = r["suffix-cut"]["decode_tok_s"]
        rows.append(TableRow(f"suffix drafts (cut to step cost), {name}: decode tok/s "
                             f"(lookup, off)", f"{fmt(suffix)} ({fmt(cut)})",
                             f"{fmt(r['lookup']['decode_tok_s'])}, {fmt(off)}",
                             fmt_x(ratio(suffix, off))))
    rows.append(TableRow("a step of 1+7 tokens over a step of 1",
                         fmt_x(step_cost["step_over_1_at_8"])))
    return rows
