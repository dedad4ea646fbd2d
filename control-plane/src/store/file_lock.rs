//! [`FileLock`]: the SQLite store's claim to its database file.
//!
//! SQLite has no leader lease: two controllers on one file would both
//! lead, push conflicting settings and interleave their writes. So the
//! store takes an exclusive `flock` on `<database>.lock` beside the file
//! before it opens the database, and holds it until the store is closed or
//! dropped (the kernel frees it when the process dies, even by SIGKILL).
//! The holder writes its pid into the file so that the refused controller
//! can say who holds it. The lock file is left behind on exit: removing it
//! would let a starting controller lock a file the next one no longer
//! sees. Once SQLite has opened (or created) the database, the store also
//! locks the database file itself ([`FileLock::hold_database`]): a hard
//! link to a store in use names another lock file, but the same file.
//! (SQLite's own locks are `fcntl` locks, which `flock` does not touch.)

use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::StoreError;

/// An exclusive lock on a SQLite database's lock file, held until
/// [`FileLock::release`] or drop.
#[derive(Debug)]
pub(super) struct FileLock {
    /// The lock file, then the database file.
    files: Mutex<Vec<File>>,
}

impl FileLock {
    /// Locks `<database>.lock`, creating it if absent. Fails with
    /// [`StoreError::InUse`] when another store (in this process or
    /// another) holds it.
    pub(super) fn acquire(database: &Path) -> Result<Self, StoreError> {
        let path = lock_path(database);
        let lock_err = |source| StoreError::Lock {
            path: path.clone(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(lock_err)?;
        try_lock(&file, database, || holder(&path), lock_err)?;
        // Best effort: the pid only improves the refusal's message.
        let _ = file
            .set_len(0)
            .and_then(|()| writeln!(file, "{}", std::process::id()));
        Ok(Self {
            files: Mutex::new(vec![file]),
        })
    }

    /// Locks the database file itself, which must exist by now (read-only
    /// is enough for `flock`). Fails with [`StoreError::InUse`] when
    /// another store holds it under another name (a hard link).
    pub(super) fn hold_database(&self, database: &Path) -> Result<(), StoreError> {
        let lock_err = |source| StoreError::Lock {
            path: database.to_owned(),
            source,
        };
        let file = File::open(database).map_err(lock_err)?;
        try_lock(&file, database, || None, lock_err)?;
        self.files().push(file);
        Ok(())
    }

    /// Gives the locks up now (closing the files releases them).
    pub(super) fn release(&self) {
        self.files().clear();
    }

    fn files(&self) -> std::sync::MutexGuard<'_, Vec<File>> {
        self.files
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Takes `file`'s exclusive lock, or says why not: [`StoreError::InUse`]
/// (with the holder's pid, when `holder` knows it) when another store holds
/// it, else the lock call's error as `lock_err` words it.
fn try_lock(
    file: &File,
    database: &Path,
    holder: impl FnOnce() -> Option<u32>,
    lock_err: impl FnOnce(std::io::Error) -> StoreError,
) -> Result<(), StoreError> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(TryLockError::WouldBlock) => Err(StoreError::InUse {
            database: database.to_owned(),
            pid: holder(),
        }),
        Err(TryLockError::Error(e)) => Err(lock_err(e)),
    }
}

/// Returns `<database>.lock`, beside the file the path names once
/// symlinks are resolved (a symlink to a store in use is that store).
fn lock_path(database: &Path) -> PathBuf {
    let resolved = database.canonicalize().unwrap_or_else(|_| {
        // Not created yet: its directory resolved, its name as given.
        match (database.parent(), database.file_name()) {
            (Some(dir), Some(file)) => {
                let dir = if dir.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    dir
                };
                dir.canonicalize()
                    .map_or_else(|_| database.to_owned(), |d| d.join(file))
            }
            _ => database.to_owned(),
        }
    });
    let mut name = resolved.into_os_string();
    name.push(".lock");
    PathBuf::from(name)
}

/// Returns the pid the holder wrote, if it did already.
fn holder(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_with_the_holders_pid_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let first = FileLock::acquire(&db).unwrap();
        assert!(dir.path().join("s.db.lock").exists());

        let err = FileLock::acquire(&db).unwrap_err();
        let StoreError::InUse { database, pid } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(database, &db);
        assert_eq!(*pid, Some(std::process::id()));
        assert!(
            err.to_string().starts_with(&format!(
                "the store {} is in use by another controller (pid {}): ",
                db.display(),
                std::process::id()
            )),
            "{err}"
        );

        // A symlink to the store is the store.
        std::fs::write(&db, b"").unwrap();
        let link = dir.path().join("link.db");
        std::os::unix::fs::symlink(&db, &link).unwrap();
        assert!(matches!(
            FileLock::acquire(&link),
            Err(StoreError::InUse { .. })
        ));

        first.release();
        let again = FileLock::acquire(&db).unwrap();
        drop(again);
        FileLock::acquire(&db).unwrap();
    }

    #[test]
    fn a_hard_link_to_a_held_database_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        std::fs::write(&db, b"").unwrap();
        let first = FileLock::acquire(&db).unwrap();
        first.hold_database(&db).unwrap();

        let link = dir.path().join("other.db");
        std::fs::hard_link(&db, &link).unwrap();
        let second = FileLock::acquire(&link).unwrap();
        assert!(matches!(
            second.hold_database(&link),
            Err(StoreError::InUse { pid: None, .. })
        ));

        first.release();
        second.hold_database(&link).unwrap();
    }
}
