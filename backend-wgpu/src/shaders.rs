//! The WGSL compute kernels, as text assembled per variant.
//!
//! All arithmetic is f32 (as backend-cpu accumulates); 16-bit weights and KV entries are stored
//! packed two to a `u32` and decoded in the shader with exact bit arithmetic, so the bf16 and f16
//! paths need neither the `shader-f16` feature nor `unpack2x16float` (which may flush f16
//! subnormals). `rnd(x, mode)` rounds to the compute type exactly as `half` does (round to
//! nearest even, f16 subnormals kept). Each kernel takes its parameters from a small uniform
//! block at a dynamic offset; index data (token ids, positions, rows) comes from a shared upload
//! arena, also at a dynamic offset. Large grids are dispatched in 2-D and flattened with
//! `WID`.

use std::fmt::Write as _;

/// Which element type a packed operand holds (weights, KV cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Elem {
    F32,
    BF16,
    F16,
}

impl Elem {
    fn array_ty(self) -> &'static str {
        match self {
            Elem::F32 => "array<f32>",
            _ => "array<u32>",
        }
    }
}

/// The kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Embed(Elem),
    RmsNorm,
    /// Matrix-vector style (few tokens); `true`: subgroup form (8 rows per workgroup), `false`:
    /// one workgroup per row with a shared-memory reduction.
    Gemv(Elem, bool),
    /// Tiled GEMM (prefill).
    Gemm(Elem),
    Rope,
    Attention(Elem),
    KvAppend(Elem),
    HeadGate,
    Geglu,
    Add,
    Gather,
}

/// How a storage buffer is bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
}

/// The binding layout of a kernel: binding 0 is always the uniform parameters; then, when
/// `data` is set, binding 1 is the index-data arena; then the buffers in order.
pub struct Layout {
    pub data: bool,
    pub bufs: &'static [Access],
}

use Access::{Read as R, ReadWrite as W};

impl Kernel {
    pub fn layout(self) -> Layout {
        let (data, bufs): (bool, &'static [Access]) = match self {
            Kernel::Embed(_) => (true, &[R, W]),
            Kernel::RmsNorm => (false, &[R, R, W]),
            Kernel::Gemv(..) | Kernel::Gemm(_) => (false, &[R, R, W]),
            Kernel::Rope => (true, &[R, R, W]),
            Kernel::Attention(_) => (false, &[R, R, R, W]),
            Kernel::KvAppend(_) => (false, &[R, W, W]),
            Kernel::HeadGate => (false, &[R, W]),
            Kernel::Geglu => (false, &[R, R, W]),
            Kernel::Add => (false, &[R, W]),
            Kernel::Gather => (true, &[R, W]),
        };
        Layout { data, bufs }
    }

    /// The full WGSL source of this kernel.
    pub fn source(self) -> String {
        let mut s = String::from(COMMON);
        let body = match self {
            Kernel::Embed(e) => with_elem(EMBED, "W", e),
            Kernel::RmsNorm => RMS_NORM.to_string(),
            Kernel::Gemv(e, false) => with_elem(&GEMV.replace("//REDUCE", GEMV_REDUCE_SHARED), "W", e),
            Kernel::Gemv(e, true) => with_elem(GEMV_SUBGROUP, "W", e),
            Kernel::Gemm(e) => with_elem(GEMM, "W", e),
            Kernel::Rope => ROPE.to_string(),
            Kernel::Attention(e) => with_elem(&with_elem(ATTENTION, "KC", e), "VC", e),
            Kernel::KvAppend(e) => {
                let store = match e {
                    Elem::F32 => KV_STORE_F32,
                    _ => KV_STORE_PACKED,
                };
                let pack = match e {
                    Elem::BF16 => "fn pack1(x: f32) -> u32 { return bitcast<u32>(rnd(x, 1u)) >> 16u; }",
                    _ => "fn pack1(x: f32) -> u32 { return f16_bits(rnd(x, 2u)); }",
                };
                format!("{}\n{pack}\n{}", KV_APPEND.replace("//STORE", store), kv_decl(e))
            }
            Kernel::HeadGate => HEAD_GATE.to_string(),
            Kernel::Geglu => format!("{ERF}\n{GEGLU}"),
            Kernel::Add => ADD.to_string(),
            Kernel::Gather => GATHER.to_string(),
        };
        let _ = writeln!(s, "{body}");
        s
    }
}

