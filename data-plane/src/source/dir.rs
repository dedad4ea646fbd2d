//! The local-directory source: a canonical root, its walked listing, and
//! the path confinement that keeps every read beneath it.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::UNIX_EPOCH;

use crate::chunk::{Buffer, Chunk};
use crate::entry::{FileEntry, Walked};
use crate::protocol::{ErrorCode, ProtocolError};
use crate::storage::{direct_unsupported, io_error, read_range, read_whole};

/// A directory of sample files.
#[derive(Debug)]
pub struct DirSource {
    root: PathBuf,
    /// Prefetch with `O_DIRECT`; cleared when the file system refuses it.
    direct: AtomicBool,
}

impl DirSource {
    /// Checks that `dir` is a directory and remembers its canonical path.
    pub fn open(dataset: &str, dir: &Path, direct: bool) -> io::Result<Self> {
        let root = dir.canonicalize().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("dataset `{dataset}` root {}: {e}", dir.display()),
            )
        })?;
        if !root.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "dataset `{dataset}` root {} is not a directory",
                    dir.display()
                ),
            ));
        }
        Ok(Self {
            root,
            direct: AtomicBool::new(direct),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Walks the root. Blocking.
    pub fn list(&self) -> io::Result<Walked> {
        let mut walked = Walked::default();
        let mut visited = vec![self.root.clone()];
        walk(&self.root, &self.root, "", &mut walked, &mut visited)?;
        Ok(walked)
    }

    /// Maps a checked name to a path beneath the root, refusing symlinks
    /// that leave it. Blocking (it resolves symlinks).
    pub fn resolve(&self, name: &str) -> Result<PathBuf, ProtocolError> {
        let canonical = self
            .root
            .join(name)
            .canonicalize()
            .map_err(|e| io_error(name, &e))?;
        if !canonical.starts_with(&self.root) {
            return Err(ProtocolError::new(
                ErrorCode::ForbiddenPath,
                format!(
                    "`{name}` resolves outside the dataset root through a symlink; only files beneath the root are served"
                ),
            ));
        }
        Ok(canonical)
    }

    /// Reads the listed file `name` whole for prefetching. Blocking.
    ///
    /// Only names of the listing come here (plan entries), and the walk that
    /// made the listing followed only symlinks that stay beneath the root;
    /// so the file is opened by its joined path without resolving every
    /// component again (that cost a readlink per component per sample). The
    /// last component is opened with `O_NOFOLLOW`; a file that is a symlink
    /// there is resolved and checked as any trainer-supplied name is.
    pub fn read_listed(
        &self,
        name: &str,
        listed: u64,
        alloc: &dyn Fn(usize) -> Buffer,
    ) -> Result<Chunk, ProtocolError> {
        let joined = self.root.join(name);
        match self.read_path(&joined, Some(listed), alloc) {
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                let path = self.resolve(name)?;
                self.read_path(&path, None, alloc)
            }
            other => other,
        }
        .map_err(|e| io_error(name, &e))
    }

    /// Resolves `name` and returns its size. Blocking.
    pub fn stat(&self, name: &str) -> Result<(PathBuf, u64), ProtocolError> {
        let path = self.resolve(name)?;
        let size = std::fs::metadata(&path).map_or(0, |m| m.len());
        Ok((path, size))
    }

    /// Reads whole the file `name` resolved to. Blocking.
    pub fn read_resolved(
        &self,
        name: &str,
        path: &Path,
        alloc: &dyn Fn(usize) -> Buffer,
    ) -> Result<Chunk, ProtocolError> {
        self.read_path(path, None, alloc)
            .map_err(|e| io_error(name, &e))
    }

    /// Reads a byte range of `name`. Blocking.
    pub fn read_range(&self, name: &str, offset: u64, length: u64) -> Result<Chunk, ProtocolError> {
        let path = self.resolve(name)?;
        read_range(&path, offset, length).map_err(|e| io_error(name, &e))
    }

    /// Reads the file at `path` whole, with direct I/O while the file system
    /// takes it: the listed file itself (`listed`: its size; the last
    /// component must not be a symlink), or a resolved path.
    fn read_path(
        &self,
        path: &Path,
        listed: Option<u64>,
        alloc: &dyn Fn(usize) -> Buffer,
    ) -> io::Result<Chunk> {
        let nofollow = listed.is_some();
        if self.direct.load(Ordering::Relaxed) {
            match read_whole(path, true, nofollow, listed, alloc) {
                Err(e) if direct_unsupported(&e) => {
                    if self.direct.swap(false, Ordering::Relaxed) {
                        tracing::warn!(root = %self.root.display(), "the file system refuses O_DIRECT: prefetching through the page cache");
                    }
                }
                other => return other,
            }
        }
        read_whole(path, false, nofollow, listed, alloc)
    }
}

/// A file's version: its modification time in nanoseconds (with its size,
/// which the entry holds beside it, the identity of what was read).
fn mtime_version(meta: &std::fs::Metadata) -> u64 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Collects the regular files beneath `dir`, following symlinks only when
/// their target stays beneath `root` and was not visited (no cycles).
fn walk(
    root: &Path,
    dir: &Path,
    prefix: &str,
    out: &mut Walked,
    visited: &mut Vec<PathBuf>,
) -> io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let Some(file_name) = entry.file_name().to_str().map(str::to_owned) else {
            tracing::warn!(dir = %dir.display(), "skipping a file whose name is not UTF-8");
            continue;
        };
        let name = if prefix.is_empty() {
            file_name
        } else {
            format!("{prefix}/{file_name}")
        };
        let path = entry.path();
        let mut file_type = entry.file_type()?;
        let mut target = path.clone();
        if file_type.is_symlink() {
            let Ok(resolved) = path.canonicalize() else {
                continue;
            };
            if !resolved.starts_with(root) {
                continue;
            }
            file_type = std::fs::metadata(&resolved)?.file_type();
            target = resolved;
        }
        if file_type.is_dir() {
            let canonical = target.canonicalize()?;
            if visited.contains(&canonical) {
                continue;
            }
            visited.push(canonical);
            let before = (out.files.len(), out.empty_dirs.len());
            walk(root, &target, &name, out, visited)?;
            if (out.files.len(), out.empty_dirs.len()) == before {
                out.empty_dirs.push(name);
            }
        } else if file_type.is_file() {
            let meta = std::fs::metadata(&target)?;
            out.files
                .push(FileEntry::new(name, meta.len(), mtime_version(&meta)));
        }
    }
    Ok(())
}
