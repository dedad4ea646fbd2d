//! What a listing is made of: one entry per sample, the syntax every
//! sample name must have, and the hash of listings and plans. A leaf
//! module: sources, datasets and the server all use it.

use std::path::{Component, Path};

use crate::protocol::{ErrorCode, ProtocolError};

/// Names longer than this are refused before touching the file system.
const MAX_NAME_BYTES: usize = 4096;

/// One sample of a dataset, named relative to its root (a file) or prefix
/// (an object). With the size, `version` is the identity of what was
/// listed: the modification time of a file, a hash of an object's ETag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
    pub version: u64,
    /// A local file's permissions and owner (an object has none).
    pub owner: Option<Owner>,
}

impl FileEntry {
    pub fn new(name: String, size: u64, version: u64) -> Self {
        Self {
            name,
            size,
            version,
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
