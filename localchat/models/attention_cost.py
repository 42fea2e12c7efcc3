"""What attending one position of the context costs a generated token here: the price the
speed model puts on attention (``speed.attention_work`` counts the work).

Every layer and query head takes a dot product with each position's key and adds its value
in, so a token at 512 positions of a grouped-query model does its KV cache's arithmetic
once per query head, 7 times over for Qwen2.5-0.5B. Priced as F16 weights (and once per KV
head) it was missing: a 2-core EPYC's 0.5b and 1b models ran 13-35% under their
predictions, and timing them at 64 and 4,096 positions there gave 38-44 ps per byte of that
work, where its F16 weights cost 16-27. So it is timed, once per calibration, on a narrow,
deep, grouped-query model whose attention outweighs its weights at a long fill: the same tokens generated
after a short and after a long prompt; the difference over the work between them is the
price.
"""

from __future__ import annotations

from pathlib import Path

from localchat.gguf.estimate import ModelDims
from localchat.gguf.info import read_gguf
from localchat.models.demo_shapes import ModelShape

# 16 layers of 12 heads of 64 on 2 KV heads (grouped as Qwen2.5's 0.5-1.5B and Llama 3.2's
# are: a head group reads its keys and values once), weights of 54 MB: at 1,536 positions its
# attention is about twice its weights' time. Without the grouping (8 heads on 8) the price
# read 47-62 ps a byte where the 0.5b and 1b models' own fills gave 38-44; grouped, 32-39.
ATTENTION_SHAPE = ModelShape("attention", 16, 768, 12, 2, 128, 1024, 4096, 10000.0)
SHORT_FILL = 64
LONG_FILL = 1536
GEN_TOKENS = 17  # 16 timed steps at each fill
REPEATS = 2  # each fill's best of two (the long prompt is read once)


def attention_model(directory: Path) -> Path:
    """The model attention is timed on (made on first use, kept beside the demo models)."""
    from localchat.models.demo import write_staged

    shape = ATTENTION_SHAPE  # named by its shape: a file of another never stands in for it
    path = directory / f"timing-attention-{shape.n_embd}x{shape.n_head}on{shape.n_head_kv}.gguf"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        write_staged(path, shape, 0)
    return path


def attention_price(directory: Path, threads: int) -> float:
    """Seconds per byte of attention work (``speed.attention_work``) on this machine; 0.0
    where the two fills did not differ the right way (a busy moment): the speed model then
    prices attention as F16 weights."""
    from localchat.backends.llama.tools import BareLoop
    from localchat.models.speed import attention_work

    path = attention_model(directory)
    dims = ModelDims.from_gguf(read_gguf(path))
    seconds = {}
    with BareLoop(path, LONG_FILL + GEN_TOKENS + 8, threads) as bare:
        for fill in (SHORT_FILL, LONG_FILL):
            runs = [bare.run(fill, GEN_TOKENS, cold=index == 0) for index in range(REPEATS)]
            seconds[fill] = min(1.0 / run["bare_gen_tps"] for run in runs)
    mean = GEN_TOKENS // 2
    work = attention_work(dims, LONG_FILL + mean) - attention_work(dims, SHORT_FILL + mean)
    return max(0.0, (seconds[LONG_FILL] - seconds[SHORT_FILL]) / work)
