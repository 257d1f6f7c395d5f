#!/usr/bin/env bash
# gpu-check.sh -- check the CUDA backend on a GPU machine that has no network and no Rust.
#
#   scripts/gpu-check.sh build [DIR]   (here, with cargo) build the release spark-run and the
#                                      CUDA test executables, and put them with the m8 golden
#                                      data into DIR (default target/gpu-check, ~35 MiB)
#   scripts/gpu-check.sh run DIR       (on the GPU machine) print nvidia-smi and lscpu, generate
#                                      a random 1.7B-shape bf16 checkpoint, run the CUDA tests
#                                      (m8 golden parity; CUDA vs CPU on the 1.7B shape), bench
#                                      the cuda backend (pp2048, tg128; batch 1, and batch 16
#                                      where `bench --batch` exists); logs go to $OUT (if set)
#                                      else DIR/out. CKPT_DIR reuses a checkpoint.
#
# With the device tool: build here, then run with the bundle carried, e.g.
#   scripts/gpu-check.sh build && run(command="bash scripts/gpu-check.sh run target/gpu-check",
#                                     carry=["target/gpu-check"], timeout_s=540)
# Everything `run` does fits in about 5 minutes on an H200 (each step has its own timeout).
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
  # The test executables of backend-cuda, found from cargo's JSON messages.
  cargo test --release -p backend-cuda --no-run --message-format=json >"$target/gpu-check-tests.json"
  mapfile -t exes < <(python3 - "$target/gpu-check-tests.json" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"])
PY
)
  [ "${#exes[@]}" -gt 0 ] || { echo "no test executables found" >&2; exit 1; }
  rm -rf "$dir"
  mkdir -p "$dir/bin" "$dir/tests" "$dir/testdata/golden"
  cp "$target/release/spark-run" "$dir/bin/"
  for e in "${exes[@]}"; do cp "$e" "$dir/tests/"; done
  cp -r testdata/golden/m8 "$dir/testdata/golden/"
  cp scripts/gpu-check.sh "$dir/"
  strip "$dir/bin/"* "$dir/tests/"* 2>/dev/null || true
  echo "bundle: $dir ($(du -sh "$dir" | cut -f1)); tests: ${exes[*]##*/}"
  ;;
run)
  dir=$(cd "${2:?usage: gpu-check.sh run DIR}" && pwd)
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
  export SPARK_REPO_DIR="$dir"
  spark="$dir/bin/spark-run"

  step "machine"
  nvidia-smi || echo "nvidia-smi failed"
  lscpu | head -20
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
    if ! timeout 300 "$t" --test-threads=1 --nocapture; then
      echo "FAILED: $(basename "$t"); again with SPARK_CUDA_DEBUG_SYNC=1 (each kernel waited for)"
      status=1
      SPARK_CUDA_DEBUG_SYNC=1 timeout 120 "$t" --test-threads=1 --nocapture f32_parity_with_cublas
      if command -v compute-sanitizer >/dev/null; then
        step "compute-sanitizer memcheck $(basename "$t") f32_parity_with_cublas"
        timeout 120 compute-sanitizer --tool memcheck "$t" --test-threads=1 f32_parity_with_cublas | tail -60
      fi
    fi
  done

  step "bench cuda 1.7B bf16: pp2048 tg128, batch 1"
  timeout 240 "$spark" --backend cuda bench --model "$ckpt" -p 2048 -n 128 -r 2 --ctx-size 4096 --json \
    | tee "$out/bench-b1.jsonl" || status=1
  if "$spark" bench --help 2>/dev/null | grep -q -- '--batch'; then
    step "bench cuda 1.7B bf16: pp2048 tg128, batch 16"
    timeout 240 "$spark" --backend cuda bench --model "$ckpt" -p 2048 -n 128 -r 2 --ctx-size 4096 --batch 16 --json \
      | tee "$out/bench-b16.jsonl" || status=1
  else
    echo "note: this spark-run has no 'bench --batch'; batch 16 not measured"
  fi
  step "done: status $status"
  exit $status
  ;;
*)
  sed -n '2,17p' "$0"
  exit 2
  ;;
esac
