//! Datasets: named root directories, their sorted file listings, and the path
//! confinement that keeps every read beneath a configured root.

use std::collections::HashMap;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::chunk::{Buffer, Chunk};
use crate::protocol::{ErrorCode, ProtocolError};
use crate::storage::{direct_unsupported, io_error, read_whole};
use crate::sync::lock;

/// How long a listing is reused before `OPEN` walks the root again.
const LISTING_TTL: Duration = Duration::from_secs(5);
/// Names longer than this are refused before touching the file system.
const MAX_NAME_BYTES: usize = 4096;

/// One file of a dataset, named relative to its root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
}

/// A dataset's files sorted by name, as `LIST` pages them.
#[derive(Debug)]
pub struct Listing {
    pub files: Vec<FileEntry>,
    pub total_bytes: u64,
    pub digest: u64,
    index: HashMap<String, u32>,
}

impl Listing {
    pub(crate) fn new(mut files: Vec<FileEntry>) -> Self {
        files.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        let mut digest = Fnv64::new();
        for f in &files {
            digest.write(f.name.as_bytes());
            digest.write(&[0]);
            digest.write(&f.size.to_be_bytes());
        }
        let index = files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.name.clone(), i as u32))
            .collect();
        Self {
            total_bytes: files.iter().map(|f| f.size).sum(),
            digest: digest.0,
            files,
            index,
        }
    }

    /// Returns the index of the file called `name`.
    pub fn position(&self, name: &str) -> Option<u32> {
        self.index.get(name).copied()
    }

    pub fn len(&self) -> u32 {
        self.files.len() as u32
    }
}

/// FNV-1a, 64 bits: the listing digest that `OPENED` reports, and plan
/// fingerprints.
pub(crate) struct Fnv64(pub u64);

impl Fnv64 {
    pub fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// A dataset the stage serves: a name and a canonical root directory.
#[derive(Debug)]
pub struct Dataset {
    pub name: String,
    root: PathBuf,
    cached: Mutex<Option<(Instant, Arc<Listing>)>>,
    /// Prefetch with `O_DIRECT`; cleared when the file system refuses it.
    direct: AtomicBool,
}

impl Dataset {
    /// Checks that `dir` is a directory and remembers its canonical path.
    pub fn new(name: &str, dir: &Path, direct: bool) -> io::Result<Self> {
        let root = dir.canonicalize().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("dataset `{name}` root {}: {e}", dir.display()),
            )
        })?;
        if !root.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("dataset `{name}` root {} is not a directory", dir.display()),
            ));
        }
        Ok(Self {
            name: name.to_owned(),
            root,
            cached: Mutex::new(None),
            direct: AtomicBool::new(direct),
        })
    }

    /// Returns the listing, walking the root again when the cached one is
    /// older than a few seconds. Blocking: call off the async runtime.
    pub fn listing(&self) -> io::Result<Arc<Listing>> {
        let mut cached = lock(&self.cached);
        if let Some((at, listing)) = cached.as_ref()
            && at.elapsed() < LISTING_TTL
        {
            return Ok(Arc::clone(listing));
        }
        let mut files = Vec::new();
        let mut visited = vec![self.root.clone()];
        walk(&self.root, &self.root, "", &mut files, &mut visited)?;
        let listing = Arc::new(Listing::new(files));
        *cached = Some((Instant::now(), Arc::clone(&listing)));
        Ok(listing)
    }

    /// Maps a trainer-supplied name to a path beneath the root, refusing
    /// absolute paths, `.`/`..`/empty components and symlinks that leave the
    /// root. Blocking (it resolves symlinks).
    pub fn resolve(&self, name: &str) -> Result<PathBuf, ProtocolError> {
        check_name(name)?;
        let joined = self.root.join(name);
        let canonical = joined.canonicalize().map_err(|e| io_error(name, &e))?;
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

    /// Reads the whole file `name` of the listing for prefetching into a
    /// buffer from `alloc`: direct I/O when enabled and supported, buffered
    /// otherwise. Blocking.
    ///
    /// Only names of the listing come here (plan entries), and the walk that
    /// made the listing followed only symlinks that stay beneath the root;
    /// so the file is opened by its joined path without resolving every
    /// component again (that cost a readlink per component per sample). The
    /// last component is opened with `O_NOFOLLOW`; a file that is a symlink
    /// there is resolved and checked as any trainer-supplied name is.
    pub fn read_whole(
        &self,
        name: &str,
        listed: u64,
        alloc: &dyn Fn(usize) -> Buffer,
    ) -> Result<Chunk, ProtocolError> {
        check_name(name)?;
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

    /// Reads whole the file `name` resolved to (`path`, from
    /// [`Dataset::resolve`]) into a buffer from `alloc`.
    pub fn read_resolved(
        &self,
        name: &str,
        path: &Path,
        alloc: &dyn Fn(usize) -> Buffer,
    ) -> Result<Chunk, ProtocolError> {
        self.read_path(path, None, alloc)
            .map_err(|e| io_error(name, &e))
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
                        tracing::warn!(dataset = %self.name, "the file system refuses O_DIRECT: prefetching through the page cache");
                    }
                }
                other => return other,
            }
        }
        read_whole(path, false, nofollow, listed, alloc)
    }

    /// Reads `length` bytes (or to the end) of `name` from `offset`. The
    /// stage reads through its jobs (`Job::read_now`, under the limiter);
    /// the tests read directly.
    #[cfg(test)]
    pub fn read(&self, name: &str, offset: u64, length: u64) -> Result<Chunk, ProtocolError> {
        let path = self.resolve(name)?;
        crate::storage::read_range(&path, offset, length).map_err(|e| io_error(name, &e))
    }
}