fn kv_decl(e: Elem) -> String {
    format!(
        "@group(0) @binding(2) var<storage, read_write> KC: {0};\n@group(0) @binding(3) var<storage, read_write> VC: {0};",
        e.array_ty()
    )
}

/// Replace `NAME_TY` by the array type and define `NAME_at(i)` decoding element `i`.
fn with_elem(src: &str, name: &str, e: Elem) -> String {
    let src = src.replace(&format!("{name}_TY"), e.array_ty());
    let f = match e {
        Elem::F32 => format!("fn {name}_at(i: u32) -> f32 {{ return {name}[i]; }}"),
        Elem::BF16 => format!(
            "fn {name}_at(i: u32) -> f32 {{ let p = {name}[i >> 1u]; return bitcast<f32>(select(p << 16u, p & 0xffff0000u, (i & 1u) == 1u)); }}"
        ),
        Elem::F16 => format!(
            "fn {name}_at(i: u32) -> f32 {{ let p = {name}[i >> 1u]; return f16_to_f32(select(p & 0xffffu, p >> 16u, (i & 1u) == 1u)); }}"
        ),
    };
    format!("{src}\n{f}\n")
}

/// Helpers every kernel gets: rounding to the compute type, f16 bit conversions, 2-D ids.
const COMMON: &str = r#"
// Round to nearest even f16 (subnormals kept, overflow to inf), returned as f32.
fn to_f16(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7f800000u) == 0x7f800000u) { return x; }
    if (abs(x) < 6.103515625e-05) {
        return round(x * 16777216.0) * 5.9604644775390625e-08;
    }
    let r = bitcast<f32>((b + 0xfffu + ((b >> 13u) & 1u)) & 0xffffe000u);
    if (abs(r) > 65504.0) { return bitcast<f32>((b & 0x80000000u) | 0x7f800000u); }
    return r;
}

// mode 0: f32 (no rounding), 1: bf16, 2: f16.
fn rnd(x: f32, mode: u32) -> f32 {
    if (mode == 1u) {
        let b = bitcast<u32>(x);
        if ((b & 0x7f800000u) == 0x7f800000u) { return x; }
        return bitcast<f32>((b + 0x7fffu + ((b >> 16u) & 1u)) & 0xffff0000u);
    }
    if (mode == 2u) { return to_f16(x); }
    return x;
}

// IEEE binary16 bits (low 16 bits of h) to f32, exactly (subnormals included).
fn f16_to_f32(h: u32) -> f32 {
    let s = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {
        let v = f32(m) * 5.9604644775390625e-08;
        return select(v, -v, s != 0u);
    }
    if (e == 31u) { return bitcast<f32>(s | 0x7f800000u | (m << 13u)); }
    return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));
}

// Bits of an f32 that is exactly representable in f16.
fn f16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let s = (b >> 16u) & 0x8000u;
    let a = abs(x);
    if ((b & 0x7f800000u) == 0x7f800000u) {
        return s | 0x7c00u | select(0u, 0x200u, (b & 0x7fffffu) != 0u);
    }
    if (a < 6.103515625e-05) { return s | u32(round(a * 16777216.0)); }
    let e = ((b >> 23u) & 0xffu) - 112u;
    return s | (e << 10u) | ((b >> 13u) & 0x3ffu);
}

// Flattened workgroup index of a 2-D dispatch.
fn wid(g: vec3<u32>, n: vec3<u32>) -> u32 { return g.x + g.y * n.x; }
"#;

const EMBED: &str = r#"
struct P { n: u32, cols: u32, r0: u32, nrows: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> W: W_TY;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = wid(g, ng) * 256u + l;
    if (i >= p.n * p.cols) { return; }
    let t = i / p.cols;
    let j = i % p.cols;
    let id = ids[t];
    if (id < p.r0 || id >= p.r0 + p.nrows) { return; }
    out[i] = W_at((id - p.r0) * p.cols + j);
}
"#;

