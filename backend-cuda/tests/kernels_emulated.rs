//! The CUDA kernels (`src/kernels.cu`) run on the CPU through a small emulation of CUDA C
//! (`tests/emu/cuda_emu.h`, `tests/emu/launch.cpp`, compiled here with g++), checked against
//! plain Rust references: their logic (indexing, ring slots, split-K, the barrier and warp-shuffle
//! reductions, the fused KV append) is tested on machines without a GPU.
//!
//! What this does not test: the GPU's memory model and timing, CUDA's math library (glibc's
//! `expf` here, so the tolerances are float ones, not bit equality), the host launch code in
//! `lib.rs`, cuBLAS. `cuda_parity` does, on a GPU (and, for the host code, on the CPU stand-in
//! for the driver that `scripts/cuda-emu.sh` builds from the same emulation).
//!
//! The compiler is `g++`, or `SPARK_EMU_CXX` (any C++20 compiler with g++'s flags, e.g. clang++).
//! Without one these tests print "skipped: no g++" and pass, unless `SPARK_REQUIRE_EMU=1` (CI
//! sets it when g++ is present), where they fail.

use std::ffi::{c_char, CString};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

type LaunchFn =
    unsafe extern "C" fn(*const c_char, *const u32, *const u32, u32, *const u64, u32, *mut c_char, usize) -> i32;

struct Emu {
    _lib: libloading::Library,
    launch: LaunchFn,
}

impl Emu {
    /// Run `name` over `grid` blocks of `block` threads with `shared` bytes of dynamic shared
    /// memory; `args` as the backend passes them (one 64-bit slot each).
    fn launch(&self, name: &str, grid: (u32, u32, u32), block: u32, shared: u32, args: &[u64]) {
        let cname = CString::new(name).unwrap();
        let g = [grid.0, grid.1, grid.2];
        let b = [block, 1, 1];
        let mut err = [0 as c_char; 256];
        // SAFETY: the library's launcher takes these pointers for the call only; every pointer
        // argument in `args` is a live buffer of the size the kernel indexes (the tests size
        // them), and the kernels run before this returns.
        let rc = unsafe {
            (self.launch)(
                cname.as_ptr(),
                g.as_ptr(),
                b.as_ptr(),
                shared,
                args.as_ptr(),
                args.len() as u32,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        // SAFETY: the launcher writes a NUL-terminated message into `err` (zeroed otherwise).
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
        assert_eq!(rc, 0, "emulated launch of {name}: {msg}");
    }
}

/// The emulator built once per test process; None (after printing why) without g++.
fn emu() -> Option<&'static Emu> {
    static EMU: OnceLock<Result<Emu, String>> = OnceLock::new();
    let r = EMU.get_or_init(build);
    match r {
        Ok(e) => Some(e),
        Err(why) => {
            let required = std::env::var("SPARK_REQUIRE_EMU").is_ok_and(|v| v == "1");
            assert!(!required, "SPARK_REQUIRE_EMU=1 but the CUDA emulator is unavailable: {why}");
            println!("skipped: {why}");
            None
        }
    }
}

fn build() -> Result<Emu, String> {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let emu_dir = here.join("tests/emu");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda-emu");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let so = out.join(format!("libspark_cuda_emu_{}.so", std::process::id()));
    let cxx = std::env::var("SPARK_EMU_CXX").unwrap_or_else(|_| "g++".into());
    let run = Command::new(&cxx)
        .args(["-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-w", "-I"])
        .arg(&emu_dir)
        .arg("-I")
        .arg(here.join("src"))
        .arg(emu_dir.join("kernels_emu.cpp"))
        .arg("-o")
        .arg(&so)
        .output();
    let run = match run {
        Ok(r) => r,
        Err(e) => return Err(format!("no g++ ({cxx}: {e}); the CUDA kernels' CPU emulation needs a C++20 compiler")),
    };
    if !run.status.success() {
        panic!("{cxx} could not compile kernels.cu for the emulator:\n{}", String::from_utf8_lossy(&run.stderr));
    }
    // SAFETY: the library was just built from our sources; loading runs no initializers beyond
    // the C++ runtime's.
    let lib = unsafe { libloading::Library::new(&so) }.map_err(|e| format!("loading {}: {e}", so.display()))?;
    // SAFETY: spark_emu_launch has exactly the LaunchFn signature (launch.cpp).
    let launch =
        *unsafe { lib.get::<LaunchFn>(b"spark_emu_launch\0") }.map_err(|e| format!("spark_emu_launch: {e}"))?;
    let _ = std::fs::remove_file(&so);
    Ok(Emu { _lib: lib, launch })
}

fn p<T>(v: &[T]) -> u64 {
    v.as_ptr() as u64
}
fn u(v: usize) -> u64 {
    u32::try_from(v).expect("fits u32") as u64
}
fn f(v: f32) -> u64 {
    v.to_bits() as u64
}

/// A small deterministic generator of values in [-1, 1).
fn rng(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn bf16_round(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}: element {i}: {g} against {w} (tolerance {tol})");
    }
}

