"""A generated vision projector: a CLIP-style ``mmproj`` GGUF (libmtmd's LLaVA-1.5 ``mlp``
projector: a small ViT, then two linear layers into the language model's width) with seeded
random weights.

No vision model small enough for a test ships where this project can reach, so the image
path (libmtmd's load, preprocessing, encoding, and the embeddings decoded at the marker) runs
on this one beside a generated language model: libmtmd loads it as it loads a LLaVA-1.5
``mmproj`` file (the same keys and tensor names as llama.cpp's converter writes), so the
chunking, the image's token count, the decode and the KV cache are real; what the image
"says" means nothing. LLaVA's projector is the plainest libmtmd knows: fixed-size square
input, one token per patch, causal decode, ordinary positions (no M-RoPE). Gemma 3's
(``gemma3-tiny``) is the one whose image is decoded with non-causal attention. The same
shape, width and seed always give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType

from localchat.models.demo import write_gguf_staged
from localchat.models.demo_shapes import SHAPES


@dataclass(frozen=True)
class ProjectorShape:
    """Architecture numbers of a generated projector's vision tower."""

    name: str
    image_size: int  # pixels a side: libmtmd resizes every image to this square
    patch_size: int  # pixels a side of one patch: one image token each
    n_layer: int  # LLaVA reads the second-to-last layer, so one more than it runs
    n_embd: int
    n_head: int
    n_ff: int  # not n_embd: the loader takes ffn_down's width == n_embd for swapped old files
    projector: str = "mlp"  # clip.projector_type
    merge: int = 1  # gemma3: patches average-pooled merge x merge into one token
    # idefics3: every image resized to this longest edge and cut in image_size tiles, each
    # read as an image of its own after an overview of the whole (0: one image, no slices).
    longest_edge: int = 0
    tokenizer: str = "spm"  # the demo LM's tokenizer kind it pairs with (its image tokens)
    lm_shape: str = "tiny"  # the demo LM it pairs with (qwen2vl: Qwen2-VL's M-RoPE one)

    @property
    def image_tokens(self) -> int:
        """How many positions one image (a sliced one's overview and each slice) takes in
        the language model's context."""
        return (self.image_size // self.patch_size // self.merge) ** 2


QWEN2VL = "qwen2vl_merger"  # Qwen2-VL's projector type

PROJECTOR_SHAPES: dict[str, ProjectorShape] = {
    # 32 px in 8 px patches: 16 image tokens, encoded in a millisecond or two.
    "vit-tiny": ProjectorShape("vit-tiny", 32, 8, 2, 64, 4, 128),
    # 64 px in 8 px patches: 64 image tokens, for tests where an image should weigh more.
    "vit-small": ProjectorShape("vit-small", 64, 8, 2, 128, 4, 256),
    # LLaVA-1.5's weight in the context (576 image tokens: 336 px in 14 px patches there),
    # 192 px in 8 px patches here; a narrow two-layer tower so that encoding stays cheap.
    "vit-bench": ProjectorShape("vit-bench", 192, 8, 2, 128, 4, 256),
    # Gemma 3's projector (SigLIP tower, 2x2 average pool, RMS norm, one projection): the
    # image is decoded with non-causal attention (``mtmd_decode_use_non_causal``), between
    # "<start_of_image>" and "<end_of_image>" text. 64 px in 8 px patches: 16 image tokens.
    "gemma3-tiny": ProjectorShape("gemma3-tiny", 64, 8, 2, 64, 4, 128, "gemma3", 2),
    # SmolVLM's projector (Idefics3: SigLIP tower, 2x2 pixel shuffle, one linear layer): an
    # image is resized to a 64 px longest edge and read as an overview and 32 px slices (a
    # square one: 1 + 2x2 images of 4 tokens), with libmtmd's text between them (its
    # "<fake_token_around_image>", "<row_1_col_1>" ...: the demo LM's idefics3 vocabulary).
    "idefics3-tiny": ProjectorShape(
        "idefics3-tiny", 32, 8, 2, 64, 4, 128, "idefics3", 2, 64, "idefics3"
    ),
    # Qwen2-VL's projector (a ViT with 2-D rotary positions, two patch kernels for a frame
    # pair, 2x2 patches merged by an MLP): an image of any size in 16 px cells, its tokens
    # placed with M-RoPE (row and column positions; the next text comes after the longer
    # side, not after every cell), between "<|vision_start|>" and "<|vision_end|>".
    "qwen2vl-tiny": ProjectorShape(
        "qwen2vl-tiny", 32, 8, 2, 64, 4, 128, QWEN2VL, 2, lm_shape="mrope-tiny"
    ),
}
SIGLIP = ("gemma3", "idefics3")  # towers with SigLIP's GELU and its norm after the blocks
# CLIP's preprocessing constants, as LLaVA-1.5's preprocessor_config.json has them.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _add_metadata(writer: GGUFWriter, shape: ProjectorShape, n_embd_text: int) -> None:
    """The ``clip.*`` keys libmtmd's loader reads for a vision-only mlp projector."""
    writer.add_name(f"localchat-demo-mmproj-{shape.name}")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(shape.projector)
    writer.add_vision_projection_dim(n_embd_text)
    writer.add_vision_image_size(shape.image_size)
    writer.add_vision_patch_size(shape.patch_size)
    writer.add_vision_embedding_length(shape.n_embd)
    writer.add_vision_feed_forward_length(shape.n_ff)
    writer.add_vision_block_count(shape.n_layer)
    writer.add_vision_head_count(shape.n_head)
    writer.add_vision_attention_layernorm_eps(1e-5)
    writer.add_vision_image_mean(list(CLIP_MEAN))
    writer.add_vision_image_std(list(CLIP_STD))
    writer.add_vision_use_gelu(shape.projector in SIGLIP)  # else CLIP's quick GELU
    if shape.projector == QWEN2VL:
        writer.add_vision_spatial_merge_size(shape.merge)
    elif shape.merge > 1:  # Gemma 3's own is 4 (what the loader assumes without the key)
        writer.add_vision_projector_scale_factor(shape.merge)
    if shape.longest_edge:
        writer.add_vision_preproc_image_size(shape.longest_edge)


def _add_tensors(
    writer: GGUFWriter, shape: ProjectorShape, n_embd_text: int, rng: np.random.Generator
) -> None:
    """The tower (patch conv, positions, blocks and a norm: CLIP's before them, SigLIP's
    after) and the projector (LLaVA's ``mm.0``/``mm.2``, Gemma 3's norm and projection), in
    llama.cpp's mmproj names; matrices F16, norms, biases and positions F32."""
    e, p = shape.n_embd, shape.patch_size

    def weights(name: str, *dims: int) -> None:
        std = np.float32(1.0 / np.sqrt(np.prod(dims[1:])))  # fan-in scaled
        writer.add_tensor(name, (rng.standard_normal(dims, np.float32) * std).astype(np.float16))

    def vector(name: str, size: int, fill: float | None = None) -> None:
        values = rng.standard_normal(size, np.float32) * 0.02 if fill is None else fill
        writer.add_tensor(name, np.full(size, values, dtype=np.float32))

    weights("v.patch_embd.weight", e, 3, p, p)  # a conv kernel, as torch lays it out
    if shape.projector == QWEN2VL:  # the second frame's kernel; rotary positions, no table
        weights("v.patch_embd.weight.1", e, 3, p, p)
    else:
        vector("v.patch_embd.bias", e)
        n_pos = (shape.image_size // p) ** 2  # one a patch, before any merge
        writer.add_tensor(
            "v.position_embd.weight",
            rng.standard_normal((n_pos, e), np.float32) * np.float32(0.02),
        )
    norm = "post_ln" if shape.projector in SIGLIP else "pre_ln"
    vector(f"v.{norm}.weight", e, 1.0)
    vector(f"v.{norm}.bias", e, 0.0)
    for i in range(shape.n_layer):
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            weights(f"v.blk.{i}.{part}.weight", e, e)
            vector(f"v.blk.{i}.{part}.bias", e)
        for norm in ("ln1", "ln2"):
            vector(f"v.blk.{i}.{norm}.weight", e, 1.0)
            vector(f"v.blk.{i}.{norm}.bias", e, 0.0)
        weights(f"v.blk.{i}.ffn_up.weight", shape.n_ff, e)
        vector(f"v.blk.{i}.ffn_up.bias", shape.n_ff)
        weights(f"v.blk.{i}.ffn_down.weight", e, shape.n_ff)
        vector(f"v.blk.{i}.ffn_down.bias", e)
    if shape.projector == "gemma3":
        vector("mm.soft_emb_norm.weight", e, 1.0)
        # Stored as the checkpoint holds it (in x out): the loader transposes it.
        weights("mm.input_projection.weight", e, n_embd_text)
        return
    if shape.projector == QWEN2VL:  # the merger: 2x2 patches side by side, an MLP
        weights("mm.0.weight", 4 * e, 4 * e)
        vector("mm.0.bias", 4 * e)
        weights("mm.2.weight", n_embd_text, 4 * e)
        vector("mm.2.bias", n_embd_text)
        return
    if shape.projector == "idefics3":  # after the shuffle: merge² patches side by side
        weights("mm.model.fc.weight", n_embd_text, e * shape.merge**2)
        return
    weights("mm.0.weight", n_embd_text, e)
    vector("mm.0.bias", n_embd_text)
    weights("mm.2.weight", n_embd_text, n_embd_text)
    vector("mm.2.bias", n_embd_text)


def make_projector(
    out: Path, lm_shape: str = "tiny", shape: str = "vit-tiny", seed: int = 0
) -> Path:
    """Write a generated projector for the demo LM of ``lm_shape`` (its output width is that
    model's ``n_embd``, which libmtmd checks at load) to ``out``, staged beside it."""
    dims = PROJECTOR_SHAPES[shape]
    n_embd_text = SHAPES[lm_shape].n_embd

    def fill(writer: GGUFWriter) -> None:
        _add_metadata(writer, dims, n_embd_text)
        _add_tensors(writer, dims, n_embd_text, np.random.default_rng(seed))

    return write_gguf_staged(out, "clip", fill)


def projector_path(directory: Path, lm_shape: str = "tiny", shape: str = "vit-tiny") -> Path:
    """Where the cached projector for ``lm_shape`` lives (seed 0)."""
    return directory / f"demo-mmproj-{shape}-for-{lm_shape}-F16.gguf"


def ensure_projector(directory: Path, lm_shape: str = "tiny", shape: str = "vit-tiny") -> Path:
    """The cached generated projector, made on first use."""
    path = projector_path(directory, lm_shape, shape)
    return path if path.exists() else make_projector(path, lm_shape, shape)
