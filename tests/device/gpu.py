"""What the GPU host has, read from the device (never assumed): the GPUs
nvidia-smi lists and each one's compute capability."""

import dataclasses
import functools
import shutil
import subprocess


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    major: int
    minor: int

    @property
    def capability(self):
        return (self.major, self.minor)

    @property
    def sm(self):
        """ "sm_90" on an H100, "sm_80" on an A100."""
        return f"sm_{self.major}{self.minor}"

    @property
    def is_hopper(self):
        """Compute capability 9.0: the Hopper kernel (sm_90a) runs here."""
        return self.capability == (9, 0)


@functools.cache
def gpus():
    """The GPUs nvidia-smi lists, in index order; () without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return ()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ()
    if out.returncode != 0:
        return ()
    found = []
    for line in out.stdout.splitlines():
        index, name, cap = (field.strip() for field in line.split(","))
        major, minor = cap.split(".")
        found.append(Gpu(int(index), name, int(major), int(minor)))
    return tuple(found)


def not_hopper_reason(gpu):
    """Why a Hopper-only check does not apply on `gpu`."""
    return (
        f"not applicable on {gpu.name} (compute capability {gpu.major}.{gpu.minor}): "
        "the Hopper kernel (sm_90a) runs on compute capability 9.0 only"
    )
