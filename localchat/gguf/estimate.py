"""How much memory a model takes at a context size, before it is loaded (or downloaded).

The parts, as llama.cpp allocates them on a CPU (and, with offload, split with a GPU):

- weights: the exact bytes of every tensor (from the GGUF header or the catalog); layers
  offloaded to the GPU live in VRAM, the rest are mapped from the file and become resident;
- KV cache: padded context x layers x KV heads x head dims x K and V x bytes per element;
- compute buffer: the largest set of intermediate tensors alive at once while evaluating one
  micro-batch: either the attention scores (context x batch x heads, f32, without flash
  attention) or the logits (vocabulary x batch, f32), plus per-token activations;
- repacked weights: on x86 with AVX2 llama.cpp copies Q4_0/Q4_K/Q2_K/IQ4_NL matrices into
  an interleaved layout for faster kernels; the mapped originals were read to make the copy
  and stay resident, so those bytes count twice in the process's memory;
- the output buffer (one row of logits) and a fixed runtime overhead (threads, graph,
  allocator slack). llama-cpp-python's logits array is allocated but never touched unless
  every token's logits are kept, so it costs no resident memory.

The compute-buffer formula was fitted to what llama.cpp 0.3.36 reports for generated models
of several shapes and contexts; ``localchat bench --only estimate`` checks the whole estimate
against measured process memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from localchat.gguf.info import GGUFInfo
from localchat.gguf.quants import bytes_per_weight, parse_tag

MIB = 1024 * 1024
N_UBATCH = 512
CTX_PADDING = 256
# The interpreter-side arrays and llama.cpp allocations not reported as buffers (measured:
# 3-6 MiB beyond the CPU work buffer, which is counted on its own).
RUNTIME_OVERHEAD_BYTES = 8 * MIB
# KV cache element sizes: bytes per value (q8_0: 34 bytes per 32, q4_0: 18 per 32).
KV_BYTES_PER_VALUE = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@dataclass(frozen=True)
class ModelDims:
    """The numbers the estimate needs: from a GGUF header or a catalog entry."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    context_length: int
    sliding_window: int = 0
    swa_pattern: int = 0  # every Nth layer attends the whole context, the others the window

    @classmethod
    def from_gguf(cls, info: GGUFInfo) -> ModelDims:
        pattern = info.arch_value("attention.sliding_window_pattern")
        return cls(
            info.n_layer,
            info.n_embd,
            info.n_head,
            info.n_head_kv,
            info.head_dim_k,
            info.head_dim_v,
            info.n_vocab,
            info.context_length,
            info.sliding_window,
            pattern if isinstance(pattern, int) else swa_pattern_of(info.architecture),
        )

    def window_layers(self, layers: int | None = None) -> int:
        """How many of the first ``layers`` layers attend only the sliding window."""
        layers = self.n_layer if layers is None else layers
        if not self.sliding_window:
            return 0
        pattern = self.swa_pattern or 2
        return layers - sum(1 for i in range(layers) if i % pattern == pattern - 1)


# Sliding-window families as llama.cpp builds them: every Nth layer is a full-context one.
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "gpt-oss": 2}
# At this context and above, flash attention on a CPU costs no generation speed and saves
# most of the compute buffer; below it, it costs speed (measured: 0.5b shape at 2k, 42 vs
# 49 tok/s) for little memory.
FLASH_ATTN_CPU_MIN_CTX = 8192


def swa_pattern_of(architecture: str) -> int:
    return SWA_PATTERNS.get(architecture, 0)


def preferred_flash_attn(n_ctx: int, kv_type: str, on_gpu: bool) -> bool:
    """Flash attention where it costs nothing: a quantized V cache needs it, GPUs run it
    faster, and a CPU at long contexts loses no speed while the buffer shrinks."""
    return kv_type != "f16" or on_gpu or n_ctx >= FLASH_ATTN_CPU_MIN_CTX


