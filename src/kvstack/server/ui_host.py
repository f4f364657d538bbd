"""The live view (`kvstack.ui`) wired into one app: what the server lends it (who a key
belongs to, how a playground request runs, tenant labels, the semantic cache's counters).

The view is a lower layer than the server and never imports it; this module hands it a
`UiHost` of plain callables, and its router is included by `create_app`. Playground requests
run exactly as API requests do (`ServerState.start`: the same limits, metrics and cleanup),
under the viewer's own tenant salt.
"""

from __future__ import annotations

from fastapi import Request

from kvstack.engine.async_llm import AsyncLLM
from kvstack.sampling_params import SamplingParams
from kvstack.server.auth import presented_key
from kvstack.server.state import ServerState
from kvstack.ui.access import Viewer
from kvstack.ui.history import SemanticCounts
from kvstack.ui.service import OutputStream, UiHost, UiService


def build_ui(state: ServerState, engine: AsyncLLM, interval_s: float = 1.0) -> UiService:
    """The app's view service over `engine` (the state's own, when it is one engine's: the
    view reads its block pool); the caller runs `service.run()` for the app's lifetime."""

    def authorize(request: Request) -> Viewer | None:
        return state.keys.viewer(presented_key(request))

    def start(ids: list[int], sampling_params: SamplingParams, request_id: str,
              cache_salt: str | None) -> OutputStream:
        return state.start(ids, sampling_params, request_id, cache_salt)

    def semantic_counts() -> SemanticCounts | None:
        if state.semantic is None:
            return None
        metrics = state.semantic.metrics
        return SemanticCounts(metrics.num_lookups, metrics.num_hits)

    host = UiHost(
        engine=engine, model_name=state.model_name,
        auth_required=state.keys.enabled,
        authorize=authorize, labels=state.keys.labels(), start=start,
        max_tokens=lambda asked, num_prompt, chat: state.max_tokens(
            asked, num_prompt, 64, api="chat" if chat else "completions"),
        semantic_counts=semantic_counts,
    )
    service = UiService(host, interval_s)
    state.metrics.listeners.append(service.observe)
    return service
