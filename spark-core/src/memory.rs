//! Giving freed heap memory back to the operating system while a model loads, and asking for
//! transparent huge pages where weights are streamed.
//!
//! Loading converts or repacks one matrix at a time and frees the host copy once it is
//! uploaded. glibc's malloc keeps such freed blocks (tens of MB each, below its adaptive
//! `mmap` threshold once the first large block was freed) in its heaps rather than returning
//! them, so without help the load peak and the settled resident memory carry hundreds of MB of
//! free memory (docs/QUANTIZATION.md, "Memory").

/// Return the allocator's free memory to the operating system: glibc's `malloc_trim`, which
/// releases the free pages of every arena, not only the top of the main heap. A no-op with
/// other C libraries.
pub fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own bookkeeping and takes any pad value;
    // it is thread-safe (each arena is locked while it is trimmed).
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Whether weight memory asks the kernel for transparent huge pages: unless the environment
/// sets `SPARK_HUGE_PAGES` to `0` or `off` (for comparisons, or a system where huge pages
/// misbehave). A decode step streams every weight once, and with 4 KiB pages the TLB misses
/// cost read bandwidth: docs/BENCHMARKS.md, session 41.
pub fn huge_pages_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !matches!(std::env::var("SPARK_HUGE_PAGES").as_deref(), Ok("0" | "off")))
}

/// Advise huge pages for a mapped checkpoint file, before its first read: on Linux the page
/// cache then reads it into 2 MiB folios and maps them whole (on a 2-core Zen 4 a bf16 file
/// read cold was 93-100 % PMD-mapped, against 4 % when the page cache held it in small pages).
/// Advice only: where the kernel or file system does not do this, nothing changes.
pub fn advise_huge_pages(map: &memmap2::Mmap) {
    #[cfg(target_os = "linux")]
    if huge_pages_enabled() {
        let _ = map.advise(memmap2::Advice::HugePage);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = map;
}
