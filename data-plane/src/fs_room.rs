//! What the kernel says of the file system under a path: how much room it
//! has left (the disk tier's start-up check against its `--cache-disk`
//! size) and which mount it is (a data set root whose volume went away).

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

/// The id of the mount `path` is on (`statx`'s `STATX_MNT_ID`); `None`
/// where the kernel does not say.
pub fn mount_id(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut out = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `path` is NUL-terminated and `out` is writable for one statx.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            path.as_ptr(),
            0,
            libc::STATX_MNT_ID,
            out.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: statx succeeded, so it wrote the buffer (zeroed before).
    let out = unsafe { out.assume_init() };
    (out.stx_mask & libc::STATX_MNT_ID != 0).then_some(out.stx_mnt_id)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_directory_has_room_and_a_missing_one_none() {
        let dir = std::env::temp_dir();
        assert!(super::free_bytes(&dir).is_some_and(|b| b > 0));
        assert_eq!(super::free_bytes(&dir.join("no-such-dir-of-sluice")), None);
    }

    #[test]
    fn a_mount_point_is_another_mount_than_its_parent() {
        let (root, proc) = (
            super::mount_id("/".as_ref()),
            super::mount_id("/proc".as_ref()),
        );
        assert!(root.is_some() && proc.is_some());
        assert_ne!(root, proc);
        assert_eq!(super::mount_id("/no-such-dir-of-sluice".as_ref()), None);
    }
}