/// Checks the syntax of a file name before it touches the file system.
pub fn check_name(name: &str) -> Result<(), ProtocolError> {
    let forbidden = |why: &str| {
        Err(ProtocolError::new(
            ErrorCode::ForbiddenPath,
            format!(
                "`{name}` is refused: {why}; name a file relative to the dataset root, like `train/0001.jpg`"
            ),
        ))
    };
    if name.is_empty() {
        return forbidden("the name is empty");
    }
    if name.len() > MAX_NAME_BYTES {
        return forbidden("the name is longer than 4096 bytes");
    }
    if name.starts_with('/') {
        return forbidden("absolute paths are not served");
    }
    for part in name.split('/') {
        match part {
            "" => return forbidden("it has an empty path component"),
            "." | ".." => return forbidden("`.` and `..` components are not allowed"),
            _ => {}
        }
    }
    if Path::new(name)
        .components()
        .any(|c| !matches!(c, Component::Normal(_)))
    {
        return forbidden("it is not a plain relative path");
    }
    Ok(())
}

/// Collects the regular files beneath `dir`, following symlinks only when
/// their target stays beneath `root` and was not visited (no cycles).
fn walk(
    root: &Path,
    dir: &Path,
    prefix: &str,
    out: &mut Vec<FileEntry>,
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
            walk(root, &target, &name, out, visited)?;
        } else if file_type.is_file() {
            let size = std::fs::metadata(&target)?.len();
            out.push(FileEntry { name, size });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::TO_END;
    use std::os::unix::fs::symlink;

    fn fixture() -> (tempfile::TempDir, Dataset) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("train/a")).unwrap();
        std::fs::write(root.join("train/a/1.bin"), b"hello").unwrap();
        std::fs::write(root.join("top.bin"), b"0123456789").unwrap();
        std::fs::write(dir.path().join("secret"), b"outside").unwrap();
        symlink(dir.path().join("secret"), root.join("escape")).unwrap();
        symlink("train/a/1.bin", root.join("inside")).unwrap();
        symlink("..", root.join("train/up")).unwrap();
        let ds = Dataset::new("d", &root, true).unwrap();
        (dir, ds)
    }

    #[test]
    fn listing_is_sorted_and_confined() {
        let (_dir, ds) = fixture();
        let listing = ds.listing().unwrap();
        let names: Vec<&str> = listing.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["inside", "top.bin", "train/a/1.bin"]);
        assert_eq!(listing.total_bytes, 20);
        assert_eq!(listing.position("top.bin"), Some(1));
    }

    #[test]
    fn names_that_leave_the_root_are_refused() {
        let (_dir, ds) = fixture();
        for name in [
            "../secret",
            "/etc/passwd",
            "train/../../secret",
            "escape",
            "train/up/../secret",
            "",
            "a//b",
            "./top.bin",
        ] {
            let err = ds.read(name, 0, TO_END).unwrap_err();
            assert_eq!(err.code, ErrorCode::ForbiddenPath, "{name}: {err}");
            assert!(
                err.message.contains("refused") || err.message.contains("outside"),
                "{}",
                err.message
            );
        }
        assert_eq!(&*ds.read("inside", 0, TO_END).unwrap(), b"hello");
    }

    #[test]
    fn ranges_missing_files_and_directories() {
        let (_dir, ds) = fixture();
        assert_eq!(&*ds.read("top.bin", 3, 4).unwrap(), b"3456");
        assert_eq!(&*ds.read("top.bin", 8, TO_END).unwrap(), b"89");
        assert_eq!(&*ds.read("top.bin", 50, 4).unwrap(), b"");
        let missing = ds.read("nope.bin", 0, TO_END).unwrap_err();
        assert_eq!(missing.code, ErrorCode::NotFound);
        assert!(missing.message.contains("nope.bin"));
        let dir = ds.read("train", 0, TO_END).unwrap_err();
        assert_eq!(dir.code, ErrorCode::IoError);
        assert!(
            dir.message.contains("not a regular file"),
            "{}",
            dir.message
        );
    }

    #[test]
    fn digest_tracks_the_listing() {
        let a = Listing::new(vec![FileEntry {
            name: "a".into(),
            size: 1,
        }]);
        let b = Listing::new(vec![FileEntry {
            name: "a".into(),
            size: 2,
        }]);
        assert_ne!(a.digest, b.digest);
        // FNV-1a of "a", 0x00, 1u64 BE: the Python client's tests check the same value.
        assert_eq!(
            a.digest,
            Listing::new(vec![FileEntry {
                name: "a".into(),
                size: 1
            }])
            .digest
        );
    }
}
