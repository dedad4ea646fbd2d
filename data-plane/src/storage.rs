//! Reading files from storage: whole files for prefetching (buffered, or
//! with `O_DIRECT` where chosen and supported) and byte ranges for random
//! access.
//!
//! Prefetched samples are read into buffers taken from the pool of
//! [`crate::chunk`], so a sample costs no allocation, zeroing or page faults
//! once the stage is warm. Buffered reads are the default: on the measured virtual disk they deliver
//! about a third more samples per second end to end than `O_DIRECT`, for
//! about 1.4x the stage's CPU (docs/data-plane.md). Direct reads keep the
//! data out of the page cache; they land in a 4 KiB-aligned window of an
//! ordinary `Vec`, so no unsafe allocation is needed.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sluice_proto::fd_limit;
use tracing::warn;

use crate::chunk::{Buffer, Chunk};
use crate::pace::Sparse;
use crate::protocol::{ErrorCode, MAX_RESPONSE_FRAME, ProtocolError, TO_END};

/// The largest file one frame can carry, leaving room for headers.
pub const MAX_FILE_BYTES: u64 = MAX_RESPONSE_FRAME as u64 - (64 << 10);
/// Alignment `O_DIRECT` needs for buffers, offsets and lengths.
const ALIGN: usize = 4096;

/// Returns the length of the buffer a prefetch read of a `size`-byte file
/// uses: the file rounded up to a size class (at most 1/8 larger, so buffers
/// of similar samples are interchangeable in the pool), one block to notice a
/// file that grew, and one block of slack to align the window. This is what
/// the engine reserves, so the buffer budget counts exactly what is held.
pub fn whole_footprint(size: u64) -> u64 {
    let window = size as usize + ALIGN;
    let highest_bit = 1usize << (usize::BITS - 1 - window.leading_zeros());
    let granule = (highest_bit / 8).max(ALIGN);
    (window.div_ceil(granule) * granule + ALIGN) as u64
}

/// Turns an I/O error on `name` into the protocol's per-request error.
pub fn io_error(name: &str, e: &io::Error) -> ProtocolError {
    match e.kind() {
        // A directory or a FIFO where a file was asked for: no such file,
        // with what is there instead.
        io::ErrorKind::NotFound if e.get_ref().is_some() => ProtocolError::new(
            ErrorCode::NotFound,
            format!("`{name}` is not a file of the dataset: {e}"),
        ),
        io::ErrorKind::NotFound => ProtocolError::new(
            ErrorCode::NotFound,
            format!("`{name}` does not exist in the dataset"),
        ),
        io::ErrorKind::NotADirectory => ProtocolError::new(
            ErrorCode::NotFound,
            format!("`{name}` does not exist in the dataset (a directory of its path is a file)"),
        ),
        io::ErrorKind::FileTooLarge => ProtocolError::new(
            ErrorCode::TooLarge,
            format!("`{name}`: {e}; read it in ranges with READ offset/length"),
        ),
        _ => ProtocolError::new(ErrorCode::IoError, format!("reading `{name}` failed: {e}")),
    }
}

fn check_regular(file: &File) -> io::Result<u64> {
    regular_metadata(file).map(|meta| meta.len())
}

/// The metadata of `file`, which must be a regular file.
fn regular_metadata(file: &File) -> io::Result<Metadata> {
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    Ok(meta)
}

fn not_regular() -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, "it is not a regular file")
}

/// Opens `path` with `options`; a UNIX socket file, which cannot be
/// opened at all (`ENXIO`), is not a regular file either. A stage out of
/// file descriptors waits for one (they come back as other reads finish
/// and connections close) for up to [`DESCRIPTOR_WAIT`] instead of failing
/// the sample at once, and then fails it saying what to raise. Blocking.
fn open_with(options: &OpenOptions, path: &Path) -> io::Result<File> {
    with_descriptor(|| options.open(path)).map_err(|e| match e.raw_os_error() {
        Some(libc::ENXIO) => not_regular(),
        _ => e,
    })
}

