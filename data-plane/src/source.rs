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

use crate::chunk::{Buffer, Chunk};
use crate::entry::Walked;
use crate::metrics::Metrics;
use crate::protocol::ProtocolError;

mod dir;
mod s3;

pub use dir::DirSource;
pub use s3::{S3Options, S3Source};

/// A dataset's storage.
#[derive(Debug)]
pub enum Source {
    Dir(DirSource),
    S3(Box<S3Source>),
}

impl Source {
    /// Opens `location`: an `s3://bucket/prefix` URL or a directory. An
    /// object store is checked with one request; the error says what to fix.
    pub async fn open(
        dataset: &str,
        location: &Path,
        direct: bool,
        s3: &S3Options,
        metrics: &Metrics,
    ) -> anyhow::Result<Self> {
        match location.to_str() {
            Some(url) if url.starts_with("s3://") => Ok(Self::S3(Box::new(
                S3Source::open(dataset, url, s3, metrics)
                    .await
                    .map_err(anyhow::Error::msg)?,
            ))),
            _ => Ok(Self::Dir(DirSource::open(dataset, location, direct)?)),
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
            Self::S3(s) => Ok(Walked {
                files: s.block_on(s.list())?,
                ..Walked::default()
            }),
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

    /// Reads `length` bytes (or to the end) of `name` from `offset`.
    /// Blocking.
    pub fn read_range(&self, name: &str, offset: u64, length: u64) -> Result<Chunk, ProtocolError> {
        match self {
            Self::Dir(d) => d.read_range(name, offset, length),
            Self::S3(s) => s.block_on(s.read_range(name, offset, length)),
        }
    }
}
