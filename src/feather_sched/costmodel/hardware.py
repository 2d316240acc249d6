"""Accelerator profiles: the few datasheet numbers the step-cost model needs.

The built-in profiles come from vendor datasheets (dense, no-sparsity tensor throughput).
On-chip (L2) bandwidth is not on any datasheet: those values are estimates, marked as
such, and a calibrated profile (``feather_sched.costmodel.calibrate``) should replace them.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TypeVar

from feather_sched.telemetry.files import read_json

GB = 1e9
MB = 1e6  # NVIDIA quotes L2 sizes in (decimal) MB; the 1e6 vs 2**20 gap is < 5%.
TERA = 1e12

L2_OVER_HBM_ESTIMATE = 2.5
"""Rule-of-thumb L2/HBM bandwidth ratio for NVIDIA data-centre parts (estimate, not datasheet).

Cross-check: the A100 whitepaper gives A100's L2 read bandwidth as 2.3x V100's, and
V100's L2 was measured at ~2.2 TB/s (Jia et al., "Dissecting the NVIDIA Volta GPU
Architecture via Microbenchmarking", 2018), i.e. ~5 TB/s = 2.5x A100's 2039 GB/s HBM.
"""


def is_number(value: object) -> bool:
    """A real number (Python's or NumPy's), not a boolean."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: object) -> bool:
    """An integer (Python's or NumPy's), not a boolean."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require(owner: object, field: str, condition: bool, what: str) -> None:
    """ValueError ``Owner.field must be <what>, got <value>`` unless ``condition``."""
    if not condition:
        raise ValueError(f"{type(owner).__name__}.{field} must be {what}, "
                         f"got {getattr(owner, field)!r}")


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator as the cost model sees it: bandwidths, capacities, peak compute."""

    name: str
    hbm_bytes_per_s: float
    """Peak device-memory (HBM / GDDR / DRAM) bandwidth."""
    l2_bytes: float
    """Last-level on-chip cache capacity."""
    l2_bytes_per_s: float
    """On-chip cache bandwidth; an estimate unless calibrated (datasheets omit it)."""
    bf16_flops: float
    """Dense bf16 tensor throughput, without structured sparsity."""
    memory_bytes: float
    """Device memory capacity."""

    def __post_init__(self) -> None:
        require(self, "name", isinstance(self.name, str) and bool(self.name),
                "a non-empty string")
        for name in ("hbm_bytes_per_s", "l2_bytes", "l2_bytes_per_s", "bf16_flops",
                     "memory_bytes"):
            value = getattr(self, name)
            require(self, name, is_number(value) and math.isfinite(value) and value > 0,
                    "a positive finite number")


_H100_L2_BYTES_PER_S = L2_OVER_HBM_ESTIMATE * 3350 * GB  # estimate, see L2_OVER_HBM_ESTIMATE

HARDWARE: dict[str, HardwareProfile] = {
    # NVIDIA RTX 6000 Ada Generation datasheet: 48 GB GDDR6 at 960 GB/s, 96 MB L2.
    # bf16 dense: NVIDIA Ada Lovelace architecture whitepaper, appendix table, "Peak BF16
    # Tensor TFLOPS with FP32 Accumulate" 364.2 (728.5 with sparsity); check: 142 SMs x
    # 2505 MHz x 1024 dense FP16/BF16 flops per SM-clock = 364.2 TFLOPS. (182.1 is TF32.)
    # L2 bandwidth: not published; estimate ~5 TB/s, because AD102's L2 runs at core clock
    # and RTX 4090 (same die) microbenchmarks land near there; calibrate before trusting.
    "rtx6000-ada": HardwareProfile(
        name="rtx6000-ada",
        hbm_bytes_per_s=960 * GB,
        l2_bytes=96 * MB,
        l2_bytes_per_s=5.0 * TERA,
        bf16_flops=364.2 * TERA,
        memory_bytes=48 * GB,
    ),
    # NVIDIA A100 datasheet (80GB SXM): 2039 GB/s HBM2e, 312 TFLOPS bf16 dense;
    # A100 whitepaper: 40 MB L2.
    "a100-80gb": HardwareProfile(
        name="a100-80gb",
        hbm_bytes_per_s=2039 * GB,
        l2_bytes=40 * MB,
        l2_bytes_per_s=L2_OVER_HBM_ESTIMATE * 2039 * GB,
        bf16_flops=312 * TERA,
        memory_bytes=80 * GB,
    ),
    # NVIDIA H100 datasheet (SXM5): 3.35 TB/s HBM3, 989 TFLOPS bf16 dense (1979 sparse);
    # Hopper whitepaper: 50 MB L2.
    "h100-sxm": HardwareProfile(
        name="h100-sxm",
        hbm_bytes_per_s=3350 * GB,
        l2_bytes=50 * MB,
        l2_bytes_per_s=_H100_L2_BYTES_PER_S,
        bf16_flops=989 * TERA,
        memory_bytes=80 * GB,
    ),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, 989 TFLOPS bf16 dense; same
    # GH100 die and 50 MB L2 as H100 SXM, so the same L2 bandwidth estimate (L2 bandwidth
    # follows the core clock, not the HBM generation).
    "h200": HardwareProfile(
        name="h200",
        hbm_bytes_per_s=4800 * GB,
        l2_bytes=50 * MB,
        l2_bytes_per_s=_H100_L2_BYTES_PER_S,
        bf16_flops=989 * TERA,
        memory_bytes=141 * GB,
    ),
}

DEVICE_NAMES = (
    # (what the driver's name contains, the profile): NVML and torch.cuda name the parts
    # "NVIDIA H200", "NVIDIA H100 80GB HBM3" (the SXM part; the PCIe and NVL parts have
    # other bandwidths), "NVIDIA A100-SXM4-80GB", "NVIDIA RTX 6000 Ada Generation".
    ("H200", "h200"),
    ("H100 80GB HBM3", "h100-sxm"),
    ("A100-SXM4-80GB", "a100-80gb"),
    ("RTX 6000 Ada", "rtx6000-ada"),
)


def device_profile(device_name: str | None) -> HardwareProfile | None:
    """The built-in profile of a device by the name its driver reports; None for a
    device without one (a CPU, another GPU, a variant with other bandwidths)."""
    for part, key in DEVICE_NAMES:
        if device_name and part in device_name:
            return HARDWARE[key]
    return None


T = TypeVar("T")


def from_dict(cls: type[T], data: object) -> T:
    """Build dataclass ``cls`` from a JSON object, every field checked by the class;
    ValueError naming the class and the field (missing, unknown, or a bad value)."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a JSON object, got {data!r}")
    names = {field.name for field in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(key) for key in set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)}")
    try:
        return cls(**data)
    except TypeError as error:  # a required field is missing
        raise ValueError(f"{cls.__name__}: {error}") from None


def save_hardware(profile: HardwareProfile, path: str | Path) -> None:
    """Write a (typically calibrated) profile as JSON."""
    Path(path).write_text(json.dumps(asdict(profile), indent=2) + "\n")


def load_hardware(path: str | Path) -> HardwareProfile:
    """Read a profile written by :func:`save_hardware`; ValueError naming the file and the
    field (OSError if it cannot be read)."""
    data = read_json(path)
    try:
        return from_dict(HardwareProfile, data)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
