//! Each wgpu op against backend-cpu's on odd shapes, in f32, bf16 and f16 rounding, with and
//! without subgroup reductions. Skipped (visibly) on a machine with no wgpu adapter.

mod common;

use backend_cpu::{CpuBackend, CpuTensor};
use spark_backend_wgpu::{WgpuBackend, WgpuTensor};
use spark_core::backend::{AttnChunk, AttnShape, Backend, WeightRole};
use spark_core::config::{GateAct, RopeParams};
use spark_core::kv::{KvKind, KvSpec};
use spark_core::rope::RopeTable;
use spark_core::weights::Tensor as HostTensor;
use spark_core::DType;

struct Rng(u64);

impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

struct Pair {
    cpu: CpuBackend,
    gpu: WgpuBackend,
}

impl Pair {
    fn new(subgroups: bool) -> Option<Pair> {
        Some(Pair { cpu: CpuBackend::new(Some(2)).unwrap(), gpu: common::backend(subgroups)? })
    }

    /// The same activations on both backends (uploaded as an embedding and gathered).
    fn act(&self, rows: usize, cols: usize, vals: &[f32]) -> (CpuTensor, WgpuTensor) {
        let t = HostTensor::from_f32("x", vec![rows, cols], DType::F32, vals);
        let ids: Vec<u32> = (0..rows as u32).collect();
        let cw = self.cpu.upload_weight(&t, WeightRole::Embedding, DType::F32).unwrap();
        let gw = self.gpu.upload_weight(&t, WeightRole::Embedding, DType::F32).unwrap();
        let mut c = self.cpu.alloc(rows, cols).unwrap();
        let mut g = self.gpu.alloc(rows, cols).unwrap();
        self.cpu.embed(&cw, &ids, &mut c).unwrap();
        self.gpu.embed(&gw, &ids, &mut g).unwrap();
        (c, g)
    }

    fn read(&self, t: &WgpuTensor) -> Vec<f32> {
        let mut v = vec![0.0; t.rows * t.cols];
        self.gpu.read(t, &mut v).unwrap();
        v
    }
}

fn tol(d: DType) -> f32 {
    match d {
        DType::F32 => 2e-5,
        DType::BF16 => 1.6e-2,
        DType::F16 => 2.5e-3,
    }
}

/// |cpu - gpu| <= tol * max(|cpu|, 1) everywhere.
fn close(what: &str, cpu: &[f32], gpu: &[f32], tol: f32) {
    assert_eq!(cpu.len(), gpu.len(), "{what}: lengths");
    let mut worst = 0.0f32;
    for (i, (a, b)) in cpu.iter().zip(gpu).enumerate() {
        let d = (a - b).abs() / a.abs().max(1.0);
        assert!(d <= tol || (a.is_nan() && b.is_nan()), "{what}: element {i}: cpu {a} gpu {b} (tolerance {tol:e})");
        worst = worst.max(d);
    }
    eprintln!("{what}: max scaled diff {worst:e}");
}

fn round_all(d: DType, v: &mut [f32]) {
    for x in v {
        *x = d.round(*x);
    }
}

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

#[test]
fn matmul_every_dtype_and_shape() {
    for subgroups in [true, false] {
        let Some(p) = Pair::new(subgroups) else { return };
        let mut rng = Rng(0x9e3779b97f4a7c15);
        for dt in DTYPES {
            for &(n, k, m) in &[(1, 37, 5), (3, 128, 67), (8, 33, 130), (9, 70, 3), (70, 129, 67), (130, 16, 65)] {
                let xv = rng.vec(n * k, 1.0);
                let wv = rng.vec(m * k, 0.5);
                let (cx, gx) = p.act(n, k, &xv);
                let w = HostTensor::from_f32("w", vec![m, k], DType::F32, &wv);
                let cw = p.cpu.upload_weight(&w, WeightRole::Matrix, dt).unwrap();
                let gw = p.gpu.upload_weight(&w, WeightRole::Matrix, dt).unwrap();
                let mut co = p.cpu.alloc(n, m).unwrap();
                let mut go = p.gpu.alloc(n, m).unwrap();
                p.cpu.matmul(&cx, &cw, &mut co, dt).unwrap();
                p.gpu.matmul(&gx, &gw, &mut go, dt).unwrap();
                close(&format!("matmul {dt} n{n} k{k} m{m} sg{subgroups}"), &co.data, &p.read(&go), tol(dt));
            }
        }
    }
}

