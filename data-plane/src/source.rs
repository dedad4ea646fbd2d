//! Sources: where a dataset's samples come from. Every read the engine
//! makes goes through [`Source`]: list the dataset (name, size, version),
//! read a listed sample whole, stat and read a name a trainer gave, read a
//! byte range.
//!
//! The local directory reads with blocking calls on the job's reader
//! threads (the measured-best path on local disks); the object store reads
//! asynchronously, so a few threads keep hundreds of requests in flight
//! (see `engine/job/readers.rs`). Both confine names: a directory refuses
//! symlinks that leave its root, an object store serves only keys beneath
//! its prefix.

use std::io;
use std::path::Path;
use std::sync::Arc;

use crate::chunk::{Buffer, Chunk};
use crate::entry::Walked;
use crate::metrics::Metrics;
use crate::protocol::{ErrorCode, ProtocolError};

mod dir;
mod fence;
mod s3;

pub use dir::DirSource;
pub(crate) use s3::configured_endpoint;
pub use s3::{S3Options, S3Source, parse_url as parse_s3_url};

/// A dataset's storage.
#[derive(Debug)]
pub enum Source {
    Dir(DirSource),
    S3(Box<S3Source>),
}

impl Source {
    /// Opens `location`: an `s3://bucket/prefix` URL or a directory, whose
    /// symlinks are not followed into `own_mount` (the stage's mount
    /// directory, canonical). An object store is checked with one request;
    /// the error says what to fix.
    pub async fn open(
        dataset: &str,
        location: &Path,
        direct: bool,
        s3: &S3Options,
        own_mount: Option<&Path>,
        metrics: &Metrics,
    ) -> anyhow::Result<Self> {
        match location.to_str() {
            Some(url) if url.starts_with("s3://") => Ok(Self::S3(Box::new(
                S3Source::open(dataset, url, s3, metrics)
                    .await
                    .map_err(anyhow::Error::msg)?,
            ))),
            _ => Ok(Self::Dir(
                DirSource::open(dataset, location, direct)?
                    .beside_mount(own_mount.map(Path::to_path_buf)),
            )),
        }
    }

    /// Where the samples are, for logs and errors.
    pub fn describe(&self) -> String {
        match self {
            Self::Dir(d) => d.root().display().to_string(),
            Self::S3(s) => s.url().to_owned(),
        }
    }

    /// The object store, when reads are asynchronous.
    pub fn remote(&self) -> Option<&S3Source> {
        match self {
            Self::Dir(_) => None,
            Self::S3(s) => Some(s),
        }
    }

    /// Lists the dataset. Blocking.
    pub fn list(&self) -> io::Result<Walked> {
        match self {
            Self::Dir(d) => d.list(),
            Self::S3(s) => s.block_on(s.list()),
        }
    }

    /// Reads listed sample `name` (`listed` bytes) whole into a buffer from
    /// `alloc`. Blocking.
    pub fn read_listed(
        &self,
        name: &str,
        listed: u64,
        alloc: &dyn Fn(usize) -> Buffer,
    ) -> Result<Chunk, ProtocolError> {
        match self {
            Self::Dir(d) => d.read_listed(name, listed, alloc),
            Self::S3(s) => {
                let buf = alloc(crate::storage::whole_footprint(listed) as usize);
                s.block_on(s.read_listed(name, listed, buf))
            }
        }
    }

    /// The size of `name` (a checked name a trainer gave), to charge the
    /// limiter before reading it. Blocking.
    pub fn stat(&self, name: &str) -> Result<u64, ProtocolError> {
        match self {
            Self::Dir(d) => d.stat(name).map(|(_, size)| size),
            Self::S3(s) => s.block_on(s.stat(name)),
        }
    }

    /// The version and size the listed file `name` has now, where asking
    /// costs no request to remote storage (a local file's `stat`); `None`
    /// for an object, or a file that cannot be examined. Blocking.
    pub fn local_version(&self, name: &str) -> Option<(u64, u64)> {
        match self {
            Self::Dir(d) => d.version(name).ok(),
            Self::S3(_) => None,
        }
    }

