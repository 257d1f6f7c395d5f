//! Opening the wgpu adapter for the tests (or skipping visibly without one). Golden data and
//! comparisons come from the spark-tests library, shared with the cpu and cuda suites.

use spark_backend_wgpu::{plugin, WgpuBackend, WgpuOptions};

/// The wgpu backend on the first adapter, or `None` (after saying so on stderr) when this
/// machine has none.
pub fn backend(subgroups: bool) -> Option<WgpuBackend> {
    let devices = plugin::probe();
    if !devices.iter().any(|d| d.usable) {
        eprintln!("skipped: no wgpu adapter ({})", devices.first().map_or("", |d| d.note.as_str()));
        return None;
    }
    let b = WgpuBackend::new(WgpuOptions { device: 0, subgroups }).expect("an adapter was probed but does not open");
    eprintln!("wgpu adapter: {} (subgroups: {})", b.adapter(), b.uses_subgroups());
    Some(b)
}
