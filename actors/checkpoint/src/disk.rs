//! Keeping the disk busy while a file is still being written. A large write into the page
//! cache reaches the disk only when the kernel's dirty-page thresholds say so (on a machine
//! with 128 GB of memory, gigabytes later) or at the file's `fsync`: a checkpoint's writers
//! filled the cache at memory speed, then waited in `fsync` while the disk did the whole
//! file, and the disk sat idle in between. Asking for the write-out of each piece as it is
//! written (Linux `sync_file_range` with `SYNC_FILE_RANGE_WRITE`, which starts the write
//! without waiting for it) keeps the disk writing from the first piece; the `fsync` at the
//! end still makes the file durable, and finds little left to do.
//!
//! Or the page cache is left out ([`DiskMode::Direct`], Linux `O_DIRECT`): an [`Appender`]
//! gathers the pieces in an aligned buffer and hands the disk whole aligned blocks straight from
//! it, so no dirty pages pile up and the kernel copies nothing; the file's unaligned tail goes
//! through the page cache at the end. Where the file system refuses direct writes the appender
//! writes through the cache as before.

use std::fs::File;
use std::io::Write;

/// How a checkpoint's files reach the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskMode {
    /// Through the page cache, each piece's write-out started as it is written.
    Buffered,
    /// Past the page cache (`O_DIRECT`) in aligned blocks; buffered where refused.
    Direct,
}

impl DiskMode {
    /// The mode `NSACTOR_CHECKPOINT_IO` names (`buffered` or `direct`); buffered when unset.
    /// Any other value is an error that says what is accepted.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var("NSACTOR_CHECKPOINT_IO") {
            Err(_) => Ok(DiskMode::Buffered),
            Ok(v) => match v.as_str() {
                "" | "buffered" => Ok(DiskMode::Buffered),
                "direct" => Ok(DiskMode::Direct),
                other => Err(format!(
                    "NSACTOR_CHECKPOINT_IO = `{other}`: expected `buffered` or `direct`"
                )),
            },
        }
    }
}

/// Alignment of a direct write's memory, length and file offset (the largest logical block
/// size in common use).
const ALIGN: usize = 4096;

/// Bytes a direct [`Appender`] gathers before one write.
const BLOCK: usize = 8 << 20;

/// A zeroed, [`ALIGN`]-aligned heap buffer of [`BLOCK`] bytes.
struct Aligned(std::ptr::NonNull<u8>);

impl Aligned {
    fn layout() -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(BLOCK, ALIGN).expect("a valid layout")
    }
    fn new() -> Self {
        // SAFETY: a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(Self::layout()) };
        Aligned(
            std::ptr::NonNull::new(p)
                .unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout())),
        )
    }
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: BLOCK initialised bytes owned by this buffer.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_ptr(), BLOCK) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { std::alloc::dealloc(self.0.as_ptr(), Self::layout()) }
    }
}

/// Sets or clears `O_DIRECT` on `f`; false where the system refuses it.
fn set_direct(f: &File, on: bool) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: plain fcntl calls on an open descriptor.
        unsafe {
            let flags = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
            if flags < 0 {
                return false;
            }
            let want = match on {
                true => flags | libc::O_DIRECT,
                false => flags & !libc::O_DIRECT,
            };
            libc::fcntl(f.as_raw_fd(), libc::F_SETFL, want) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (f, on);
        !on
    }
}

/// Appends pieces to a file opened empty, in the chosen [`DiskMode`].
pub struct Appender<'f> {
    f: &'f mut File,
    /// Bytes handed to the file so far (the gathered ones not counted).
    at: u64,
    /// Direct mode's buffer and how much of it is filled; `None` when buffered.
    direct: Option<(Aligned, usize)>,
}

impl<'f> Appender<'f> {
    /// An appender for `f` (empty, at offset 0). Direct mode falls back to buffered where the
    /// file system refuses `O_DIRECT`.
    pub fn new(f: &'f mut File, mode: DiskMode) -> Self {
        let direct = (mode == DiskMode::Direct && set_direct(f, true)).then(|| (Aligned::new(), 0));
        Appender { f, at: 0, direct }
    }

    /// Whether the writes go past the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Appends `piece`.
    pub fn put(&mut self, mut piece: &[u8]) -> std::io::Result<()> {
        while !piece.is_empty() {
            // A fallback in `flush_block` leaves the rest to the page cache.
            let Some((buf, used)) = self.direct.as_mut() else {
                return append(self.f, &mut self.at, piece);
            };
            let n = (BLOCK - *used).min(piece.len());
            buf.bytes()[*used..*used + n].copy_from_slice(&piece[..n]);
            *used += n;
            piece = &piece[n..];
            if *used == BLOCK {
                self.flush_block()?;
            }
        }
        Ok(())
    }

    /// Writes the full block gathered. A file system that refuses the direct write (`EINVAL`)
    /// gets it, and every later piece, through the page cache.
    fn flush_block(&mut self) -> std::io::Result<()> {
        let Some((buf, used)) = self.direct.as_mut() else {
            return Ok(());
        };
        let mut done = 0;
        while done < *used {
            match self.f.write(&buf.bytes()[done..*used]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) if (done + n) % ALIGN == 0 || done + n == *used => done += n,
                Ok(n) => {
                    // A short write off the alignment: the rest goes buffered.
                    done += n;
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                Err(e) => return Err(e),
            }
        }
        self.at += done as u64;
        if done < *used {
            let rest = buf.bytes()[done..*used].to_vec();
            self.direct = None;
            set_direct(self.f, false);
            return append(self.f, &mut self.at, &rest);
        }
        *used = 0;
        Ok(())
    }

    /// Writes what is left (a direct appender's unaligned tail through the page cache) and
    /// returns the file's length. The caller still syncs the file.
    pub fn finish(mut self) -> std::io::Result<u64> {
        if let Some((buf, used)) = self.direct.as_mut() {
            let whole = *used / ALIGN * ALIGN;
            let tail = buf.bytes()[whole..*used].to_vec();
            *used = whole;
            self.flush_block()?;
            if self.direct.is_some() {
                set_direct(self.f, false);
                self.direct = None;
            }
            append(self.f, &mut self.at, &tail)?;
        }
        Ok(self.at)
    }
}

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

    /// Pieces of awkward sizes through both modes: the same bytes, the same length (direct
    /// mode on a file system that refuses it falls back; on one that takes it, blocks and a
    /// tail).
    #[test]
    fn an_appender_writes_the_same_bytes_in_both_modes() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..(2 * BLOCK + 12_345))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        for mode in [DiskMode::Buffered, DiskMode::Direct] {
            let path = dir.path().join(format!("{mode:?}"));
            let mut f = File::create(&path).unwrap();
            let mut a = Appender::new(&mut f, mode);
            for piece in [
                &data[..1],
                &data[1..5000],
                &data[5000..BLOCK + 3],
                &data[BLOCK + 3..],
            ] {
                a.put(piece).unwrap();
            }
            a.put(&[]).unwrap();
            assert_eq!(a.finish().unwrap(), data.len() as u64);
            f.sync_all().unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), data, "{mode:?}");
        }
        // Shorter than one aligned block: the tail alone.
        let path = dir.path().join("short");
        let mut f = File::create(&path).unwrap();
        let mut a = Appender::new(&mut f, DiskMode::Direct);
        a.put(b"abc").unwrap();
        assert_eq!(a.finish().unwrap(), 3);
        assert_eq!(std::fs::read(&path).unwrap(), b"abc");
    }

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