# Share of a file's bytes in tensor types that get repacked, by quant (catalog entries carry
# no tensor list): Q4_K_M keeps attn_v/ffn_down halves and the output in Q6_K, and so on.
# A Q2_K file where Q2_K itself is not repacked (x86 without AVX-512): its Q4_K tensors are.
Q2_K_SHARE_WITHOUT_ITS_KERNEL = 0.02
REPACKED_SHARE_BY_QUANT = {"Q4_K_M": 0.70, "Q2_K": 0.55, "Q3_K_M": 0.05, "Q4_0": 0.95}


@dataclass(frozen=True)
class LayerWeights:
    """Weight bytes split the way llama.cpp offloads them, and how much of each is repacked."""

    per_layer: tuple[int, ...]  # blk.N.* bytes for each layer
    output: int  # output.weight and output_norm (offloaded with the last "layer")
    embeddings: int  # token embeddings: always in RAM (looked up on the CPU)
    repacked_per_layer: tuple[int, ...] = ()
    repacked_output: int = 0

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.output + self.embeddings

    @classmethod
    def from_gguf(
        cls, info: GGUFInfo, repacked_types: frozenset[str] = frozenset()
    ) -> LayerWeights:
        per_layer = [0] * info.n_layer
        repacked = [0] * info.n_layer
        output = embeddings = repacked_output = 0
        for tensor in info.tensors:
            # Matrices whose rows come in groups of 8 are repacked; embeddings never are.
            repack = (
                tensor.ggml_type in repacked_types
                and len(tensor.shape) == 2
                and tensor.shape[1] % 8 == 0
                and not tensor.name.startswith("token_embd")
            )
            if tensor.layer is not None and tensor.layer < info.n_layer:
                per_layer[tensor.layer] += tensor.n_bytes
                repacked[tensor.layer] += tensor.n_bytes if repack else 0
            elif tensor.name.startswith("token_embd"):
                embeddings += tensor.n_bytes
            else:
                output += tensor.n_bytes
                repacked_output += tensor.n_bytes if repack else 0
        if not any(t.name == "output.weight" for t in info.tensors):
            output += embeddings  # tied embeddings: the output matrix is the embedding matrix
        return cls(tuple(per_layer), output, embeddings, tuple(repacked), repacked_output)

    @classmethod
    def from_total(
        cls,
        total: int,
        dims: ModelDims,
        quant: str = "",
        repacks: bool | frozenset[str] = False,
    ) -> LayerWeights:
        """An even split for catalog entries that give only the file size."""
        embeddings = int(total * dims.n_vocab * dims.n_embd / max(1, _approx_params(dims)))
        output = embeddings
        layer = max(0, total - embeddings - output) // max(1, dims.n_layer)
        tag = parse_tag(quant)  # a vendor tag (UD-Q4_K_XL) repacks like the type it builds on
        base = tag.base if tag else quant
        share = REPACKED_SHARE_BY_QUANT.get(base, 0.0) if repacks else 0.0
        if base == "Q2_K" and isinstance(repacks, frozenset) and "Q2_K" not in repacks:
            share = Q2_K_SHARE_WITHOUT_ITS_KERNEL
        repacked_layer = int(layer * share)
        return cls(
            tuple([layer] * dims.n_layer),
            output,
            embeddings,
            tuple([repacked_layer] * dims.n_layer),
            int(output * share),
        )


def file_bytes_from_type(dims: ModelDims, quant: str) -> int:
    """A file's size from its shape and its type's bytes per weight, for listings that give
    no size; 0 for a type the tables do not know."""
    per_weight = bytes_per_weight(quant)
    return int(_approx_params(dims) * per_weight) if per_weight else 0


def _approx_params(dims: ModelDims) -> int:
    attn = dims.n_embd * (dims.n_head * dims.head_dim_k) * 2 + dims.n_embd * dims.n_head_kv * (
        dims.head_dim_k + dims.head_dim_v
    )
    ffn = 3 * dims.n_embd * dims.n_embd * 4
    return dims.n_layer * (attn + ffn) + 2 * dims.n_vocab * dims.n_embd


