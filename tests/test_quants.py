"""Quant tags as files on the hub are named: exact, any case, vendor variants included."""

from __future__ import annotations

import pytest

from localchat.gguf.info import is_projector
from localchat.gguf.quants import QUALITY_ORDER, parse_tag, quality_rank, tag_of_file
from localchat.models.hub import normal_tag, quant_of


@pytest.mark.parametrize(
    ("filename", "tag", "base"),
    [
        ("Qwen3-8B-UD-Q4_K_XL.gguf", "UD-Q4_K_XL", "Q4_K_M"),
        ("Meta-Llama-3.1-8B-Instruct-Q4_K_L.gguf", "Q4_K_L", "Q4_K_M"),
        ("Mistral-Nemo.i1-Q4_K_M.gguf", "i1-Q4_K_M", "Q4_K_M"),
        ("gemma-3-4b-it-bf16.gguf", "BF16", "BF16"),
        ("gemma-3-4b-it-f16.gguf", "F16", "F16"),
        ("model-BF16-00001-of-00002.gguf", "BF16", "BF16"),
        ("phi-4-IQ3_M.gguf", "IQ3_M", "IQ3_M"),
        ("phi-4-IQ2_XXS.gguf", "IQ2_XXS", "IQ2_XXS"),
        ("tiny-q5_0.gguf", "Q5_0", "Q5_0"),
        ("gpt-oss-20b-MXFP4.gguf", "MXFP4", "MXFP4"),
        ("bitnet-TQ1_0.gguf", "TQ1_0", "TQ1_0"),
        ("llama-Q3_K_L.gguf", "Q3_K_L", "Q3_K_L"),  # an official type, not a vendor size
        ("Qwen2.5-Coder-7B-Q2_K_S.gguf", "Q2_K_S", "Q2_K_S"),
        ("org/repo/sub/model-IQ4_NL.gguf", "IQ4_NL", "IQ4_NL"),
    ],
)
def test_tags_are_read_from_file_names(filename: str, tag: str, base: str) -> None:
    parsed = tag_of_file(filename)
    assert parsed is not None and (parsed.tag, parsed.base) == (tag, base)
    assert quant_of(filename) == tag


def test_unknown_names_have_no_tag() -> None:
    for name in ("model.gguf", "Q4-model.gguf", "model-Q9_K_M.gguf", "FF16.gguf"):
        assert quant_of(name) == "unknown"


def test_matching_is_exact_and_case_insensitive() -> None:
    assert normal_tag("f16") == "F16" != normal_tag("bf16")
    assert normal_tag("ud-q4_k_xl") == "UD-Q4_K_XL"
    assert normal_tag("I1-q4_k_m") == "i1-Q4_K_M"
    assert parse_tag("Q4_K") is None


def test_every_type_ranks_and_vendor_variants_sit_beside_their_type() -> None:
    for name in QUALITY_ORDER:
        assert parse_tag(name) is not None
    assert quality_rank("F16") < quality_rank("Q8_0") < quality_rank("Q4_K_M")
    assert quality_rank("UD-Q4_K_XL") == quality_rank("Q4_K_M") < quality_rank("IQ3_M")
    assert quality_rank("mystery") == len(QUALITY_ORDER)


def test_projectors_are_not_chat_models() -> None:
    assert is_projector("mmproj-gemma-3-4b-F16.gguf")
    assert is_projector("vision/MMPROJ-model-f16.gguf")
    assert not is_projector("gemma-3-4b-F16.gguf")


def test_a_vendor_tag_is_sized_like_the_type_it_builds_on() -> None:
    from localchat.gguf.estimate import LayerWeights, ModelDims

    dims = ModelDims(24, 896, 14, 2, 64, 64, 151936, 32768, 0)
    plain = LayerWeights.from_total(491_400_032, dims, "Q4_K_M", repacks=True)
    vendor = LayerWeights.from_total(491_400_032, dims, "UD-Q4_K_XL", repacks=True)
    assert vendor == plain and plain.repacked_per_layer[0] > 0


def test_block_tables_are_ggufs_own_and_every_ranked_type_has_a_size() -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from localchat.gguf.quants import GGML_BLOCKS, bytes_per_weight

    for name, block in GGML_BLOCKS.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == block, name
    for tag in QUALITY_ORDER:
        assert bytes_per_weight(tag) is not None, tag
    assert bytes_per_weight("Q4_K_M") == 144 / 256
    assert bytes_per_weight("UD-Q4_K_XL") == bytes_per_weight("Q4_K_M")
    assert bytes_per_weight("F16") == 2.0 and bytes_per_weight("Q8_0") == 34 / 32
    assert bytes_per_weight("nonsense") is None
    assert bytes_per_weight("IQ2_M") == 82 / 256  # IQ2_M's matrices are mostly IQ2_S


def test_a_listing_without_sizes_is_planned_from_bytes_per_weight() -> None:
    from localchat.models.catalog import load_catalog
    from localchat.models.planner import sized_candidates

    for name in ("qwen2.5-7b-instruct", "mistral-7b-instruct-v0.3"):
        entry = next(m for m in load_catalog() if m.name == name)
        listed = {f.quant: f.size for f in entry.files}
        # One sibling has a size (the hub lists most): the others scale from it.
        files = [("Q8_0", "q8.gguf", listed["Q8_0"]), ("Q4_K_M", "q4.gguf", 0), ("Q6_K", "q6", 0)]
        sized = {c.quant: c.weights.total for c in sized_candidates(entry.dims, files)}
        for quant in ("Q4_K_M", "Q6_K"):
            assert 0.85 * listed[quant] <= sized[quant] <= 1.15 * listed[quant], (name, quant)
        # None has one: the shape and the type alone, roughly.
        alone = sized_candidates(entry.dims, [("Q4_K_M", "q4.gguf", 0)])[0].weights.total
        assert 0.6 * listed["Q4_K_M"] <= alone <= 1.4 * listed["Q4_K_M"], name
