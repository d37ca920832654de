#!/usr/bin/env bash
# Prints the Bazel config flag for this machine: the CUDA build when nvcc is
# installed (the kernels compile; they run only where a GPU is), else nocuda.
if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo ""
else
  echo "--config=nocuda"
fi
