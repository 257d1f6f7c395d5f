//! Giving freed heap memory back to the operating system while a model loads.
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
