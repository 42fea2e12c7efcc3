"""localchat: chat with quantized local LLMs; every conversation keeps its KV cache on disk."""

__version__ = "0.1.0"
