"""`bench load`: guidellm, the vLLM project's load generator, against `kvstack serve` and
llama.cpp's server on the same GGUF file (`case`), with its driver (`guidellm_driver`) and the
peer server (`peer_server`)."""

from kvstack.bench.load.case import run

__all__ = ["run"]
