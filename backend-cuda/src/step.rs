//! The step recorder: the kernel launches and GEMMs of one forward step are recorded as the graph
//! walks the model and run when the step's result is read (or the next step begins), either one
//! by one or as a CUDA graph.
//!
//! Everything a step reads from the host (token ids, positions, each attention chunk's start) is
//! appended to one staging array, uploaded once before the step runs; kernels read it through
//! [`Arg::Stage`] pointers. A decode step's launches are therefore the same at every position,
//! and with pooled activation buffers (see `CudaBackend::alloc`) the same from one step to the
//! next. A step whose recorded launches (kernels, launch shapes, every argument) equal those of a
//! step seen before is captured into a CUDA graph, which later equal steps replay with one
//! launch. Because the whole launch list is the key, a replay does exactly what launching the
//! records would. cuBLAS calls are captured too (the handle has its own workspace); a list whose
//! capture fails runs launch by launch from then on. Profiled or debug-synchronized runs are not
//! captured.

use std::collections::hash_map::DefaultHasher;
use std::collections::VecDeque;
use std::hash::{Hash, Hasher};

use cudarc::driver::{sys, CudaFunction, CudaGraph, CudaSlice, LaunchConfig};

use crate::kernels::Arg;

/// A recorded cuBLAS GEMM in cuBLAS's column-major terms: `C = op(A) op(B)` with f32 output and
/// f32 accumulation, A and B bf16 or f32, `batch` of them at the given element strides
/// (`cublasGemmEx` for one, `cublasGemmStridedBatchedEx` for more).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmRec {
    /// Whether A, B are transposed.
    pub ta: bool,
    pub tb: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub a: u64,
    pub lda: i32,
    pub stride_a: i64,
    pub b: u64,
    pub ldb: i32,
    pub stride_b: i64,
    pub c: u64,
    pub ldc: i32,
    pub stride_c: i64,
    pub batch: i32,
    /// Whether A and B are bf16 (else f32).
    pub bf16: bool,
}

/// What every chunk of one batched attention launch shares (the layer's shape and buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnKey {
    pub qkv: u64,
    pub qkv_cols: u32,
    pub out: u64,
    pub out_cols: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub window: u32,
    pub scale_bits: u32,
    pub mode: i32,
    pub kv_bf16: bool,
}

/// One chunk's attention, waiting to be launched with the other chunks of its step.
#[derive(Debug, Clone, Copy)]
pub struct PendingAttn {
    pub key: AttnKey,
    pub row0: u32,
    pub start: u32,
    pub first: u32,
    pub rows_h: u32,
    pub nsplit: u32,
    pub keys: u32,
    pub ring: u32,
    pub kc: u64,
    pub vc: u64,
}

/// A head gate fused into the pending decode attention: the gate activations `[rows, n_heads]`
/// and the activation (0 = sigmoid, 1 = silu).
#[derive(Debug, Clone, Copy)]
pub struct PendingGate {
    pub g: u64,
    pub act: i32,
}

/// One recorded operation.
pub enum Rec {
    Kernel { f: CudaFunction, what: &'static str, cfg: LaunchConfig, args: Vec<Arg> },
    Gemm(GemmRec),
}

/// A CUDA graph with the launch list it was captured from.
pub struct Captured {
    pub sig: Vec<u64>,
    pub graph: SendGraph,
}

/// A [`CudaGraph`] that may move between threads.
pub struct SendGraph(pub CudaGraph);

// SAFETY: a CUDA graph may be used from any thread as long as calls on it are serialized; the
// backend only touches its graphs while holding the step mutex.
unsafe impl Send for SendGraph {}

/// Graphs kept (the most recently captured).
pub const MAX_GRAPHS: usize = 16;
/// Launch-list hashes remembered (a list is captured the second time it is seen).
const MAX_SEEN: usize = 32;

/// The state of the step being recorded, and the captured graphs.
#[derive(Default)]
pub struct Step {
    pub recs: Vec<Rec>,
    /// Host data of this step, uploaded to `stage_dev` before it runs.
    pub stage: Vec<u32>,
    pub stage_dev: Option<CudaSlice<u32>>,
    /// The last positions staged this step and their offset (every layer's RoPE passes the same).
    pub last_positions: Option<(Vec<u32>, u32)>,
    /// Device buffers replaced during the step, kept until it has been launched (their frees
    /// are then ordered after it on the stream).
    pub keep: Vec<Box<dyn std::any::Any + Send>>,
    pub graphs: VecDeque<Captured>,
    seen: VecDeque<u64>,
    /// Launch lists whose capture failed (they run launch by launch).
    never: Vec<u64>,
    /// Decode chunks' attention, launched together when the next other operation is recorded.
    pub pending_attn: Vec<PendingAttn>,
    /// The head gate to apply in the pending attention's last kernel (see `head_gate`).
    pub pending_gate: Option<PendingGate>,
    /// Token rows of the step (from its embedding lookup).
    pub rows: usize,
    /// Graphs captured and graph launches (captures included), for tests and reports.
    pub captured: u64,
    pub replayed: u64,
    /// Host time (`SPARK_CUDA_PROFILE=steps`): when this step's first launch was recorded, and
    /// the totals over steps of recording, of uploading and launching, and of waiting for the
    /// result.
    pub first_rec: Option<std::time::Instant>,
    pub times: StepTimes,
}

/// Host time spent per phase of the steps, in seconds, and the steps counted.
#[derive(Default, Debug, Clone, Copy)]
pub struct StepTimes {
    pub steps: u64,
    pub record: f64,
    pub launch: f64,
    pub wait: f64,
}

impl Step {
    /// Append `v` to the staging array; returns its offset (in u32 elements).
    pub fn stage(&mut self, v: &[u32]) -> u32 {
        let off = self.stage.len() as u32;
        self.stage.extend_from_slice(v);
        off
    }