    /// Of a local file: `name` opened now, its reads pinned to that file
    /// (see [`DirSource::open_pinned`]); `None` for an object. Blocking.
    pub fn open_local(&self, name: &str) -> Option<Result<Pinned, ProtocolError>> {
        match self {
            Self::Dir(d) => Some(d.open_pinned(name)),
            Self::S3(_) => None,
        }
    }

    /// Reads `name` (a checked name a trainer gave) whole into a buffer
    /// from `alloc`. Blocking.
    pub fn read_unlisted(
        &self,
        name: &str,
        alloc: &dyn Fn(usize) -> Buffer,
    ) -> Result<Chunk, ProtocolError> {
        match self {
            Self::Dir(d) => {
                let (path, _) = d.stat(name)?;
                d.read_resolved(name, &path, alloc)
            }
            Self::S3(s) => s.block_on(s.read_unlisted(name, alloc)),
        }
    }

    /// Reads `length` bytes (or to the end) of `name` from `offset`, of
    /// the version `pin` holds when one is given (see [`Pinned`]), and
    /// returns the version it read. Blocking.
    pub fn read_range(
        &self,
        name: &str,
        offset: u64,
        length: u64,
        pin: Option<&Pinned>,
    ) -> Result<(Chunk, Pinned), ProtocolError> {
        match self {
            Self::Dir(d) => d.read_range(name, offset, length, pin),
            Self::S3(s) => s.block_on(s.read_range(name, offset, length, pin)),
        }
    }
}

/// The one version of a file that all the ranges one reader reads of it
/// come from (the mount's windows of an open file): the first range read
/// pins it, and a later range of another version is refused, never mixed
/// in with it.
#[derive(Debug, Clone)]
pub struct Pinned {
    /// The listing's version of the file (see [`crate::entry::FileEntry`]).
    pub version: u64,
    pub size: u64,
    held: Held,
}

#[derive(Debug, Clone)]
enum Held {
    /// Read from the node cache; the source holds nothing yet.
    Nothing,
    /// A local file, open: later ranges read it, as a local reader that
    /// opened it would (one replaced by a rename keeps its old bytes).
    File(Arc<std::fs::File>),
    /// An object's ETag: later ranges are read only while it is the same.
    Object(Arc<str>),
}

impl Pinned {
    /// The version of a sample the node cache holds.
    pub fn cached(version: u64, size: u64) -> Self {
        Self {
            version,
            size,
            held: Held::Nothing,
        }
    }

    fn file(version: u64, size: u64, file: std::fs::File) -> Self {
        Self {
            version,
            size,
            held: Held::File(Arc::new(file)),
        }
    }

    fn object(version: u64, size: u64, e_tag: Option<String>) -> Self {
        Self {
            version,
            size,
            held: e_tag.map_or(Held::Nothing, |tag| Held::Object(tag.into())),
        }
    }

    /// The local file it holds open.
    fn held_file(&self) -> Option<&std::fs::File> {
        match &self.held {
            Held::File(file) => Some(file),
            _ => None,
        }
    }

    /// The object's ETag it holds.
    fn held_e_tag(&self) -> Option<&str> {
        match &self.held {
            Held::Object(tag) => Some(tag),
            _ => None,
        }
    }

    /// Whether `other` is the same version of the file.
    pub fn same(&self, other: &Pinned) -> bool {
        (self.version, self.size) == (other.version, other.size)
    }

    /// This pin, holding what `other` (of the same version) holds of the
    /// source when it holds nothing itself.
    pub fn or_held(self, other: Pinned) -> Pinned {
        match self.held {
            Held::Nothing => other,
            _ => self,
        }
    }
}

/// The error of an object found `size` bytes long at its first read
/// through the mount, grown since it was listed at `listed`.
pub fn grown(name: &str, listed: u64, size: u64) -> ProtocolError {
    ProtocolError::new(
        ErrorCode::IoError,
        format!(
            "`{name}` was replaced since the stage listed it: it is {size} bytes now, not {listed}, and would read cut short (open it again once the stage lists its data set again, within seconds)"
        ),
    )
}

/// The error of a range of another version than the reader's first.
pub fn changed(name: &str) -> ProtocolError {
    ProtocolError::new(
        ErrorCode::IoError,
        format!(
            "`{name}` was replaced while it was read: the rest of it is of another version than what was read of it (open it, or read it, again)"
        ),
    )
}
