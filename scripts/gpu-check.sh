#!/usr/bin/env bash
# gpu-check.sh -- check the CUDA backend on a GPU machine that has no network and no Rust.
#
#   scripts/gpu-check.sh build [DIR]   (here, with cargo) build the release spark-run, the CUDA
#                                      test executables and the CPU kernel tests, and pack them
#                                      into DIR/bundle.tar.xz (default target/gpu-check, ~4 MiB:
#                                      what travels is limited); the golden data the tests read
#                                      is the repository's (testdata/), which travels with it
#   scripts/gpu-check.sh run DIR       (on the GPU machine) unpack the bundle; print nvidia-smi
#                                      and lscpu; generate a random 1.7B-shape bf16 checkpoint;
#                                      run the CUDA tests (m8 golden parity; CUDA vs CPU on the
#                                      1.7B shape); bench the cuda backend (pp2048 and tg128 at
#                                      batch 1, tg128 at batch 16) and profile it per kernel
#                                      (SPARK_CUDA_PROFILE=1); bench the wgpu backend through
#                                      Vulkan (SKIP_WGPU=1 skips); the PyTorch peer
#                                      (scripts/torch-peer.py, SKIP_TORCH=1 skips); run the CPU kernel tests on
#                                      the host CPU (SKIP_CPU=1 skips). Logs go to $OUT (if set)
#                                      else DIR/out. CKPT_DIR reuses a checkpoint.
#
# With the device tool: build here, then run with the bundle (and the Vulkan loader, .gl, see
# the device README) carried, e.g.
#   scripts/gpu-check.sh build && run(command="for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig;
#       bash scripts/gpu-check.sh run target/gpu-check", carry=["target/gpu-check", ".gl"], timeout_s=540)
# Everything `run` does fits in about 6 minutes on an H200 (each step has its own timeout).
set -uo pipefail

cmd=${1:-}
case "$cmd" in
build)
  set -e
  here=$(cd "$(dirname "$0")/.." && pwd)
  dir=${2:-$here/target/gpu-check}
  target=${CARGO_TARGET_DIR:-$here/target}
  cd "$here"
  cargo build --release -p spark-run --features cuda
  # test_exes PKG: the test executables of PKG, built, found from cargo's JSON messages.
  test_exes() {
    cargo test --release -p "$1" --no-run --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"])'
  }
  mapfile -t exes < <(test_exes backend-cuda)
  [ "${#exes[@]}" -gt 0 ] || { echo "no test executables found" >&2; exit 1; }
  # The CPU kernel tests too, to run them on the GPU host's processor.
  mapfile -t cpu_exes < <(test_exes backend-cpu)
  rm -rf "$dir"
  mkdir -p "$dir/bin" "$dir/tests" "$dir/tests-cpu"
  cp "$target/release/spark-run" "$dir/bin/"
  for e in "${exes[@]}"; do cp "$e" "$dir/tests/"; done
  for e in "${cpu_exes[@]}"; do cp "$e" "$dir/tests-cpu/"; done
  strip "$dir/bin/"* "$dir/tests/"* "$dir/tests-cpu/"* 2>/dev/null || true
  # One compressed file: the working tree that travels to the device is limited to 64 MiB.
  tar -C "$dir" -cJf "$dir/bundle.tar.xz" bin tests tests-cpu
  rm -rf "${dir:?}/bin" "$dir/tests" "$dir/tests-cpu"
  echo "bundle: $dir/bundle.tar.xz ($(du -sh "$dir/bundle.tar.xz" | cut -f1)); tests: ${exes[*]##*/}"
  ;;
