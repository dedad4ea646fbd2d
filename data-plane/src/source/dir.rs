//! The local-directory source: a canonical root, its walked listing, and
//! the path confinement that keeps every read beneath it.

use std::fs::{DirEntry, FileType, ReadDir};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use sluice_proto::fd_limit;

use super::fence::{self, IntoMount, into_mount};
use super::{Pinned, changed};
use crate::chunk::{Buffer, Chunk};
use crate::entry::{FileEntry, Owner, Walked};
use crate::protocol::{ErrorCode, ProtocolError};
use crate::storage::{
    direct_unsupported, io_error, open_regular_as_is, read_range_of, read_whole, with_descriptor,
};

/// A directory of sample files.
#[derive(Debug)]
pub struct DirSource {
    /// The root as configured (absolute): a symlink there is followed
    /// again at every listing.
    given: PathBuf,
    /// Where it resolved at the last listing: what reads are confined to.
    root: RwLock<Arc<PathBuf>>,
    /// The device the root was on at the last listing (0: not listed yet).
    device: AtomicU64,
    /// The mount it was on then (0: not listed yet, or not known).
    mount: AtomicU64,
    /// Prefetch with `O_DIRECT`; cleared when the file system refuses it.
    direct: AtomicBool,
    /// The stage's own mount (canonical), which symlinks are not resolved
    /// into (see [`fence`]).
    own_mount: Option<PathBuf>,
}

