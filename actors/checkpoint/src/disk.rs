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

/// Alignment of a direct write's memory, length and file offset, and so the boundary between
/// what goes direct and what goes through the page cache: 4 KiB (the largest logical block
/// size in common use) or the page size where that is larger (64 KiB pages on some arm64
/// kernels), so a cached page never holds part of a block written direct.
fn align() -> usize {
    static ALIGN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ALIGN.get_or_init(|| {
        #[cfg(unix)]
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(0);
        #[cfg(not(unix))]
        let page = 0;
        page.max(4096)
    })
}

/// Bytes a direct [`Appender`] gathers before one write.
pub const BLOCK: usize = 8 << 20;

/// A zeroed, [`align`]ed heap buffer of [`BLOCK`] bytes.
struct Aligned(std::ptr::NonNull<u8>);

impl Aligned {
    fn layout() -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(BLOCK, align()).expect("a valid layout")
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

/// A second descriptor on a file, open for direct writes (`O_DIRECT`): the aligned blocks go
/// through it while the unaligned rest goes through the page cache on the first.
pub struct DirectTwin(File);

impl DirectTwin {
    /// A direct descriptor on `f`'s file (Linux, through `/proc/self/fd`); `None` where the
    /// system or the file system refuses one.
    pub fn open(f: &File) -> Option<Self> {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(format!("/proc/self/fd/{}", f.as_raw_fd()))
                .ok()
                .map(DirectTwin)
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = f;
            None
        }
    }

    /// [`open`](Self::open) in [`DiskMode::Direct`]; `None` in [`DiskMode::Buffered`].
    pub fn for_mode(f: &File, mode: DiskMode) -> Option<Self> {
        match mode {
            DiskMode::Direct => Self::open(f),
            DiskMode::Buffered => None,
        }
    }

    /// Writes `data` at `at` in the file: straight to the disk when `data`'s address, length
    /// and `at` are [`align`]ed and the file system takes it; what it refuses (`EINVAL`) or
    /// leaves after a short write goes through `f`'s page cache.
    pub fn write_at(&self, f: &File, data: &[u8], at: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let align = align();
        let aligned = (data.as_ptr() as usize).is_multiple_of(align)
            && data.len().is_multiple_of(align)
            && at.is_multiple_of(align as u64);
        let mut done = 0;
        while aligned && done < data.len() {
            match self.0.write_at(&data[done..], at + done as u64) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    done += n;
                    if !done.is_multiple_of(align) {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                Err(e) => return Err(e),
            }
        }
        buffered_at(f, &data[done..], at + done as u64)
    }
}

/// Writes `data` at `at` through the page cache and starts its write-out.
pub fn buffered_at(f: &File, data: &[u8], at: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    if data.is_empty() {
        return Ok(());
    }
    f.write_all_at(data, at)?;
    start_writeback(f, at, data.len());
    Ok(())
}

/// An [`align`]ed bounce buffer of [`BLOCK`] bytes for direct writes, one per thread, kept.
pub fn with_bounce<T>(f: impl FnOnce(&mut [u8]) -> T) -> T {
    thread_local! {
        static BOUNCE: std::cell::RefCell<Option<Aligned>> = const { std::cell::RefCell::new(None) };
    }
    BOUNCE.with(|b| f(b.borrow_mut().get_or_insert_with(Aligned::new).bytes()))
}

