"""Pick, for a model and a machine, the best configuration that fits — and say why.

Policy, in order (the first that fits wins):

0. with a usable discrete GPU: the best quant from F16 down to Q4_K_M whose every layer fits
   in VRAM at the wanted context (a model split between GPU and CPU runs at CPU speed);
1. the best quant from F16 down to Q4_K_M at the wanted context, KV cache f16, then q8_0
   (quantizing the cache halves it, at a small quality cost);
2. the same quants with the context halved step by step down to a floor of 2048;
3. the quants below Q4_K_M (Q3_K_M, Q2_K), wanted context first, then shrinking.

Quality loss from quants below Q4_K_M is steep, so a shorter context is preferred to them.
With a usable GPU as many layers as fit go to VRAM (all, then fewer); the rest run from RAM.
"Needs" counts RAM that must be free: repacked weights' mapped originals stay resident but
are reclaimable page cache, so they are in the estimate (what the process will show) and not
in the requirement. A plan always leaves headroom: 10% of free RAM plus 512 MiB, and 512 MiB of VRAM. It never
returns a plan that does not fit; when nothing fits it says what the smallest option needs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from localchat.gguf.estimate import (
    N_UBATCH,
    LayerWeights,
    MemoryEstimate,
    ModelDims,
    compute_buffer_bytes,
    estimate_memory,
    file_bytes_from_type,
    preferred_flash_attn,
)
from localchat.gguf.info import read_gguf
from localchat.gguf.quants import bytes_per_weight, is_good_enough, parse_tag, quality_rank
from localchat.models.catalog import CatalogModel, chat_models
from localchat.models.catalog_vision import planned_projector_bytes
from localchat.models.hardware import GPU_NONE, Hardware, repacked_weight_types
from localchat.models.speed import (
    SpeedModel,
    SpeedPrediction,
    TokenWork,
    attention_work,
    work_of_size,
)
from localchat.units import format_bytes

CTX_FLOOR = 2048
DEFAULT_CTX = 8192
RAM_HEADROOM_SHARE = 0.10
RAM_HEADROOM_BYTES = 512 * 1024 * 1024
VRAM_HEADROOM_BYTES = 512 * 1024 * 1024
KV_TYPES_TRIED = ("f16", "q8_0")
# Generation speed a plan should reach (about reading speed), unless a setting says otherwise.
MIN_TOKENS_PER_S = 8.0
# Speeds are predicted for a conversation's early turns: this many positions of KV behind.
PREDICT_FILL = 512
# Types that buy nothing measurable over Q8_0 (llama.cpp's KL-divergence tables).
ABOVE_Q8_0 = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class Candidate:
    """A quant the planner may choose: its file and its weights."""

    quant: str
    file: str
    weights: LayerWeights
    work: TokenWork | None = None  # a local file's own tensors; else by its type

    def token_work(self) -> TokenWork:
        """What a token costs, by weight type (``speed.TokenWork``)."""
        if self.work is not None:
            return self.work
        read = self.weights.total - self.weights.embeddings
        return work_of_size(self.quant, read)


@dataclass(frozen=True)
class Plan:
    model: str
    quant: str
    file: str
    n_gpu_layers: int
    n_layers: int
    n_ctx: int
    kv_type: str
    estimated_bytes: int
    fits: bool
    explanation: str
    estimate: MemoryEstimate | None = None
    predicted_gen_tps: float | None = None  # on this machine's calibration; None without one
    predicted_prompt_tps: float | None = None
    flash_attn: bool = False
    n_ubatch: int = N_UBATCH
    draft: str | None = None  # the catalog's draft model, where it would pay here
    draft_gain: float | None = None  # the speed-up the calibration predicts with it
    predicted_step_costs: dict[int, float] | None = None  # SpeedPrediction.step_costs

    def as_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "quant": self.quant,
            "file": self.file,
            "n_gpu_layers": self.n_gpu_layers,
            "n_layers": self.n_layers,
            "n_ctx": self.n_ctx,
            "kv_type": self.kv_type,
            "estimated_bytes": self.estimated_bytes,
            # What must be free: RAM without the reclaimable mapped pages, and VRAM.
            "required_bytes": self.estimate.ram_required if self.estimate else None,
            "required_vram_bytes": self.estimate.vram if self.estimate else None,
            "fits": self.fits,
            "predicted_gen_tps": _rounded(self.predicted_gen_tps),
            "predicted_prompt_tps": _rounded(self.predicted_prompt_tps),
            "flash_attn": self.flash_attn,
            "n_ubatch": self.n_ubatch,
            "draft": self.draft,
            "draft_predicted_gain": _rounded(self.draft_gain),
            "explanation": self.explanation,
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _budgets(hardware: Hardware) -> tuple[int, int]:
    ram = int(hardware.ram_available_bytes * (1 - RAM_HEADROOM_SHARE)) - RAM_HEADROOM_BYTES
    vram = hardware.vram_free_bytes - VRAM_HEADROOM_BYTES if hardware.gpu_offload else 0
    return max(0, ram), max(0, vram)


def _contexts(wanted: int) -> list[int]:
    contexts = [wanted]
    while contexts[-1] // 2 >= CTX_FLOOR:
        contexts.append(contexts[-1] // 2)
    if contexts[-1] > CTX_FLOOR and wanted > CTX_FLOOR:
        contexts.append(CTX_FLOOR)
    return contexts


@dataclass(frozen=True)
class Attention:
    """The attention kernel and micro-batch a plan runs with (None: the engine's rule)."""

    flash_attn: bool | None = None
    n_ubatch: int = N_UBATCH


# Tried in order until the plan fits: the engine's choice, then flash attention wherever
# it is off, then a smaller micro-batch (each shrinks the compute buffer; the last costs a
# little prefill speed).
ATTENTION_TRIED = (Attention(), Attention(True), Attention(True, N_UBATCH // 2))
# Memory-frugal steps in order: flash attention before a quantized KV cache (which costs a
# little quality), the smaller micro-batch last.
_CONFIGS_TRIED = (
    (ATTENTION_TRIED[0], "f16"),
    (ATTENTION_TRIED[1], "f16"),
    (ATTENTION_TRIED[1], "q8_0"),
    (ATTENTION_TRIED[2], "f16"),
    (ATTENTION_TRIED[2], "q8_0"),
)


def _fit(
    dims: ModelDims,
    weights: LayerWeights,
    n_ctx: int,
    kv_type: str,
    hardware: Hardware,
    full_gpu_only: bool = False,
    attention: Attention = ATTENTION_TRIED[0],
) -> tuple[int, MemoryEstimate] | None:
    """The most GPU layers that fit (all, fewer, none), or None if even CPU-only does not."""
    ram_budget, vram_budget = _budgets(hardware)

    def sized(layers: int) -> MemoryEstimate:
        return estimate_memory(
            dims, weights, n_ctx, kv_type, layers, attention.flash_attn, attention.n_ubatch
        )

    if full_gpu_only:
        estimate = sized(dims.n_layer + 1)
        if vram_budget and estimate.vram <= vram_budget and estimate.ram_required <= ram_budget:
            return dims.n_layer + 1, estimate
        return None
    if hardware.unified_memory and hardware.gpu_offload:
        estimate = sized(dims.n_layer + 1)
        shared = min(ram_budget, vram_budget)
        if estimate.total - estimate.reclaimable_ram <= shared:
            return dims.n_layer + 1, estimate
    elif vram_budget > 0:
        for layers in range(dims.n_layer + 1, 0, -1):
            estimate = sized(layers)
            if estimate.vram <= vram_budget:
                if estimate.ram_required <= ram_budget:
                    return layers, estimate
                break  # fewer GPU layers only moves more into RAM
    estimate = sized(0)
    if estimate.ram_required <= ram_budget:
        return 0, estimate
    return None


def plan_model(
    name: str,
    dims: ModelDims,
    candidates: list[Candidate],
    hardware: Hardware,
    wanted_ctx: int = DEFAULT_CTX,
    speed: SpeedModel | None = None,
    min_tps: float = MIN_TOKENS_PER_S,
) -> Plan:
    """The best configuration of one model on ``hardware`` (see the module's policy): the
    best quality that fits and, with a calibration, generates at ``min_tps`` or faster."""
    wanted = min(wanted_ctx, dims.context_length) if dims.context_length else wanted_ctx
    ranked = sorted(candidates, key=lambda c: quality_rank(c.quant))
    if any(_base(c.quant) == "Q8_0" for c in ranked):
        ranked = [c for c in ranked if _base(c.quant) not in ABOVE_Q8_0] or ranked
    known = [c for c in ranked if parse_tag(c.quant) is not None]
    good = [c for c in known if is_good_enough(c.quant)]
    low = [c for c in known if not is_good_enough(c.quant)]
    others = [c for c in ranked if parse_tag(c.quant) is None]  # a local file's own quant
    contexts = _contexts(wanted)
    passes: list[list[tuple[Candidate, int]]] = [
        [(c, wanted) for c in good + others],
        [(c, ctx) for ctx in contexts[1:] for c in good + others],
        [(c, ctx) for ctx in contexts for c in low],
    ]
    planner = _Planner(name, dims, hardware, speed, min_tps)
    if hardware.gpu_offload and hardware.vram_free_bytes and not hardware.unified_memory:
        chosen = planner.first_fast([(c, wanted) for c in good + others], full_gpu_only=True)
        if chosen is not None:
            return chosen
    for attempts in passes:
        chosen = planner.first_fast(attempts)
        if chosen is not None:
            return chosen
    return _too_big(name, dims, candidates, hardware, contexts[-1])


def _base(quant: str) -> str:
    parsed = parse_tag(quant)
    return parsed.base if parsed else quant


@dataclass(frozen=True)
class _Planner:
    name: str
    dims: ModelDims
    hardware: Hardware
    speed: SpeedModel | None
    min_tps: float

    def first_fast(
        self, attempts: list[tuple[Candidate, int]], full_gpu_only: bool = False
    ) -> Plan | None:
        """The first attempt that fits and is fast enough; else the fastest that fits (with
        why); None when none fits. Says why it passed over the next better quant."""
        passed_over: str | None = None
        slow: list[Plan] = []
        for candidate, n_ctx in attempts:
            plan = self._fit_plan(candidate, n_ctx, full_gpu_only)
            if plan is None:
                passed_over = f"{candidate.quant} does not fit"
                continue
            tps = plan.predicted_gen_tps
            if tps is None or tps >= self.min_tps:
                return _with_note(plan, passed_over)
            slow.append(plan)
            passed_over = f"{candidate.quant} would be ~{format_tps(tps)} tok/s"
        if not slow:
            return None
        fastest = max(slow, key=lambda p: p.predicted_gen_tps or 0.0)
        note = (
            f"under the {self.min_tps:g} tok/s wanted: the fastest that fits"
            " of the quants that keep quality"
        )
        return _with_note(fastest, note)

    def _fit_plan(self, candidate: Candidate, n_ctx: int, full_gpu_only: bool) -> Plan | None:
        for attention, kv_type in _CONFIGS_TRIED:
            fitted = _fit(
                self.dims, candidate.weights, n_ctx, kv_type, self.hardware, full_gpu_only,
                attention,
            )  # fmt: skip
            if fitted is not None:
                layers, estimate = fitted
                prediction = _predict(
                    self.speed, self.dims, candidate, kv_type, estimate, self.hardware
                )
                return _plan(
                    self.name, self.dims, candidate, n_ctx, kv_type, layers, estimate,
                    self.hardware, prediction, attention,
                )  # fmt: skip
        return None


def _predict(
    speed: SpeedModel | None,
    dims: ModelDims,
    candidate: Candidate,
    kv_type: str,
    estimate: MemoryEstimate,
    hardware: Hardware,
) -> SpeedPrediction | None:
    """The calibrated speed of a candidate placed as ``estimate`` says (GPU layers at the
    GPU's bandwidth), with PREDICT_FILL positions of KV behind each token."""
    if speed is None:
        return None
    read = max(1, candidate.weights.total - candidate.weights.embeddings)  # bytes, as VRAM is
    on_gpu = min(estimate.weights_vram, read)
    cpu_share = (read - on_gpu) / read
    on_cpu = candidate.token_work().scaled(cpu_share)
    return speed.predict(
        on_cpu.gen,
        int(attention_work(dims, PREDICT_FILL) * cpu_share),
        on_gpu,
        hardware.gpu_bandwidth_bytes_per_s,
        on_cpu.prompt,
    )


def format_tps(tps: float) -> str:
    """Speeds near the wanted one keep a decimal (7.6 must not read as 8)."""
    return f"{tps:.1f}" if tps < 10 else f"{tps:.0f}"


def _with_note(plan: Plan, note: str | None) -> Plan:
    if not note:
        return plan
    return replace(plan, explanation=f"{plan.explanation}; {note}")


def _free_text(hardware: Hardware, estimate: MemoryEstimate, layers: int) -> str:
    if layers and hardware.unified_memory:
        return f"needs {format_bytes(estimate.total - estimate.reclaimable_ram)} of {format_bytes(hardware.ram_available_bytes)} free (unified)"
    if layers:
        return (
            f"needs {format_bytes(estimate.vram)} of {format_bytes(hardware.vram_free_bytes)} free VRAM"
            f" + {format_bytes(estimate.ram_required)} of {format_bytes(hardware.ram_available_bytes)} free RAM"
        )
    return f"needs {format_bytes(estimate.ram_required)} of {format_bytes(hardware.ram_available_bytes)} free RAM"


def _plan(
    name: str,
    dims: ModelDims,
    candidate: Candidate,
    n_ctx: int,
    kv_type: str,
    layers: int,
    estimate: MemoryEstimate,
    hardware: Hardware,
    prediction: SpeedPrediction | None = None,
    attention: Attention = ATTENTION_TRIED[0],
) -> Plan:
    if layers == 0:
        placement = "CPU only"
    else:
        placement = f"{min(layers, dims.n_layer)}/{dims.n_layer} layers on GPU"
    parts = [candidate.quant, placement, f"ctx {n_ctx}"]
    if kv_type != "f16":
        parts.append(f"KV {kv_type}")
    preferred = preferred_flash_attn(n_ctx, kv_type, layers > 0)
    flash_attn = attention.flash_attn if attention.flash_attn is not None else preferred
    parts += _attention_notes(dims, n_ctx, kv_type, flash_attn, preferred, attention.n_ubatch)
    if prediction is not None:
        parts.append(f"~{format_tps(prediction.gen_tps)} tok/s here")
    parts.append(_free_text(hardware, estimate, layers))
    return Plan(
        name,
        candidate.quant,
        candidate.file,
        layers,
        dims.n_layer,
        n_ctx,
        kv_type,
        estimate.total,
        True,
        " · ".join(parts),
        estimate,
        prediction.gen_tps if prediction else None,
        prediction.prompt_tps if prediction else None,
        flash_attn,
        attention.n_ubatch,
        predicted_step_costs=prediction.step_costs if prediction else None,
    )


def _attention_notes(
    dims: ModelDims, n_ctx: int, kv_type: str, flash_attn: bool, preferred: bool, n_ubatch: int
) -> list[str]:
    """Which attention kernel and micro-batch, and why, where it is worth saying."""
    notes = []
    if flash_attn and not preferred:
        notes.append("flash attention (to fit)")
    elif flash_attn:
        saved = compute_buffer_bytes(dims, n_ctx, kv_type, False, n_ubatch) - (
            compute_buffer_bytes(dims, n_ctx, kv_type, True, n_ubatch)
        )
        if saved > 16 * 2**20:  # worth saying
            notes.append(f"flash attention (saves {format_bytes(saved)})")
    if n_ubatch != N_UBATCH:
        notes.append(f"micro-batch {n_ubatch} (to fit)")
    return notes


def _too_big(
    name: str, dims: ModelDims, candidates: list[Candidate], hardware: Hardware, n_ctx: int
) -> Plan:
    """Nothing fits: report what the smallest option would need."""
    smallest = min(candidates, key=lambda c: c.weights.total)
    estimate = estimate_memory(dims, smallest.weights, n_ctx, "q8_0", 0)
    free = hardware.ram_available_bytes + (hardware.vram_free_bytes if hardware.gpu_offload else 0)
    explanation = (
        f"too big: the smallest option ({smallest.quant}, ctx {n_ctx}, KV q8_0) needs"
        f" {format_bytes(estimate.ram_required)}; {format_bytes(free)} free"
    )
    return Plan(
        name,
        smallest.quant,
        smallest.file,
        0,
        dims.n_layer,
        n_ctx,
        "q8_0",
        estimate.total,
        False,
        explanation,
        estimate,
    )


def sized_candidates(dims: ModelDims, files: Iterable[tuple[str, str, int]]) -> list[Candidate]:
    """Candidates known only by (quant, file name, size): catalog entries and hub listings.
    A file listed without a size is sized from a sibling's by their bytes per weight (or from
    the shape alone when no sibling has a size)."""
    repacks = repacked_weight_types()
    listed = list(files)
    reference = next(
        ((q, size) for q, _n, size in listed if size > 0 and bytes_per_weight(q)), None
    )

    def size_of(quant: str, size: int) -> int:
        per_weight = bytes_per_weight(quant)
        if size > 0 or per_weight is None:
            return size
        if reference is not None:
            return int(reference[1] * per_weight / (bytes_per_weight(reference[0]) or 1.0))
        return file_bytes_from_type(dims, quant)

    return [
        Candidate(quant, name, LayerWeights.from_total(size_of(quant, size), dims, quant, repacks))
        for quant, name, size in listed
    ]


def plan_catalog(
    models: list[CatalogModel],
    hardware: Hardware,
    wanted_ctx: int = DEFAULT_CTX,
    speed: SpeedModel | None = None,
    min_tps: float = MIN_TOKENS_PER_S,
) -> list[Plan]:
    """A plan for every catalog chat model (from catalog numbers: nothing is downloaded),
    a vision model's with its projector; embedding models are not run as chats, so not
    planned as one."""
    return [
        plan_with_projector(
            model.name,
            model.dims,
            sized_candidates(model.dims, ((f.quant, f.file, f.size) for f in model.files)),
            hardware,
            wanted_ctx,
            speed,
            min_tps,
            planned_projector_bytes(model),
        )
        for model in chat_models(models)
    ]


def plan_file(
    path: Path,
    hardware: Hardware,
    wanted_ctx: int = DEFAULT_CTX,
    speed: SpeedModel | None = None,
    min_tps: float = MIN_TOKENS_PER_S,
    projector_bytes: int = 0,
) -> Plan:
    """The plan for one local GGUF file; its quant is the file's own. ``projector_bytes``:
    a vision projector loaded beside it (``projectors.projector_memory_bytes``)."""
    info = read_gguf(path)
    weights = LayerWeights.from_gguf(info, repacked_weight_types())
    candidate = Candidate(info.file_type, path.name, weights, TokenWork.of(info))
    dims = ModelDims.from_gguf(info)
    return plan_with_projector(
        path.name, dims, [candidate], hardware, wanted_ctx, speed, min_tps, projector_bytes
    )


def less_ram(hardware: Hardware, taken: int) -> Hardware:
    """The machine with ``taken`` bytes of RAM already spoken for (a vision projector)."""
    if not taken:
        return hardware
    return replace(hardware, ram_available_bytes=max(0, hardware.ram_available_bytes - taken))


def plan_with_projector(
    name: str,
    dims: ModelDims,
    candidates: list[Candidate],
    hardware: Hardware,
    wanted_ctx: int,
    speed: SpeedModel | None,
    min_tps: float,
    projector_bytes: int = 0,
) -> Plan:
    """``plan_model`` with a vision projector beside the model: in RAM (libmtmd runs it on
    the CPU here), planned around and counted in the estimate."""
    left = less_ram(hardware, projector_bytes)
    plan = plan_model(name, dims, candidates, left, wanted_ctx, speed, min_tps)
    if not projector_bytes:
        return plan
    return replace(
        plan,
        estimated_bytes=plan.estimated_bytes + projector_bytes,
        explanation=f"{plan.explanation}; with the vision projector ({format_bytes(projector_bytes)})",
    )


def fit_label(
    dims: ModelDims,
    candidate: Candidate,
    hardware: Hardware,
    n_ctx: int,
    speed: SpeedModel | None = None,
) -> tuple[str, int, SpeedPrediction | None]:
    """Where this file runs at ``n_ctx``: "GPU" (every layer), "RAM" (some or all on the CPU)
    or "too big"; with the memory it needs free, in bytes, and, with a calibration, how fast
    it runs placed so (for listings)."""
    for kv_type in KV_TYPES_TRIED:
        fitted = _fit(dims, candidate.weights, n_ctx, kv_type, hardware)
        if fitted is not None:
            layers, estimate = fitted
            label = "GPU" if layers > dims.n_layer else "RAM"
            prediction = _predict(speed, dims, candidate, kv_type, estimate, hardware)
            return label, estimate.ram_required + estimate.vram, prediction
    needs = estimate_memory(dims, candidate.weights, n_ctx, "q8_0", 0).ram_required
    return "too big", needs, None


def hardware_json(hardware: Hardware) -> dict[str, object]:
    return {
        "ram_total_bytes": hardware.ram_total_bytes,
        "ram_available_bytes": hardware.ram_available_bytes,
        "vram_total_bytes": hardware.vram_total_bytes,
        "vram_free_bytes": hardware.vram_free_bytes,
        "gpu_offload": hardware.gpu_offload,
        "cores": hardware.cores,
        "gpu": hardware.gpu,
        "gpu_name": hardware.gpu_name,
        "notes": list(hardware.notes),
    }


def format_hardware_report(
    hardware: Hardware, plans: list[Plan], speed: SpeedModel | None = None
) -> str:
    """What `localchat hw` prints and the app's hardware screen shows (``speed``: where the
    predicted speeds come from, when they were asked for)."""
    if hardware.gpu == GPU_NONE:
        gpu = "none"
    else:
        gpu = f"{hardware.gpu_name}, {format_bytes(hardware.vram_free_bytes)} free of {format_bytes(hardware.vram_total_bytes)}"
        if not hardware.gpu_offload:
            gpu += " (this llama.cpp build cannot use it)"
    lines = [
        f"RAM   {format_bytes(hardware.ram_available_bytes)} free of {format_bytes(hardware.ram_total_bytes)}",
        f"CPU   {hardware.cores} cores",
        f"GPU   {gpu}",
    ]
    lines += [f"      ({note})" for note in hardware.notes]
    if speed is not None:
        lines.append(f"SPEED {speed.describe()}")
    lines.append("")
    width = max((len(plan.model) for plan in plans), default=0) + 2
    lines += [f"{plan.model.ljust(width)}{plan.explanation}" for plan in plans]
    return "\n".join(lines) + "\n"
