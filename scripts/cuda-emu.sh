#!/usr/bin/env bash
# Build the CPU stand-in for the CUDA driver and cuBLAS (backend-cuda/tests/emu/driver.cpp: the
# kernels of kernels.cu run on the CPU through the emulation of backend-cuda/tests/emu) into DIR
# (default target/cuda-emu) as DIR/libcuda.so and DIR/libcublas.so (a link to the same file).
# With DIR on LD_LIBRARY_PATH, backend-cuda finds a "GPU" and its GPU tests run on the CPU:
#   scripts/cuda-emu.sh && LD_LIBRARY_PATH=target/cuda-emu cargo test --release -p backend-cuda \
#       --test cuda_parity -- --test-threads=1
# What the emulation does and does not model: backend-cuda/tests/emu/cuda_emu.h, docs/CUDA.md.
# x86-64 only. CXX picks the compiler (default g++; C++20).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/cuda-emu}
mkdir -p "$out"
"${CXX:-g++}" -std=c++20 -O2 -fPIC -shared -pthread -w -I backend-cuda/tests/emu -I backend-cuda/src \
    backend-cuda/tests/emu/driver.cpp -o "$out/libcuda.so"
ln -sf libcuda.so "$out/libcublas.so"
echo "built $out/libcuda.so and $out/libcublas.so (CPU emulation)"
