"""Whether a draft model pays for a model on this machine, and whether both fit.

A draft model (a smaller one of the same family) writes a few tokens ahead and the big one
verifies them in one step. What that gains is arithmetic over this machine's calibration:
the big model's and the draft's generation speeds (the draft's steps cost time), what each
step of several tokens costs the big model (``SpeedModel.step_costs``, measured per weight
type; flat on GPUs, steep on 2 CPU cores for most types) and how often a same-family draft is right (a prior: the engine measures the
real rate as it goes and stops drafting where it does not pay). Memory: the draft's weights,
its own cache (``DRAFT_CTX`` at most) and compute buffer come on top of the big model's plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from localchat.backends.llama.draft_policy import (
    DRAFT_CTX,
    MAX_DRAFT,
    MODEL,
    DraftPolicy,
)
from localchat.gguf.estimate import LayerWeights, ModelDims, estimate_memory
from localchat.gguf.info import GGUFInfo, read_gguf
from localchat.models.catalog import CatalogModel, chat_models
from localchat.models.hardware import Hardware, repacked_weight_types
from localchat.models.planner import PREDICT_FILL, Plan
from localchat.models.speed import SpeedModel, SpeedPrediction, TokenWork, attention_work
from localchat.units import format_bytes

# A draft is worth loading only where it is predicted to beat plain steps by this much: the
# prediction's acceptance is a prior, and a draft costs memory and load time.
MIN_PREDICTED_GAIN = 1.1


@dataclass(frozen=True)
class DraftPlan:
    """A draft model for a model: whether it fits beside it, the speed-up predicted (None
    without a calibration) and why, in words."""

    path: Path
    fits: bool
    gain: float | None
    draft_length: int  # the draft length the prediction is best at (0: none pays)
    ram_bytes: int  # what the draft adds: weights, its cache, its compute buffer
    explanation: str
    step_cost: float | None = None  # a draft step in the model's steps (predicted)

    @property
    def pays(self) -> bool:
        return self.fits and self.gain is not None and self.gain >= MIN_PREDICTED_GAIN


def predicted_gain(target: SpeedPrediction, draft: SpeedPrediction) -> tuple[int, float]:
    """(draft length, tokens/s with drafts over without) for a draft model whose tokens the
    big model keeps at the policy's prior rate, its steps costing what the target's
    prediction says (the policy's default where it says nothing)."""
    policy = DraftPolicy()
    if target.step_costs is not None:
        policy.prior_costs = dict(target.step_costs)
    length, gain = policy.best_length(MODEL, MAX_DRAFT, target.gen_tps / draft.gen_tps)
    return (length, gain) if length else (0, 1.0)


def plan_draft(
    target_path: Path,
    draft_path: Path,
    hardware: Hardware,
    n_ctx: int,
    kv_type: str,
    speed: SpeedModel | None,
) -> DraftPlan:
    """The draft at ``draft_path`` for the model at ``target_path`` run at ``n_ctx`` with a
    ``kv_type`` cache (on the CPU): does it fit beside it, and does it pay."""
    target, draft = read_gguf(target_path), read_gguf(draft_path)
    target_needs = _ram_required(target, n_ctx, kv_type)
    needs = _ram_required(draft, min(n_ctx, DRAFT_CTX), "f16")
    free = hardware.ram_available_bytes - target_needs
    fits = needs <= free
    room = f"needs {format_bytes(needs)} more, {format_bytes(max(0, free))} left"
    if speed is None:
        return DraftPlan(draft_path, fits, None, 0, needs, f"{room}; no speed calibration")
    ours, theirs = _predict(speed, target), _predict(speed, draft)
    length, gain = predicted_gain(ours, theirs)
    verdict = f"~x{gain:.2f} predicted, drafts of {length}" if length else "predicted no gain"
    step_cost = ours.gen_tps / theirs.gen_tps
    return DraftPlan(draft_path, fits, gain, length, needs, f"{verdict}; {room}", step_cost)


def _ram_required(info: GGUFInfo, n_ctx: int, kv_type: str) -> int:
    weights = LayerWeights.from_gguf(info, repacked_weight_types())
    return estimate_memory(ModelDims.from_gguf(info), weights, n_ctx, kv_type).ram_required


def _predict(speed: SpeedModel, info: GGUFInfo) -> SpeedPrediction:
    work = TokenWork.of(info)
    attention = attention_work(ModelDims.from_gguf(info), PREDICT_FILL)
    prediction = speed.predict(work.gen, attention, prompt_work=work.prompt)
    assert prediction is not None  # None only for GPU layers of unknown bandwidth
    return prediction


def with_catalog_drafts(
    models: list[CatalogModel], plans: list[Plan], hardware: Hardware, speed: SpeedModel | None
) -> list[Plan]:
    """``plans`` (``plan_catalog``'s, one per model) with the catalog's draft named where
    both fit together and the calibration predicts a gain (drafts keep replies exact with a
    quantized KV cache; ``--speculative draft`` uses them anyway)."""
    by_name = {plan.model: plan for plan in plans}
    out = []
    for model, plan in zip(chat_models(models), plans, strict=True):  # as plan_catalog's
        draft = by_name.get(model.draft or "")
        if speed is None or draft is None or not plan.fits or not draft.fits:
            out.append(plan)
            continue
        if plan.predicted_gen_tps is None or draft.predicted_gen_tps is None:
            out.append(plan)
            continue
        ours = SpeedPrediction(
            plan.predicted_gen_tps, plan.predicted_prompt_tps or 0.0, plan.predicted_step_costs
        )
        theirs = SpeedPrediction(draft.predicted_gen_tps, draft.predicted_prompt_tps or 0.0)
        _length, gain = predicted_gain(ours, theirs)
        both = (plan.estimate.ram_required if plan.estimate else 0) + (
            draft.estimate.ram_required if draft.estimate else 0
        )
        if gain < MIN_PREDICTED_GAIN or both > hardware.ram_available_bytes:
            out.append(plan)
            continue
        note = f"with draft model {draft.model} {draft.quant}: ~x{gain:.2f}"
        if plan.kv_type == "f16":
            note += ' (kv_type = "q8_0" keeps replies exact)'
        out.append(
            replace(
                plan, draft=draft.model, draft_gain=gain, explanation=f"{plan.explanation}; {note}"
            )
        )
    return out
