"""A request's stop check and its public outputs: what the step loop reports of a `Request`."""

from __future__ import annotations

from collections.abc import Set

from kvstack.engine.detokenizer import find_stop, stop_holdback
from kvstack.engine.request import Request
from kvstack.outputs import CompletionOutput, RequestOutput


def stop_reason(request: Request, token: int, delta: str, eos_token_ids: Set[int]) -> str | None:
    """"stop" or "length" when `token` (whose text is `delta`) ends the request, else None.
    A stop string found in the text cuts it (keeping the string only if asked to)."""
    p = request.sampling_params
    if p.stop_token_ids and token in p.stop_token_ids:
        request.stop_reason = token
        return "stop"
    if not p.ignore_eos and token in eos_token_ids:
        request.stop_reason = token
        return "stop"
    if p.stop:
        match = find_stop(request.text, len(delta), p.stop)
        if match is not None:
            index, stop = match
            request.text = request.text[: index + (len(stop) if
                                                   p.include_stop_str_in_output else 0)]
            request.stop_reason = stop
            return "stop"
    if len(request.output_token_ids) >= request.max_tokens:
        return "length"
    return None


def completion_output(request: Request) -> CompletionOutput:
    text, sp = request.text, request.sampling_params
    if not request.finished and sp.stop:
        # Hold back a tail that may still grow into a stop string.
        text = text[: len(text) - stop_holdback(text, sp.stop)]
    return CompletionOutput(
        index=0,
        text=text,
        token_ids=list(request.output_token_ids),
        logprobs=list(request.logprobs) if sp.logprobs is not None else None,
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        top_logprobs=list(request.top_logprobs) if sp.logprobs else None,
        cumulative_logprob=sum(request.logprobs) if sp.logprobs is not None else None,
    )


def request_output(request: Request) -> RequestOutput:
    sp = request.sampling_params
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[completion_output(request)],
        finished=request.finished,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        metrics=request.metrics,
        prompt_logprobs=(request.prompt_scores.logprobs(sp.prompt_logprobs)
                         if request.prompt_scores is not None and sp.prompt_logprobs is not None
                         else None),
        provenance=request.provenance(),
        blend=request.step_plan.final_usage() if request.step_plan is not None else None,
    )
