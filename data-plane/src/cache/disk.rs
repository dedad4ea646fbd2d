//! The local-disk tier's files (`--cache-dir`): one file per sample, named
//! by a hash of its key, holding a header (the full key, the length and a
//! checksum of the bytes) and then the bytes. Files are written under a
//! temporary name and renamed, and verified whenever they are read, so a
//! torn write, a flipped bit or a file of another sample is a miss, never
//! wrong bytes. The files outlive the stage: at start-up their headers are
//! read back into the index.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::SampleKey;

const MAGIC: &[u8; 8] = b"SLUICE1\n";
/// A header longer than this is not one of ours.
const MAX_HEADER: usize = 64 << 10;
const TMP_SUFFIX: &str = ".tmp";

/// Where a cached sample is on disk.
#[derive(Debug)]
pub(super) struct DiskFile {
    pub path: PathBuf,
    /// Written completely (readers skip a file still being written).
    pub ready: bool,
}

/// The path of `key`'s file beneath `dir`: `dir/ab/ab0123...` (256
/// subdirectories keep directories small).
pub(super) fn path_of(dir: &Path, key: &SampleKey) -> PathBuf {
    let mut a = crate::entry::Fnv64::new();
    a.write(key.source.as_bytes());
    a.write(&[0]);
    a.write(key.name.as_bytes());
    let b = checksum(&[key.version.to_le_bytes(), key.size.to_le_bytes()].concat()) ^ a.0;
    let name = format!("{:016x}{:016x}", a.0, b);
    dir.join(&name[..2]).join(name)
}

/// A fast checksum of sample bytes (corruption, not adversaries: the
/// directory is the stage's own).
pub(super) fn checksum(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        h = (h ^ w).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(31);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn header(key: &SampleKey, bytes: &[u8]) -> Vec<u8> {
    let mut h = Vec::with_capacity(64 + key.source.len() + key.name.len());
    h.extend_from_slice(MAGIC);
    for part in [key.source.as_bytes(), key.name.as_bytes()] {
        h.extend_from_slice(&(part.len() as u32).to_le_bytes());
        h.extend_from_slice(part);
    }
    for n in [key.version, key.size, bytes.len() as u64, checksum(bytes)] {
        h.extend_from_slice(&n.to_le_bytes());
    }
    h
}

/// Writes `key`'s file: header and bytes under a temporary name, then
/// renamed into place.
pub(super) fn write(path: &Path, key: &SampleKey, bytes: &[u8]) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    let tmp = path.with_extension(TMP_SUFFIX.trim_start_matches('.'));
    let mut f = fs::File::create(&tmp)?;
    let written = f
        .write_all(&header(key, bytes))
        .and_then(|()| f.write_all(bytes));
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, path)
}

/// A file's header: the key it holds, the length and checksum of its bytes.
struct Header {
    key: SampleKey,
    len: u64,
    sum: u64,
}

fn read_header(f: &mut impl Read) -> io::Result<Header> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    let mut magic = [0u8; 8];
    f.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(bad("not a sluice cache file"));
    }
    let mut text = || -> io::Result<String> {
        let mut len = [0u8; 4];
        f.read_exact(&mut len)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_HEADER {
            return Err(bad("header too long"));
        }
        let mut s = vec![0u8; len];
        f.read_exact(&mut s)?;
        String::from_utf8(s).map_err(|_| bad("header is not UTF-8"))
    };
    let (source, name) = (text()?, text()?);
    let mut n = [0u8; 32];
    f.read_exact(&mut n)?;
    let word = |i: usize| u64::from_le_bytes(n[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    Ok(Header {
        key: SampleKey {
            source: source.into(),
            name: name.into(),
            version: word(0),
            size: word(1),
        },
        len: word(2),
        sum: word(3),
    })
}

/// Reads `key`'s bytes from `path`, verifying that the file holds that key
/// whole and intact.
pub(super) fn read(path: &Path, key: &SampleKey) -> io::Result<Vec<u8>> {
    let mut f = io::BufReader::with_capacity(8 << 10, fs::File::open(path)?);
    let header = read_header(&mut f)?;
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    if header.key != *key {
        return Err(bad("the file holds another sample"));
    }
    let mut bytes = Vec::with_capacity(header.len as usize);
    f.read_to_end(&mut bytes)?;
    if bytes.len() as u64 != header.len || checksum(&bytes) != header.sum {
        return Err(bad("the bytes do not match the checksum"));
    }
    Ok(bytes)
}

/// The files a previous stage left in `dir` whose source is one of
/// `sources`: (key, path, length). Anything else there (files of other
/// sources, unreadable or torn files, temporary files) is removed.
pub(super) fn scan(dir: &Path, sources: &[Arc<str>]) -> io::Result<Vec<(SampleKey, PathBuf, u64)>> {
    let mut found = Vec::new();
    for sub in fs::read_dir(dir)? {
        let sub = sub?;
        if !sub.file_type()?.is_dir() {
            continue;
        }
        for file in fs::read_dir(sub.path())? {
            let path = file?.path();
            let known = fs::File::open(&path)
                .map(io::BufReader::new)
                .and_then(|mut f| read_header(&mut f))
                .ok()
                .and_then(|h| {
                    let source = sources.iter().find(|s| ***s == *h.key.source)?;
                    let key = SampleKey {
                        source: Arc::clone(source),
                        ..h.key
                    };
                    (path_of(dir, &key) == path).then_some((key, h.len))
                });
            match known {
                Some((key, len)) => found.push((key, path, len)),
                None => {
                    let _ = fs::remove_file(&path);
                }
            }
        }
    }
    Ok(found)
}