const RMS_NORM: &str = r#"
struct P { rows: u32, cols: u32, eps: f32, mode: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
var<workgroup> red: array<f32, 256>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let row = wid(g, ng);
    if (row >= p.rows) { return; }
    let base = row * p.cols;
    var s = 0.0;
    for (var j = l; j < p.cols; j += 256u) {
        let v = x[base + j];
        s += v * v;
    }
    red[l] = s;
    workgroupBarrier();
    for (var k = 128u; k > 0u; k >>= 1u) {
        if (l < k) { red[l] += red[l + k]; }
        workgroupBarrier();
    }
    let r = 1.0 / sqrt(red[0] / f32(p.cols) + p.eps);
    for (var j = l; j < p.cols; j += 256u) {
        out[base + j] = rnd(w[j] * (x[base + j] * r), p.mode);
    }
}
"#;

/// Up to 8 tokens per pass, 64 threads striding over `k` for one output row.
const GEMV: &str = r#"
struct P { n: u32, k: u32, m: u32, r0: u32, nrows: u32, mode: u32, t0: u32, nt: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> W: W_TY;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
var<workgroup> red: array<array<f32, 64>, 8>;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let r = wid(g, ng);
    if (r >= p.nrows) { return; }
    var acc: array<f32, 8>;
    let wbase = r * p.k;
    for (var j = l; j < p.k; j += 64u) {
        let w = W_at(wbase + j);
        for (var t = 0u; t < p.nt; t++) {
            acc[t] += x[(p.t0 + t) * p.k + j] * w;
        }
    }
    //REDUCE
}
"#;

const GEMV_REDUCE_SHARED: &str = r#"
    for (var t = 0u; t < 8u; t++) { red[t][l] = acc[t]; }
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (l < s) {
            for (var t = 0u; t < 8u; t++) { red[t][l] += red[t][l + s]; }
        }
        workgroupBarrier();
    }
    if (l < p.nt) {
        out[(p.t0 + l) * p.m + p.r0 + r] = rnd(red[l][0], p.mode);
    }
"#;

/// Subgroup form: 8 rows per workgroup, each subgroup reduces whole rows with `subgroupAdd`,
/// so there is no workgroup barrier at all (whatever the subgroup size).
const GEMV_SUBGROUP: &str = r#"
struct P { n: u32, k: u32, m: u32, r0: u32, nrows: u32, mode: u32, t0: u32, nt: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> W: W_TY;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>,
        @builtin(subgroup_id) sg_id: u32, @builtin(subgroup_invocation_id) lane: u32,
        @builtin(subgroup_size) sg_size: u32, @builtin(num_subgroups) sg_n: u32) {
    let base = wid(g, ng) * 8u;
    for (var rr = sg_id; rr < 8u; rr += sg_n) {
        let r = base + rr;
        if (r >= p.nrows) { break; }
        var acc: array<f32, 8>;
        let wbase = r * p.k;
        for (var j = lane; j < p.k; j += sg_size) {
            let w = W_at(wbase + j);
            for (var t = 0u; t < p.nt; t++) {
                acc[t] += x[(p.t0 + t) * p.k + j] * w;
            }
        }
        for (var t = 0u; t < p.nt; t++) {
            let s = subgroupAdd(acc[t]);
            if (lane == 0u) { out[(p.t0 + t) * p.m + p.r0 + r] = rnd(s, p.mode); }
        }
    }
}
"#;

