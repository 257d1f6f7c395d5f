#!/usr/bin/env bash
# bench-vs-llamacpp.sh -- spark and llama.cpp on the same weights, interleaved run by run so that
# machine noise hits both alike; prints the median tokens/s of each and the ratio.
#
#   scripts/bench-vs-llamacpp.sh MODEL_DIR MODEL.gguf THREADS [RUNS] [PP] [TG]
#
# MODEL_DIR is the safetensors checkpoint spark-run reads, MODEL.gguf the same weights converted
# with `scripts/llamacpp-peer.sh convert` (and `llama-quantize` for Q8_0 / Q4_K_M). SPARK_ARGS
# adds options to spark-run bench (e.g. SPARK_ARGS="--quant int8" beside a Q8_0 file). Needs target/release/spark-run and the llama.cpp peer
# built by `scripts/llamacpp-peer.sh build` (PEER_DIR, default /work/peer).
#
# LLAMA_ISA=avx2 compares the AVX2 paths alone: llama.cpp's AVX2-only build
# (`LLAMA_ISA=avx2 scripts/llamacpp-peer.sh build`) against spark-run with SPARK_CPU_SIMD=avx2
# (no AVX-512, VNNI or AMX kernels), the instruction set of the Zen3 machines the CPU targets
# are set on.
set -euo pipefail
model=${1:?MODEL_DIR}; gguf=${2:?MODEL.gguf}; t=${3:?THREADS}; runs=${4:-3}; pp=${5:-512}; tg=${6:-128}
here=$(cd "$(dirname "$0")/.." && pwd)
spark=${SPARK_RUN:-$here/target/release/spark-run}
case "${LLAMA_ISA:-native}" in
  native) bench=${PEER_DIR:-/work/peer}/llama-build/bin/llama-bench ;;
  avx2) bench=${PEER_DIR:-/work/peer}/llama-build-avx2/bin/llama-bench; export SPARK_CPU_SIMD=avx2 ;;
  *) echo "LLAMA_ISA must be native or avx2" >&2; exit 2 ;;
esac
out=$(mktemp -d)
for i in $(seq "$runs"); do
  # shellcheck disable=SC2086
  "$spark" bench --model "$model" -p "$pp" -n "$tg" -r 1 -t "$t" --json ${SPARK_ARGS:-} >>"$out/spark.jsonl"
  "$bench" -m "$gguf" -p "$pp" -n "$tg" -r 1 -t "$t" -o jsonl >>"$out/llama.jsonl" 2>/dev/null
done
python3 - "$out" "$pp" "$tg" <<'PY'
import json, statistics, sys
d, pp, tg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = {}
for l in open(f"{d}/spark.jsonl"):
    j = json.loads(l); s.setdefault(j["test"], []).append(j["tok_s_mean"])
L = {}
for l in open(f"{d}/llama.jsonl"):
    j = json.loads(l)
    test = f"pp{j['n_prompt']}" if j["n_gen"] == 0 else f"tg{j['n_gen']}"
    L.setdefault(test, []).append(j["avg_ts"])
print("| test | spark tok/s (median) | llama.cpp tok/s (median) | spark / llama.cpp | runs |")
print("| --- | ---: | ---: | ---: | ---: |")
for test in [f"pp{pp}", f"tg{tg}"]:
    a, b = s.get(test, []), L.get(test, [])
    if a and b:
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {test} | {ma:.2f} ({', '.join(f'{x:.2f}' for x in a)}) | {mb:.2f} ({', '.join(f'{x:.2f}' for x in b)}) | {ma/mb:.2f}x | {len(a)} |")
PY
