//! Opening a file by a path that has no symlink on it, in one step
//! (`openat2` with `RESOLVE_NO_SYMLINKS`), where the kernel has it.

#![allow(unsafe_code)]

use std::fs::{File, Metadata};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether the kernel takes `openat2` (cleared at its first refusal: a
/// kernel before 5.6, or a seccomp profile that blocks it).
static OPENAT2: AtomicBool = AtomicBool::new(true);

/// Opens the regular file at `path` as [`crate::storage::open_regular_as_is`] does, in one
/// step, when no component of `path` is a symlink (`RESOLVE_NO_SYMLINKS`):
/// a path joined from a canonical root and a name without `..` then stays
/// beneath the root, with no component to resolve and check one by one.
/// `None` when it cannot be opened so (a symlink on the way, no such file,
/// not a regular file, no `openat2`, no free descriptor): the caller
/// resolves the path itself, which gives the error that says why.
/// Blocking.
pub fn open_plain(path: &Path) -> Option<(File, Metadata)> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    if !OPENAT2.load(Ordering::Relaxed) {
        return None;
    }
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: `open_how` is three integers, all zero meaning "none".
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_NO_SYMLINKS;
    // SAFETY: `path` is a NUL-terminated string and `how` an `open_how` of
    // the size given; the descriptor returned is owned by the `File` alone.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            libc::AT_FDCWD,
            path.as_ptr(),
            &raw const how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error().raw_os_error();
        if matches!(e, Some(libc::ENOSYS | libc::EPERM)) {
            OPENAT2.store(false, Ordering::Relaxed);
        }
        return None;
    }
    // SAFETY: a descriptor just opened, owned by nothing else.
    let file = unsafe { File::from_raw_fd(fd as i32) };
    let meta = file.metadata().ok().filter(Metadata::is_file)?;
    Some((file, meta))
}