#[test]
fn rms_norm_and_residual_add_match_the_reference() {
    let Some(emu) = emu() else { return };
    let (rows, cols, eps) = (3usize, 1000usize, 1e-6f32);
    let mut s = 7;
    let x: Vec<f32> = (0..rows * cols).map(|_| rng(&mut s)).collect();
    let r: Vec<f32> = (0..rows * cols).map(|_| rng(&mut s)).collect();
    let w: Vec<f32> = (0..cols).map(|_| 1.0 + 0.5 * rng(&mut s)).collect();
    let norm = |h: &[f32]| -> Vec<f32> {
        let mut o = vec![0.0; rows * cols];
        for row in 0..rows {
            let xr = &h[row * cols..(row + 1) * cols];
            let ms = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / cols as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            for j in 0..cols {
                o[row * cols + j] = (w[j] as f64 * (xr[j] as f64 * inv)) as f32;
            }
        }
        o
    };
    // The strided kernels, and the `_vec` ones (the row in registers: 1 to 8 float4 per thread
    // at these block sizes, and the strided fallback past that).
    for (suffix, block) in [("", 32u32), ("", 256), ("_vec", 32), ("_vec", 64), ("_vec", 256)] {
        let (norm_k, add_k) = (format!("rms_norm{suffix}"), format!("add_rms_norm{suffix}"));
        let mut out = vec![f32::NAN; rows * cols];
        emu.launch(&norm_k, (rows as u32, 1, 1), block, 0, &[p(&x), p(&w), p(&out), u(cols), f(eps), 0]);
        assert_close(&format!("{norm_k}, {block} threads"), &out, &norm(&x), 1e-5);
        // bf16 mode rounds every output to bf16.
        emu.launch(&norm_k, (rows as u32, 1, 1), block, 0, &[p(&x), p(&w), p(&out), u(cols), f(eps), 1]);
        assert!(out.iter().all(|&v| bf16_round(v) == v), "{norm_k} mode 1: outputs not bf16 values");
        assert_close(&format!("{norm_k} bf16, {block} threads"), &out, &norm(&x), 1e-2);
        out.fill(f32::NAN);
        let h = x.clone();
        emu.launch(&add_k, (rows as u32, 1, 1), block, 0, &[p(&h), p(&r), p(&w), p(&out), u(cols), f(eps), 0]);
        let sum: Vec<f32> = x.iter().zip(&r).map(|(a, b)| a + b).collect();
        assert_eq!(h, sum, "{add_k}: the residual");
        assert_close(&format!("{add_k}, {block} threads"), &out, &norm(&sum), 1e-5);
    }
    // The register-resident kernels sum the squares in the strided kernels' order: the same bits
    // (at 1000 columns the vector kernels hold the row; at 1002 they fall back to a loop).
    for cols in [1000usize, 1002] {
        let x: Vec<f32> = (0..rows * cols).map(|_| 3.0 * rng(&mut s)).collect();
        let r: Vec<f32> = (0..rows * cols).map(|_| rng(&mut s)).collect();
        let w: Vec<f32> = (0..cols).map(|_| 1.0 + 0.5 * rng(&mut s)).collect();
        for block in [32u32, 64, 256] {
            let run = |k: &str| -> (Vec<f32>, Vec<f32>) {
                let out = vec![f32::NAN; rows * cols];
                if k.starts_with("add") {
                    let h = x.clone();
                    emu.launch(k, (rows as u32, 1, 1), block, 0, &[p(&h), p(&r), p(&w), p(&out), u(cols), f(eps), 0]);
                    (out, h)
                } else {
                    emu.launch(k, (rows as u32, 1, 1), block, 0, &[p(&x), p(&w), p(&out), u(cols), f(eps), 0]);
                    (out, vec![])
                }
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for k in ["rms_norm", "add_rms_norm"] {
                let (a, ha) = run(k);
                let (b, hb) = run(&format!("{k}_vec"));
                let differ = |a: &[f32], b: &[f32]| bits(a).iter().zip(bits(b)).filter(|(x, y)| *x != y).count();
                let n = differ(&a, &b);
                assert_eq!(
                    n,
                    0,
                    "{k} and {k}_vec: {n} of {} outputs differ ({cols} columns, {block} threads)",
                    a.len()
                );
                assert_eq!(differ(&ha, &hb), 0, "{k} and {k}_vec: the residual differs");
            }
        }
    }
}

/// One attention case: `nq` queries at positions `start..`, rows `row0..` of `qkv`, over a cache
/// holding positions below `start` (a ring of `ring` slots when `ring > 0`).
struct Case {
    nh: usize,
    nkv: usize,
    d: usize,
    window: usize,
    ring: usize,
    start: usize,
    nq: usize,
    row0: usize,
    bf16_cache: bool,
}

impl Case {
    fn kvd(&self) -> usize {
        self.nkv * self.d
    }
    fn cols(&self) -> usize {
        self.nh * self.d + 2 * self.kvd()
    }
    fn slots(&self) -> usize {
        if self.ring > 0 {
            self.ring
        } else {
            self.start + self.nq
        }
    }
    fn slot(&self, pos: usize) -> usize {
        if self.ring > 0 {
            pos % self.ring
        } else {
            pos
        }
    }
}

/// Random qkv rows and a cache (f32 values, bf16-representable when the cache is bf16), as
/// `(qkv, k cache, v cache)`; the cache as stored (f32 words or bf16 bits in u16).
fn case_data(c: &Case, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut s = seed;
    let qkv: Vec<f32> = (0..(c.row0 + c.nq) * c.cols()).map(|_| rng(&mut s)).collect();
    let mut cache = || -> Vec<f32> {
        (0..c.slots() * c.kvd()).map(|_| if c.bf16_cache { bf16_round(rng(&mut s)) } else { rng(&mut s) }).collect()
    };
    let (k, v) = (cache(), cache());
    (qkv, k, v)
}

/// The reference: softmax(q k^T * scale) v over each query's keys, in f64.
fn reference(c: &Case, qkv: &[f32], kc: &[f32], vc: &[f32], scale: f32) -> Vec<f32> {
    let cols = c.cols();
    let mut out = vec![0.0f32; c.nq * c.nh * c.d];
    for i in 0..c.nq {
        let pos = c.start + i;
        let lo = if c.window > 0 && pos + 1 > c.window { pos + 1 - c.window } else { 0 };
        for h in 0..c.nh {
            let kvh = h / (c.nh / c.nkv);
            let q = &qkv[(c.row0 + i) * cols + h * c.d..][..c.d];
            let kv_at = |p: usize, which: usize| -> &[f32] {
                if p >= c.start {
                    &qkv[(c.row0 + p - c.start) * cols + c.nh * c.d + which * c.kvd() + kvh * c.d..][..c.d]
                } else {
                    let base = if which == 0 { kc } else { vc };
                    &base[c.slot(p) * c.kvd() + kvh * c.d..][..c.d]
                }
            };
            let scores: Vec<f64> = (lo..=pos)
                .map(|p| q.iter().zip(kv_at(p, 0)).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale as f64)
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|&s| (s - m).exp()).collect();
            let l: f64 = e.iter().sum();
            for dd in 0..c.d {
                let o: f64 = (lo..=pos).zip(&e).map(|(p, &w)| w / l * kv_at(p, 1)[dd] as f64).sum();
                out[(i * c.nh + h) * c.d + dd] = o as f32;
            }
        }
    }
    out
}

