//! Zeroed byte buffers backed by transparent huge pages where the kernel gives them.
//!
//! A decode step streams every weight once; with 4 KiB pages that is one TLB entry per 4 KiB
//! of each of a tile's row streams, and the page walks stall the stream. On a 2-core Zen 4
//! guest one thread read 23 GB/s from 4 KiB pages and 30 GB/s from 2 MiB pages (the same
//! loop, docs/BENCHMARKS.md, session 41). Most Linux systems run transparent huge pages in
//! `madvise` mode, so a mapping gets them only when asked: [`HugeBytes`] maps anonymous memory
//! aligned to 2 MiB and advises `MADV_HUGEPAGE` before the first touch. Where that is not
//! possible (another OS, a buffer under 2 MiB, a failed `mmap`) it is a plain `Vec<u8>`; the
//! contents are the same either way, only the page size differs. Pages are allocated on first
//! touch, as with `vec![0; n]`, so resident memory is what is written, rounded to the page.
//! `SPARK_HUGE_PAGES=0` turns the advice off (plain vectors everywhere), for comparisons.

use std::ops::{Deref, DerefMut};

/// The huge page size asked for (x86-64 and arm64 with 4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// A zeroed, fixed-length byte buffer; see the module documentation.
pub struct HugeBytes {
    inner: Inner,
}

enum Inner {
    Vec(Vec<u8>),
    #[cfg(target_os = "linux")]
    Mapped {
        /// Start of the buffer (2 MiB aligned) and its length.
        ptr: std::ptr::NonNull<u8>,
        len: usize,
        /// The mapping this buffer owns: `ptr..ptr + map_len` (`len` rounded up to 4 KiB).
        map_len: usize,
    },
}

// SAFETY: the mapping is owned by this value alone (no aliases are handed out beyond borrows
// tied to it), like a `Vec<u8>`'s allocation.
unsafe impl Send for HugeBytes {}
// SAFETY: shared access only reads the bytes, as for `Vec<u8>`.
unsafe impl Sync for HugeBytes {}

impl HugeBytes {
    /// `len` zero bytes, on huge pages when `len >= HUGE_PAGE` and the OS allows it.
    pub fn zeroed(len: usize) -> HugeBytes {
        #[cfg(target_os = "linux")]
        if len >= HUGE_PAGE && spark_core::memory::huge_pages_enabled() {
            if let Some(inner) = map_huge(len) {
                return HugeBytes { inner };
            }
        }
        HugeBytes { inner: Inner::Vec(vec![0u8; len]) }
    }

    /// Whether the buffer was mapped with the huge-page advice (the kernel may still have
    /// backed parts of it with small pages).
    pub fn advised(&self) -> bool {
        !matches!(self.inner, Inner::Vec(_))
    }
}

/// Map `len` bytes at a 2 MiB boundary and advise huge pages; `None` if `mmap` fails.
#[cfg(target_os = "linux")]
fn map_huge(len: usize) -> Option<Inner> {
    const SMALL_PAGE: usize = 4096;
    let map_len = len.div_ceil(SMALL_PAGE) * SMALL_PAGE;
    let over = map_len.checked_add(HUGE_PAGE)?;
    // SAFETY: an anonymous private mapping at an address the kernel picks; no memory of ours
    // is touched. The result is checked against MAP_FAILED below.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            over,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let base = raw as usize;
    let start = base.next_multiple_of(HUGE_PAGE);
    let (head, tail) = (start - base, over - (start - base) - map_len);
    // SAFETY: `base..start` and `start + map_len..base + over` lie inside the mapping just made
    // and are page aligned (`base` and `map_len` are multiples of 4 KiB, `start` of 2 MiB);
    // nothing refers to them. Unmapping the slack leaves exactly `start..start + map_len`.
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((start + map_len) as *mut libc::c_void, tail);
        }
        // Advice only: on a kernel without transparent huge pages it fails and the mapping
        // keeps small pages, which is still a correct buffer.
        libc::madvise(start as *mut libc::c_void, map_len, libc::MADV_HUGEPAGE);
    }
    Some(Inner::Mapped { ptr: std::ptr::NonNull::new(start as *mut u8)?, len, map_len })
}

impl Deref for HugeBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.inner {
            Inner::Vec(v) => v,
            #[cfg(target_os = "linux")]
            // SAFETY: `ptr..ptr + len` is inside the live mapping this value owns, readable and
            // initialized (anonymous pages read as zero until written).
            Inner::Mapped { ptr, len, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
        }
    }
}

impl DerefMut for HugeBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.inner {
            Inner::Vec(v) => v,
            #[cfg(target_os = "linux")]
            // SAFETY: as in `deref`, and `&mut self` makes this the only borrow of the bytes.
            Inner::Mapped { ptr, len, .. } => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), *len) },
        }
    }
}

impl Drop for HugeBytes {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if let Inner::Mapped { ptr, map_len, .. } = self.inner {
            // SAFETY: `ptr..ptr + map_len` is the mapping `map_huge` left, owned by this value
            // alone; no borrow outlives `self`.
            unsafe {
                libc::munmap(ptr.as_ptr().cast(), map_len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_buffers_are_plain_vectors() {
        let b = HugeBytes::zeroed(1000);
        assert!(!b.advised());
        assert_eq!(b.len(), 1000);
        assert!(b.iter().all(|&x| x == 0));
    }

    #[test]
    fn large_buffers_are_zeroed_writable_and_aligned() {
        let len = 3 * HUGE_PAGE + 12345;
        let mut b = HugeBytes::zeroed(len);
        assert_eq!(b.len(), len);
        #[cfg(target_os = "linux")]
        if spark_core::memory::huge_pages_enabled() {
            assert!(b.advised(), "mmap of {len} bytes failed");
            assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
        }
        assert!(b.iter().step_by(4093).all(|&x| x == 0) && b[len - 1] == 0);
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
    }
}