#[test]
fn weights_stored_in_another_type_are_converted() {
    let Some(p) = Pair::new(true) else { return };
    let mut rng = Rng(7);
    let (n, k, m) = (2, 31, 9);
    let (cx, gx) = p.act(n, k, &rng.vec(n * k, 1.0));
    // A bf16 checkpoint tensor used in f16 and f32, an f16 one in bf16.
    for (stored, dt) in [(DType::BF16, DType::F16), (DType::BF16, DType::F32), (DType::F16, DType::BF16)] {
        let w = HostTensor::from_f32("w", vec![m, k], stored, &rng.vec(m * k, 0.5));
        let cw = p.cpu.upload_weight(&w, WeightRole::Matrix, dt).unwrap();
        let gw = p.gpu.upload_weight(&w, WeightRole::Matrix, dt).unwrap();
        let mut co = p.cpu.alloc(n, m).unwrap();
        let mut go = p.gpu.alloc(n, m).unwrap();
        p.cpu.matmul(&cx, &cw, &mut co, dt).unwrap();
        p.gpu.matmul(&gx, &gw, &mut go, dt).unwrap();
        close(&format!("matmul stored {stored} as {dt}"), &co.data, &p.read(&go), tol(dt));
    }
}

#[test]
fn embedding_in_every_dtype() {
    let Some(p) = Pair::new(true) else { return };
    let mut rng = Rng(11);
    let (rows, cols) = (13, 7);
    let t = HostTensor::from_f32("e", vec![rows, cols], DType::F32, &rng.vec(rows * cols, 2.0));
    let ids = [12u32, 0, 5, 5, 3];
    for dt in DTYPES {
        let cw = p.cpu.upload_weight(&t, WeightRole::Embedding, dt).unwrap();
        let gw = p.gpu.upload_weight(&t, WeightRole::Embedding, dt).unwrap();
        let mut co = p.cpu.alloc(ids.len(), cols).unwrap();
        let mut go = p.gpu.alloc(ids.len(), cols).unwrap();
        p.cpu.embed(&cw, &ids, &mut co).unwrap();
        p.gpu.embed(&gw, &ids, &mut go).unwrap();
        close(&format!("embed {dt}"), &co.data, &p.read(&go), 0.0);
    }
    let mut go = p.gpu.alloc(1, cols).unwrap();
    let gw = p.gpu.upload_weight(&t, WeightRole::Embedding, DType::F32).unwrap();
    assert!(p.gpu.embed(&gw, &[13], &mut go).is_err(), "an id past the table is refused");
}

#[test]
fn elementwise_ops() {
    let Some(p) = Pair::new(true) else { return };
    let mut rng = Rng(3);
    for dt in DTYPES {
        let (rows, cols) = (5, 77);
        // RMSNorm.
        let (cx, gx) = p.act(rows, cols, &rng.vec(rows * cols, 3.0));
        let w = HostTensor::from_f32("n", vec![cols], DType::F32, &rng.vec(cols, 1.5));
        let cw = p.cpu.upload_weight(&w, WeightRole::Norm, DType::F32).unwrap();
        let gw = p.gpu.upload_weight(&w, WeightRole::Norm, DType::F32).unwrap();
        let mut co = p.cpu.alloc(rows, cols).unwrap();
        let mut go = p.gpu.alloc(rows, cols).unwrap();
        p.cpu.rms_norm(&cx, &cw, 1e-6, &mut co, dt).unwrap();
        p.gpu.rms_norm(&gx, &gw, 1e-6, &mut go, dt).unwrap();
        close(&format!("rms_norm {dt}"), &co.data, &p.read(&go), tol(dt));

        // GEGLU over a range that reaches every branch of erf (|x| up to 8).
        let n = 3 * 1001;
        let mut gv: Vec<f32> = (0..n).map(|i| (i as f32 - 1500.0) / 180.0).collect();
        gv[0] = 1e-9;
        gv[1] = -3e-30;
        let (cg, gg) = p.act(3, 1001, &gv);
        let (cu, gu) = p.act(3, 1001, &rng.vec(n, 2.0));
        let mut co = p.cpu.alloc(3, 1001).unwrap();
        let mut go = p.gpu.alloc(3, 1001).unwrap();
        p.cpu.geglu(&cg, &cu, &mut co, dt).unwrap();
        p.gpu.geglu(&gg, &gu, &mut go, dt).unwrap();
        close(&format!("geglu {dt}"), &co.data, &p.read(&go), tol(dt).max(1e-6));

        // Head gate, both activations.
        let (hd, heads) = (6, 5);
        for act in [GateAct::Sigmoid, GateAct::Silu] {
            let (mut ca, mut ga) = p.act(rows, hd * heads, &rng.vec(rows * hd * heads, 2.0));
            let (cg, gg) = p.act(rows, heads, &rng.vec(rows * heads, 6.0));
            p.cpu.head_gate(&mut ca, &cg, act, hd, dt).unwrap();
            p.gpu.head_gate(&mut ga, &gg, act, hd, dt).unwrap();
            close(&format!("head_gate {act:?} {dt}"), &ca.data, &p.read(&ga), tol(dt));
        }
    }
    // Residual add and row gather.
    let (mut ch, mut gh) = p.act(4, 9, &rng.vec(36, 1.0));
    let (cx, gx) = p.act(4, 9, &rng.vec(36, 1.0));
    p.cpu.add(&mut ch, &cx).unwrap();
    p.gpu.add(&mut gh, &gx).unwrap();
    close("add", &ch.data, &p.read(&gh), 0.0);
    let rows = [3usize, 0, 3];
    let mut co = p.cpu.alloc(3, 9).unwrap();
    let mut go = p.gpu.alloc(3, 9).unwrap();
    p.cpu.gather_rows(&ch, &rows, &mut co).unwrap();
    p.gpu.gather_rows(&gh, &rows, &mut go).unwrap();
    close("gather_rows", &co.data, &p.read(&go), 0.0);
}