fn to_bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect()
}

/// Positions per page of a full layer's cache (`KV_PAGE` in kernels.cu).
const KV_PAGE: usize = 64;

/// One cache (K or V) as the kernels hold it: f32 bits, or bf16 bits two per word; a ring's rows
/// in one buffer, or (ring 0) pages of KV_PAGE rows with a table of their addresses. The pages
/// are stored out of order (page j at page slot pages - j of the buffer, slot 0 a NaN hole), so
/// that only the table can find them.
struct Cache {
    words: Vec<u32>,
    table: Vec<u64>,
    row_words: usize,
    rows: usize,
    bf16: bool,
}

impl Cache {
    /// `values`: `rows` rows of `kvd` values in position (ring: slot) order.
    fn new(values: &[f32], bf16: bool, ring: usize, kvd: usize) -> Cache {
        let row_words = if bf16 { kvd / 2 } else { kvd };
        let rows = values.len() / kvd;
        let pack = |row: &[f32]| -> Vec<u32> {
            if bf16 {
                let b = to_bf16_bits(row);
                b.chunks(2).map(|p| p[0] as u32 | (p[1] as u32) << 16).collect()
            } else {
                row.iter().map(|x| x.to_bits()).collect()
            }
        };
        if ring > 0 {
            let words = values.chunks(kvd).flat_map(pack).collect();
            return Cache { words, table: vec![], row_words, rows, bf16 };
        }
        let pages = rows.div_ceil(KV_PAGE);
        let nan = if bf16 { 0x7fc0_7fc0 } else { 0x7fc0_0000 };
        let mut words = vec![nan; (pages + 1) * KV_PAGE * row_words];
        for (pos, row) in values.chunks(kvd).enumerate() {
            let at = ((pages - pos / KV_PAGE) * KV_PAGE + pos % KV_PAGE) * row_words;
            words[at..at + row_words].copy_from_slice(&pack(row));
        }
        let base = words.as_ptr() as u64;
        let table = (0..pages).map(|j| base + (4 * (pages - j) * KV_PAGE * row_words) as u64).collect();
        Cache { words, table, row_words, rows, bf16 }
    }

    /// The kernels' argument: the ring's rows or the page table.
    fn arg(&self) -> u64 {
        if self.table.is_empty() {
            p(&self.words)
        } else {
            p(&self.table)
        }
    }

    /// The values, in the order `new` took them.
    fn values(&self) -> Vec<f32> {
        (0..self.rows)
            .flat_map(|pos| {
                let at = if self.table.is_empty() {
                    pos * self.row_words
                } else {
                    let pages = self.table.len();
                    ((pages - pos / KV_PAGE) * KV_PAGE + pos % KV_PAGE) * self.row_words
                };
                let w = &self.words[at..at + self.row_words];
                let v: Vec<f32> = if self.bf16 {
                    w.iter()
                        .flat_map(|&x| [x as u16, (x >> 16) as u16])
                        .map(|b| half::bf16::from_bits(b).to_f32())
                        .collect()
                } else {
                    w.iter().map(|&x| f32::from_bits(x)).collect()
                };
                v
            })
            .collect()
    }
}