    /// Stage `positions`, reusing the previous copy when it is the same.
    pub fn stage_positions(&mut self, positions: &[u32]) -> u32 {
        if let Some((p, off)) = &self.last_positions {
            if p == positions {
                return *off;
            }
        }
        let off = self.stage(positions);
        self.last_positions = Some((positions.to_vec(), off));
        off
    }

    /// Forget the step (after it ran).
    pub fn clear(&mut self) {
        self.recs.clear();
        self.rows = 0;
        self.stage.clear();
        self.last_positions = None;
        self.keep.clear();
    }

    /// The launch list with staged pointers resolved against `stage_base`, flattened for an exact
    /// comparison.
    pub fn signature(&self, stage_base: u64) -> Vec<u64> {
        let mut sig = Vec::with_capacity(self.recs.len() * 16);
        for r in &self.recs {
            match r {
                Rec::Kernel { f, cfg, args, .. } => {
                    sig.extend([
                        f.cu_function() as u64,
                        cfg.grid_dim.0 as u64,
                        cfg.grid_dim.1 as u64,
                        cfg.grid_dim.2 as u64,
                        cfg.block_dim.0 as u64,
                        cfg.shared_mem_bytes as u64,
                        args.len() as u64,
                    ]);
                    sig.extend(args.iter().map(|a| a.slot(stage_base)));
                }
                Rec::Gemm(g) => sig.extend([
                    u64::MAX,
                    g.ta as u64,
                    g.tb as u64,
                    g.m as u64,
                    g.n as u64,
                    g.k as u64,
                    g.a,
                    g.lda as u64,
                    g.stride_a as u64,
                    g.b,
                    g.ldb as u64,
                    g.stride_b as u64,
                    g.c,
                    g.ldc as u64,
                    g.stride_c as u64,
                    g.batch as u64,
                    g.bf16 as u64,
                ]),
            }
        }
        sig
    }

    fn hash(sig: &[u64]) -> u64 {
        let mut h = DefaultHasher::new();
        sig.hash(&mut h);
        h.finish()
    }

    /// Remember that capturing `sig` failed.
    pub fn capture_failed(&mut self, sig: &[u64]) {
        self.never.push(Self::hash(sig));
    }

    /// Whether a graph should be captured for `sig` now: true the second time a list is seen.
    pub fn should_capture(&mut self, sig: &[u64]) -> bool {
        let h = Self::hash(sig);
        if self.never.contains(&h) {
            return false;
        }
        if self.seen.contains(&h) {
            return true;
        }
        if self.seen.len() == MAX_SEEN {
            self.seen.pop_front();
        }
        self.seen.push_back(h);
        false
    }

    /// Keep a captured graph (dropping the oldest beyond [`MAX_GRAPHS`]).
    pub fn keep_graph(&mut self, sig: Vec<u64>, graph: CudaGraph) -> &CudaGraph {
        if self.graphs.len() == MAX_GRAPHS {
            self.graphs.pop_front();
        }
        self.graphs.push_back(Captured { sig, graph: SendGraph(graph) });
        &self.graphs.back().expect("just pushed").graph.0
    }
}

/// Capture mode: only this thread's CUDA calls are captured.
pub const CAPTURE_MODE: sys::CUstreamCaptureMode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;

#[cfg(test)]
mod tests {
    use super::*;

    fn gemm(m: i32, c: u64) -> Rec {
        Rec::Gemm(GemmRec {
            ta: true,
            tb: false,
            m,
            n: 1,
            k: 8,
            a: 0x1000,
            lda: 8,
            stride_a: 0,
            b: 0x2000,
            ldb: 8,
            stride_b: 0,
            c,
            ldc: m,
            stride_c: 0,
            batch: 1,
            bf16: true,
        })
    }

    #[test]
    fn staging_appends_and_reuses_the_same_positions() {
        let mut st = Step::default();
        assert_eq!(st.stage(&[7, 8]), 0);
        assert_eq!(st.stage_positions(&[3, 4, 5]), 2);
        assert_eq!(st.stage_positions(&[3, 4, 5]), 2, "the same positions are staged once");
        assert_eq!(st.stage_positions(&[4, 5, 6]), 5);
        assert_eq!(st.stage, vec![7, 8, 3, 4, 5, 4, 5, 6]);
        st.clear();
        assert!(st.stage.is_empty() && st.last_positions.is_none() && st.recs.is_empty());
        assert_eq!(st.stage_positions(&[4, 5, 6]), 0, "a new step stages its positions again");
    }

    #[test]
    fn staged_arguments_resolve_against_the_staging_buffer() {
        assert_eq!(Arg::Stage(3).slot(0x10_0000), 0x10_000c);
        assert_eq!(Arg::U32(5).slot(0x10_0000), 5);
        assert_eq!(Arg::I32(-1).slot(0), 0xffff_ffff);
        assert_eq!(Arg::F32(1.0).slot(0), 0x3f80_0000);
    }

    #[test]
    fn a_list_is_captured_the_second_time_it_is_seen_and_never_after_a_failed_capture() {
        let mut st = Step { recs: vec![gemm(16, 0x3000), gemm(32, 0x4000)], ..Default::default() };
        let sig = st.signature(0);
        st.recs = vec![gemm(16, 0x3000), gemm(32, 0x5000)];
        let other = st.signature(0);
        assert_ne!(sig, other, "every argument is part of the key");
        assert!(!st.should_capture(&sig));
        assert!(st.should_capture(&sig));
        assert!(!st.should_capture(&other));
        st.capture_failed(&other);
        assert!(!st.should_capture(&other), "a list whose capture failed is not tried again");
    }
}
