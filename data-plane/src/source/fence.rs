//! Resolving paths of a local data set without looking into the stage's
//! own mount.
//!
//! The stage answers the mount's requests itself. A symlink in a data set
//! whose target is beneath the mount (`lnk -> /mnt/sluice/ds/a`) cannot be
//! resolved by the kernel without asking the stage, which is busy resolving
//! it: the listing waited on a lookup that waited on the listing, and the
//! mount hung. So where a mount is configured, symlinks are resolved here
//! one component at a time, and a path that reaches the mount is refused
//! before anything beneath it is looked at.

use std::ffi::OsString;
use std::io;
use std::path::{Component, Path, PathBuf};

/// How many symlinks one resolution follows, as the kernel's `ELOOP`.
const MAX_LINKS: usize = 40;

/// Where a path led: into the stage's own mount, which it is not resolved
/// through.
#[derive(Debug)]
pub struct IntoMount {
    /// The mount's directory.
    pub mount: PathBuf,
    /// The path beneath it the resolution reached.
    pub reached: PathBuf,
}

impl std::fmt::Display for IntoMount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "it leads to {}, inside the stage's own mount {}: a data set is read from storage, \
             never through the mount that serves it",
            self.reached.display(),
            self.mount.display()
        )
    }
}

impl std::error::Error for IntoMount {}

/// Whether `error` is an [`IntoMount`].
pub fn into_mount(error: &io::Error) -> bool {
    error.get_ref().is_some_and(|e| e.is::<IntoMount>())
}

/// Resolves `path` as `canonicalize` does: `rest` is taken beneath `base`
/// (canonical), symlinks are followed and `..` goes up from where they
/// led. Nothing beneath `mount` (canonical) is looked at: a path that
/// reaches it is an [`IntoMount`] error. Blocking.
pub fn resolve(base: &Path, rest: &Path, mount: &Path) -> io::Result<PathBuf> {
    let mut done = base.to_path_buf();
    let mut todo: Vec<OsString> = Vec::new();
    push_front(&mut todo, &mut done, rest);
    let mut links = 0;
    while let Some(part) = todo.pop() {
        if part == ".." {
            done.pop();
            continue;
        }
        let next = done.join(&part);
        if next.starts_with(mount) {
            return Err(io::Error::other(IntoMount {
                mount: mount.to_path_buf(),
                reached: next,
            }));
        }
        let meta = std::fs::symlink_metadata(&next)?;
        if meta.file_type().is_symlink() {
            links += 1;
            if links > MAX_LINKS {
                return Err(io::Error::from_raw_os_error(libc::ELOOP));
            }
            push_front(&mut todo, &mut done, &std::fs::read_link(&next)?);
        } else if !todo.is_empty() && !meta.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        } else {
            done = next;
        }
    }
    Ok(done)
}

/// Puts the components of `path` before those still to resolve (`todo`
/// holds them last first); an absolute path starts again from `/`.
fn push_front(todo: &mut Vec<OsString>, done: &mut PathBuf, path: &Path) {
    let mut parts = Vec::new();
    for component in path.components() {
        match component {
            Component::RootDir | Component::Prefix(_) => {
                *done = PathBuf::from("/");
                parts.clear();
            }
            Component::CurDir => {}
            Component::ParentDir => parts.push(OsString::from("..")),
            Component::Normal(name) => parts.push(name.to_owned()),
        }
    }
    todo.extend(parts.into_iter().rev());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn resolves_as_canonicalize_does_outside_the_mount() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        let mount = base.join("mnt");
        std::fs::create_dir_all(base.join("a/b/c")).unwrap();
        std::fs::create_dir_all(&mount).unwrap();
        std::fs::write(base.join("a/b/c/f"), b"1").unwrap();
        symlink("b/c", base.join("a/short")).unwrap();
        symlink("../../b", base.join("a/b/c/up")).unwrap();
        symlink(base.join("a/b/c/f"), base.join("abs")).unwrap();
        symlink("a/short/../../../a/./b/c/f", base.join("dotted")).unwrap();
        symlink("loop2", base.join("loop1")).unwrap();
        symlink("loop1", base.join("loop2")).unwrap();
        symlink("nowhere", base.join("dangling")).unwrap();
        for name in [
            "a",
            "a/short",
            "a/short/f",
            "a/b/c/up/c/up/c/f",
            "abs",
            "dotted",
            "a/short/..",
            "a/../a/b/../b/c/f",
        ] {
            assert_eq!(
                resolve(&base, Path::new(name), &mount).unwrap(),
                base.join(name).canonicalize().unwrap(),
                "{name}"
            );
        }
        for name in ["loop1", "dangling", "a/b/c/f/x", "missing"] {
            let ours = resolve(&base, Path::new(name), &mount).unwrap_err();
            let std = base.join(name).canonicalize().unwrap_err();
            assert_eq!(
                ours.raw_os_error(),
                std.raw_os_error(),
                "{name}: {ours} / {std}"
            );
        }
    }

    #[test]
    fn a_path_that_reaches_the_mount_is_refused_before_anything_beneath_it_is_looked_at() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        let mount = base.join("mnt");
        std::fs::create_dir_all(base.join("ds")).unwrap();
        // Nothing is there: a lookup beneath the mount would fail with
        // NotFound, not name the mount.
        symlink(mount.join("ds/a/f"), base.join("ds/direct")).unwrap();
        symlink("../mnt", base.join("ds/to-mount")).unwrap();
        symlink("to-mount/ds/x", base.join("ds/through")).unwrap();
        symlink("../via", base.join("ds/chain")).unwrap();
        symlink("mnt/ds", base.join("via")).unwrap();
        for name in ["direct", "to-mount", "through", "chain"] {
            let e = resolve(&base.join("ds"), Path::new(name), &mount).unwrap_err();
            assert!(into_mount(&e), "{name}: {e}");
            assert!(
                e.to_string().contains("inside the stage's own mount"),
                "{e}"
            );
        }
    }
}