/// The `ATTN_PARAMS` slots of a case (kernels.cu), in rounding mode `mode`.
#[allow(clippy::too_many_arguments)]
fn attn_params(c: &Case, qkv: &[f32], kw: &Cache, vw: &Cache, dynv: &[u32; 2], nsplit: usize, mode: u64) -> Vec<u64> {
    vec![
        p(qkv),
        kw.arg(),
        vw.arg(),
        u(c.cols()),
        u(c.row0),
        p(dynv),
        u(c.nh),
        u(c.nkv),
        u(c.d),
        u(c.window),
        u(c.ring),
        u(nsplit),
        c.bf16_cache as u64,
        mode,
        f(1.0 / (c.d as f32).sqrt()),
    ]
}

/// Runs attn_reduce over a case's `nsplit` partial sums into `out` (which also appends the
/// chunk's K/V to the caches).
#[allow(clippy::too_many_arguments)]
fn run_reduce(
    emu: &Emu,
    c: &Case,
    qkv: &[f32],
    kw: &Cache,
    vw: &Cache,
    dynv: &[u32; 2],
    partial: &[f32],
    out: &[f32],
    nsplit: usize,
    mode: u64,
) {
    let args = [
        p(partial),
        p(out),
        u(c.nh * c.d),
        u(c.row0),
        u(c.nh),
        u(c.d),
        u(nsplit),
        mode,
        p(qkv),
        kw.arg(),
        vw.arg(),
        u(c.cols()),
        p(dynv),
        u(c.nkv),
        u(c.ring),
        c.bf16_cache as u64,
    ];
    emu.launch("attn_reduce", ((c.nq * c.nh) as u32, 1, 1), 128, 0, &args);
}

/// Runs the case through the two-pass kernels (`scored == false`: attn_stats, attn_accum) or the
/// scored ones (attn_scores, attn_pv), then attn_reduce, which also appends the chunk's K/V.
/// Returns the attention output rows and the caches afterwards (as f32).
fn run_case(emu: &Emu, c: &Case, nsplit: usize, scored: bool, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (qkv, k, v) = case_data(c, seed);
    let scale = 1.0 / (c.d as f32).sqrt();
    let want = reference(c, &qkv, &k, &v, scale);
    // The cache as the kernels hold it.
    let (kw, vw) = (Cache::new(&k, c.bf16_cache, c.ring, c.kvd()), Cache::new(&v, c.bf16_cache, c.ring, c.kvd()));
    let rows_h = c.nq * c.nh;
    let dynv = [c.start as u32, c.start as u32];
    let out_cols = c.nh * c.d;
    let out = vec![f32::NAN; (c.row0 + c.nq) * out_cols];
    let stats = vec![0.0f32; 2 * rows_h * nsplit];
    let partial = vec![0.0f32; rows_h * nsplit * c.d];
    let end = c.start + c.nq;
    let max_keys = if c.window > 0 { c.window.min(end) } else { end };
    let scores = vec![0.0f32; rows_h * max_keys];
    let common = attn_params(c, &qkv, &kw, &vw, &dynv, nsplit, 0);
    let grid = (rows_h as u32, nsplit as u32, 1);
    let d4 = (c.d * 4) as u32;
    if scored {
        let mut a = common.to_vec();
        a.extend([u(max_keys), p(&scores), p(&stats)]);
        emu.launch("attn_scores", grid, 128, 0, &a);
        let mut a = common.to_vec();
        a.extend([u(max_keys), p(&scores), p(&stats), p(&partial)]);
        emu.launch("attn_pv", grid, 128, d4 * 4, &a);
    } else {
        let mut a = common.to_vec();
        a.push(p(&stats));
        emu.launch("attn_stats", grid, 128, d4, &a);
        let mut a = common.to_vec();
        a.extend([p(&stats), p(&partial)]);
        emu.launch("attn_accum", grid, 128, d4 * 5, &a);
    }
    run_reduce(emu, c, &qkv, &kw, &vw, &dynv, &partial, &out, nsplit, 0);
    let got = out[c.row0 * out_cols..].to_vec();
    // The caches as they must be after the append: the chunk's K/V at their slots.
    let (mut k_after, mut v_after) = (k, v);
    for i in 0..c.nq {
        let row = &qkv[(c.row0 + i) * c.cols() + c.nh * c.d..];
        let at = c.slot(c.start + i) * c.kvd();
        for e in 0..c.kvd() {
            let (kx, vx) = (row[e], row[c.kvd() + e]);
            k_after[at + e] = if c.bf16_cache { bf16_round(kx) } else { kx };
            v_after[at + e] = if c.bf16_cache { bf16_round(vx) } else { vx };
        }
    }
    assert_eq!(kw.values(), k_after, "K cache after attn_reduce's append");
    assert_eq!(vw.values(), v_after, "V cache after attn_reduce's append");
    (got, want, k_after, v_after)
}

