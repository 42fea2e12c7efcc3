"""The generated models' names: quants, tokenizer kinds and shapes (architecture numbers).
Apart from ``demo.py`` (which writes the files, with numpy and gguf) so that the command
line can offer them as choices without loading either."""

from __future__ import annotations

from dataclasses import dataclass

# Quality order, best first: the planner walks it in this order.
QUANTS: tuple[str, ...] = (
    "F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "Q5_0", "Q4_0", "IQ4_XS"
)  # fmt: skip

# The tokenizer kinds, named after the models whose tokenizer they stand for. "spm" is the
# original demo vocabulary (no space prefix); "spm-space" is the same one with the Llama 2 /
# Mistral space prefix; the rest share one byte-level BPE vocabulary and differ in llama.cpp's
# pre-tokenizer (how text is split into words before the merges run).
TOKENIZERS: tuple[str, ...] = ("spm", "spm-space", "gpt2", "llama3", "qwen2", "idefics3")
# Tokens a kind's vocabulary holds whole beside its pieces: Idefics3's (SmolVLM's) image
# markers, which libmtmd looks up by their text to write around an image's slices.
ADDED_TOKENS: dict[str, tuple[str, ...]] = {
    "idefics3": ("\n\n", "<fake_token_around_image>", "<global-img>"),
}


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers of a generated model."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    context_length: int
    rope_freq_base: float
    architecture: str = "llama"
    sliding_window: int = 0  # gemma3: 5 of every 6 layers attend this many positions back
    head_dim_set: int = 0  # when it is not n_embd / n_head (Gemma 3)

    @property
    def head_dim(self) -> int:
        return self.head_dim_set or self.n_embd // self.n_head


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape("tiny", 2, 128, 4, 2, 256, 1024, 4096, 10000.0),
    "small": ModelShape("small", 4, 512, 8, 4, 1408, 8192, 8192, 10000.0),
    # Qwen2.5-0.5B dimensions.
    "0.5b": ModelShape("0.5b", 24, 896, 14, 2, 4864, 32000, 32768, 1_000_000.0),
    # Llama-3.2-1B dimensions (vocabulary kept at 32k so the file stays laptop-sized).
    "1b": ModelShape("1b", 16, 2048, 32, 8, 8192, 32000, 131072, 500_000.0),
    # Sliding-window attention as Gemma 3 has it (gemma3 architecture, window 64 here).
    "swa-tiny": ModelShape(
        "swa-tiny", 6, 128, 4, 2, 256, 1024, 8192, 1_000_000.0, "gemma3", 64, 32
    ),
    # Qwen2-VL's language model (qwen2vl: M-RoPE, each position in 4 sections that an
    # image's cells fill with their row and column), tiny's numbers otherwise.
    "mrope-tiny": ModelShape("mrope-tiny", 2, 128, 4, 2, 256, 1024, 4096, 10000.0, "qwen2vl"),
    # Gemma-3-270M's dimensions (vocabulary kept at 32k so the file stays small).
    "gemma3": ModelShape(
        "gemma3", 18, 640, 4, 1, 2048, 32000, 32768, 1_000_000.0, "gemma3", 512, 256
    ),
}