impl DirSource {
    /// Checks that `dir` is a directory and remembers where it resolves.
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
            given: std::path::absolute(dir)?,
            root: RwLock::new(Arc::new(root)),
            device: AtomicU64::new(0),
            mount: AtomicU64::new(0),
            direct: AtomicBool::new(direct),
            own_mount: None,
        })
    }

    /// Resolves no symlink into `mount` (canonical), the stage's own mount
    /// directory: one that leads there is left out of the listing, and a
    /// read through it is refused.
    #[must_use]
    pub fn beside_mount(mut self, mount: Option<PathBuf>) -> Self {
        self.own_mount = mount;
        self
    }

    /// `base` (canonical) joined with `rest`, its symlinks resolved, none
    /// into the stage's own mount. Blocking.
    fn canonical(&self, base: &Path, rest: &Path) -> io::Result<PathBuf> {
        match &self.own_mount {
            Some(mount) => fence::resolve(base, rest, mount),
            None => base.join(rest).canonicalize(),
        }
    }

    /// Where the root resolved at the last listing.
    pub fn root(&self) -> Arc<PathBuf> {
        Arc::clone(&self.root.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Resolves the configured root again: a root that is a symlink
    /// swapped to a new version of the data set (`ln -sfn v2 current.tmp
    /// && mv -T current.tmp current`, the usual way to publish one) is
    /// read from where it points now. Where it cannot be resolved (a link
    /// to a version not there), the listing fails naming the configured
    /// root and where it led before (not the old target alone).
    fn resolve_root(&self) -> io::Result<Arc<PathBuf>> {
        let now = self.canonical(Path::new("/"), &self.given).map_err(|e| {
            let last = self.root();
            let note = if *last == self.given {
                String::new()
            } else {
                format!(" (it led to {} before)", last.display())
            };
            io::Error::new(e.kind(), format!("{}: {e}{note}", self.given.display()))
        })?;
        let mut root = self.root.write().unwrap_or_else(PoisonError::into_inner);
        if **root != now {
            tracing::info!(
                root = %self.given.display(),
                from = %root.display(),
                to = %now.display(),
                "the data set's root resolves to another directory now: listing and reading it there"
            );
            *root = Arc::new(now);
        }
        Ok(Arc::clone(&root))
    }

    /// Walks the root, leaving out with one warning the entries that cannot
    /// be examined, unreadable subdirectories among them (not the root:
    /// that is an error). Blocking.
    pub fn list(&self) -> io::Result<Walked> {
        let root = self.resolve_root()?;
        let root = root.as_path();
        let at_root = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", root.display()));
        let entries = with_descriptor(|| std::fs::read_dir(root)).map_err(at_root)?;
        let mut walk = Walk {
            source: self,
            root,
            out: Walked::default(),
            ancestors: vec![root.to_path_buf()],
            unreadable: LeftOut::default(),
            outside: LeftOut::default(),
            into_mount: LeftOut::default(),
            broken: LeftOut::default(),
            not_utf8: LeftOut::default(),
        };
        let meta = std::fs::metadata(root).map_err(at_root)?;
        walk.out.dir_owners.push((String::new(), Owner::of(&meta)));
        walk.entries(entries, "")?;
        self.check_device(root, &meta, &walk.out)?;
        walk.unreadable.report(
            root,
            "left entries out of the listing that could not be examined",
        );
        walk.out.unexamined = walk.unreadable.count;
        walk.outside.report(
            root,
            "left symlinks out of the listing whose targets are outside the data set's directory \
             (only files beneath it are served): point the data set at a directory that holds \
             the targets too",
        );
        walk.into_mount.report(
            root,
            "left symlinks out of the listing whose targets are inside the stage's own mount \
             (the stage would read the data set through itself): point them at the storage",
        );
        walk.broken.report(
            root,
            "left symlinks out of the listing that lead nowhere (dangling, or a loop)",
        );
        walk.not_utf8.report(
            root,
            "left entries out of the listing whose names are not UTF-8 (sample names are UTF-8): rename them",
        );
        Ok(walk.out)
    }

    /// Compares the file system and the mount the root is on with the last
    /// listing's: a root that is a mount point (an NFS export, a
    /// Kubernetes volume, a bind mount of another directory of the same
    /// file system) whose volume went away shows the empty directory
    /// beneath it, which is refused as a listing (so the last one stands
    /// in, each sample saying why) rather than taken as a data set
    /// emptied; a root on another file system or mount with files is
    /// listed, with a warning.
    fn check_device(
        &self,
        root: &Path,
        meta: &std::fs::Metadata,
        walked: &Walked,
    ) -> io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let (now, now_mount) = (meta.dev(), crate::fs_room::mount_id(root).unwrap_or(0));
        let before = self.device.load(Ordering::Relaxed);
        let before_mount = self.mount.load(Ordering::Relaxed);
        let moved = if before != 0 && before != now {
            Some(format!(
                "on another file system than when it was last listed (device {now:#x}, was {before:#x})"
            ))
        } else if before_mount != 0 && now_mount != 0 && before_mount != now_mount {
            Some(format!(
                "on another mount than when it was last listed (mount {now_mount}, was {before_mount})"
            ))
        } else {
            None
        };
        if let Some(moved) = moved {
            if walked.files.is_empty() {
                return Err(io::Error::other(format!(
                    "{} is now an empty directory {moved}: the volume mounted there is not any more; mount it again",
                    root.display()
                )));
            }
            tracing::warn!(
                root = %root.display(),
                "the data set's root is {moved}: a volume was mounted there, or unmounted from it"
            );
        }
        self.device.store(now, Ordering::Relaxed);
        self.mount.store(now_mount, Ordering::Relaxed);
        Ok(())
    }

    /// Maps a checked name to a path beneath the root, refusing symlinks
    /// that leave it. Blocking (it resolves symlinks).
    pub fn resolve(&self, name: &str) -> Result<PathBuf, ProtocolError> {
        let root = self.root();
        let canonical = self.canonical(&root, Path::new(name)).map_err(|e| {
            match e.get_ref().and_then(|e| e.downcast_ref::<IntoMount>()) {
                Some(into) => ProtocolError::new(
                    ErrorCode::ForbiddenPath,
                    format!("`{name}` is not served through a symlink: {into}"),
                ),
                None => io_error(name, &e),
            }
        })?;
        if !canonical.starts_with(root.as_path()) {
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
        let joined = self.root().join(name);
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

    /// The version and size the listed file `name` has now (a `stat`;
    /// nothing is read, so it is not resolved and checked as a read is).
    pub fn version(&self, name: &str) -> io::Result<(u64, u64)> {
        let meta = std::fs::metadata(self.root().join(name))?;
        Ok((file_version(&meta), meta.len()))
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

    /// Opens `name` as a reader's open of it would, pinning the file it
    /// is now: later ranges read with the pin read that file (see
    /// [`Pinned`]). Blocking.
    pub fn open_pinned(&self, name: &str) -> Result<Pinned, ProtocolError> {
        let (file, meta) = match self.open_beneath(name) {
            Some(opened) => opened,
            None => {
                let path = self.resolve(name)?;
                open_regular_as_is(&path).map_err(|e| io_error(name, &e))?
            }
        };
        Ok(Pinned::file(file_version(&meta), meta.len(), file))
    }

    /// Opens `name` in one step when its path beneath the root has no
    /// symlink and no `..` (it cannot leave the root then), and the
    /// stage's own mount is not beneath the root (a plain path could reach
    /// it); `None` otherwise, or when it cannot be opened so, for
    /// [`DirSource::resolve`] to resolve and check it component by
    /// component (an `lstat` each, a tenth of the mount's CPU for each
    /// open of a file it keeps the pages of). Blocking.
    fn open_beneath(&self, name: &str) -> Option<(std::fs::File, std::fs::Metadata)> {
        let root = self.root();
        if name.split('/').any(|part| part == "..")
            || self
                .own_mount
                .as_ref()
                .is_some_and(|mount| mount.starts_with(root.as_path()))
        {
            return None;
        }
        crate::plain_open::open_plain(&root.join(name))
    }

    /// Reads a byte range of `name`. Blocking.
    pub fn read_range(
        &self,
        name: &str,
        offset: u64,
        length: u64,
        pin: Option<&Pinned>,
    ) -> Result<(Chunk, Pinned), ProtocolError> {
        let pinned = match pin.filter(|p| p.held_file().is_some()) {
            Some(pinned) => pinned.clone(),
            None => {
                let now = self.open_pinned(name)?;
                if pin.is_some_and(|p| !p.same(&now)) {
                    return Err(changed(name));
                }
                now
            }
        };
        let file = pinned.held_file().expect("a local file's pin holds it");
        let chunk =
            read_range_of(file, pinned.size, offset, length).map_err(|e| io_error(name, &e))?;
        Ok((chunk, pinned))
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
                        tracing::warn!(root = %self.root().display(), "the file system refuses O_DIRECT: prefetching through the page cache");
                    }
                }
                other => return other,
            }
        }
        read_whole(path, false, nofollow, listed, alloc)
    }
}

