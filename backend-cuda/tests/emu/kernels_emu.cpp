// kernels.cu on the CPU: the emulation header, the kernels, the launcher (see cuda_emu.h).
// Built by tests/kernels_emulated.rs with `-I tests/emu -I src`.
#define SPARK_CUDA_EMU 1
#include "cuda_emu.h"
#include "kernels.cu"
#include "launch.cpp"
