//! `SPARK_CUDA_PROFILE=1`: GPU time per kernel and per GEMM shape, measured with CUDA events
//! around every launch (steps then run kernel by kernel, not as CUDA graphs), summed when a
//! step's results are read, and printed to stderr when the backend is dropped.
//! `SPARK_CUDA_PROFILE=steps`: host time per step (recording, launching, waiting), graphs kept.
//! Both off by default.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{sys, CudaEvent, CudaStream};

/// Whether profiling is on (read once).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPARK_CUDA_PROFILE").is_ok_and(|v| v == "1"))
}

#[derive(Default)]
struct Profile {
    /// Event pairs not yet read, with their label.
    pending: Vec<(String, CudaEvent, CudaEvent)>,
    /// label -> (total ms, count).
    totals: HashMap<String, (f64, u64)>,
}

fn profile() -> &'static Mutex<Profile> {
    static P: OnceLock<Mutex<Profile>> = OnceLock::new();
    P.get_or_init(|| Mutex::new(Profile::default()))
}

/// Whether host step times are kept (`SPARK_CUDA_PROFILE=steps`).
pub fn steps() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPARK_CUDA_PROFILE").is_ok_and(|v| v == "steps"))
}

/// A start event on `stream` (timing enabled), or None when profiling is off or it fails.
pub fn start(stream: &CudaStream) -> Option<CudaEvent> {
    if !enabled() {
        return None;
    }
    stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).ok()
}

/// Record the end of the work labelled `label` that began at `start`.
pub fn end(stream: &CudaStream, start: Option<CudaEvent>, label: impl FnOnce() -> String) {
    let Some(s) = start else { return };
    if let Ok(e) = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)) {
        let mut p = profile().lock().unwrap_or_else(|p| p.into_inner());
        p.pending.push((label(), s, e));
    }
}

/// Add the pending pairs' times to the totals (call after the stream is synchronized).
pub fn collect() {
    if !enabled() {
        return;
    }
    let mut p = profile().lock().unwrap_or_else(|p| p.into_inner());
    let pending = std::mem::take(&mut p.pending);
    for (label, s, e) in pending {
        if let Ok(ms) = s.elapsed_ms(&e) {
            let t = p.totals.entry(label).or_insert((0.0, 0));
            t.0 += ms as f64;
            t.1 += 1;
        }
    }
}

/// Print the totals, largest first, and clear them.
pub fn report() {
    if !enabled() {
        return;
    }
    collect();
    let mut p = profile().lock().unwrap_or_else(|p| p.into_inner());
    let mut rows: Vec<(String, (f64, u64))> = p.totals.drain().collect();
    rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    let total: f64 = rows.iter().map(|r| r.1 .0).sum();
    eprintln!("cuda profile (GPU time between events; {total:.3} ms in all):");
    eprintln!("{:>10} {:>8} {:>10} {:>6}  label", "ms", "count", "us/call", "%");
    for (label, (ms, n)) in rows {
        eprintln!(
            "{ms:>10.3} {n:>8} {:>10.2} {:>5.1}%  {label}",
            ms * 1e3 / n.max(1) as f64,
            100.0 * ms / total.max(1e-12)
        );
    }
}