/// A file's version: its modification time, which file it is and when
/// its inode last changed (with its size, which the entry holds beside
/// it, the identity of what was read). The device and inode tell apart
/// files of one name, size and time in two versions of a data set: a
/// volume mounted again over the root with a new version whose times are
/// the same (an image or archive that sets them all alike), or two
/// versions written within one tick of the clock; by time and size alone
/// the node cache served the old bytes. The change time, which no program
/// can set, tells apart what those cannot: a new volume that numbers its
/// files as the old one did (a fresh tmpfs filled by `cp -a`), and a file
/// rewritten in place whose time was set back (`touch -r`). A file whose
/// owner or mode changes, or that is linked again, is another version
/// too: read once more, never answered with bytes it might not have.
fn file_version(meta: &std::fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut which = crate::entry::Fnv64::new();
    which.write(&meta.dev().to_le_bytes());
    which.write(&meta.ino().to_le_bytes());
    which.write(&meta.ctime().to_le_bytes());
    which.write(&meta.ctime_nsec().to_le_bytes());
    mtime_ns(meta) as u64 ^ which.0
}

/// A file's modification time in nanoseconds since the epoch.
/// The file's modification time in nanoseconds since 1970, negative before
/// it (archives keep such dates: they were shown as 1970), saturated at
/// the years 1677 and 2262.
fn mtime_ns(meta: &std::fs::Metadata) -> i64 {
    use std::os::unix::fs::MetadataExt;
    let ns = i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec());
    ns.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

/// A walk of a root: what it has listed so far, and the directories on the
/// path it is in (canonical, the root first), which it does not enter
/// again: a symlink to one of them is a cycle.
struct Walk<'a> {
    source: &'a DirSource,
    root: &'a Path,
    out: Walked,
    ancestors: Vec<PathBuf>,
    /// Entries that could not be examined (a file whose directory may be
    /// read but not searched, say); entries that vanished while the walk
    /// ran are left out silently.
    unreadable: LeftOut,
    /// Symlinks whose targets leave the root.
    outside: LeftOut,
    /// Symlinks that lead into the stage's own mount.
    into_mount: LeftOut,
    /// Symlinks that dangle or loop.
    broken: LeftOut,
    /// Entries whose names are not UTF-8 (a directory's tree with it).
    not_utf8: LeftOut,
}

/// Entries a walk left out for one reason, reported once per listing:
/// how many, and the first with what it says of it.
#[derive(Default)]
struct LeftOut {
    count: usize,
    first: Option<(PathBuf, String)>,
}

