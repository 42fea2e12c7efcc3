"""Quantization types and the tags files are named by: the one table of them (a leaf module).

llama.cpp's quantizer types are ranked in its published quality order (KL divergence and
perplexity from its quantize tool, best first). Files on the hub carry a tag in their name:
one of those types (`model-Q4_K_M.gguf`), or a vendor variant of one (`UD-Q4_K_XL` from
unsloth's dynamic quants, `Q4_K_L` from bartowski's with 8-bit embeddings, `i1-Q4_K_M` from
imatrix quants). A tag is matched exactly and case-insensitively: `F16` never matches `BF16`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Best first. MXFP4 (gpt-oss) sits with the 4-bit types it is sized like.
QUALITY_ORDER: tuple[str, ...] = (
    "F32",
    "BF16",
    "F16",
    "Q8_0",
    "Q6_K",
    "Q5_K_M",
    "Q5_K_S",
    "Q5_1",
    "Q5_0",
    "Q4_K_M",
    "MXFP4",
    "Q4_K_S",
    "IQ4_NL",
    "IQ4_XS",
    "Q4_1",
    "Q4_0",
    "Q3_K_L",
    "Q3_K_M",
    "IQ3_M",
    "IQ3_S",
    "Q3_K_S",
    "IQ3_XS",
    "IQ3_XXS",
    "Q2_K",
    "Q2_K_S",
    "IQ2_M",
    "IQ2_S",
    "IQ2_XS",
    "IQ2_XXS",
    "TQ2_0",
    "IQ1_M",
    "TQ1_0",
    "IQ1_S",
)

# How sliding-window layers keep their cache: only their window, or every position.
SWA_CACHE_MODES: tuple[str, ...] = ("window", "full")

# The planner's line between the quants that keep a model's quality and those that trade it.
GOOD_ENOUGH = "Q4_K_M"

# A tag: a vendor prefix, then a type-like word (letters, digits, underscores).
_TAG_RE = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-|i1-)?(?:I?Q\d(?:_[0-9A-Z]+)*|B?F(?:16|32)|MXFP4|TQ\d_0))(?![A-Za-z0-9])",
    re.IGNORECASE,
)
# Vendor sizes of a k-quant: _L (8-bit embeddings and output) and _XL (unsloth dynamic).
_VENDOR_SIZE_RE = re.compile(r"^Q(\d)_K_X?L$")
_K_BASE = {"2": "Q2_K", "3": "Q3_K_M", "4": "Q4_K_M", "5": "Q5_K_M", "6": "Q6_K", "8": "Q8_0"}


@dataclass(frozen=True)
class QuantTag:
    """A file's quant tag as published (``tag``) and the llama.cpp type it builds on."""

    tag: str
    base: str

    @property
    def rank(self) -> int:
        """Position in the quality order (0 is best)."""
        return QUALITY_ORDER.index(self.base)


def parse_tag(text: str) -> QuantTag | None:
    """The tag named by ``text`` (``UD-q4_k_xl`` → ``UD-Q4_K_XL`` on Q4_K_M), or None."""
    tag = text.strip().upper().replace("I1-", "i1-")
    body = tag.removeprefix("UD-").removeprefix("i1-")
    if body in QUALITY_ORDER:
        return QuantTag(tag, body)
    vendor = _VENDOR_SIZE_RE.match(body)
    if vendor and vendor.group(1) in _K_BASE:
        return QuantTag(tag, _K_BASE[vendor.group(1)])
    return None


def tag_of_file(filename: str) -> QuantTag | None:
    """The quant tag in a GGUF file's name (the last one that is a known tag)."""
    found = find_tag(filename.rsplit("/", 1)[-1])
    return found[0] if found else None


def find_tag(name: str) -> tuple[QuantTag, int, int] | None:
    """The last known quant tag in ``name`` and where it stands (start, end): a display
    name is the name around it."""
    found = None
    for match in _TAG_RE.finditer(name):
        tag = parse_tag(match.group(1))
        if tag is not None:
            found = (tag, match.start(1), match.end(1))
    return found


def quality_rank(tag: str) -> int:
    """Sort key for tags: known ones in quality order, vendor variants beside their type."""
    parsed = parse_tag(tag)
    return parsed.rank if parsed else len(QUALITY_ORDER)


def is_good_enough(tag: str) -> bool:
    """Whether a tag keeps quality (Q4_K_M or better) rather than trading it for size."""
    return quality_rank(tag) <= QUALITY_ORDER.index(GOOD_ENOUGH)


# Each ggml type's block: (weights, bytes), by name, and the ids GGUF files use for the types
# and for file types. The same numbers as gguf-py's GGML_QUANT_SIZES, GGMLQuantizationType
# and LlamaFileType (a test holds them equal); kept here so readers load no numpy.
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q8_1": (32, 40),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "Q8_K": (256, 292),
    "IQ2_XXS": (256, 66),
    "IQ2_XS": (256, 74),
    "IQ3_XXS": (256, 98),
    "IQ1_S": (256, 50),
    "IQ4_NL": (32, 18),
    "IQ3_S": (256, 110),
    "IQ2_S": (256, 82),
    "IQ4_XS": (256, 136),
    "I8": (1, 1),
    "I16": (1, 2),
    "I32": (1, 4),
    "I64": (1, 8),
    "F64": (1, 8),
    "IQ1_M": (256, 56),
    "BF16": (1, 2),
    "TQ1_0": (256, 54),
    "TQ2_0": (256, 66),
    "MXFP4": (32, 17),
    "NVFP4": (64, 36),
    "Q1_0": (128, 18),
}
GGML_TYPE_IDS: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}  # fmt: skip
FILE_TYPE_IDS: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0", 1024: "GUESSED",
}  # fmt: skip

# The weight type most of a file type's matrices are in, as llama.cpp's quantizer picks it
# (Q4_K_M: Q4_K, with attn_v and half of ffn_down a step up in Q6_K; IQ2_M: IQ2_S).
MAIN_WEIGHT_TYPE: dict[str, str] = {
    **{name: name for name in QUALITY_ORDER if name in GGML_BLOCKS},
    "Q5_K_M": "Q5_K",
    "Q5_K_S": "Q5_K",
    "Q4_K_M": "Q4_K",
    "Q4_K_S": "Q4_K",
    "Q3_K_L": "Q3_K",
    "Q3_K_M": "Q3_K",
    "Q3_K_S": "Q3_K",
    "IQ3_M": "IQ3_S",
    "IQ3_XS": "IQ3_S",
    "Q2_K_S": "Q2_K",
    "IQ2_M": "IQ2_S",
}


def bytes_per_weight(tag: str) -> float | None:
    """What one weight of a file type's main matrices takes (Q4_K_M: 0.5625), or None."""
    parsed = parse_tag(tag)
    weight_type = MAIN_WEIGHT_TYPE.get(parsed.base if parsed else tag.upper())
    if weight_type is None:
        return None
    weights, size = GGML_BLOCKS[weight_type]
    return size / weights
