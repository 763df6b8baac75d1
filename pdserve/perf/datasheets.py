"""GPU datasheet peaks, for MFU/MBU on GPUs and for analytic profiles of hardware not here.

Dense (no 2:4 sparsity) tensor-core peaks for bf16/fp16 with fp32 accumulate, plain fp32 (no
TF32, torch's default for matmul), and HBM/GDDR bandwidth, from the vendors' datasheets. No
torch here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Datasheet:
    label: str
    fp32_flops: float
    half_flops: float  # bf16 / fp16
    bandwidth: float  # bytes/s

    def peak_flops(self, dtype: str) -> float:
        return self.fp32_flops if dtype in ("float32", "float") else self.half_flops


# label, patterns, fp32 TFLOP/s, bf16/fp16 TFLOP/s, bandwidth GB/s. A name matches the first
# entry whose every pattern occurs in it (so "L40S" comes before "L4", "H100 PCIe" before "H100").
_DATASHEETS: list[tuple[str, tuple[str, ...], float, float, float]] = [
    ("NVIDIA H200", ("H200",), 66.9, 989.4, 4800.0),
    ("NVIDIA H100 PCIe", ("H100", "PCIE"), 51.2, 756.0, 2000.0),
    ("NVIDIA H100 NVL", ("H100", "NVL"), 60.0, 835.0, 3900.0),
    ("NVIDIA H100 SXM", ("H100",), 66.9, 989.4, 3350.0),
    ("NVIDIA A100 80GB PCIe", ("A100", "80GB", "PCIE"), 19.5, 312.0, 1935.0),
    ("NVIDIA A100 80GB SXM", ("A100", "80GB"), 19.5, 312.0, 2039.0),
    ("NVIDIA A100 40GB", ("A100",), 19.5, 312.0, 1555.0),
    ("NVIDIA L40S", ("L40S",), 91.6, 362.1, 864.0),
    ("NVIDIA L4", ("L4",), 30.3, 121.0, 300.0),
    ("NVIDIA A10G", ("A10G",), 31.2, 125.0, 600.0),
    ("NVIDIA GeForce RTX 4090", ("4090",), 82.6, 165.2, 1008.0),
]


def datasheet(device_name: str) -> Datasheet:
    """The datasheet of a GPU named as `torch.cuda.get_device_name()` names it ("H100" will do)."""
    upper = device_name.upper()
    for label, patterns, fp32, half, bandwidth_gb_s in _DATASHEETS:
        if all(_has_token(upper, p) for p in patterns):
            return Datasheet(label, fp32 * 1e12, half * 1e12, bandwidth_gb_s * 1e9)
    known = ", ".join(label for label, *_ in _DATASHEETS)
    raise ValueError(f"no datasheet for GPU {device_name!r}; known: {known}")


def _has_token(name: str, pattern: str) -> bool:
    """`pattern` occurs in `name` and is not the prefix of a longer alphanumeric word ("L4" is
    not in "L40S")."""
    start = name.find(pattern)
    while start >= 0:
        end = start + len(pattern)
        if end == len(name) or not name[end].isalnum():
            return True
        start = name.find(pattern, start + 1)
    return False
