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
#                                      batch 1, tg128 at batch 16, pp2048 in steps of 512 with
#                                      and without attn_flash, pp8192) and profile it per kernel
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
# `run` took about 6 minutes on an H200 before session 17 added four benches and a profile (not
# yet timed there); each step has its own timeout.
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
  # Each test on its own, with its own timeout, so that one that fails or hangs is named; one
  # that fails is run again with programmatic dependent launch off (SPARK_CUDA_NO_PDL=1) and
  # with every kernel waited for (SPARK_CUDA_DEBUG_SYNC=1), to tell a race from a wrong result.
  # The ignored tests (experimental kernels, see cuda_parity.rs) run too, with a short timeout
  # and no second run: which of them hang is the finding.
  failed=()
  for t in "$dir"/tests/*; do
    step "test $(basename "$t")"
    mapfile -t names < <("$t" --list 2>/dev/null | sed -n 's/: test$//p')
    mapfile -t ignored < <("$t" --list --ignored 2>/dev/null | sed -n 's/: test$//p')
    for n in "${names[@]}"; do
      experimental=0
      for i in "${ignored[@]}"; do [ "$i" = "$n" ] && experimental=1; done
      limit=45; [ $experimental = 1 ] && limit=25
      if timeout $limit "$t" --exact "$n" --include-ignored --test-threads=1 --nocapture >"$dir/test.out" 2>&1; then
        grep -v -E '^(running|test result|$)' "$dir/test.out"
      else
        echo "FAILED (status $?)$([ $experimental = 1 ] && echo ' [experimental]'): $n"; tail -40 "$dir/test.out"
        if [ $experimental = 0 ]; then failed+=("$t::$n"); status=1; fi
      fi
    done
  done
  for f in "${failed[@]}"; do
    t=${f%%::*}; n=${f#*::}
    step "again: $n with SPARK_CUDA_NO_PDL=1"
    SPARK_CUDA_NO_PDL=1 timeout 45 "$t" --exact "$n" --test-threads=1 --nocapture 2>&1 | tail -20
    step "again: $n with SPARK_CUDA_DEBUG_SYNC=1"
    SPARK_CUDA_DEBUG_SYNC=1 timeout 45 "$t" --exact "$n" --test-threads=1 --nocapture 2>&1 | tail -20
  done
  if [ "${#failed[@]}" -gt 0 ] && command -v compute-sanitizer >/dev/null; then
    t=${failed[0]%%::*}; n=${failed[0]#*::}
    step "compute-sanitizer memcheck: $n"
    timeout 90 compute-sanitizer --tool memcheck "$t" --exact "$n" --test-threads=1 2>&1 | tail -60
  fi

  # Benches: one JSON line per test in $out/bench.jsonl, each tagged with its variant (one knob
  # changed against the default of the same run).
  bench() {  # bench VARIANT BATCH PROMPT [ENV...] [-- BENCH ARGS...]; BENCH_CTX (4096) the context
    local name=$1 b=$2 p=$3 envs=() args=()
    shift 3
    while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
    [ "${1:-}" = -- ] && shift && args=("$@")
    step "bench cuda 1.7B bf16: $([ "$p" != 0 ] && echo "pp$p ")tg128, batch $b, $name ${envs[*]} ${args[*]}"
    env "${envs[@]}" timeout 120 "$spark" --backend cuda bench --model "$ckpt" -p "$p" -n 128 -r 3 \
      --ctx-size "${BENCH_CTX:-4096}" --batch "$b" "${args[@]}" --json | sed "s/^{/{\"variant\":\"$name\",/" \
      | tee -a "$out/bench.jsonl"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  }
  bench default 1 2048
  # Prefill in steps of 512 tokens (llama.cpp's default ubatch): the chunks after the first take
  # attn_flash, or with SPARK_CUDA_NO_FLASH=1 the split-K kernels; the whole prompt through
  # attn_flash instead of the cuBLAS attention (SPARK_CUDA_NO_DENSE=1); and an 8192-token prompt
  # in one step (past the dense path's 256 MiB of scores: attn_flash from position 0).
  bench ub512 1 2048 -- --ubatch 512
  bench ub512-noflash 1 2048 SPARK_CUDA_NO_FLASH=1 -- --ubatch 512
  bench nodense 1 2048 SPARK_CUDA_NO_DENSE=1
  BENCH_CTX=8448 bench pp8192 1 8192
  for b in 4 8 16; do bench default $b 0; done
  bench pinned 1 0 SPARK_CUDA_PINNED_READ=1
  bench pinned 16 0 SPARK_CUDA_PINNED_READ=1
  bench pdl 1 0 SPARK_CUDA_PDL=1
  bench fuse 1 0 SPARK_CUDA_FUSE=1
  bench fuse+pdl 1 0 SPARK_CUDA_FUSE=1 SPARK_CUDA_PDL=1
  bench nographs 1 0 SPARK_CUDA_NO_GRAPHS=1
  # The default sends steps of more than 4 rows to cuBLAS (gemm::GEMV_DEFAULT_ROWS).
  for r in 8 16; do
    bench "gemv$r" 8 0 SPARK_CUDA_GEMV_MAX_ROWS=$r
    bench "gemv$r" 16 0 SPARK_CUDA_GEMV_MAX_ROWS=$r
  done
  bench gemv0 4 0 SPARK_CUDA_GEMV_MAX_ROWS=0
  # GPU time per kernel (CUDA events around each launch; no graphs then): prefill, then decode.
  step "profile cuda: pp2048 (SPARK_CUDA_PROFILE=1)"
  SPARK_CUDA_PROFILE=1 timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 2048 -n 0 -r 1 --ctx-size 4096
  step "profile cuda: pp2048 in steps of 512 (SPARK_CUDA_PROFILE=1)"
  SPARK_CUDA_PROFILE=1 timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 2048 --ubatch 512 -n 0 -r 1 --ctx-size 4096
  step "profile cuda: tg128 batch 1 (SPARK_CUDA_PROFILE=1)"
  SPARK_CUDA_PROFILE=1 timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 1 --ctx-size 4096
  step "profile cuda: tg128 batch 16 (SPARK_CUDA_PROFILE=1)"
  SPARK_CUDA_PROFILE=1 timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 32 -r 1 --ctx-size 4096 --batch 16

  step "host time per step: tg128 batch 1 (SPARK_CUDA_PROFILE=steps)"
  SPARK_CUDA_PROFILE=steps timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 1 --ctx-size 4096 2>&1 | grep -E 'cuda steps|tg128'
  step "host time per step: tg128 batch 16 (SPARK_CUDA_PROFILE=steps)"
  SPARK_CUDA_PROFILE=steps timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 -r 1 --ctx-size 4096 \
    --batch 16 2>&1 | grep -E 'cuda steps|tg128'
  step "host time per step: tg128 batch 16, pinned reads (SPARK_CUDA_PROFILE=steps SPARK_CUDA_PINNED_READ=1)"
  SPARK_CUDA_PINNED_READ=1 SPARK_CUDA_PROFILE=steps timeout 60 "$spark" --backend cuda bench --model "$ckpt" -p 0 -n 128 \
    -r 1 --ctx-size 4096 --batch 16 2>&1 | grep -E 'cuda steps|tg128'

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
      | sed 's/^{/{"variant":"wgpu",/' | tee -a "$out/bench.jsonl" || echo "wgpu bench failed or timed out"
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