def padded_ctx(n_ctx: int) -> int:
    return -(-n_ctx // CTX_PADDING) * CTX_PADDING


def kv_bytes_per_token(dims: ModelDims, kv_type: str = "f16") -> int:
    """What one position of KV cache takes over all layers (what a generated token reads
    for each position behind it)."""
    per_position = dims.n_head_kv * (dims.head_dim_k + dims.head_dim_v)
    return int(dims.n_layer * per_position * KV_BYTES_PER_VALUE[kv_type])


def window_cells(dims: ModelDims, n_ctx: int, n_ubatch: int = N_UBATCH) -> int:
    """Cells of a sliding-window layer's cache: its window plus a micro-batch, padded (as
    llama.cpp sizes it), never more than the context."""
    return min(padded_ctx(n_ctx), padded_ctx(dims.sliding_window + n_ubatch))


def kv_cache_bytes(
    dims: ModelDims,
    n_ctx: int,
    kv_type: str = "f16",
    n_layers: int | None = None,
    swa_full: bool = False,
    n_ubatch: int = N_UBATCH,
) -> int:
    """KV bytes for ``n_layers`` (default all). Sliding-window layers (Gemma 2 and 3…) keep
    only their window unless ``swa_full``."""
    layers = dims.n_layer if n_layers is None else n_layers
    per_position = dims.n_head_kv * (dims.head_dim_k + dims.head_dim_v)
    windowed = 0 if swa_full else dims.window_layers(layers)
    positions = (layers - windowed) * padded_ctx(n_ctx)
    positions += windowed * window_cells(dims, n_ctx, n_ubatch)
    return int(positions * per_position * KV_BYTES_PER_VALUE[kv_type])


def compute_buffer_bytes(
    dims: ModelDims,
    n_ctx: int,
    kv_type: str = "f16",
    flash_attn: bool | None = None,
    n_ubatch: int = N_UBATCH,
    n_outputs: int | None = None,
) -> int:
    """The largest set of intermediates alive while evaluating one micro-batch (``flash_attn``
    None: as a quantized cache forces it, else off). llama.cpp reserves logits for every
    token of a micro-batch (``n_outputs`` None); a chat computes them for the last token
    only, so with ``n_outputs=1`` this is the part that becomes resident."""
    if flash_attn is None:
        flash_attn = kv_type != "f16"
    ctx = padded_ctx(n_ctx)
    ub = min(n_ubatch, ctx)
    outputs = ub if n_outputs is None else min(n_outputs, ub)
    activations = 6 * dims.n_embd * ub * 4
    logits_phase = dims.n_vocab * outputs * 4 + 2 * dims.n_embd * ub * 4
    if not flash_attn:  # the full attention-score matrix is built
        attention_phase = ctx * ub * (dims.n_head + 1) * 4 + activations
    else:  # flash attention: scores stay in tiles
        attention_phase = (
            ctx * ub * 2
            + activations
            + ctx * dims.n_head_kv * (dims.head_dim_k + dims.head_dim_v) * 2
        )
    return max(logits_phase, attention_phase)


def cpu_work_bytes(dims: ModelDims, n_ctx: int, flash_attn: bool, n_ubatch: int = N_UBATCH) -> int:
    """The CPU backend's work buffer, which llama.cpp does not report: without flash
    attention the soft-maxed scores (context x micro-batch x heads) are converted to F16 for
    the product with V (measured: 109 MiB at 8k for the 0.5b shape; 112 predicted)."""
    if flash_attn:
        return 0
    return padded_ctx(n_ctx) * min(n_ubatch, padded_ctx(n_ctx)) * dims.n_head * 2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes in RAM and in VRAM for one configuration, by part."""

    weights_ram: int
    weights_vram: int
    kv_ram: int
    kv_vram: int
    compute_ram: int
    compute_vram: int
    other_ram: int
    reclaimable_ram: int = 0
    """Part of ``weights_ram``: mapped file pages of repacked tensors. They stay resident (so
    the process shows them) but are clean page cache the kernel drops under pressure, so a
    plan does not need them free."""

    @property
    def ram(self) -> int:
        return self.weights_ram + self.kv_ram + self.compute_ram + self.other_ram

    @property
    def ram_required(self) -> int:
        """RAM that must be free for the model to run without swapping."""
        return self.ram - self.reclaimable_ram

    @property
    def vram(self) -> int:
        return self.weights_vram + self.kv_vram + self.compute_vram

    @property
    def total(self) -> int:
        return self.ram + self.vram


def estimate_memory(
    dims: ModelDims,
    weights: LayerWeights,
    n_ctx: int,
    kv_type: str = "f16",
    n_gpu_layers: int = 0,
    flash_attn: bool | None = None,
    n_ubatch: int = N_UBATCH,
    swa_full: bool = False,
) -> MemoryEstimate:
    """The estimate for ``n_gpu_layers`` offloaded (llama.cpp's convention: more layers than
    the model has also puts the output layer on the GPU); ``flash_attn`` None: as the engine
    picks it (``preferred_flash_attn``)."""
    if flash_attn is None:
        flash_attn = preferred_flash_attn(n_ctx, kv_type, n_gpu_layers > 0)
    on_gpu = min(n_gpu_layers, dims.n_layer)
    output_on_gpu = n_gpu_layers > dims.n_layer
    layer_bytes = list(weights.per_layer)
    gpu_layer_bytes = sum(layer_bytes[dims.n_layer - on_gpu :]) if on_gpu else 0
    weights_vram = gpu_layer_bytes + (weights.output if output_on_gpu else 0)
    cpu_layers = dims.n_layer - on_gpu
    repacked = sum(weights.repacked_per_layer[:cpu_layers]) + (
        0 if output_on_gpu else weights.repacked_output
    )
    weights_ram = weights.total - weights_vram + repacked
    kv_vram = kv_cache_bytes(dims, n_ctx, kv_type, on_gpu, swa_full, n_ubatch)
    kv_ram = kv_cache_bytes(dims, n_ctx, kv_type, dims.n_layer - on_gpu, swa_full, n_ubatch)
    compute = compute_buffer_bytes(dims, n_ctx, kv_type, flash_attn, n_ubatch, n_outputs=1)
    compute_vram = compute if on_gpu else 0
    # With everything offloaded the CPU keeps a small buffer for the embedding lookup.
    compute_ram = (
        compute if on_gpu < dims.n_layer or not output_on_gpu else dims.n_embd * n_ubatch * 4 * 2
    )
    output_buffer = dims.n_vocab * 4
    other_ram = output_buffer + RUNTIME_OVERHEAD_BYTES
    if on_gpu < dims.n_layer:  # attention computed on the CPU for some layers
        other_ram += cpu_work_bytes(dims, n_ctx, flash_attn, n_ubatch)
    return MemoryEstimate(
        weights_ram, weights_vram, kv_ram, kv_vram, compute_ram, compute_vram, other_ram, repacked
    )


@dataclass(frozen=True)
class VisionTower:
    """A vision projector's tower, as far as planning needs it: what one image's encode
    takes beside the projector's weights."""

    image_size: int  # pixels a side of the image (or a slice) it encodes
    patch_size: int
    n_embd: int
    n_ff: int
    n_head: int

    @classmethod
    def of_metadata(cls, meta: dict[str, object]) -> VisionTower:
        """From a projector file's ``clip.vision.*`` keys (0 where one is missing)."""

        def number(key: str) -> int:
            value = meta.get(f"clip.vision.{key}", 0)
            return int(value) if isinstance(value, int | float) else 0

        return cls(
            number("image_size"),
            number("patch_size"),
            number("embedding_length"),
            number("feed_forward_length"),
            number("attention.head_count"),
        )

    def encode_buffer_bytes(self) -> int:
        """The compute buffer of one image's encode: every patch's activations (the
        residual stream several times over, the feed-forward's width) and one head's worth
        of attention scores per head. An estimate: libmtmd reserves it at its first
        encode."""
        if not self.image_size or not self.patch_size:
            return 0
        patches = (self.image_size // self.patch_size) ** 2
        return 4 * patches * (4 * self.n_embd + self.n_ff) + 4 * self.n_head * patches**2