/// Runs `open`, which takes a file descriptor: a stage out of them waits
/// for one (they come back as other reads finish and connections close)
/// for up to [`DESCRIPTOR_WAIT`], trying again, instead of failing at
/// once, and then fails saying what to raise. Blocking.
pub fn with_descriptor<T>(mut open: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        match open() {
            Err(e) if fd_limit::exhausted(&e) && started.elapsed() < DESCRIPTOR_WAIT => {
                descriptors_short();
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(e) if fd_limit::exhausted(&e) => {
                return Err(io::Error::new(
                    e.kind(),
                    fd_limit::Exhausted(format!(
                        "{e}: the stage found no free file descriptor for {} s (it may open {}); raise its `nofile` limit (ulimit -n, or the container runtime's), or run fewer jobs or connections on it",
                        DESCRIPTOR_WAIT.as_secs(),
                        fd_limit::soft()
                    )),
                ));
            }
            done => return done,
        }
    }
}

/// How long a read waits for a free file descriptor.
const DESCRIPTOR_WAIT: Duration = Duration::from_secs(10);

/// Whether a read waited for a file descriptor since the last call (the
/// engine then forgets the jobs kept idle, and their descriptors go back).
pub fn descriptors_were_short() -> bool {
    SHORT.swap(false, Ordering::Relaxed)
}

static SHORT: AtomicBool = AtomicBool::new(false);

/// Notes that a read waits for a file descriptor, and warns about it at
/// most once a minute.
fn descriptors_short() {
    static WARNED: Mutex<Sparse> = Mutex::new(Sparse::new());
    SHORT.store(true, Ordering::Relaxed);
    if let Some(times) = crate::sync::lock(&WARNED).note(Duration::from_secs(60)) {
        warn!(
            times,
            limit = fd_limit::soft(),
            "reads waited for a free file descriptor: the stage holds as many as it may open (connections, shared-memory regions, open files); raise its `nofile` limit, or run fewer jobs or connections on it"
        );
    }
}

fn grew(listed: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::FileTooLarge,
        format!("it grew since it was listed ({listed} bytes then)"),
    )
}

fn too_large(want: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::FileTooLarge,
        format!("{want} bytes is more than one response frame carries ({MAX_FILE_BYTES} bytes)"),
    )
}

/// The part of a `size`-byte sample that `READ offset/length` asks for:
/// its start and length (empty past the end; `TO_END`: the rest).
pub fn clamp_range(size: u64, offset: u64, length: u64) -> (u64, u64) {
    let start = offset.min(size);
    let want = if length == TO_END {
        size - start
    } else {
        length.min(size - start)
    };
    (start, want)
}

/// Opens the regular file at `path` for reading and returns it with its
/// size. Opened non-blocking, so that a FIFO or device put in a file's
/// place fails here instead of holding the thread until a writer comes
/// (on a regular file `O_NONBLOCK` changes nothing). Blocking.
pub fn open_regular(path: &Path) -> io::Result<(File, u64)> {
    let (file, meta) = open_regular_as_is(path)?;
    Ok((file, meta.len()))
}

/// [`open_regular`], returning the file's metadata (one `fstat` for both
/// the check and the caller). Blocking.
pub fn open_regular_as_is(path: &Path) -> io::Result<(File, Metadata)> {
    let file = open_with(
        OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK),
        path,
    )?;
    let meta = regular_metadata(&file)?;
    Ok((file, meta))
}

/// Reads a byte range of a regular file through the page cache. Blocking.
pub fn read_range(path: &Path, offset: u64, length: u64) -> io::Result<Chunk> {
    let (file, size) = open_regular(path)?;
    read_range_of(&file, size, offset, length)
}