impl LeftOut {
    fn note(&mut self, path: PathBuf, why: impl FnOnce() -> String) {
        self.count += 1;
        if self.first.is_none() {
            self.first = Some((path, why()));
        }
    }

    fn report(&self, root: &Path, what: &str) {
        if let Some((path, why)) = &self.first {
            tracing::warn!(
                root = %root.display(),
                skipped = self.count,
                first = %path.display(),
                detail = %why,
                "{what}"
            );
        }
    }
}

impl Walk<'_> {
    /// Collects the regular files among `entries`, those of the last of
    /// the ancestors, named under `prefix`. Symlinks are followed when
    /// their target stays beneath the root and is not an ancestor; a
    /// directory reached both by its own name and through a symlink is
    /// listed under both names, as `os.walk(followlinks=True)` does.
    fn entries(&mut self, entries: ReadDir, prefix: &str) -> io::Result<()> {
        for entry in entries {
            let entry = entry?;
            let Some(file_name) = entry.file_name().to_str().map(str::to_owned) else {
                let kind = match entry.file_type() {
                    Ok(t) if t.is_dir() => "a directory: its whole tree is left out",
                    _ => "left out",
                };
                self.not_utf8.note(entry.path(), || kind.to_owned());
                continue;
            };
            let name = if prefix.is_empty() {
                file_name
            } else {
                format!("{prefix}/{file_name}")
            };
            // One entry that cannot be examined (or that went while the
            // walk ran) is left out, not the data set failed; a stage out
            // of descriptors fails the listing (the last one stands in):
            // a subtree left out for it would be a silent gap.
            match self.entry(&entry, name) {
                Err(error) if fd_limit::exhausted(&error) => return Err(error),
                Err(error) if error.kind() != io::ErrorKind::NotFound => {
                    self.unreadable.note(entry.path(), || error.to_string());
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Lists one entry of a directory as `name`: a file, or a directory's
    /// files.
    fn entry(&mut self, entry: &DirEntry, name: String) -> io::Result<()> {
        let Some((file_type, target, through)) = self.follow(entry)? else {
            return Ok(());
        };
        if file_type.is_dir() {
            self.subdir(target, name, &through)?;
        } else if file_type.is_file() {
            let meta = std::fs::metadata(&target)?;
            self.out.files.push(FileEntry {
                owner: Some(Owner::of(&meta).behind(&through)),
                mtime_ns: mtime_ns(&meta),
                ..FileEntry::new(name, meta.len(), file_version(&meta))
            });
        }
        Ok(())
    }

    /// Returns the type of `entry`, the canonical path to read it by (its
    /// own, its directory's being canonical, or a symlink's target), and
    /// the owners of the directories a symlink's target is beneath within
    /// the root (none for an entry that is not a symlink); `None` (noted
    /// for the listing's warnings) for a symlink that dangles, loops or
    /// leaves the root.
    fn follow(&mut self, entry: &DirEntry) -> io::Result<Option<(FileType, PathBuf, Vec<Owner>)>> {
        let path = entry.path();
        let file_type = entry.file_type()?;
        if !file_type.is_symlink() {
            return Ok(Some((file_type, path, Vec::new())));
        }
        let parent = path.parent().unwrap_or(self.root);
        let resolved = match self.source.canonical(parent, Path::new(&entry.file_name())) {
            Ok(resolved) => resolved,
            Err(error) if into_mount(&error) => {
                self.into_mount.note(path, || error.to_string());
                return Ok(None);
            }
            Err(error) => {
                self.broken.note(path, || error.to_string());
                return Ok(None);
            }
        };
        if !resolved.starts_with(self.root) {
            self.outside
                .note(path, || format!("-> {}", resolved.display()));
            return Ok(None);
        }
        let file_type = std::fs::metadata(&resolved)?.file_type();
        let mut through = Vec::new();
        for dir in resolved.ancestors().skip(1) {
            if !dir.starts_with(self.root) || dir == self.root {
                break;
            }
            through.push(Owner::of(&std::fs::metadata(dir)?));
        }
        Ok(Some((file_type, resolved, through)))
    }

    /// Walks the subdirectory `dir` (canonical) listed as `name`, recording
    /// it when nothing is listed beneath it. Skips an ancestor (a cycle);
    /// one that cannot be read is an error its caller leaves out (see
    /// [`Walk::unreadable`]).
    fn subdir(&mut self, dir: PathBuf, name: String, through: &[Owner]) -> io::Result<()> {
        if self.ancestors.contains(&dir) {
            return Ok(());
        }
        let entries = with_descriptor(|| std::fs::read_dir(&dir))?;
        if let Ok(meta) = std::fs::metadata(&dir) {
            let owner = Owner::of(&meta).behind(through);
            self.out.dir_owners.push((name.clone(), owner));
        }
        let before = (self.out.files.len(), self.out.empty_dirs.len());
        self.ancestors.push(dir.clone());
        let walked = self.entries(entries, &name);
        self.ancestors.pop();
        walked?;
        if (self.out.files.len(), self.out.empty_dirs.len()) == before {
            self.out.empty_dirs.push(name);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn listed(root: &Path) -> Vec<String> {
        let walked = DirSource::open("d", root, false).unwrap().list().unwrap();
        let mut names: Vec<String> = walked.files.into_iter().map(|f| f.name).collect();
        names.sort();
        names
    }

    #[test]
    fn symlinked_directories_are_listed_beside_their_targets_and_cycles_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("realdir")).unwrap();
        std::fs::create_dir_all(root.join("other")).unwrap();
        std::fs::write(root.join("realdir/file"), b"1").unwrap();
        std::fs::write(root.join("other/x"), b"2").unwrap();
        // Whichever of `alias` and `realdir` the directory order gives
        // first, both are listed.
        symlink("realdir", root.join("alias")).unwrap();
        symlink("../other", root.join("realdir/side")).unwrap();
        // Cycles: to the directory itself, to the root, and back to
        // `realdir` from beneath it (`realdir/side/back`).
        symlink(".", root.join("realdir/loop")).unwrap();
        symlink("..", root.join("realdir/up")).unwrap();
        symlink("../realdir", root.join("other/back")).unwrap();
        assert_eq!(
            listed(&root),
            [
                "alias/file",
                "alias/side/x",
                "other/back/file",
                "other/x",
                "realdir/file",
                "realdir/side/x",
            ]
        );
    }

    #[test]
    fn a_subdirectory_that_cannot_be_read_is_skipped() {
        // Root reads a directory whatever its mode, so the unreadable one
        // here lies past PATH_MAX, where opening it fails (ENAMETOOLONG)
        // for root too. It is built from the bottom up by renames of
        // short paths.
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("kept.bin"), b"1").unwrap();
        let (chain, next) = (dir.path().join("chain"), dir.path().join("next"));
        std::fs::create_dir(&chain).unwrap();
        for _ in 0..24 {
            std::fs::create_dir(&next).unwrap();
            std::fs::rename(&chain, next.join("d".repeat(200))).unwrap();
            std::fs::rename(&next, &chain).unwrap();
        }
        std::fs::rename(&chain, root.join("deep")).unwrap();
        assert_eq!(listed(&root), ["kept.bin"]);
    }

    #[test]
    fn names_that_are_not_utf8_are_left_out_with_their_trees() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let odd = std::ffi::OsStr::from_bytes(b"caf\xe9");
        std::fs::create_dir_all(root.join("ok")).unwrap();
        std::fs::create_dir_all(root.join(odd)).unwrap();
        std::fs::write(root.join("ok/a"), b"1").unwrap();
        std::fs::write(root.join("ok").join(odd), b"2").unwrap();
        std::fs::write(root.join(odd).join("b"), b"3").unwrap();
        assert_eq!(listed(&root), ["ok/a"]);
    }

    #[test]
    fn a_root_that_is_a_symlink_follows_it_when_it_is_swapped() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        for (version, names) in [("v1", &["a", "b"][..]), ("v2", &["a", "c"][..])] {
            let root = dir.path().join(version);
            std::fs::create_dir(&root).unwrap();
            for name in names {
                std::fs::write(root.join(name), format!("{version}/{name}")).unwrap();
            }
        }
        let current = dir.path().join("current");
        symlink("v1", &current).unwrap();
        let source = DirSource::open("d", &current, false).unwrap();
        let read = |name: &str| {
            let chunk = source.read_listed(name, 5, &Buffer::heap).unwrap();
            String::from_utf8(chunk.to_vec()).unwrap()
        };
        let names = |w: Walked| {
            let mut names: Vec<_> = w.files.into_iter().map(|f| f.name).collect();
            names.sort();
            names
        };
        assert_eq!(names(source.list().unwrap()), ["a", "b"]);
        assert_eq!(read("a"), "v1/a");
        // Published as a new version is: a new link renamed over the old.
        let next = dir.path().join("current.tmp");
        symlink("v2", &next).unwrap();
        std::fs::rename(&next, &current).unwrap();
        assert_eq!(names(source.list().unwrap()), ["a", "c"]);
        assert_eq!((read("a"), read("c")), ("v2/a".into(), "v2/c".into()));
        // The old version cleaned up: nothing of it is needed.
        std::fs::remove_dir_all(dir.path().join("v1")).unwrap();
        assert_eq!(names(source.list().unwrap()), ["a", "c"]);
        // Swapped to a version that is not there: the error names the link.
        symlink("v9", &next).unwrap();
        std::fs::rename(&next, &current).unwrap();
        let e = source.list().unwrap_err().to_string();
        assert!(e.starts_with(&current.display().to_string()), "{e}");
        assert!(e.contains("v2 before"), "{e}");
        assert_eq!(
            source.resolve("c").unwrap(),
            dir.path().join("v2/c").canonicalize().unwrap()
        );
    }

    #[test]
    fn a_file_replaced_by_one_of_the_same_size_and_time_is_another_version() {
        let dir = tempfile::tempdir().unwrap();
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        let write = |name: &str, bytes: &[u8]| {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            std::fs::File::options()
                .write(true)
                .open(&path)
                .unwrap()
                .set_modified(at)
                .unwrap();
        };
        let source = DirSource::open("d", dir.path(), false).unwrap();
        write("a", b"old");
        let before = source.list().unwrap().files.remove(0);
        // A new version put in its place (as a volume mounted again with
        // an image's files is), with the same size and time.
        write("a.new", b"new");
        std::fs::rename(dir.path().join("a.new"), dir.path().join("a")).unwrap();
        let after = source.list().unwrap().files.remove(0);
        assert_eq!((before.size, before.mtime_ns), (after.size, after.mtime_ns));
        assert_ne!(before.version, after.version);
        assert_eq!(source.version("a").unwrap(), (after.version, 3));
    }

    #[test]
    fn a_file_rewritten_in_place_with_its_time_set_back_is_another_version() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a");
        std::fs::write(&path, b"old").unwrap();
        let at = std::fs::metadata(&path).unwrap().modified().unwrap();
        let source = DirSource::open("d", dir.path(), false).unwrap();
        let before = source.list().unwrap().files.remove(0);
        // The change time moves by the kernel's clock tick (a few ms).
        std::thread::sleep(std::time::Duration::from_millis(30));
        // Same inode, same size, the time put back as `touch -r` does.
        let mut file = std::fs::File::options().write(true).open(&path).unwrap();
        file.write_all(b"new").unwrap();
        file.set_modified(at).unwrap();
        drop(file);
        let after = source.list().unwrap().files.remove(0);
        assert_eq!((before.size, before.mtime_ns), (after.size, after.mtime_ns));
        assert_ne!(before.version, after.version);
        assert_eq!(source.version("a").unwrap(), (after.version, 3));
    }

    #[test]
    fn a_root_whose_volume_went_away_is_not_listed_empty() {
        use std::os::unix::fs::{MetadataExt, symlink};
        // The root moves to another file system as an unmounted volume's
        // does: here by a symlink swapped to a directory in /dev/shm.
        let dir = tempfile::tempdir().unwrap();
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let device = |p: &Path| std::fs::metadata(p).unwrap().dev();
        assert_ne!(
            device(dir.path()),
            device(shm.path()),
            "this test needs /dev/shm on another file system than the temp directory"
        );
        let swap = |to: &Path| {
            let next = dir.path().join("next");
            symlink(to, &next).unwrap();
            std::fs::rename(&next, dir.path().join("root")).unwrap();
        };
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("a"), b"1").unwrap();
        swap(&data);
        let source = DirSource::open("d", &dir.path().join("root"), false).unwrap();
        assert_eq!(source.list().unwrap().files.len(), 1);
        let empty = shm.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        swap(&empty);
        let e = source.list().unwrap_err();
        assert!(
            e.to_string()
                .contains("is now an empty directory on another file system"),
            "{e}"
        );
        // Files there: listed (with a warning), and from then on that file
        // system is the root's.
        std::fs::write(empty.join("b"), b"2").unwrap();
        assert_eq!(source.list().unwrap().files.len(), 1);
        std::fs::remove_file(empty.join("b")).unwrap();
        assert!(
            source.list().unwrap().files.is_empty(),
            "emptied in place: listed empty"
        );
    }

    #[test]
    fn a_root_whose_bind_mount_went_away_is_not_listed_empty() {
        use std::process::Command;
        if !std::fs::metadata("/proc/self")
            .is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "this test bind-mounts a directory: run it as root"
            );
            eprintln!("skipped: bind-mounting a directory needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (data, root) = (dir.path().join("data"), dir.path().join("root"));
        std::fs::create_dir(&data).unwrap();
        std::fs::create_dir(&root).unwrap();
        std::fs::write(data.join("a"), b"1").unwrap();
        let run = |args: &[&std::ffi::OsStr]| {
            let status = Command::new(args[0]).args(&args[1..]).status().unwrap();
            assert!(status.success(), "{args:?}: {status}");
        };
        run(&[
            "mount".as_ref(),
            "--bind".as_ref(),
            data.as_os_str(),
            root.as_os_str(),
        ]);
        let source = DirSource::open("d", &root, false).unwrap();
        let listed = source.list();
        // Unmounted: the same file system, the empty directory beneath.
        run(&["umount".as_ref(), root.as_os_str()]);
        assert_eq!(listed.unwrap().files.len(), 1);
        let e = source.list().unwrap_err();
        assert!(
            e.to_string()
                .contains("is now an empty directory on another mount"),
            "{e}"
        );
    }

    #[test]
    fn an_unreadable_root_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let source = DirSource::open("d", dir.path(), false).unwrap();
        std::fs::remove_dir(dir.path()).unwrap();
        let e = source.list().unwrap_err();
        assert!(
            e.to_string().contains(&dir.path().display().to_string()),
            "{e}"
        );
    }

    #[test]
    fn a_pinned_open_takes_one_step_on_a_plain_path_and_resolves_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        let (root, mount) = (base.join("root"), base.join("mnt"));
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::create_dir_all(base.join("outside")).unwrap();
        std::fs::create_dir_all(&mount).unwrap();
        std::fs::write(root.join("sub/f"), b"plain").unwrap();
        std::fs::write(base.join("outside/secret"), b"no").unwrap();
        symlink("sub", root.join("alias")).unwrap();
        symlink("../outside", root.join("escape")).unwrap();
        symlink("../mnt", root.join("into")).unwrap();
        let fifo = root.join("fifo");
        assert!(
            std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap()
                .success()
        );
        let source = DirSource::open("d", &root, false)
            .unwrap()
            .beside_mount(Some(mount.clone()));
        // A plain path opens in one step, and a symlink on the way is not
        // followed by it.
        assert!(crate::plain_open::open_plain(&root.join("sub/f")).is_some());
        assert!(crate::plain_open::open_plain(&root.join("alias/f")).is_none());
        assert!(crate::plain_open::open_plain(&fifo).is_none());
        // Every open pins the file, whichever way it was opened.
        for name in ["sub/f", "alias/f", "sub/../sub/f"] {
            let pin = source.open_pinned(name).unwrap();
            assert_eq!(pin.size, 5, "{name}");
        }
        // Paths that leave the root, or reach the mount, or are no
        // regular file, are refused as before.
        let escape = source.open_pinned("escape/secret").unwrap_err();
        assert_eq!(escape.code, ErrorCode::ForbiddenPath, "{}", escape.message);
        let into = source.open_pinned("into/x").unwrap_err();
        assert!(
            into.message.contains("inside the stage's own mount"),
            "{}",
            into.message
        );
        for name in ["fifo", "sub", "missing", "../outside/secret"] {
            assert!(source.open_pinned(name).is_err(), "{name}");
        }
        // A mount beneath the root: every path is resolved and checked.
        std::fs::create_dir_all(root.join("m")).unwrap();
        let nested = DirSource::open("d", &root, false)
            .unwrap()
            .beside_mount(Some(root.join("m")));
        assert!(nested.open_beneath("sub/f").is_none());
        assert_eq!(nested.open_pinned("sub/f").unwrap().size, 5);
    }
}
