//! What a listing is made of: one entry per sample, the syntax every
//! sample name must have, and the hash of listings and plans. A leaf
//! module: sources, datasets and the server all use it.

use std::path::{Component, Path};

use crate::protocol::{ErrorCode, ProtocolError};

/// Names longer than this are refused before touching the file system.
const MAX_NAME_BYTES: usize = 4096;

/// One sample of a dataset, named relative to its root (a file) or prefix
/// (an object). With the size, `version` is the identity of what was
/// listed: of a file, its modification time and which file it is (device
/// and inode); of an object, a hash of its ETag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
    pub version: u64,
    /// A local file's modification time in nanoseconds since 1970
    /// (before it: negative; 0 for an object).
    pub mtime_ns: i64,
    /// A local file's permissions and owner (an object has none).
    pub owner: Option<Owner>,
}

impl FileEntry {
    pub fn new(name: String, size: u64, version: u64) -> Self {
        Self {
            name,
            size,
            version,
            mtime_ns: 0,
            owner: None,
        }
    }
}

/// A local file's or directory's permission bits and owner, as listed:
/// the mount shows them (so the kernel checks readers against them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Owner {
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
}

impl Owner {
    pub fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            perm: (meta.mode() & 0o7777) as u16,
            uid: meta.uid(),
            gid: meta.gid(),
        }
    }

    /// This file's owner with the permission bits a reader keeps who
    /// reaches it through the directories `path` (a symlink's target's
    /// directories, which the mount does not show on the way to it): a
    /// class of the file (its owner, its group, the others) keeps its bits
    /// only if whoever is in that class may search every directory of
    /// `path` whichever of the directory's classes they are in, so nobody
    /// reads through a symlink what the directories above its target keep
    /// from them.
    pub fn behind(self, path: &[Owner]) -> Self {
        let search = |class: u16, dir: &Owner| dir.perm & class != 0;
        let (user, group, other) = (0o100, 0o010, 0o001);
        let mut perm = self.perm;
        for dir in path {
            let dir_owner_is_owner = dir.uid == self.uid;
            let dir_group_is_group = dir.gid == self.gid;
            // The file's owner is the directory's owner, or in its group or not.
            let owner = if dir_owner_is_owner {
                search(user, dir)
            } else {
                search(group, dir) && search(other, dir)
            };
            // The file's group members may own the directory, be in its
            // group (surely so when it is the same), or not.
            let grouped = (dir_owner_is_owner || search(user, dir))
                && search(group, dir)
                && (dir_group_is_group || search(other, dir));
            // Anyone else may own the directory or be in its group.
            let others = (dir_owner_is_owner || search(user, dir))
                && (dir_group_is_group || search(group, dir))
                && search(other, dir);
            for (keeps, bits) in [(owner, 0o700), (grouped, 0o070), (others, 0o007)] {
                if !keeps {
                    perm &= !bits;
                }
            }
        }
        Self { perm, ..self }
    }
}

/// What listing a source found: its samples, and the directories with
/// nothing listed beneath them (a local directory's empty ones; object
/// stores have none), which the mount shows as they are.
#[derive(Debug, Default)]
pub struct Walked {
    pub files: Vec<FileEntry>,
    pub empty_dirs: Vec<String>,
    /// A local data set's directories ("" its root) with their owners.
    pub dir_owners: Vec<(String, Owner)>,
    /// Entries left out because they could not be examined (an unreadable
    /// directory, an I/O error): what is beneath them is not known.
    pub unexamined: usize,
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

#[cfg(test)]
mod tests {
    use super::Owner;

    fn owner(perm: u16, uid: u32, gid: u32) -> Owner {
        Owner { perm, uid, gid }
    }

    #[test]
    fn a_file_behind_directories_keeps_what_every_class_may_search_for() {
        let file = owner(0o644, 1000, 100);
        assert_eq!(file.behind(&[]).perm, 0o644);
        assert_eq!(file.behind(&[owner(0o755, 0, 0)]).perm, 0o644);
        // The owner's private directory: only the owner gets through.
        assert_eq!(file.behind(&[owner(0o700, 1000, 100)]).perm, 0o600);
        // Its group's: the owner and the group, not the others.
        assert_eq!(file.behind(&[owner(0o750, 1000, 100)]).perm, 0o640);
        // Another user's private directory: nobody but root.
        assert_eq!(file.behind(&[owner(0o700, 0, 0)]).perm, 0);
        // Another group's directory open to its group only: whoever is in
        // a class of the file may or may not be in it, so nobody.
        assert_eq!(file.behind(&[owner(0o750, 0, 7)]).perm, 0);
        // Every directory on the way counts.
        let path = [
            owner(0o755, 0, 0),
            owner(0o711, 0, 0),
            owner(0o750, 1000, 100),
        ];
        assert_eq!(file.behind(&path).perm, 0o640);
        // Set-id and sticky bits are the file's own, kept as they are.
        assert_eq!(
            owner(0o4755, 1000, 100)
                .behind(&[owner(0o700, 1000, 100)])
                .perm,
            0o4700
        );
    }
}
