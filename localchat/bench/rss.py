"""One full-context turn measured in a fresh process: resident memory before the model,
its growth, the process's own peak, and llama.cpp's buffers (``bench --only estimate`` and
``memory`` both stand on it; ``python -m localchat.bench.rss measure MODEL CTX TOKENS``).

The peak is the kernel's ``VmHWM`` for this process, read by the process itself at the end
of its run. ``ru_maxrss`` cannot be used: Linux carries it across fork and exec (exec folds
the old address space's high-water mark into the process's record, and with vfork, as
Python's subprocess starts children, that address space is the parent's), so a child started
by a 2.5 GB bench reported the bench's peak instead of its own. ``VmHWM`` belongs to the
address space, which exec replaces: it counts from zero in the new program.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from localchat.cpu import physical_cores


def _status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A ``kB`` field of /proc/PID/status in bytes; None where there is no /proc (not Linux)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def high_water_bytes(pid: int | str = "self") -> int | None:
    """The process's own peak resident set (``VmHWM``), None where the kernel does not say."""
    return _status_bytes("VmHWM", pid)


def process_resident_bytes(pid: int | str = "self") -> int:
    """The process's resident set now (``VmRSS``; 0 where the kernel does not say)."""
    return _status_bytes("VmRSS", pid) or 0


def peak_rss() -> tuple[int, str]:
    """(this process's peak RSS in bytes, where it was read). Off Linux, ``ru_maxrss`` is
    the only figure there is (bytes on macOS, KiB elsewhere); there it is the best we have."""
    peak = high_water_bytes()
    if peak is not None:
        return peak, "VmHWM"
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss * (1 if sys.platform == "darwin" else 1024), "ru_maxrss"


def measure_rss_growth(
    model_path: Path,
    n_ctx: int,
    gen_tokens: int = 1,
    kv_type: str = "f16",
    flash_attn: bool | None = None,
) -> dict[str, Any]:
    """One full-context turn in this process (run it in a fresh one: it is what the estimate
    predicts): RSS before load, growth to after the turn, the peak, llama.cpp's own buffers,
    and how much of llama-cpp-python's logits array became resident."""
    import psutil

    from localchat.backends.base import Sampling
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.backends.llama.tools import synthetic_prompt

    process = psutil.Process()
    before = process.memory_info().rss
    options = LoadOptions(
        n_ctx=n_ctx, n_threads=physical_cores(), kv_type=kv_type, flash_attn=flash_attn
    )
    engine = Engine(model_path, options)
    prompt = synthetic_prompt(engine.bos_token, engine.n_vocab, n_ctx - gen_tokens - 1)
    for _ in engine.generate(prompt, Sampling(temperature=0.0), gen_tokens):
        pass
    after = process.memory_info().rss
    peak, source = peak_rss()
    scores = engine.llm.scores  # llama-cpp-python's n_batch x n_vocab array
    buffers = engine.buffers
    return {
        "rss_before": before,
        "rss_growth": after - before,
        "rss_peak": peak,
        "rss_peak_source": source,
        "cached_tokens": len(engine.cache.cached_tokens),
        "weights_bytes": sum(buffers.weights.values()),
        "kv_bytes": buffers.kv_bytes,
        "compute_bytes": sum(buffers.compute.values()),
        "output_bytes": buffers.output,
        "flash_attn": engine.flash_attn,
        "logits_array_bytes": int(scores.nbytes),
        "logits_array_resident_bytes": resident_bytes(scores.ctypes.data, int(scores.nbytes)),
    }


def resident_bytes(address: int, size: int) -> int:
    """Resident bytes of the mappings that hold [address, address + size) (Linux smaps)."""
    resident = 0
    inside = False
    try:
        with open("/proc/self/smaps", encoding="utf-8") as smaps:
            for line in smaps:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start < address + size and address < end
                elif inside and line.startswith("Rss:"):
                    resident += int(line.split()[1]) * 1024
    except OSError:
        return -1
    return resident


def measure_in_fresh_process(
    path: Path,
    n_ctx: int,
    gen_tokens: int = 1,
    kv_type: str = "f16",
    flash_attn: bool | None = None,
) -> dict[str, Any]:
    """``measure_rss_growth`` in a new interpreter: nothing measured before weighs on it."""
    command = [sys.executable, "-m", "localchat.bench.rss", "measure", str(path), str(n_ctx)]
    command += [str(gen_tokens), kv_type, _FLASH_ARGS[flash_attn]]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"memory measurement failed: {result.stderr.strip()[-500:]}")
    measured: dict[str, Any] = json.loads(result.stdout)
    return measured


_FLASH_ARGS: dict[bool | None, str] = {None: "auto", True: "on", False: "off"}

if __name__ == "__main__":  # the fresh process that estimate and memory measure in
    if len(sys.argv) == 7 and sys.argv[1] == "measure":
        model, n_ctx, tokens, kv, flash = sys.argv[2:]
        flash_attn = {arg: value for value, arg in _FLASH_ARGS.items()}[flash]
        figures = measure_rss_growth(Path(model), int(n_ctx), int(tokens), kv, flash_attn)
        print(json.dumps(figures))
