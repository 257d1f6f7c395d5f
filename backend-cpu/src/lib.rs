//! backend-cpu: spark's CPU backend.
//!
//! Implements [`spark_core::Backend`] with multi-threaded kernels (a rayon pool of `--threads`
//! workers) and SIMD chosen at run time (AVX2+FMA+F16C, or the portable path). Weights in f32,
//! bf16 or f16 are used straight from the memory-mapped checkpoint when their stored type is the
//! compute type; accumulation is always f32. Quantized (int8/int4) matrices are repacked at
//! upload and multiplied by integer kernels with the activations quantized to int8 per 32-block
//! ([`kernels::qmatmul`]: AVX-512 VNNI, AVX2 or portable).
//!
//! - [`kernels`]: dot products, GEMM/GEMV, SIMD dispatch.
//! - [`attention`]: attention over the KV cache (ring for sliding layers, growing for full).
//! - [`ops`]: RMSNorm, RoPE, head gate, GEGLU, residual add.
//! - [`weights`]: how uploaded weights are held.
//! - [`huge_pages`]: zeroed buffers on transparent huge pages (quantized weights).
//! - [`roofline`]: measured read bandwidth and FMA peak (the ceilings `bench` reports against).
//! - [`plugin`]: the backend as a factory, exported as the `spark_backend_v1` plugin entry.

pub mod attention;
pub mod huge_pages;
pub mod kernels;
pub mod ops;
pub mod plugin;
pub mod roofline;
pub mod weights;

use rayon::prelude::*;
use spark_core::backend::{AttnChunk, AttnShape, Backend, WeightRole};
use spark_core::config::GateAct;
use spark_core::kv::KvSpec;
use spark_core::quant::QTensor;
use spark_core::rope::RopeTable;
use spark_core::weights::Tensor as HostTensor;
use spark_core::{DType, Error, Result};

pub use attention::CpuKv;
pub use kernels::Simd;
pub use weights::CpuWeight;

/// A row-major `[rows, cols]` f32 activation buffer.
#[derive(Debug, Clone)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// The CPU backend: a thread pool and the SIMD level.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    simd: Simd,
}

impl CpuBackend {
    /// A backend running on `threads` worker threads (`None`: one per available core).
    pub fn new(threads: Option<usize>) -> Result<Self> {
        let n = threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        if n == 0 {
            return Err(Error::invalid("--threads must be at least 1"));
        }
        let pool =
            rayon::ThreadPoolBuilder::new().num_threads(n).thread_name(|i| format!("spark-cpu-{i}")).build().map_err(
                |e| Error::new(spark_core::ErrorKind::Backend, format!("cannot start {n} CPU threads: {e}")),
            )?;
        Ok(CpuBackend { pool, simd: Simd::detect() })
    }

    /// As [`CpuBackend::new`], with a given SIMD level (tests compare the portable and AVX2
    /// paths; the level is capped at what the processor has).
    pub fn with_simd(threads: Option<usize>, simd: Simd) -> Result<Self> {
        let mut b = Self::new(threads)?;
        b.simd = simd.min(Simd::detect());
        Ok(b)
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
    pub fn simd(&self) -> Simd {
        self.simd
    }
}

fn check(cond: bool, what: &str) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::internal(format!("cpu backend: shape mismatch in {what}")))
    }
}

impl Backend for CpuBackend {
    type Weight = CpuWeight;
    type Tensor = CpuTensor;
    type Rope = RopeTable;
    type Kv = CpuKv;

    fn name(&self) -> &str {
        "cpu"
    }

    fn upload_weight(&self, t: &HostTensor, _role: WeightRole, dtype: DType) -> Result<CpuWeight> {
        CpuWeight::from_host(t, dtype)
    }

    /// Repacked for the integer kernels ([`kernels::qmatmul`]); groups that are not multiples of
    /// 16 fall back to the dequantized float weight.
    fn upload_quant(&self, q: &QTensor, role: WeightRole, dtype: DType) -> Result<CpuWeight> {
        match CpuWeight::from_quant(q, dtype)? {
            Some(w) => Ok(w),
            None => self.upload_weight(&q.to_tensor(dtype), role, dtype),
        }
    }

