"""pdserve: an LLM inference engine and server built around the prefill/decode split."""

from pdserve.types import RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked for.
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
