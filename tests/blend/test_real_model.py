"""Blending on the embedded model (SmolLM2-135M): chats with documents, text chunks, and the
identity recompute_ratio=1.0 == full prefill; plus a measured (not exact) default."""

from __future__ import annotations

import pytest

from kvstack import LLM, BlendParams, Chunk, SamplingParams
from kvstack.blend.segments import document_text

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MODEL = "smollm2-135m"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
DOCS = [
    {"title": "Harbor", "text": "The harbor town of Velm ships salt and amber. Its lighthouse "
     "was built in 1822 by the engineer Ada Korrin."},
    {"title": "Orchards", "text": "North of Velm lie apple orchards owned by the Tessel family, "
     "who press cider every October."},
    {"text": "Velm's mayor, Jon Arvid, was elected in 2019 after a campaign about the port."},
]
QUESTION = [{"role": "user", "content": "Who built the lighthouse of Velm?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, kv_cache_memory="64MiB", enable_prefix_caching=False)


def test_chat_documents_render_as_chunks_and_ratio_one_is_exact(llm: LLM) -> None:
    assert llm.precompute_chunks(DOCS) == 3
    assert llm.precompute_chunks(DOCS) == 0  # held already
    blended = llm.chat(QUESTION, GREEDY, documents=DOCS, blend=BlendParams(recompute_ratio=1.0))
    exact = llm.chat(QUESTION, GREEDY, documents=DOCS)  # the same segments, no blending
    assert blended[0].blend is not None and blended[0].blend.chunks_hit == 3
    assert blended[0].outputs[0].token_ids == exact[0].outputs[0].token_ids
    reordered = llm.chat(QUESTION, GREEDY, documents=DOCS[::-1], blend=BlendParams())[0]
    assert reordered.blend is not None and reordered.blend.chunks_hit == 3
    assert 0 < reordered.blend.recomputed_tokens < reordered.blend.reused_tokens
    llm.engine.check_integrity()


def test_text_chunks_hit_wherever_they_appear(llm: LLM) -> None:
    texts = [document_text(d) for d in DOCS]
    prompt = {"segments": ["Answer from the documents.\n\n", Chunk(texts[2]), "\n\n",
                           Chunk(texts[0]), "\n\nQuestion: who built the lighthouse?\nAnswer:"]}
    out = llm.generate(prompt, GREEDY, blend=BlendParams(selector="first_k", first_k=8))[0]
    assert out.blend is not None and (out.blend.chunks_hit, out.blend.chunks_missed) == (2, 0)
    assert out.blend.recomputed_tokens == 16
    llm.engine.check_integrity()