#[test]
fn attention_kernels_match_the_reference_on_sliding_and_full_layers() {
    let Some(emu) = emu() else { return };
    for (window, ring) in [(8usize, 8usize), (0, 0)] {
        for bf16_cache in [false, true] {
            // A prefill chunk after a cached prefix, and a decode step.
            for (start, nq) in [(11usize, 5usize), (13, 1), (75, 5), (70, 1)] {
                let c = Case { nh: 4, nkv: 2, d: 64, window, ring, start, nq, row0: 2, bf16_cache };
                for (nsplit, scored) in [(1, false), (3, false), (1, true), (2, true)] {
                    let (got, want, ..) = run_case(emu, &c, nsplit, scored, 17 + start as u64);
                    let what = format!(
                        "window {window}, bf16 cache {bf16_cache}, start {start}, {nq} queries, {nsplit} splits, scored {scored}"
                    );
                    assert_close(&what, &got, &want, 2e-5);
                }
            }
        }
    }
}

/// Bytes of dynamic shared memory attn_flash takes (`FLASH_SHARED_FLOATS` in kernels.cu).
fn flash_shared(d: usize) -> u32 {
    (4 * (64 * (d + 1) + 32 * 33 + 64)) as u32
}

/// Runs attn_flash over a case in rounding mode `mode` with the keys in `nsplit` splits (phase 0
/// for one, else phases 1 and 2 and then attn_reduce); returns the chunk's output rows. Checks
/// that attn_flash leaves the caches alone.
fn run_flash(emu: &Emu, c: &Case, data: &(Vec<f32>, Vec<f32>, Vec<f32>), mode: u64, nsplit: usize) -> Vec<f32> {
    let (qkv, k, v) = data;
    let (kw, vw) = (Cache::new(k, c.bf16_cache, c.ring, c.kvd()), Cache::new(v, c.bf16_cache, c.ring, c.kvd()));
    let out_cols = c.nh * c.d;
    let out = vec![f32::NAN; (c.row0 + c.nq) * out_cols];
    let dynv = [c.start as u32, c.start as u32];
    let rows = c.nq * (c.nh / c.nkv);
    let stats = vec![f32::NAN; 2 * rows * c.nkv * nsplit];
    let partial = vec![f32::NAN; c.nq * c.nh * nsplit * c.d];
    let args = |phase: u64| {
        let mut a = attn_params(c, qkv, &kw, &vw, &dynv, nsplit, mode);
        a.extend([u(c.nq), p(&out), u(out_cols), phase, p(&stats), p(&partial)]);
        a
    };
    let grid = (rows.div_ceil(32) as u32, c.nkv as u32, nsplit as u32);
    if nsplit == 1 {
        emu.launch("attn_flash", grid, 256, flash_shared(c.d), &args(0));
    } else {
        emu.launch("attn_flash", grid, 256, flash_shared(c.d), &args(1));
        emu.launch("attn_flash", grid, 256, flash_shared(c.d), &args(2));
    }
    assert_eq!(&kw.values(), k, "attn_flash changed the K cache");
    assert_eq!(&vw.values(), v, "attn_flash changed the V cache");
    if nsplit > 1 {
        run_reduce(emu, c, qkv, &kw, &vw, &dynv, &partial, &out, nsplit, mode);
    }
    assert!(out[..c.row0 * out_cols].iter().all(|v| v.is_nan()), "attn_flash wrote rows before the chunk");
    out[c.row0 * out_cols..].to_vec()
}

#[test]
fn flash_attention_matches_the_reference() {
    let Some(emu) = emu() else { return };
    // (heads, kv heads, head_dim): query groups of 2, 4, 1, 6 and 3 (blocks of 32 rows then end
    // inside a query's group), and every head_dim the kernel is instantiated for but 512.
    let shapes = [(4usize, 2usize, 64usize), (8, 2, 32), (2, 2, 128), (6, 1, 32), (3, 1, 256)];
    for (si, &(nh, nkv, d)) in shapes.iter().enumerate() {
        for (window, ring) in [(8usize, 8usize), (0, 0)] {
            // A chunk that starts the sequence, one after a cached prefix (longer than the
            // window), and a single query; the keys in 1 to 5 splits (more splits than tiles too).
            for (start, nq, nsplit) in
                [(0usize, 37usize, 1usize), (11, 21, 1), (5, 1, 1), (0, 37, 2), (70, 21, 3), (11, 4, 5)]
            {
                let bf16_cache = (si + start) % 2 == 1;
                let c = Case { nh, nkv, d, window, ring, start, nq, row0: 3, bf16_cache };
                let data = case_data(&c, 40 + si as u64 + start as u64);
                let want = reference(&c, &data.0, &data.1, &data.2, 1.0 / (d as f32).sqrt());
                let what = format!(
                    "{nh}/{nkv} heads, d {d}, window {window}, start {start}, {nq} queries, {nsplit} splits, bf16 cache {bf16_cache}"
                );
                let got = run_flash(emu, &c, &data, 0, nsplit);
                assert_close(&what, &got, &want, 2e-5);
                // bf16 rounding: every output a bf16 value, near the exact result.
                let got = run_flash(emu, &c, &data, 1, nsplit);
                assert!(got.iter().all(|&x| bf16_round(x) == x), "{what}: bf16 mode outputs not bf16 values");
                assert_close(&format!("{what}, bf16 mode"), &got, &want, 2e-2);
            }
        }
    }
}