run)
  dir=$(cd "${2:?usage: gpu-check.sh run DIR}" && pwd)
  [ -f "$dir/bundle.tar.xz" ] && tar -C "$dir" -xJf "$dir/bundle.tar.xz"
  out=${OUT:-$dir/out}
  mkdir -p "$out"
  log="$out/gpu-check.log"
  exec > >(tee -a "$log") 2>&1
  step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
  status=0
  # Where a CUDA toolkit's libraries usually are (libcublas, libnvrtc); the driver's libcuda is
  # on the default path.
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
  done
  # Else wherever a toolkit or a Python wheel (nvidia-cublas, nvidia-cuda-nvrtc) put them.
  for lib in libcublas.so libnvrtc.so; do
    found=$(ldconfig -p | grep -c "$lib")
    for d in ${LD_LIBRARY_PATH//:/ }; do ls "$d/$lib"* >/dev/null 2>&1 && found=1; done
    if [ "$found" = 0 ]; then
      f=$(find /usr/local /opt /usr/lib -name "$lib*" 2>/dev/null | sort | head -1)
      [ -n "$f" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(dirname "$f")"
    fi
  done
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  # The tests read testdata/ of the repository this script is in (the device's working tree).
  export SPARK_REPO_DIR=$(cd "$(dirname "$0")/.." && pwd)
  spark="$dir/bin/spark-run"

  step "machine"
  nvidia-smi || echo "nvidia-smi failed"
  lscpu | head -20; grep -m1 '^flags' /proc/cpuinfo
  ldd --version | head -1
  ls -l /usr/local/cuda*/lib64/libcublas.so* /usr/local/cuda*/lib64/libnvrtc.so* 2>/dev/null || echo "(no toolkit libraries under /usr/local/cuda)"

  step "spark-run backends"
  timeout 60 "$spark" backends || status=1

  ckpt=${CKPT_DIR:-/tmp/spark-1.7b-random}
  step "gen-random 1.7b -> $ckpt"
  if [ ! -f "$ckpt/config.json" ]; then
    timeout 240 "$spark" gen-random --shape 1.7b --dtype bf16 --out "$ckpt" || { echo "gen-random failed"; status=1; }
  fi
  du -sh "$ckpt" 2>/dev/null

  # The golden tests (m8), then CUDA against CPU on the real-shape checkpoint.
  export SPARK_CUDA_CHECK_CKPT="$ckpt"
  for t in "$dir"/tests/*; do
    step "test $(basename "$t")"
    if ! timeout 180 "$t" --test-threads=1 --nocapture; then
      echo "FAILED: $(basename "$t"); again with SPARK_CUDA_DEBUG_SYNC=1 (each kernel waited for)"
      status=1
      SPARK_CUDA_DEBUG_SYNC=1 timeout 60 "$t" --test-threads=1 --nocapture f32_parity_with_cublas
      if command -v compute-sanitizer >/dev/null; then
        step "compute-sanitizer memcheck $(basename "$t") f32_parity_with_cublas"
        timeout 60 compute-sanitizer --tool memcheck "$t" --test-threads=1 f32_parity_with_cublas | tail -60
      fi
    fi
  done

  step "bench cuda 1.7B bf16: pp2048 tg128, batch 1"
  timeout 150 "$spark" --backend cuda bench --model "$ckpt" -p 2048 -n 128 -r 3 --ctx-size 4096 --json \
    | tee "$out/bench-b1.jsonl" || status=1
  if "$spark" bench --help 2>/dev/null | grep -q -- '--batch'; then
    step "bench cuda 1.7B bf16: tg128, batch 16"
    timeout 100 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 3 --ctx-size 4096 --batch 16 --json \
      | tee "$out/bench-b16.jsonl" || status=1
  else
    echo "note: this spark-run has no 'bench --batch'; batch 16 not measured"
  fi
  for b in 4 8; do
    step "bench cuda 1.7B bf16: tg128, batch $b"
    timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 3 --ctx-size 4096 --batch $b --json \
      | tee "$out/bench-b$b.jsonl" || status=1
  done
  step "bench cuda 1.7B bf16: tg128, batch 16, cuBLAS above 4 rows (SPARK_CUDA_GEMV_MAX_ROWS=4)"
  SPARK_CUDA_GEMV_MAX_ROWS=4 timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 3 --ctx-size 4096 \
    --batch 16 --json | tee "$out/bench-b16-gemv4.jsonl" || status=1
  step "bench cuda 1.7B bf16: tg128, batch 16, attention per sequence (SPARK_CUDA_NO_BATCH_ATTENTION=1)"
  SPARK_CUDA_NO_BATCH_ATTENTION=1 timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 3 \
    --ctx-size 4096 --batch 16 --json | tee "$out/bench-b16-nobatchattn.jsonl" || status=1
  step "bench cuda 1.7B bf16: tg128, batch 16, results read through pinned memory (SPARK_CUDA_PINNED_READ=1)"
  SPARK_CUDA_PINNED_READ=1 timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 3 --ctx-size 4096 \
    --batch 16 --json | tee "$out/bench-b16-pinned.jsonl" || status=1
  step "bench cuda 1.7B bf16: tg128, batch 1, without CUDA graphs (SPARK_CUDA_NO_GRAPHS=1)"
  SPARK_CUDA_NO_GRAPHS=1 timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 3 --ctx-size 4096 --json \
    | tee "$out/bench-b1-nographs.jsonl" || status=1
  # GPU time per kernel (CUDA events around each launch; no graphs then): prefill, then decode.
  step "profile cuda: pp2048 (SPARK_CUDA_PROFILE=1)"
  SPARK_CUDA_PROFILE=1 timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 2048 -n 0 -r 1 --ctx-size 4096
  step "profile cuda: tg128 batch 1 (SPARK_CUDA_PROFILE=1)"
  SPARK_CUDA_PROFILE=1 timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 1 --ctx-size 4096

  step "host time per step: tg128 batch 1 (SPARK_CUDA_PROFILE=steps)"
  SPARK_CUDA_PROFILE=steps timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 1 --ctx-size 4096 2>&1 | grep -E 'cuda steps|tg128'
  step "host time per step: tg128 batch 16 (SPARK_CUDA_PROFILE=steps)"
  SPARK_CUDA_PROFILE=steps timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 1 --ctx-size 4096 \
    --batch 16 2>&1 | grep -E 'cuda steps|tg128'

  # A peer on the same GPU and checkpoint: the model in plain PyTorch (eager, and decode as a
  # torch CUDA graph), where python3 has torch (no other engine can be installed there).
  if [ "${SKIP_TORCH:-0}" != 1 ] && python3 -c 'import torch, safetensors' 2>/dev/null; then
    step "peer: PyTorch on the same checkpoint (scripts/torch-peer.py)"
    timeout 300 python3 "$(dirname "$0")/torch-peer.py" --model "$ckpt" -p 2048 -n 128 --batch 1,16 --reps 3 \
      | tee "$out/torch-peer.jsonl" || echo "torch peer failed or timed out"
  fi

  # The wgpu backend on the same GPU through its Vulkan driver (issue 7), where a loader is
  # present (carry .gl with libvulkan1 and unpack it first: see the device README).
  if [ "${SKIP_WGPU:-0}" != 1 ]; then
    export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
    [ -f "$VK_DRIVER_FILES" ] || unset VK_DRIVER_FILES
    step "spark-run backends (wgpu through Vulkan)"
    timeout 60 "$spark" backends 2>&1 | grep -A2 '^wgpu'
    step "bench wgpu 1.7B: pp512 tg128, batch 1"
    timeout 120 "$spark" --backend wgpu bench --model "$ckpt" -p 512 -n 128 -r 2 --ctx-size 4096 --json \
      | tee "$out/bench-wgpu.jsonl" || echo "wgpu bench failed or timed out"
  fi

  # The CPU kernels on this host's processor (another CPU model than the build machine's).
  if [ -d "$dir/tests-cpu" ] && [ "${SKIP_CPU:-0}" != 1 ]; then
    grep -o -w -E 'avx2|avx512f|avx512_vnni|avx512_bf16|amx_bf16|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
    for t in "$dir"/tests-cpu/*; do
      step "cpu test $(basename "$t")"
      timeout 60 "$t" --test-threads=8 -q 2>&1 | tail -6 || status=1
    done
  fi
  step "done: status $status"
  exit $status
  ;;
*)
  sed -n '2,17p' "$0"
  exit 2
  ;;
esac