/// 64 tokens x 64 rows per workgroup, 4x4 per thread, k in steps of 16.
const GEMM: &str = r#"
struct P { n: u32, k: u32, m: u32, r0: u32, nrows: u32, mode: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> W: W_TY;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
var<workgroup> xs: array<f32, 1024>;
var<workgroup> ws: array<f32, 1024>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let rbase = g.x * 64u;
    let tbase = g.y * 64u;
    let tx = l % 16u;
    let ty = l / 16u;
    var acc: array<array<f32, 4>, 4>;
    for (var kb = 0u; kb < p.k; kb += 16u) {
        for (var q = 0u; q < 4u; q++) {
            let idx = l + 256u * q;
            let a = idx / 16u;
            let kk = kb + idx % 16u;
            let t = tbase + a;
            var xv = 0.0;
            if (t < p.n && kk < p.k) { xv = x[t * p.k + kk]; }
            xs[idx] = xv;
            let r = rbase + a;
            var wv = 0.0;
            if (r < p.nrows && kk < p.k) { wv = W_at(r * p.k + kk); }
            ws[idx] = wv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {
            var a: array<f32, 4>;
            var b: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                a[i] = xs[(ty + 16u * i) * 16u + kk];
                b[i] = ws[(tx + 16u * i) * 16u + kk];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i][j] += a[i] * b[j];
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let t = tbase + ty + 16u * i;
        for (var j = 0u; j < 4u; j++) {
            let r = rbase + tx + 16u * j;
            if (t < p.n && r < p.nrows) {
                out[t * p.m + p.r0 + r] = rnd(acc[i][j], p.mode);
            }
        }
    }
}
"#;

const ROPE: &str = r#"
struct P { rows: u32, cols: u32, nh: u32, hd: u32, half: u32, mode: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> pos: array<u32>;
@group(0) @binding(2) var<storage, read> cs: array<f32>;
@group(0) @binding(3) var<storage, read> sn: array<f32>;
@group(0) @binding(4) var<storage, read_write> qkv: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = wid(g, ng) * 256u + l;
    let per_row = p.nh * p.half;
    if (i >= p.rows * per_row) { return; }
    let r = i / per_row;
    let h = (i % per_row) / p.half;
    let j = i % p.half;
    let at = pos[r] * p.half + j;
    let c = cs[at];
    let s = sn[at];
    let base = r * p.cols + h * p.hd;
    let a = qkv[base + j];
    let b = qkv[base + j + p.half];
    qkv[base + j] = rnd(a * c - b * s, p.mode);
    qkv[base + j + p.half] = rnd(b * c + a * s, p.mode);
}
"#;

/// One workgroup per (query row, head): scores (kept in workgroup memory for the first
/// `SCAP` keys, recomputed beyond), their max, the sum of exponentials, then the weighted values
/// a block of 64 keys at a time. Any number of keys works; a sliding window of up to `SCAP`
/// keys never computes a score twice.
const ATTENTION: &str = r#"
struct P {
    qcols: u32, row0: u32, len: u32, start: u32,
    nh: u32, nkv: u32, hd: u32, window: u32,
    slots: u32, scale: f32, mode: u32, ocols: u32,
}
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> KC: KC_TY;
@group(0) @binding(3) var<storage, read> VC: VC_TY;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
const SCAP: u32 = 2048u;
var<workgroup> q: array<f32, 512>;
var<workgroup> sc: array<f32, 2048>;
var<workgroup> red: array<f32, 64>;
var<workgroup> pb: array<f32, 64>;

fn cache_index(pos: u32, kvh: u32) -> u32 {
    var slot = pos;
    if (p.slots > 0u) { slot = pos % p.slots; }
    return slot * p.nkv * p.hd + kvh * p.hd;
}

fn score(pos: u32, kvh: u32) -> f32 {
    var d = 0.0;
    if (pos >= p.start) {
        let b = (p.row0 + pos - p.start) * p.qcols + p.nh * p.hd + kvh * p.hd;
        for (var e = 0u; e < p.hd; e++) { d += q[e] * qkv[b + e]; }
    } else {
        let b = cache_index(pos, kvh);
        for (var e = 0u; e < p.hd; e++) { d += q[e] * KC_at(b + e); }
    }
    return rnd(rnd(d, p.mode) * p.scale, p.mode);
}

fn value(pos: u32, kvh: u32, e: u32) -> f32 {
    if (pos >= p.start) {
        return qkv[(p.row0 + pos - p.start) * p.qcols + (p.nh + p.nkv) * p.hd + kvh * p.hd + e];
    }
    return VC_at(cache_index(pos, kvh) + e);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let w = wid(g, ng);
    if (w >= p.len * p.nh) { return; }
    let i = w / p.nh;
    let h = w % p.nh;
    let kvh = h / (p.nh / p.nkv);
    let ps = p.start + i;
    var lo = 0u;
    if (p.window > 0u && ps + 1u > p.window) { lo = ps + 1u - p.window; }
    let nkeys = ps - lo + 1u;
    let qb = (p.row0 + i) * p.qcols + h * p.hd;
    for (var e = l; e < p.hd; e += 64u) { q[e] = qkv[qb + e]; }
    workgroupBarrier();

    var m = -3.4028234663852886e38;
    for (var t = l; t < nkeys; t += 64u) {
        let s = score(lo + t, kvh);
        if (t < SCAP) { sc[t] = s; }
        m = max(m, s);
    }
    red[l] = m;
    workgroupBarrier();
    for (var k = 32u; k > 0u; k >>= 1u) {
        if (l < k) { red[l] = max(red[l], red[l + k]); }
        workgroupBarrier();
    }
    let mx = red[0];
    workgroupBarrier();

    var s = 0.0;
    for (var t = l; t < nkeys; t += 64u) {
        var x: f32;
        if (t < SCAP) { x = sc[t]; } else { x = score(lo + t, kvh); }
        let e = exp(x - mx);
        if (t < SCAP) { sc[t] = e; }
        s += e;
    }
    red[l] = s;
    workgroupBarrier();
    for (var k = 32u; k > 0u; k >>= 1u) {
        if (l < k) { red[l] += red[l + k]; }
        workgroupBarrier();
    }
    let inv = 1.0 / red[0];

    var acc: array<f32, 8>;
    for (var blk = 0u; blk < nkeys; blk += 64u) {
        let t = blk + l;
        var pr = 0.0;
        if (t < nkeys) {
            var e: f32;
            if (t < SCAP) { e = sc[t]; } else { e = exp(score(lo + t, kvh) - mx); }
            pr = rnd(e * inv, p.mode);
        }
        pb[l] = pr;
        workgroupBarrier();
        let nb = min(64u, nkeys - blk);
        for (var jj = 0u; jj < nb; jj++) {
            let pj = pb[jj];
            let pos = lo + blk + jj;
            for (var c = 0u; c < 8u; c++) {
                let e = l + 64u * c;
                if (e < p.hd) { acc[c] += pj * value(pos, kvh, e); }
            }
        }
        workgroupBarrier();
    }
    let ob = (p.row0 + i) * p.ocols + h * p.hd;
    for (var c = 0u; c < 8u; c++) {
        let e = l + 64u * c;
        if (e < p.hd) { out[ob + e] = rnd(acc[c], p.mode); }
    }
}
"#;

const KV_APPEND: &str = r#"
struct P { qcols: u32, row0: u32, start: u32, first: u32, count: u32, kvd: u32, qd: u32, slots: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = wid(g, ng) * 256u + l;
    //STORE
}
"#;

const KV_STORE_F32: &str = r#"
    if (i >= p.count * p.kvd) { return; }
    let pos = p.first + i / p.kvd;
    let e = i % p.kvd;
    var slot = pos;
    if (p.slots > 0u) { slot = pos % p.slots; }
    let src = (p.row0 + pos - p.start) * p.qcols + p.qd + e;
    KC[slot * p.kvd + e] = qkv[src];
    VC[slot * p.kvd + e] = qkv[src + p.kvd];
"#;

const KV_STORE_PACKED: &str = r#"
    let half = p.kvd / 2u;
    if (i >= p.count * half) { return; }
    let pos = p.first + i / half;
    let e = 2u * (i % half);
    var slot = pos;
    if (p.slots > 0u) { slot = pos % p.slots; }
    let src = (p.row0 + pos - p.start) * p.qcols + p.qd + e;
    let dst = (slot * p.kvd + e) / 2u;
    KC[dst] = pack1(qkv[src]) | (pack1(qkv[src + 1u]) << 16u);
    VC[dst] = pack1(qkv[src + p.kvd]) | (pack1(qkv[src + p.kvd + 1u]) << 16u);
"#;

const HEAD_GATE: &str = r#"
struct P { rows: u32, cols: u32, gcols: u32, hd: u32, act: u32, mode: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> gt: array<f32>;
@group(0) @binding(2) var<storage, read_write> a: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = wid(g, ng) * 256u + l;
    if (i >= p.rows * p.cols) { return; }
    let r = i / p.cols;
    let h = (i % p.cols) / p.hd;
    let gv = gt[r * p.gcols + h];
    var s = 1.0 / (1.0 + exp(-gv));
    if (p.act == 1u) { s = gv / (1.0 + exp(-gv)); }
    s = rnd(s, p.mode);
    a[i] = rnd(a[i] * s, p.mode);
}
"#;

/// erf for f32, ported from FreeBSD's s_erff.c (as in the `libm` crate backend-cpu uses).
const ERF: &str = r#"
fn erfc1(x: f32) -> f32 {
    let s = abs(x) - 1.0;
    let pp = -2.3621185683e-03 + s * (4.1485610604e-01 + s * (-3.7220788002e-01 + s * (3.1834661961e-01
        + s * (-1.1089469492e-01 + s * (3.5478305072e-02 + s * -2.1663755178e-03)))));
    let qq = 1.0 + s * (1.0642088205e-01 + s * (5.4039794207e-01 + s * (7.1828655899e-02
        + s * (1.2617121637e-01 + s * (1.3637083583e-02 + s * 1.1984500103e-02)))));
    return 1.0 - 8.4506291151e-01 - pp / qq;
}

fn erfc2(ix: u32, x0: f32) -> f32 {
    if (ix < 0x3fa00000u) { return erfc1(x0); }
    let x = abs(x0);
    let s = 1.0 / (x * x);
    var r: f32;
    var bs: f32;
    if (ix < 0x4036db6du) {
        r = -9.8649440333e-03 + s * (-6.9385856390e-01 + s * (-1.0558626175e+01 + s * (-6.2375331879e+01
            + s * (-1.6239666748e+02 + s * (-1.8460508728e+02 + s * (-8.1287437439e+01 + s * -9.8143291473e+00))))));
        bs = 1.0 + s * (1.9651271820e+01 + s * (1.3765776062e+02 + s * (4.3456588745e+02 + s * (6.4538726807e+02
            + s * (4.2900814819e+02 + s * (1.0863500214e+02 + s * (6.5702495575e+00 + s * -6.0424413532e-02)))))));
    } else {
        r = -9.8649431020e-03 + s * (-7.9928326607e-01 + s * (-1.7757955551e+01 + s * (-1.6063638306e+02
            + s * (-6.3756646729e+02 + s * (-1.0250950928e+03 + s * -4.8351919556e+02)))));
        bs = 1.0 + s * (3.0338060379e+01 + s * (3.2579251099e+02 + s * (1.5367296143e+03 + s * (3.1998581543e+03
            + s * (2.5530502930e+03 + s * (4.7452853394e+02 + s * -2.2440952301e+01))))));
    }
    let z = bitcast<f32>(bitcast<u32>(x) & 0xffffe000u);
    return exp(-z * z - 0.5625) * exp((z - x) * (z + x) + r / bs) / x;
}

fn erf(x: f32) -> f32 {
    let bits = bitcast<u32>(x);
    let ix = bits & 0x7fffffffu;
    let neg = (bits >> 31u) != 0u;
    if (ix >= 0x7f800000u) {
        if (ix > 0x7f800000u) { return x; }
        return select(1.0, -1.0, neg);
    }
    if (ix < 0x3f580000u) {
        if (ix < 0x31800000u) { return 0.125 * (8.0 * x + 1.0270333290e+00 * x); }
        let z = x * x;
        let r = 1.2837916613e-01 + z * (-3.2504209876e-01 + z * (-2.8481749818e-02 + z * (-5.7702702470e-03 + z * -2.3763017452e-05)));
        let s = 1.0 + z * (3.9791721106e-01 + z * (6.5022252500e-02 + z * (5.0813062117e-03 + z * (1.3249473704e-04 + z * -3.9602282413e-06))));
        return x + x * (r / s);
    }
    var y = 1.0;
    if (ix < 0x40c00000u) { y = 1.0 - erfc2(ix, x); }
    return select(y, -y, neg);
}

fn gelu_erf(x: f32) -> f32 { return 0.5 * x * (1.0 + erf(x * 0.70710678118654752)); }
"#;

const GEGLU: &str = r#"
struct P { n: u32, mode: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> gate: array<f32>;
@group(0) @binding(2) var<storage, read> up: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = wid(g, ng) * 256u + l;
    if (i >= p.n) { return; }
    out[i] = rnd(rnd(gelu_erf(gate[i]), p.mode) * up[i], p.mode);
}
"#;

const ADD: &str = r#"
struct P { n: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> h: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = wid(g, ng) * 256u + l;
    if (i >= p.n) { return; }
    h[i] = h[i] + x[i];
}
"#;

const GATHER: &str = r#"
struct P { n: u32, cols: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> rows: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = wid(g, ng) * 256u + l;
    if (i >= p.n * p.cols) { return; }
    out[i] = x[rows[i / p.cols] * p.cols + i % p.cols];
}
"#;