#[test]
fn kv_append_writes_ring_and_growing_slots() {
    let Some(emu) = emu() else { return };
    for ring in [0usize, 8] {
        for bf16_cache in [false, true] {
            // Positions 60..67: across the first page boundary of a paged cache.
            let c = Case { nh: 4, nkv: 2, d: 32, window: ring, ring, start: 62, nq: 5, row0: 1, bf16_cache };
            let (qkv, k, v) = case_data(&c, 3);
            let (kw, vw) = (Cache::new(&k, bf16_cache, ring, c.kvd()), Cache::new(&v, bf16_cache, ring, c.kvd()));
            // Append positions from first = start + 1 on (the earlier ones are held already).
            let first = c.start + 1;
            let dynv = [c.start as u32, first as u32];
            let n = c.start + c.nq - first;
            emu.launch(
                "kv_append",
                (n as u32, 1, 1),
                64,
                0,
                &[
                    p(&qkv),
                    kw.arg(),
                    vw.arg(),
                    u(c.cols()),
                    u(c.row0),
                    p(&dynv),
                    u(c.nh * c.d),
                    u(c.kvd()),
                    u(c.ring),
                    bf16_cache as u64,
                ],
            );
            let (mut ke, mut ve) = (k, v);
            let r = |x: f32| if bf16_cache { bf16_round(x) } else { x };
            for pos in first..c.start + c.nq {
                let row = &qkv[(c.row0 + pos - c.start) * c.cols() + c.nh * c.d..];
                let at = c.slot(pos) * c.kvd();
                for e in 0..c.kvd() {
                    ke[at + e] = r(row[e]);
                    ve[at + e] = r(row[c.kvd() + e]);
                }
            }
            assert_eq!(kw.values(), ke, "ring {ring}, bf16 {bf16_cache}: K");
            assert_eq!(vw.values(), ve, "ring {ring}, bf16 {bf16_cache}: V");
        }
    }
}

#[test]
fn batched_decode_attention_matches_the_reference_per_sequence() {
    let Some(emu) = emu() else { return };
    let sigmoid = |g: f32| 1.0 / (1.0 + (-g as f64).exp());
    for (window, ring) in [(8usize, 8usize), (0, 0)] {
        for bf16_cache in [false, true] {
            // Two sequences' decode chunks of one layer in one launch: rows 0 and 1 of qkv.
            let cases = [
                Case { nh: 4, nkv: 2, d: 64, window, ring, start: 11, nq: 1, row0: 0, bf16_cache },
                Case { nh: 4, nkv: 2, d: 64, window, ring, start: 70, nq: 1, row0: 1, bf16_cache },
            ];
            let c0 = &cases[0];
            let (qkv, _, _) = case_data(&Case { row0: 1, ..*c0 }, 5);
            let caches: Vec<(Vec<f32>, Vec<f32>)> = cases
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let (_, k, v) = case_data(c, 100 + i as u64);
                    (k, v)
                })
                .collect();
            let words: Vec<(Cache, Cache)> = caches
                .iter()
                .zip(&cases)
                .map(|((k, v), c)| {
                    (Cache::new(k, bf16_cache, c.ring, c.kvd()), Cache::new(v, bf16_cache, c.ring, c.kvd()))
                })
                .collect();
            let scale = 1.0 / (c0.d as f32).sqrt();
            let gate: Vec<f32> = {
                let mut s = 9;
                (0..2 * c0.nh).map(|_| 2.0 * rng(&mut s)).collect()
            };
            let nsplit = [2usize, 1];
            let mut table = vec![0u32; cases.len() * 16];
            let (mut so, mut po, mut sco) = (0usize, 0usize, 0usize);
            let mut max_rows = 0;
            for (i, c) in cases.iter().enumerate() {
                let rows_h = c.nq * c.nh;
                let end = c.start + c.nq;
                let keys = if c.window > 0 { c.window.min(end) } else { end };
                let (kp, vp) = (words[i].0.arg(), words[i].1.arg());
                let e = &mut table[i * 16..(i + 1) * 16];
                e[..7].copy_from_slice(&[
                    c.row0 as u32,
                    c.start as u32,
                    c.start as u32,
                    rows_h as u32,
                    nsplit[i] as u32,
                    keys as u32,
                    c.ring as u32,
                ]);
                e[7..11].copy_from_slice(&[kp as u32, (kp >> 32) as u32, vp as u32, (vp >> 32) as u32]);
                e[11..14].copy_from_slice(&[so as u32, po as u32, sco as u32]);
                so += 2 * rows_h * nsplit[i];
                po += rows_h * nsplit[i] * c.d;
                sco += rows_h * keys;
                max_rows = max_rows.max(rows_h);
            }
            let (stats, partial, scores) = (vec![0.0f32; so], vec![0.0f32; po], vec![0.0f32; sco]);
            let out_cols = c0.nh * c0.d;
            let out = vec![f32::NAN; 2 * out_cols];
            let common = [
                p(&qkv),
                u(c0.cols()),
                u(c0.nh),
                u(c0.nkv),
                u(c0.d),
                u(window),
                bf16_cache as u64,
                0,
                f(scale),
                p(&table),
            ];
            let grid = |y: usize| (max_rows as u32, y as u32, cases.len() as u32);
            let mut a = common.to_vec();
            a.extend([p(&scores), p(&stats)]);
            emu.launch("attn_scores_batch", grid(2), 128, 0, &a);
            let mut a = common.to_vec();
            a.extend([p(&scores), p(&stats), p(&partial)]);
            emu.launch("attn_pv_batch", grid(2), 128, (c0.d * 4 * 4) as u32, &a);
            let mut a = common.to_vec();
            a.extend([p(&partial), p(&out), u(out_cols), p(&gate), 0]);
            emu.launch("attn_reduce_batch", grid(1), 128, 0, &a);
            for (i, c) in cases.iter().enumerate() {
                let want = reference(c, &qkv, &caches[i].0, &caches[i].1, scale);
                let gated: Vec<f32> = want
                    .iter()
                    .enumerate()
                    .map(|(j, &o)| (o as f64 * sigmoid(gate[c.row0 * c.nh + j / c.d])) as f32)
                    .collect();
                let got = &out[c.row0 * out_cols..(c.row0 + 1) * out_cols];
                assert_close(&format!("sequence {i}, window {window}, bf16 cache {bf16_cache}"), got, &gated, 2e-5);
                // The append: this sequence's K/V at its slot, in its own cache.
                let row = &qkv[c.row0 * c.cols() + c.nh * c.d..];
                let at = c.slot(c.start) * c.kvd();
                let (mut k, mut v) = caches[i].clone();
                for e in 0..c.kvd() {
                    let r = |x: f32| if bf16_cache { bf16_round(x) } else { x };
                    k[at + e] = r(row[e]);
                    v[at + e] = r(row[c.kvd() + e]);
                }
                assert_eq!(words[i].0.values(), k, "sequence {i}: K cache after the append");
                assert_eq!(words[i].1.values(), v, "sequence {i}: V cache after the append");
            }
        }
    }
}

