"""GPUs the estimator can name in `--gpu` and list under "fits" (pure).

Memory is what NVML reports as the device total, the figure GPU Feature Discovery writes to
`nvidia.com/gpu.memory` (MiB). At bind time vramsched uses the node's own label, not this
table; the table only lets `vramsched estimate --gpu` answer before a pod exists. MIG slices
come from extender.mig (measured `nvidia-smi mig -lgip` figures where known).
"""

from __future__ import annotations

from dataclasses import dataclass

from extender import mig
from extender.sizing.errors import SizingError

__all__ = ["GpuModel", "Device", "GPUS", "find_gpu", "devices"]

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class GpuModel:
    product: str  # nvidia.com/gpu.product as GFD writes it
    memory_mib: int  # nvidia.com/gpu.memory
    aliases: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB


@dataclass(frozen=True, slots=True)
class Device:
    """A whole GPU or one MIG profile of it."""

    name: str
    memory_bytes: int
    product: str
    profile: str | None = None


# NVML totals. A10 23028 and L4 23034 MiB are GFD labels observed on real nodes; T4 15360 is
# GFD's documented example; the rest are the totals nvidia-smi prints for those boards.
GPUS: tuple[GpuModel, ...] = (
    GpuModel("Tesla-T4", 15360, ("T4",)),
    GpuModel("NVIDIA-A10", 23028, ("A10",)),
    GpuModel("NVIDIA-A10G", 23028, ("A10G",)),
    GpuModel("NVIDIA-L4", 23034, ("L4",)),
    GpuModel("NVIDIA-GeForce-RTX-4090", 24564, ("RTX-4090", "4090")),
    GpuModel("NVIDIA-L40S", 46068, ("L40S",)),
    GpuModel("NVIDIA-A100-SXM4-40GB", 40960, ("A100-40GB", "A100-PCIE-40GB")),
    GpuModel("NVIDIA-A100-SXM4-80GB", 81920, ("A100-80GB", "A100", "A100-PCIE-80GB")),
    GpuModel("NVIDIA-H100-80GB-HBM3", 81559, ("H100", "H100-80GB", "H100-SXM", "NVIDIA-H100-PCIe")),
    GpuModel("NVIDIA-H100-NVL", 95830, ("H100-NVL", "H100-94GB")),
    GpuModel("NVIDIA-H200", 143771, ("H200", "H200-141GB")),
    GpuModel("NVIDIA-B200", 183359, ("B200",)),
)


def _key(name: str) -> str:
    return name.strip().upper().replace(" ", "-").replace("_", "-").removeprefix("NVIDIA-")


def find_gpu(name: str) -> GpuModel:
    """A GPU by GFD product name or short alias (case-insensitive); SizingError names the choices."""
    wanted = _key(name)
    for g in GPUS:
        if wanted == _key(g.product) or wanted in (_key(a) for a in g.aliases):
            return g
    known = ", ".join(a for g in GPUS for a in g.aliases[:1])
    raise SizingError(f"unknown GPU {name!r}; known: {known}")


def devices(gpu: GpuModel | None = None) -> list[Device]:
    """Whole GPUs and their MIG profiles (biggest first), for one GPU or all of them."""
    out: list[Device] = []
    for g in (gpu,) if gpu is not None else GPUS:
        out.append(Device(g.product, g.memory_bytes, g.product))
        model = mig.model_for_product(g.product)
        if model is None:
            continue
        for p in sorted(model.profiles, key=lambda p: -p.memory_bytes):
            if p.media_extensions or p.compute_slices == 7:
                continue  # +me is the same memory as its base; 7g is the whole GPU
            out.append(Device(f"{g.product} MIG {p.name}", p.memory_bytes, g.product, p.name))
    return out