    fn upload_rope(&self, table: &RopeTable) -> Result<RopeTable> {
        Ok(table.clone())
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<CpuTensor> {
        Ok(CpuTensor { rows, cols, data: vec![0.0; rows * cols] })
    }

    fn kv_alloc(&self, spec: &KvSpec) -> Result<CpuKv> {
        Ok(CpuKv::new(*spec))
    }

    fn kv_truncate(&self, kv: &mut CpuKv, new_len: usize) -> Result<()> {
        kv.truncate(new_len);
        Ok(())
    }

    fn kv_clone(&self, kv: &CpuKv) -> Result<CpuKv> {
        Ok(kv.clone())
    }

    fn kv_bytes(&self, kv: &CpuKv) -> usize {
        kv.bytes()
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32], out: &mut CpuTensor) -> Result<()> {
        check(out.rows == ids.len() && out.cols == table.cols, "embed")?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(Error::invalid(format!("token id {id} is outside the vocabulary ({})", table.rows)));
        }
        for (o, &id) in out.data.chunks_mut(out.cols).zip(ids) {
            table.dequant_row(id as usize, o);
        }
        Ok(())
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuWeight, eps: f32, out: &mut CpuTensor, round: DType) -> Result<()> {
        check(x.rows == out.rows && x.cols == out.cols && w.cols == x.cols, "rms_norm")?;
        let wv = w.f32_vec();
        self.pool.install(|| {
            out.data
                .par_chunks_mut(x.cols)
                .zip(x.data.par_chunks(x.cols))
                .for_each(|(o, xr)| ops::rms_norm(xr, &wv, eps, o, round))
        });
        Ok(())
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuWeight, out: &mut CpuTensor, round: DType) -> Result<()> {
        check(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows, "matmul")?;
        if let Some(q) = w.quant() {
            let simd = self.simd;
            self.pool
                .install(|| kernels::qmatmul::quant_matmul(simd, &x.data, x.rows, x.cols, q, &mut out.data, round));
            return Ok(());
        }
        self.pool.install(|| {
            kernels::matmul::matmul(self.simd, &x.data, x.rows, x.cols, w.mat(), w.rows, &mut out.data, round)
        });
        Ok(())
    }

    fn rope(
        &self,
        qkv: &mut CpuTensor,
        positions: &[u32],
        table: &RopeTable,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        round: DType,
    ) -> Result<()> {
        check(qkv.rows == positions.len() && qkv.cols >= (n_heads + n_kv_heads) * head_dim, "rope")?;
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= table.positions) {
            return Err(Error::invalid(format!(
                "position {p} is beyond the RoPE table ({} positions)",
                table.positions
            )));
        }
        let cols = qkv.cols;
        self.pool.install(|| {
            qkv.data.par_chunks_mut(cols).zip(positions.par_iter()).for_each(|(row, &p)| {
                for h in 0..n_heads + n_kv_heads {
                    ops::rope_head(&mut row[h * head_dim..(h + 1) * head_dim], p as usize, table, round);
                }
            })
        });
        Ok(())
    }

    fn attention(
        &self,
        qkv: &CpuTensor,
        chunk: AttnChunk,
        shape: AttnShape,
        kv: &mut CpuKv,
        out: &mut CpuTensor,
        round: DType,
    ) -> Result<()> {
        check(out.cols == shape.n_heads * shape.head_dim && chunk.row + chunk.len <= qkv.rows, "attention")?;
        if kv.len() != chunk.start_pos {
            return Err(Error::internal(format!(
                "attention: cache holds {} positions, chunk starts at {}",
                kv.len(),
                chunk.start_pos
            )));
        }
        self.pool.install(|| attention::attend(self.simd, qkv, chunk, shape, kv, out, round));
        kv.append(qkv, chunk, shape)
    }

    fn head_gate(
        &self,
        attn: &mut CpuTensor,
        g: &CpuTensor,
        act: GateAct,
        head_dim: usize,
        round: DType,
    ) -> Result<()> {
        check(attn.rows == g.rows && attn.cols == g.cols * head_dim, "head_gate")?;
        let gc = g.cols;
        self.pool.install(|| {
            attn.data
                .par_chunks_mut(attn.cols)
                .zip(g.data.par_chunks(gc))
                .for_each(|(a, gr)| ops::head_gate(a, gr, act, head_dim, round))
        });
        Ok(())
    }

    fn geglu(&self, gate: &CpuTensor, up: &CpuTensor, out: &mut CpuTensor, round: DType) -> Result<()> {
        check(gate.data.len() == up.data.len() && out.data.len() == up.data.len(), "geglu")?;
        self.pool.install(|| {
            out.data
                .par_chunks_mut(4096)
                .zip(gate.data.par_chunks(4096).zip(up.data.par_chunks(4096)))
                .for_each(|(o, (g, u))| ops::geglu(g, u, o, round))
        });
        Ok(())
    }

    fn add(&self, h: &mut CpuTensor, x: &CpuTensor) -> Result<()> {
        check(h.data.len() == x.data.len(), "add")?;
        h.data.iter_mut().zip(&x.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn run_step<R: Send>(&self, step: impl FnOnce() -> R + Send) -> R {
        // Once per step: the ops' own `install` calls then run inline on this pool's worker.
        self.pool.install(step)
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize], out: &mut CpuTensor) -> Result<()> {
        check(out.rows == rows.len() && out.cols == x.cols && rows.iter().all(|&r| r < x.rows), "gather_rows")?;
        for (o, &r) in out.data.chunks_mut(x.cols).zip(rows) {
            o.copy_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
        }
        Ok(())
    }

    fn read(&self, x: &CpuTensor, out: &mut [f32]) -> Result<()> {
        check(out.len() == x.data.len(), "read")?;
        out.copy_from_slice(&x.data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step runs on one of the backend's own workers, and the ops it issues there (each an
    /// `install` of the same pool) run inline and still split over every thread.
    #[test]
    fn run_step_enters_the_pool_once_and_ops_still_run_in_parallel() {
        let b = CpuBackend::new(Some(2)).unwrap();
        assert_eq!(rayon::current_thread_index(), None, "the test thread is not a worker");
        let (worker, threads_seen) = b.run_step(|| {
            let worker = rayon::current_thread_index();
            let mut x = b.alloc(64, 256).unwrap();
            x.data.iter_mut().enumerate().for_each(|(i, v)| *v = (i % 7) as f32 - 3.0);
            let t = spark_core::weights::Tensor::from_f32("norm", vec![256], DType::F32, &[1.0; 256]);
            let w = b.upload_weight(&t, WeightRole::Norm, DType::F32).unwrap();
            let mut out = b.alloc(64, 256).unwrap();
            b.rms_norm(&x, &w, 1e-6, &mut out, DType::F32).unwrap();
            assert!(out.data.iter().all(|v| v.is_finite()));
            // Which workers a parallel loop issued from inside the step reaches (both, given
            // enough slow tasks: the other worker steals while this one sleeps).
            let seen = std::sync::Mutex::new(std::collections::BTreeSet::new());
            b.pool.install(|| {
                (0..64).into_par_iter().for_each(|_| {
                    seen.lock().unwrap().insert(rayon::current_thread_index());
                    std::thread::sleep(std::time::Duration::from_millis(2));
                })
            });
            (worker, seen.into_inner().unwrap())
        });
        assert!(worker.is_some(), "run_step must run the step on a worker of the backend's pool");
        assert_eq!(threads_seen.len(), 2, "ops inside a step must still use every worker: {threads_seen:?}");
    }

    /// A step that panics inside a parallel loop reaches the caller, and the pool runs the next
    /// step (on 1, 2 and 3 threads).
    #[test]
    fn a_panicking_step_releases_the_pool() {
        for threads in 1..=3 {
            let b = CpuBackend::new(Some(threads)).unwrap();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                b.run_step(|| (0..1000).into_par_iter().for_each(|i| assert!(i != 777, "deliberate failure")))
            }));
            assert!(r.is_err(), "{threads} threads: the panic must reach the caller");
            let n: usize = b.run_step(|| (0..1000).into_par_iter().map(|i| i % 3).sum());
            assert_eq!(n, 999, "{threads} threads");
        }
    }
}
