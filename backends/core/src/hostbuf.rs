//! Host buffers for serialised stages. A 0.9B layer's shard is ~0.5 GB, written once and
//! dropped after its file is on disk, so every checkpoint's buffers are fresh memory: faulted
//! in 4 KB page by 4 KB page as the copy from the device first touches them, which cost more
//! than the copy itself. A buffer here comes zeroed from the allocator (`calloc`: fresh pages,
//! no `memset`) and, on Linux, is asked for huge pages and populated in one call before the
//! copy, so the copy runs at memory speed.

/// Below this, the page-fault cost is noise and the advice is not worth a system call.
const ADVISE_FROM: usize = 16 << 20;

/// A zeroed buffer of `len` bytes, its pages in place (see the file's note).
pub(crate) fn zeroed(len: usize) -> Vec<u8> {
    let v = vec![0u8; len];
    if len >= ADVISE_FROM {
        populate(&v);
    }
    v
}

/// Asks the kernel for transparent huge pages over `v`'s whole pages, then to fault them all in
/// at once (`MADV_POPULATE_WRITE`, Linux 5.14). Advice only: an older kernel, or one with huge
/// pages off, refuses it, and the pages then fault in on first touch as before.
#[cfg(target_os = "linux")]
fn populate(v: &[u8]) {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let start = (v.as_ptr() as usize).next_multiple_of(page);
    let end = (v.as_ptr() as usize + v.len()) / page * page;
    if end <= start {
        return;
    }
    let (addr, len) = (start as *mut libc::c_void, end - start);
    // SAFETY: the range lies within `v`'s allocation, whole pages only; both calls are advice
    // that leaves the contents (zeros) as they are.
    unsafe {
        libc::madvise(addr, len, libc::MADV_HUGEPAGE);
        libc::madvise(addr, len, libc::MADV_POPULATE_WRITE);
    }
}

#[cfg(not(target_os = "linux"))]
fn populate(_: &[u8]) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_and_sized_small_and_large() {
        for len in [0, 1, 4095, ADVISE_FROM + 12_345] {
            let v = zeroed(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&b| b == 0), "{len} bytes not all zero");
        }
    }
}