/// Writes `data` at `at` in `f`: with a [`DirectTwin`], its [`align`]ed middle straight to
/// the disk in blocks of up to [`BLOCK`] bytes copied through the thread's bounce buffer, the
/// unaligned head and tail through the page cache; without one, all through the page cache.
pub fn write_span(
    f: &File,
    direct: Option<&DirectTwin>,
    data: &[u8],
    at: u64,
) -> std::io::Result<()> {
    let Some(twin) = direct else {
        return buffered_at(f, data, at);
    };
    let (end, align) = (at + data.len() as u64, align() as u64);
    let (lo, hi) = (at.next_multiple_of(align), end / align * align);
    if lo >= hi {
        return buffered_at(f, data, at);
    }
    let (head, rest) = data.split_at((lo - at) as usize);
    let (middle, tail) = rest.split_at((hi - lo) as usize);
    buffered_at(f, head, at)?;
    for (k, block) in middle.chunks(BLOCK).enumerate() {
        with_bounce(|b| {
            b[..block.len()].copy_from_slice(block);
            twin.write_at(f, &b[..block.len()], lo + (k * BLOCK) as u64)
        })?;
    }
    buffered_at(f, tail, hi)
}

/// Appends pieces to a file opened empty, in the chosen [`DiskMode`].
pub struct Appender<'f> {
    f: &'f mut File,
    /// Bytes handed to the file so far (the gathered ones not counted).
    at: u64,
    /// Direct mode's descriptor, buffer and how much of the buffer is filled; `None` when
    /// buffered.
    direct: Option<(DirectTwin, Aligned, usize)>,
}

impl<'f> Appender<'f> {
    /// An appender for `f` (empty, at offset 0). Direct mode falls back to buffered where the
    /// file system refuses `O_DIRECT`.
    pub fn new(f: &'f mut File, mode: DiskMode) -> Self {
        let direct = DirectTwin::for_mode(f, mode).map(|t| (t, Aligned::new(), 0));
        Appender { f, at: 0, direct }
    }

    /// Whether the writes go past the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Appends `piece`.
    pub fn put(&mut self, mut piece: &[u8]) -> std::io::Result<()> {
        let Some((twin, buf, used)) = self.direct.as_mut() else {
            return append(self.f, &mut self.at, piece);
        };
        while !piece.is_empty() {
            let n = (BLOCK - *used).min(piece.len());
            buf.bytes()[*used..*used + n].copy_from_slice(&piece[..n]);
            *used += n;
            piece = &piece[n..];
            if *used == BLOCK {
                twin.write_at(self.f, buf.bytes(), self.at)?;
                self.at += BLOCK as u64;
                *used = 0;
            }
        }
        Ok(())
    }

    /// Writes what is left (a direct appender's aligned part straight to the disk, its tail
    /// through the page cache) and returns the file's length. The caller still syncs the file.
    pub fn finish(mut self) -> std::io::Result<u64> {
        if let Some((twin, buf, used)) = self.direct.as_mut() {
            let whole = *used / align() * align();
            twin.write_at(self.f, &buf.bytes()[..whole], self.at)?;
            buffered_at(self.f, &buf.bytes()[whole..*used], self.at + whole as u64)?;
            self.at += *used as u64;
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

    /// Spans at odd offsets, across 8 MB marks, written by several threads at once through
    /// `write_span` (the weights file's way): the file holds each where it belongs.
    #[test]
    fn spans_at_odd_offsets_land_in_place_in_both_modes() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..(BLOCK * 2 + 777_777))
            .map(|i| (i * 13 % 241) as u8)
            .collect();
        let cuts = [
            0,
            3,
            4096,
            4099,
            BLOCK - 1,
            BLOCK + 5000,
            2 * BLOCK + 1,
            data.len(),
        ];
        for mode in [DiskMode::Buffered, DiskMode::Direct] {
            let path = dir.path().join(format!("{mode:?}"));
            let f = File::create(&path).unwrap();
            f.set_len(data.len() as u64).unwrap();
            let twin = DirectTwin::for_mode(&f, mode);
            std::thread::scope(|s| {
                for w in cuts.windows(2) {
                    let (f, twin, data) = (&f, twin.as_ref(), &data);
                    s.spawn(move || write_span(f, twin, &data[w[0]..w[1]], w[0] as u64).unwrap());
                }
            });
            f.sync_all().unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), data, "{mode:?}");
        }
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
