"""`LLM` where vLLM's users import it from (`vllm.entrypoints.llm`); it lives in pagedjax.llm."""

from pagedjax.llm import LLM

__all__ = ["LLM"]
