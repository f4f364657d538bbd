"""The peers our engine is measured against, and `bench peers`, which runs them side by side.

`hf`: Hugging Face transformers with exactly our weights (float32), used by every case.
`llamacpp`: llama.cpp through llama-cpp-python on the model's GGUF file, when installed.
`case`: the `bench peers` case (decode, prefill and batch throughput on every engine);
`display`: its summary line, benchmark-page rows and plot.
"""

from kvstack.bench.peers.case import run
from kvstack.bench.peers.hf import PeerRun, TransformersPeer, transformers_model

__all__ = ["PeerRun", "TransformersPeer", "run", "transformers_model"]
