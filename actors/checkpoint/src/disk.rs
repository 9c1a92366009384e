//! Keeping the disk busy while a file is still being written. A large write into the page
//! cache reaches the disk only when the kernel's dirty-page thresholds say so (on a machine
//! with 128 GB of memory, gigabytes later) or at the file's `fsync`: a checkpoint's writers
//! filled the cache at memory speed, then waited in `fsync` while the disk did the whole
//! file, and the disk sat idle in between. Asking for the write-out of each piece as it is
//! written (Linux `sync_file_range` with `SYNC_FILE_RANGE_WRITE`, which starts the write
//! without waiting for it) keeps the disk writing from the first piece; the `fsync` at the
//! end still makes the file durable, and finds little left to do.

use std::fs::File;
use std::io::Write;

/// Starts the disk writing `len` bytes of `f` from `offset` (already written to the page
/// cache), without waiting for them. Advice: where the call is missing or refused, the data
/// goes out at the file's `fsync` as before. It may block while the disk's queue is full,
/// which paces the writer at the disk's rate.
pub fn start_writeback(f: &File, offset: u64, len: usize) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain system call on an open descriptor; it reads no memory of ours.
        unsafe {
            libc::sync_file_range(
                f.as_raw_fd(),
                offset as libc::off64_t,
                len as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (f, offset, len);
}

/// Appends `piece` to `f` (whose end is at `*at`) and starts its write-out
/// ([`start_writeback`]), moving `*at` past it.
pub fn append(f: &mut File, at: &mut u64, piece: &[u8]) -> std::io::Result<()> {
    f.write_all(piece)?;
    start_writeback(f, *at, piece.len());
    *at += piece.len() as u64;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appended_pieces_land_in_order_and_the_offset_follows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut f = File::create(&path).unwrap();
        let mut at = 0;
        for piece in [&b"abc"[..], b"", b"defgh"] {
            append(&mut f, &mut at, piece).unwrap();
        }
        f.sync_all().unwrap();
        assert_eq!(at, 8);
        assert_eq!(std::fs::read(&path).unwrap(), b"abcdefgh");
        // Advice past the end, or of nothing, is harmless.
        start_writeback(&f, 100, 10);
        start_writeback(&f, 0, 0);
    }
}
