//! How much room a file system has left, for the disk tier's start-up
//! check against its `--cache-disk` size.

#![allow(unsafe_code)]

use std::path::Path;

/// Bytes an unprivileged writer may still put on the file system of `dir`
/// (`None` where it cannot be told).
pub fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `path` is NUL-terminated and `st` is writable for one statvfs.
    if unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs succeeded, so it filled the struct.
    let st = unsafe { st.assume_init() };
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_directory_has_room_and_a_missing_one_none() {
        let dir = std::env::temp_dir();
        assert!(super::free_bytes(&dir).is_some_and(|b| b > 0));
        assert_eq!(super::free_bytes(&dir.join("no-such-dir-of-sluice")), None);
    }
}
