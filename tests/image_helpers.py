"""Vision models and pictures for the image tests: the tiny generated LM with a generated
projector beside it (as ``pull`` leaves a vision model), and random PNGs."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image as PILImage

from localchat.models.demo import make_demo_model
from localchat.models.demo_vision import PROJECTOR_SHAPES, make_projector


def vision_model_with(models_dir: Path, shape: str = "vit-tiny") -> Path:
    """The tiny LM in a folder of its own with a ``shape`` projector beside it."""
    folder = models_dir / f"vision-{shape}"
    folder.mkdir(exist_ok=True)
    model = folder / "tiny-vision-Q4_K_M.gguf"
    if not model.exists():
        paired = PROJECTOR_SHAPES[shape]  # the LM it goes with, its image tokens if any
        make_demo_model(model, paired.lm_shape, "Q4_K_M", seed=0, tokenizer=paired.tokenizer)
        make_projector(folder / "mmproj-tiny-vision-F16.gguf", paired.lm_shape, shape)
    return model


def random_png(seed: int, size: tuple[int, int] = (48, 36)) -> bytes:
    """A PNG of random pixels (``size``: width, height)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()
