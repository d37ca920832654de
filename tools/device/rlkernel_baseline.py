"""RL-Kernel's fused linear-logp (csrc/cuda/fused_linear_logp_sm90.cu:
mma.sync m16n8k16 fed by TMA, the vocabulary split by a throughput heuristic,
so not batch invariant) as a baseline in the same run as ours (the
portable kernel is to reach >= 1.8x it).

Third-party code never enters the repository: copy its two sources from a
clone of RL-Kernel into a folder of their own,
  for f in csrc/cuda/fused_linear_logp_sm90.cu csrc/utils/tma_utils.cuh; do
    mkdir -p "$DIR/$(dirname $f)"; git -C RL-Kernel show "HEAD:$f" > "$DIR/$f"; done
and pass --rlkernel DIR (DETLOGP_TUNING=1 DETLOGP_RLKERNEL=DIR for run_suite.sh kernels). Built on
the GPU host with torch.utils.cpp_extension (nvcc, ninja), binding only
its forward: (hidden [N, D] bf16, weight [V, D] bf16, target [N], bias [V]
or None) -> [logp [N], lse [N]] in fp32, temperature 1.
"""

import os
import pathlib
import tempfile

BINDING = """
#include <torch/extension.h>
#include <vector>
std::vector<torch::Tensor> fused_linear_logp_sm90_forward(
    torch::Tensor hidden, torch::Tensor weight, torch::Tensor target,
    torch::optional<torch::Tensor> bias);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &fused_linear_logp_sm90_forward);
}
"""


def load(src_dir):
    """The built forward, or raises if the sources are not staged."""
    from torch.utils import cpp_extension

    src_dir = pathlib.Path(src_dir)
    kernel = src_dir / "csrc" / "cuda" / "fused_linear_logp_sm90.cu"
    if not kernel.is_file():
        raise FileNotFoundError(f"{kernel}: RL-Kernel's sources are not there")
    build = pathlib.Path(tempfile.mkdtemp(prefix="rlkernel_build_"))
    binding = build / "binding.cpp"
    binding.write_text(BINDING)
    module = cpp_extension.load(
        name="rlkernel_fused_linear_logp_sm90",
        sources=[str(kernel), str(binding)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
        extra_ldflags=["-lcuda"],
        build_directory=str(build),
        verbose=bool(os.environ.get("RLKERNEL_VERBOSE")),
    )
    return module.forward
