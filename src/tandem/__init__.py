"""tandem: lossless speculative decoding for PyTorch."""

from tandem.config import EngineConfig, SamplingParams, SpecConfig, StructuredOutput  # noqa: F401

__all__ = ["LLM", "SamplingParams", "SpecConfig", "EngineConfig", "StructuredOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from tandem.llm import LLM  # lazy: the engine pulls in the model stack; `import tandem` stays light

        return LLM
    raise AttributeError(name)