/// Reads a byte range of `file`, open and `size` bytes long, with
/// positioned reads (several threads may read one file at once); a file
/// that shrank since gives what it has. Blocking.
pub fn read_range_of(file: &File, size: u64, offset: u64, length: u64) -> io::Result<Chunk> {
    let (start, want) = clamp_range(size, offset, length);
    if want > MAX_FILE_BYTES {
        return Err(too_large(want));
    }
    let mut data = vec![0; want as usize];
    let mut len = 0;
    while len < data.len() {
        match file.read_at(&mut data[len..], start + len as u64) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    data.truncate(len);
    Ok(Chunk::from_vec(data))
}

/// Whether a failed direct read means "this file system does not do
/// `O_DIRECT`" (so buffered reads should be used instead).
pub fn direct_unsupported(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// Reads a whole regular file for prefetching into a buffer of
/// [`whole_footprint`] bytes that `alloc` provides (from the heap pool or a
/// shared-memory region), with `O_DIRECT` when `direct` is set. Blocking. A
/// direct read fails with `EINVAL` where the file system does not support
/// direct I/O. With `nofollow`, a symlink as the last component fails
/// with `ELOOP`.
///
/// `listed` is the size the data set's listing gave, when the file comes
/// from it: the buffer is sized by it, and a read that stops short at
/// exactly that size is the end of the file without a second read to see
/// it. A file that grew is read again whole. Every file is opened
/// non-blocking, and one that ends short of its listed size must be a
/// regular file, so one replaced by a FIFO or a device since it was listed
/// fails instead of hanging or reading empty.
pub fn read_whole(
    path: &Path,
    direct: bool,
    nofollow: bool,
    listed: Option<u64>,
    alloc: &dyn Fn(usize) -> Buffer,
) -> io::Result<Chunk> {
    let mut options = OpenOptions::new();
    options.read(true);
    let mut flags = 0;
    if direct {
        flags |= libc::O_DIRECT;
    }
    if nofollow {
        flags |= libc::O_NOFOLLOW;
    }
    // A FIFO or device put where a file was must not block the open.
    flags |= libc::O_NONBLOCK;
    options.custom_flags(flags);
    let mut file = open_with(&options, path)?;
    let size = match listed {
        Some(size) => size,
        None => check_regular(&file)?,
    };
    if size > MAX_FILE_BYTES {
        return Err(too_large(size));
    }
    let mut buf = alloc(whole_footprint(size) as usize);
    let bytes = buf.as_mut_slice();
    let window = bytes.len() - ALIGN;
    let start = bytes.as_ptr().align_offset(ALIGN);
    let mut len = 0;
    loop {
        let asked = window - len;
        let n = file.read(&mut buf.as_mut_slice()[start + len..start + window])?;
        if n == 0 {
            break;
        }
        len += n;
        // A regular file gives less than asked only at its end.
        if listed.is_some() && n < asked && len as u64 == size {
            return Ok(Chunk::pooled(buf, start, len));
        }
        if len == window {
            buf.recycle();
            // The file grew past its listed size plus a block since it was
            // listed (written while the data set was read): it is not read
            // into the buffer past the bytes reserved for it, which would
            // take memory the budget does not hold (files listed empty and
            // then written held 176 MiB on a 64 MiB budget), nor made to
            // wait for room (read-ahead behind the entry a consumer waits on
            // holds it). The trainer reads it in ranges, as it does an
            // object that grew, until the next listing has its size.
            if let Some(listed) = listed {
                return Err(grew(listed));
            }
            // Grew while being read: read it the plain way.
            return read_range(path, 0, TO_END);
        }
    }
    // It ended short of its listed size: a file that shrank, or a FIFO or
    // a device put in its place since the listing, which is an error, not
    // an empty sample. (What ends at the listed size is not stat'ed.)
    if listed.is_some() {
        check_regular(&file)?;
    }
    Ok(Chunk::pooled(buf, start, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_beneath_a_file_is_not_found() {
        let e = io_error("a.bin/x", &io::Error::from_raw_os_error(libc::ENOTDIR));
        assert_eq!(e.code, ErrorCode::NotFound, "{e}");
    }

    #[test]
    fn whole_direct_and_range_reads_agree() {
        // /var/tmp is disk-backed on most systems; tmpfs refuses O_DIRECT,
        // which must surface as "unsupported", never as wrong bytes.
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        for size in [0usize, 1, 4095, 4096, 4097, 100 * 1024 + 3] {
            let path = dir.path().join(format!("f{size}"));
            let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
            std::fs::write(&path, &data).unwrap();
            assert_eq!(&*read_range(&path, 0, TO_END).unwrap(), &data[..]);
            let buffered = read_whole(&path, false, false, None, &Buffer::heap).unwrap();
            assert_eq!(&*buffered, &data[..], "size {size}");
            assert_eq!(buffered.footprint(), whole_footprint(size as u64));
            // With the listed size: the same bytes, and a file that grew
            // since it was listed within its buffer's block is read whole
            // all the same; one that grew past it is refused as too large
            // (read in ranges), not read past what was reserved for it.
            let listed = read_whole(&path, false, true, Some(size as u64), &Buffer::heap);
            assert_eq!(&*listed.unwrap(), &data[..], "size {size}");
            let less = size.saturating_sub(1) as u64;
            let grew = read_whole(&path, false, true, Some(less), &Buffer::heap);
            if whole_footprint(less) - ALIGN as u64 > size as u64 {
                assert_eq!(&*grew.unwrap(), &data[..], "size {size}");
            } else {
                let e = grew.unwrap_err();
                assert_eq!(e.kind(), io::ErrorKind::FileTooLarge, "size {size}: {e}");
                assert!(e.to_string().contains("grew since it was listed"), "{e}");
            }
            match read_whole(&path, true, true, None, &Buffer::heap) {
                Ok(chunk) => {
                    assert_eq!(&*chunk, &data[..], "size {size}");
                    assert_eq!(
                        chunk.footprint(),
                        whole_footprint(size as u64),
                        "what is reserved is what is held"
                    );
                }
                Err(e) => assert!(direct_unsupported(&e), "{e}"),
            }
        }
    }

    #[test]
    fn footprints_are_aligned_and_close_to_the_size() {
        for size in [0u64, 1, 4096, 100 * 1024, 110_000, 2_700_000, 140 << 20] {
            let f = whole_footprint(size);
            assert_eq!(f % ALIGN as u64, 0);
            assert!(f >= size + 2 * ALIGN as u64 - 1, "{size}: {f}");
            assert!(
                f as f64 <= (size + 2 * ALIGN as u64) as f64 * 1.125 + ALIGN as f64,
                "{size}: {f}"
            );
        }
    }

    #[test]
    fn directories_are_not_files() {
        let dir = tempfile::tempdir().unwrap();
        let err = read_range(dir.path(), 0, TO_END).unwrap_err();
        assert!(err.to_string().contains("not a regular file"));
    }

    #[test]
    fn a_fifo_in_a_files_place_fails_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("f");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.unwrap().success());
        // Without a writer, a blocking open would wait for one for ever.
        let err = read_range(&fifo, 0, TO_END).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        assert!(open_regular(&fifo).is_err());
        let sock = dir.path().join("s");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let err = read_range(&sock, 0, TO_END).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        // Listed as a 10,000-byte file before it was replaced: an error
        // still, not an empty sample (with O_DIRECT the open itself fails
        // with EINVAL, and the caller reads again without it).
        let err = read_whole(&fifo, false, true, Some(10_000), &Buffer::heap).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        let file = dir.path().join("g");
        std::fs::write(&file, b"abc").unwrap();
        let (mut f, size) = open_regular(&file).unwrap();
        let mut read = String::new();
        f.read_to_string(&mut read).unwrap();
        assert_eq!((size, read.as_str()), (3, "abc"));
    }
}