/// `x W^T` in f64 for bf16 weights `w` `[m, k]` and f32 `x` `[n, k]`, as f32.
fn matmul_ref(x: &[f32], w: &[u16], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n * m];
    for t in 0..n {
        for r in 0..m {
            let s: f64 = (0..k).map(|j| x[t * k + j] as f64 * half::bf16::from_bits(w[r * k + j]).to_f64()).sum();
            out[t * m + r] = s as f32;
        }
    }
    out
}

fn bf16_weights(len: usize, seed: &mut u64) -> Vec<u16> {
    (0..len).map(|_| half::bf16::from_f32(0.2 * rng(seed)).to_bits()).collect()
}

/// `0.5 x (1 + erf(x / sqrt 2))` through erfc's Chebyshev fit (Numerical Recipes' `erfcc`,
/// fractional error below 1.2e-7 everywhere).
fn gelu_erf(x: f64) -> f64 {
    let erfc = |v: f64| {
        let z = v.abs();
        let t = 1.0 / (1.0 + 0.5 * z);
        let poly = -z * z - 1.26551223
            + t * (1.00002368
                + t * (0.37409196
                    + t * (0.09678418
                        + t * (-0.18628806
                            + t * (0.27886807
                                + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
        let r = t * poly.exp();
        if v >= 0.0 {
            r
        } else {
            2.0 - r
        }
    };
    0.5 * x * erfc(-x / std::f64::consts::SQRT_2)
}

#[test]
fn decode_gemvs_match_the_reference() {
    let Some(emu) = emu() else { return };
    let mut s = 21;
    // k a multiple of 8 but not of 256 * 8: the lanes' tails and the unrolled loads' bounds.
    let (k, m1, m2) = (2056usize, 9usize, 6usize);
    let w1 = bf16_weights(m1 * k, &mut s);
    let w2 = bf16_weights(m2 * k, &mut s);
    for n in [1usize, 3, 5, 16] {
        let x: Vec<f32> = (0..n * k).map(|_| rng(&mut s)).collect();
        let (o1, o2) = (vec![f32::NAN; n * m1], vec![f32::NAN; n * m2]);
        let blocks = (m1 + m2).div_ceil(4) as u32;
        emu.launch(
            "gemv_bf16w",
            (blocks, 1, 1),
            128,
            0,
            &[p(&x), p(&w1), p(&o1), u(m1), p(&w2), p(&o2), u(m2), u(n), u(k), 0],
        );
        assert_close(&format!("gemv_bf16w out1, {n} rows"), &o1, &matmul_ref(&x, &w1, n, k, m1), 1e-5);
        assert_close(&format!("gemv_bf16w out2, {n} rows"), &o2, &matmul_ref(&x, &w2, n, k, m2), 1e-5);

        // GEGLU of the two projections (w1's first m2 rows as the gate, w2 as up).
        let out = vec![f32::NAN; n * m2];
        emu.launch(
            "gemv_geglu_bf16w",
            (m2.div_ceil(4) as u32, 1, 1),
            128,
            0,
            &[p(&x), p(&w1), p(&w2), p(&out), u(m2), u(n), u(k), 0],
        );
        let (g, up) = (matmul_ref(&x, &w1[..m2 * k], n, k, m2), matmul_ref(&x, &w2, n, k, m2));
        let want: Vec<f32> = g.iter().zip(&up).map(|(&g, &u)| (gelu_erf(g as f64) * u as f64) as f32).collect();
        assert_close(&format!("gemv_geglu_bf16w, {n} rows"), &out, &want, 1e-5);
    }
}

#[test]
fn fused_qkv_gemv_with_rope_matches_gemv_then_rotation() {
    let Some(emu) = emu() else { return };
    let mut s = 33;
    // Two rotated heads of 16 dims with 6 of 8 pairs rotated (partial rotary), then 8 more rows
    // (the K/V part), and a 3-row second weight (the head gate).
    let (k, head_dim, half, n_rot) = (264usize, 16usize, 6usize, 2usize);
    let (m1, m2) = (n_rot * head_dim + 8, 3usize);
    let w1 = bf16_weights(m1 * k, &mut s);
    let w2 = bf16_weights(m2 * k, &mut s);
    let positions = 40;
    let cos_t: Vec<f32> = (0..positions * half).map(|i| ((i as f32) * 0.37).cos()).collect();
    let sin_t: Vec<f32> = (0..positions * half).map(|i| ((i as f32) * 0.37).sin()).collect();
    for n in [1usize, 4] {
        let x: Vec<f32> = (0..n * k).map(|_| rng(&mut s)).collect();
        let pos: Vec<u32> = (0..n as u32).map(|t| 7 + 9 * t).collect();
        let (o1, o2) = (vec![f32::NAN; n * m1], vec![f32::NAN; n * m2]);
        let tasks = m1 + m2 - n_rot * half;
        emu.launch(
            "gemv_qkv_rope",
            (tasks.div_ceil(4) as u32, 1, 1),
            128,
            0,
            &[
                p(&x),
                p(&w1),
                p(&o1),
                u(m1),
                p(&w2),
                p(&o2),
                u(m2),
                u(n),
                u(k),
                0,
                p(&pos),
                p(&cos_t),
                p(&sin_t),
                u(n_rot),
                u(head_dim),
                u(half),
            ],
        );
        let mut want = matmul_ref(&x, &w1, n, k, m1);
        for (t, &pt) in pos.iter().enumerate() {
            for h in 0..n_rot {
                for j in 0..half {
                    let (ia, ib) = (t * m1 + h * head_dim + j, t * m1 + h * head_dim + j + half);
                    let cs = pt as usize * half + j;
                    let (a, b) = (want[ia] as f64, want[ib] as f64);
                    want[ia] = (a * cos_t[cs] as f64 - b * sin_t[cs] as f64) as f32;
                    want[ib] = (b * cos_t[cs] as f64 + a * sin_t[cs] as f64) as f32;
                }
            }
        }
        assert_close(&format!("gemv_qkv_rope out1, {n} rows"), &o1, &want, 1e-5);
        assert_close(&format!("gemv_qkv_rope out2, {n} rows"), &o2, &matmul_ref(&x, &w2, n, k, m2), 1e-5);
    }
}

#[test]
fn row_and_elementwise_kernels_match_the_reference() {
    let Some(emu) = emu() else { return };
    let mut s = 41;
    // embed_bf16: rows of the table by id.
    let (vocab, cols) = (10usize, 72usize);
    let table = bf16_weights(vocab * cols, &mut s);
    let ids = [3u32, 0, 9, 3];
    let out = vec![f32::NAN; ids.len() * cols];
    emu.launch("embed_bf16", (ids.len() as u32, 1, 1), 32, 0, &[p(&table), p(&ids), p(&out), u(cols)]);
    for (r, &id) in ids.iter().enumerate() {
        let want: Vec<f32> =
            table[id as usize * cols..][..cols].iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
        assert_eq!(&out[r * cols..(r + 1) * cols], &want[..], "embed_bf16 row {r}");
    }
    // geglu over a grid-stride loop shorter than n.
    let n = 3000usize;
    let g: Vec<f32> = (0..n).map(|_| 3.0 * rng(&mut s)).collect();
    let up: Vec<f32> = (0..n).map(|_| rng(&mut s)).collect();
    let out = vec![f32::NAN; n];
    emu.launch("geglu", (2, 1, 1), 256, 0, &[p(&g), p(&up), p(&out), n as u64, 0]);
    let want: Vec<f32> = g.iter().zip(&up).map(|(&g, &u)| (gelu_erf(g as f64) * u as f64) as f32).collect();
    assert_close("geglu", &out, &want, 1e-5);
    // head_gate, sigmoid and silu.
    let (rows, heads, d) = (3usize, 4usize, 8usize);
    let attn: Vec<f32> = (0..rows * heads * d).map(|_| rng(&mut s)).collect();
    let gate: Vec<f32> = (0..rows * heads).map(|_| 3.0 * rng(&mut s)).collect();
    for act in [0i32, 1] {
        let a = attn.clone();
        emu.launch("head_gate", (rows as u32, 1, 1), 32, 0, &[p(&a), p(&gate), u(heads), u(d), act as u64, 0]);
        let want: Vec<f32> = attn
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let gv = gate[i / d] as f64;
                let sg = 1.0 / (1.0 + (-gv).exp());
                (v as f64 * if act == 0 { sg } else { gv * sg }) as f32
            })
            .collect();
        assert_close(&format!("head_gate act {act}"), &a, &want, 1e-6);
    }
}
