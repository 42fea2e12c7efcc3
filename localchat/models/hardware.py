"""What this machine has: RAM, cores, GPU memory and whether llama.cpp can use the GPU.

Detection never fails: a missing tool or library means "no GPU", with a note saying why.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from dataclasses import dataclass, field

import psutil

from localchat.cpu import cpu_flags, physical_cores

GPU_NONE = "none"
GPU_NVIDIA = "nvidia"
GPU_APPLE = "apple"


@dataclass(frozen=True)
class Hardware:
    ram_total_bytes: int
    ram_available_bytes: int
    cores: int
    vram_total_bytes: int = 0
    vram_free_bytes: int = 0
    gpu: str = GPU_NONE
    gpu_name: str = ""
    gpu_offload: bool = False  # this llama.cpp build can offload layers to that GPU
    gpu_bandwidth_bytes_per_s: float = 0.0  # the GPU's peak memory bandwidth; 0 if unknown
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def unified_memory(self) -> bool:
        """Apple Silicon: the GPU uses the same RAM, so RAM and VRAM are one budget."""
        return self.gpu == GPU_APPLE


def detect_hardware() -> Hardware:
    """This machine, as well as it can be told; never raises."""
    memory = psutil.virtual_memory()
    notes: list[str] = []
    gpu, name, total, free, bandwidth = _detect_nvidia(notes)
    if gpu == GPU_NONE and platform.system() == "Darwin" and platform.machine() == "arm64":
        # Metal can use about three quarters of unified memory for the GPU.
        gpu, name = GPU_APPLE, "Apple Silicon (Metal)"
        total = int(memory.total * 0.75)
        free = min(total, memory.available)
    offload = _llama_gpu_offload()
    if gpu != GPU_NONE and not offload:
        notes.append(f"{name} found, but this llama.cpp build has no GPU backend (CPU only)")
    return Hardware(
        memory.total,
        memory.available,
        physical_cores(),
        total,
        free,
        gpu,
        name,
        offload,
        bandwidth,
        tuple(notes),
    )


def _llama_gpu_offload() -> bool:
    from localchat.backends.llama.tools import supports_gpu_offload

    try:
        return supports_gpu_offload()
    except Exception:
        return False


def _detect_nvidia(notes: list[str]) -> tuple[str, str, int, int, float]:
    """VRAM of the first NVIDIA GPU: NVML (nvidia-ml-py) if installed, else nvidia-smi;
    with its peak memory bandwidth where NVML tells it (bus width x memory clock)."""
    try:
        import pynvml  # nvidia-ml-py, optional

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
            return GPU_NVIDIA, name, int(info.total), int(info.free), _nvml_bandwidth(handle)
        finally:
            pynvml.nvmlShutdown()
    except ImportError:
        pass
    except Exception as exc:  # NVML present but no driver/GPU
        notes.append(f"NVML: {exc}")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        notes.append("no NVIDIA GPU (nvidia-smi not found)")
        return GPU_NONE, "", 0, 0, 0.0
    try:
        output = subprocess.run(
            [smi, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
        name, total_mib, free_mib = (part.strip() for part in output.splitlines()[0].split(","))
        return GPU_NVIDIA, name, int(float(total_mib)) * 2**20, int(float(free_mib)) * 2**20, 0.0
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        notes.append(f"nvidia-smi failed: {exc}")
        return GPU_NONE, "", 0, 0, 0.0


def _nvml_bandwidth(handle: object) -> float:
    """Peak bytes/s: the bus width in bytes x the memory clock x 2 (double data rate)."""
    try:
        import pynvml

        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        return float(bus_bits / 8 * clock_mhz * 1e6 * 2)
    except Exception:  # an older driver or library without these calls: unknown
        return 0.0


X86_REPACKED = frozenset({"Q4_0", "Q4_K", "IQ4_NL"})
# Q2_K's interleaved kernels need AVX-512: with AVX2 alone llama.cpp leaves Q2_K as it is
# (measured: 9 of a Q2_K file's 413 MiB went to CPU_REPACK, its Q4_K tensors).
X86_AVX512_REPACKED = X86_REPACKED | {"Q2_K"}
ARM_REPACKED = frozenset({"Q4_0", "IQ4_NL"})


def repacked_weight_types() -> frozenset[str]:
    """Weight types llama.cpp's CPU backend repacks on this processor (its faster kernels
    need an interleaved copy). x86 with AVX2 and ARM with NEON dot products have them; none
    where llama.cpp's extra buffers are off (they crashed this machine's first decode: see
    ``backends.llama.runtime.extra_buffers_allowed``), for the repacked copies live there."""
    from localchat.backends.llama.runtime import extra_buffers_allowed  # tested once, cached

    if not extra_buffers_allowed():
        return frozenset()
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        flags = cpu_flags()
        if "avx512f" in flags:
            return X86_AVX512_REPACKED
        return X86_REPACKED if "avx2" in flags else frozenset()
    if machine in ("arm64", "aarch64"):
        return ARM_REPACKED
    return frozenset()
