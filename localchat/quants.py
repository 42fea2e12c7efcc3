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
    found = None
    for match in _TAG_RE.finditer(filename.rsplit("/", 1)[-1]):
        found = parse_tag(match.group(1)) or found
    return found


def quality_rank(tag: str) -> int:
    """Sort key for tags: known ones in quality order, vendor variants beside their type."""
    parsed = parse_tag(tag)
    return parsed.rank if parsed else len(QUALITY_ORDER)


def is_good_enough(tag: str) -> bool:
    """Whether a tag keeps quality (Q4_K_M or better) rather than trading it for size."""
    return quality_rank(tag) <= QUALITY_ORDER.index(GOOD_ENOUGH)