#[test]
fn rope_full_and_partial() {
    let Some(p) = Pair::new(true) else { return };
    let mut rng = Rng(5);
    let (nh, nkv, hd) = (3, 1, 16);
    let cols = (nh + 2 * nkv) * hd;
    for rot in [16, 4] {
        let table = RopeTable::new(RopeParams { theta: 10000.0, rot_dims: rot }, 50);
        let gt = p.gpu.upload_rope(&table).unwrap();
        for dt in DTYPES {
            let positions = [0u32, 7, 49, 3];
            let (mut cq, mut gq) = p.act(4, cols, &rng.vec(4 * cols, 2.0));
            p.cpu.rope(&mut cq, &positions, &table, nh, nkv, hd, dt).unwrap();
            p.gpu.rope(&mut gq, &positions, &gt, nh, nkv, hd, dt).unwrap();
            close(&format!("rope rot {rot} {dt}"), &cq.data, &p.read(&gq), tol(dt));
        }
        let (_, mut gq) = p.act(1, cols, &rng.vec(cols, 1.0));
        assert!(p.gpu.rope(&mut gq, &[50], &gt, nh, nkv, hd, DType::F32).is_err(), "position past the table");
    }
}

#[test]
fn attention_ring_and_growing_caches_over_chunks() {
    for subgroups in [true, false] {
        let Some(p) = Pair::new(subgroups) else { return };
        let mut rng = Rng(17);
        let (nh, nkv) = (4, 2);
        for hd in [24, 10] {
            let qd = nh * hd;
            let cols = qd + 2 * nkv * hd;
            for dt in DTYPES {
                for kind in [KvKind::Ring { window: 5 }, KvKind::Grow { max: 300 }] {
                    let spec = KvSpec { kind, kv_heads: nkv, head_dim: hd, dtype: dt };
                    let window = match kind {
                        KvKind::Ring { window } => Some(window),
                        KvKind::Grow { .. } => None,
                    };
                    let shape = AttnShape { n_heads: nh, n_kv_heads: nkv, head_dim: hd, window, scale: 0.3 };
                    let mut ckv = p.cpu.kv_alloc(&spec).unwrap();
                    let mut gkv = p.gpu.kv_alloc(&spec).unwrap();
                    let mut start = 0;
                    // Prefill longer than the window, single steps, a chunk that crosses a
                    // growth block.
                    for len in [7usize, 1, 1, 11, 1, 270] {
                        // One spare row before the chunk: chunk.row is honoured.
                        let rows = len + 1;
                        let mut v = rng.vec(rows * cols, 1.5);
                        round_all(dt, &mut v);
                        let (cq, gq) = p.act(rows, cols, &v);
                        let chunk = AttnChunk { row: 1, len, start_pos: start };
                        let mut co = p.cpu.alloc(rows, qd).unwrap();
                        let mut go = p.gpu.alloc(rows, qd).unwrap();
                        p.cpu.attention(&cq, chunk, shape, &mut ckv, &mut co, dt).unwrap();
                        p.gpu.attention(&gq, chunk, shape, &mut gkv, &mut go, dt).unwrap();
                        let what = format!("attention hd{hd} {dt} {kind:?} start {start} len {len} sg{subgroups}");
                        close(&what, &co.data[qd..], &p.read(&go)[qd..], tol(dt));
                        start += len;
                    }
                    assert!(p.gpu.kv_bytes(&gkv) > 0);
                    // A fork continues like the original.
                    let mut fork = p.gpu.kv_clone(&gkv).unwrap();
                    let mut v = rng.vec(2 * cols, 1.5);
                    round_all(dt, &mut v);
                    let (cq, gq) = p.act(2, cols, &v);
                    let chunk = AttnChunk { row: 0, len: 2, start_pos: start };
                    let mut co = p.cpu.alloc(2, qd).unwrap();
                    let mut go = p.gpu.alloc(2, qd).unwrap();
                    p.cpu.attention(&cq, chunk, shape, &mut ckv, &mut co, dt).unwrap();
                    p.gpu.attention(&gq, chunk, shape, &mut fork, &mut go, dt).unwrap();
                    close("attention on a fork", &co.data, &p.read(&go), tol(dt));
                }
            }
        }
    }
}
