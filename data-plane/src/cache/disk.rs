//! The local-disk tier's files (`--cache-dir`): one file per sample, named
//! by a hash of its key, holding a header (the full key, the length, a
//! checksum of the bytes and one of each [`SUM_BLOCK`] of them) and then
//! the bytes. Files are written under a temporary name and renamed, and
//! verified whenever they are read (a whole sample by its checksum, a
//! range by those of the blocks it touches), so a torn write, a flipped
//! bit or a file of another sample is a miss, never wrong bytes. The files
//! outlive the stage: at start-up their headers are read back into the
//! index. Files of the first format (`SLUICE1`, no block checksums) are
//! read too; a range of one is checked by reading it whole.

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::SampleKey;

const MAGIC: &[u8; 8] = b"SLUICE2\n";
/// The first format's: no block checksums.
const MAGIC_V1: &[u8; 8] = b"SLUICE1\n";
/// The bytes each block checksum covers: a range read reads and checks
/// the blocks it touches, at most one more than it asks for at each end.
const SUM_BLOCK: u64 = 1 << 20;
/// A header longer than this is not one of ours.
const MAX_HEADER: usize = 64 << 10;
const TMP_SUFFIX: &str = ".tmp";
/// The file that marks a directory as a disk tier's (and is locked by the
/// stage using it).
pub(super) const MARKER: &str = "SLUICE-CACHE";
const MARKER_TEXT: &[u8] = b"A sluice-stage node cache (--cache-dir): its files are the stage's \
and are removed by it. Do not keep anything else here.\n";
/// The unit a file takes on disk, for the tier's accounting.
const BLOCK: u64 = 4096;

/// Takes `dir` (which exists) for the disk tier: it must be one a stage
/// made or be empty (a file system's `lost+found` aside), take writes, and
/// not be in use by another stage. The returned file holds the lock: keep
/// it open while the tier is used; [`Marker::of`] names it.
pub(super) fn claim(dir: &Path) -> io::Result<fs::File> {
    let refuse = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
    let marker = dir.join(MARKER);
    // Without the marker, a directory holding nothing but the tier's own
    // files is one a stage made and lost its marker (`rm -rf` of it raced
    // the writer, which made a subdirectory again behind it).
    if fs::symlink_metadata(&marker).is_err()
        && let Some(name) = fs::read_dir(dir)?
            .filter_map(Result::ok)
            .find(|e| e.file_name() != "lost+found" && !tier_own(e))
            .map(|e| e.file_name())
    {
        return Err(refuse(format!(
            "--cache-dir {} holds `{}`, which is not the node cache's: give it an empty \
             directory (or one a stage made), since the disk tier removes files it cannot use",
            dir.display(),
            name.to_string_lossy()
        )));
    }
    let mut file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&marker)
        .map_err(|e| {
            refuse(format!(
                "cannot write in --cache-dir {}: {e}",
                dir.display()
            ))
        })?;
    // A marker with another name elsewhere (a hard link) would have that
    // file overwritten below.
    if file
        .metadata()
        .map_err(|e| refuse(format!("cannot read {}: {e}", marker.display())))?
        .nlink()
        > 1
    {
        return Err(refuse(format!(
            "{} has other names (hard links): remove it, and give --cache-dir a directory of its own",
            marker.display()
        )));
    }
    match file.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => {
            return Err(refuse(format!(
                "--cache-dir {} is in use by another sluice-stage: give each stage its own directory",
                dir.display()
            )));
        }
        Err(fs::TryLockError::Error(e)) => return Err(e),
    }
    // Written at every start: proves the directory takes writes now.
    file.set_len(0)
        .and_then(|()| file.write_all(MARKER_TEXT))
        .map_err(|e| {
            refuse(format!(
                "cannot write in --cache-dir {}: {e}",
                dir.display()
            ))
        })?;
    Ok(file)
}

/// The marker file a stage claimed, by its identity: a directory removed
/// under the stage and made again (by another stage taking the path) has
/// another, and this stage writes nothing there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Marker {
    dev: u64,
    ino: u64,
}

impl Marker {
    /// The identity of the claimed marker `file`.
    pub(super) fn of(file: &fs::File) -> io::Result<Self> {
        let m = file.metadata()?;
        Ok(Self {
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    /// Whether the marker in `dir` is still this one; the error says why
    /// not, for the warning.
    fn still_in(self, dir: &Path) -> io::Result<()> {
        let path = dir.join(MARKER);
        let stop = "nothing is written to the disk tier until the stage restarts";
        match fs::symlink_metadata(&path) {
            Ok(m) if m.dev() == self.dev && m.ino() == self.ino => Ok(()),
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "{} is not the marker this stage made (the directory was removed and made \
                     again, by another stage taking its path?): {stop}",
                    path.display()
                ),
            )),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "{MARKER} is gone from {} (the directory was removed or emptied while the stage \
                     ran): {stop}",
                    dir.display()
                ),
            )),
            Err(e) => Err(io::Error::new(
                e.kind(),
                format!(
                    "cannot reach {} ({e}): nothing is written to the disk tier until it can",
                    path.display()
                ),
            )),
        }
    }
}

/// Block checksums a sample of `len` bytes has.
fn blocks(len: u64) -> u64 {
    len.div_ceil(SUM_BLOCK)
}

/// The bytes a header for `key` takes before its block checksums (all
/// of a header of the first format).
fn key_header_len(key: &SampleKey) -> u64 {
    (MAGIC.len() + 4 + key.source.len() + 4 + key.name.len() + 32) as u64
}

/// The bytes a header for `key` holding `len` bytes takes.
fn header_len(key: &SampleKey, len: u64) -> u64 {
    key_header_len(key) + 8 * blocks(len)
}

/// What the file of `key` holding `len` bytes takes on disk.
pub(super) fn footprint(key: &SampleKey, len: u64) -> u64 {
    (header_len(key, len) + len).div_ceil(BLOCK) * BLOCK
}

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
    // FNV-1a's top bits hardly depend on a name's last bytes (`f0000` to
    // `f0399` fell in 4 subdirectories): mix them all in before the top
    // byte picks the subdirectory.
    let a = mix(a.0);
    let b = checksum(&[key.version.to_le_bytes(), key.size.to_le_bytes()].concat()) ^ a;
    let name = format!("{a:016x}{b:016x}");
    dir.join(&name[..2]).join(name)
}

/// A 64-bit finalizer (MurmurHash3's): every input bit moves every output
/// bit with even odds.
fn mix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
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
    for block in bytes.chunks(SUM_BLOCK as usize) {
        h.extend_from_slice(&checksum(block).to_le_bytes());
    }
    h
}

/// Writes `key`'s file in the tier's directory `dir`: header and bytes
/// under a temporary name, then renamed into place. Nothing is written
/// once the directory's marker is not the one this stage claimed (the
/// directory was removed or emptied while the stage ran, maybe made again
/// by another stage): made again without it, the directory would be
/// refused at the next start as holding files that are not the cache's,
/// and another stage's files are its own. A write that raced the removal
/// takes back what it made.
pub(super) fn write(
    dir: &Path,
    marker: Marker,
    path: &Path,
    key: &SampleKey,
    bytes: &[u8],
) -> io::Result<()> {
    marker.still_in(dir)?;
    let Some(sub) = path.parent() else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "no subdirectory",
        ));
    };
    // Not `create_dir_all`: a removed tier directory is not made again.
    match fs::create_dir(sub) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let tmp = path.with_extension(TMP_SUFFIX.trim_start_matches('.'));
    let written = fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(&header(key, bytes))?;
        f.write_all(bytes)
    });
    let placed = written.and_then(|()| fs::rename(&tmp, path));
    let kept = placed.and_then(|()| marker.still_in(dir));
    if kept.is_err() {
        let _ = fs::remove_file(&tmp);
        let _ = fs::remove_file(path);
        let _ = fs::remove_dir(sub);
    }
    kept
}

/// A file's header: the key it holds, the length and checksum of its
/// bytes, and those of each block of them (`None`: a file of the first
/// format, which has none).
struct Header {
    key: SampleKey,
    len: u64,
    sum: u64,
    blocks: Option<Vec<u64>>,
}

impl Header {
    /// The bytes it takes in its file.
    fn len_on_disk(&self) -> u64 {
        match self.blocks {
            Some(_) => header_len(&self.key, self.len),
            None => key_header_len(&self.key),
        }
    }
}

/// Reads a header from a file of `on_disk` bytes (a length past it is
/// refused before anything is allocated for its block checksums).
fn read_header(f: &mut impl Read, on_disk: u64) -> io::Result<Header> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    let mut magic = [0u8; 8];
    f.read_exact(&mut magic)?;
    let summed = match &magic {
        m if m == MAGIC => true,
        m if m == MAGIC_V1 => false,
        _ => return Err(bad("not a sluice cache file")),
    };
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
    let len = word(2);
    if len > on_disk {
        return Err(bad("the file's length does not match its header"));
    }
    let blocks = if summed {
        let mut sums = vec![0u8; 8 * blocks(len) as usize];
        f.read_exact(&mut sums)?;
        Some(
            sums.chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
                .collect(),
        )
    } else {
        None
    };
    Ok(Header {
        key: SampleKey {
            source: source.into(),
            name: name.into(),
            version: word(0),
            size: word(1),
        },
        len,
        sum: word(3),
        blocks,
    })
}

/// Opens the file at `path` past its header, which must name `key` and
/// the file's length (checked before anything is allocated for it: a
/// damaged header must not ask for a terabyte).
fn open_holding(path: &Path, key: &SampleKey) -> io::Result<(io::BufReader<fs::File>, Header)> {
    let (file, on_disk) = crate::storage::open_regular(path)?;
    let mut f = io::BufReader::with_capacity(8 << 10, file);
    let header = read_header(&mut f, on_disk)?;
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    if header.key != *key {
        return Err(bad("the file holds another sample"));
    }
    if header.len_on_disk() + header.len != on_disk {
        return Err(bad("the file's length does not match its header"));
    }
    Ok((f, header))
}

/// Reads the sample in the file at `path`, which must hold `key`, into
/// `buf` (exactly its length), and checks it.
pub(super) fn read_into(path: &Path, key: &SampleKey, buf: &mut [u8]) -> io::Result<()> {
    let (mut f, header) = open_holding(path, key)?;
    if header.len != buf.len() as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the file holds another length of the sample",
        ));
    }
    read_checked(&mut f, &header, buf)
}

/// Reads the bytes after `header` into `buf` and checks their sum.
fn read_checked(f: &mut impl Read, header: &Header, buf: &mut [u8]) -> io::Result<()> {
    f.read_exact(buf)?;
    if checksum(buf) != header.sum {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the bytes do not match the checksum",
        ));
    }
    Ok(())
}

/// Reads `buf.len()` bytes from `offset` of the sample in the file at
/// `path`, which must hold `key` whole, and checks them: the blocks the
/// range touches are read and checked against their checksums (a file of
/// the first format is read whole and checked).
pub(super) fn read_range(
    path: &Path,
    key: &SampleKey,
    offset: u64,
    buf: &mut [u8],
) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let (mut f, header) = open_holding(path, key)?;
    let end = offset.saturating_add(buf.len() as u64);
    if end > header.len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the range ends past the sample",
        ));
    }
    let Some(sums) = &header.blocks else {
        let mut whole = vec![0; header.len as usize];
        read_checked(&mut f, &header, &mut whole)?;
        buf.copy_from_slice(&whole[offset as usize..end as usize]);
        return Ok(());
    };
    if buf.is_empty() {
        return Ok(());
    }
    let (first, last) = (offset / SUM_BLOCK, (end - 1) / SUM_BLOCK);
    let from = first * SUM_BLOCK;
    let to = ((last + 1) * SUM_BLOCK).min(header.len);
    let mut read = vec![0; (to - from) as usize];
    f.get_ref()
        .read_exact_at(&mut read, header.len_on_disk() + from)?;
    for (i, block) in read.chunks(SUM_BLOCK as usize).enumerate() {
        if sums.get(first as usize + i) != Some(&checksum(block)) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the bytes do not match the checksum",
            ));
        }
    }
    let start = (offset - from) as usize;
    buf.copy_from_slice(&read[start..start + buf.len()]);
    Ok(())
}

/// The files a previous stage left in `dir` whose source is one of
/// `sources`: (key, path, footprint). The tier's files it cannot use
/// (of other sources, unreadable, torn or temporary) are removed; anything
/// not named as the tier names its files is left alone.
pub(super) fn scan(dir: &Path, sources: &[Arc<str>]) -> io::Result<Vec<(SampleKey, PathBuf, u64)>> {
    let mut found = Vec::new();
    for sub in fs::read_dir(dir)? {
        let sub = sub?;
        if !sub.file_type()?.is_dir() || !is_hex(&sub.file_name(), 2) {
            continue;
        }
        for file in fs::read_dir(sub.path())? {
            let file = file?;
            let name = file.file_name();
            let tmp = name
                .to_string_lossy()
                .strip_suffix(TMP_SUFFIX)
                .map(str::to_owned);
            let ours = match &tmp {
                Some(stem) => is_hex(std::ffi::OsStr::new(stem), 32),
                None => is_hex(&name, 32),
            };
            if !ours || !file.file_type()?.is_file() {
                continue;
            }
            let path = file.path();
            let known = tmp.is_none().then(|| indexed(&path, sources)).flatten();
            match known {
                Some((key, len)) => {
                    // A file named as an earlier release named it moves
                    // to its name now, rather than be read again.
                    let named = path_of(dir, &key);
                    if named == path || moved(&path, &named) {
                        found.push((key, named, len));
                    } else {
                        let _ = fs::remove_file(&path);
                    }
                }
                None => {
                    let _ = fs::remove_file(&path);
                }
            }
        }
    }
    Ok(found)
}

/// The key and footprint of the complete file at `path`, when it holds a
/// sample of one of `sources`.
fn indexed(path: &Path, sources: &[Arc<str>]) -> Option<(SampleKey, u64)> {
    let (file, on_disk) = crate::storage::open_regular(path).ok()?;
    let h = read_header(&mut io::BufReader::new(file), on_disk).ok()?;
    let source = sources.iter().find(|s| ***s == *h.key.source)?;
    if h.len_on_disk() + h.len != on_disk {
        return None;
    }
    let key = SampleKey {
        source: Arc::clone(source),
        ..h.key
    };
    // Counted as it takes room: a file of the first format by its size.
    let len = on_disk.div_ceil(BLOCK) * BLOCK;
    Some((key, len))
}

/// Moves the file at `from` to `to` (in a subdirectory that may not exist
/// yet), unless a file is there already.
fn moved(from: &Path, to: &Path) -> bool {
    if fs::symlink_metadata(to).is_ok() {
        return false;
    }
    to.parent()
        .is_some_and(|sub| fs::create_dir_all(sub).is_ok())
        && fs::rename(from, to).is_ok()
}

/// Whether the entry `e` of a tier's directory is one of its subdirectories
/// holding only files named as the tier names its own.
fn tier_own(e: &fs::DirEntry) -> bool {
    let named = |name: &std::ffi::OsStr| {
        let text = name.to_string_lossy();
        is_hex(
            std::ffi::OsStr::new(text.strip_suffix(TMP_SUFFIX).unwrap_or(&text)),
            32,
        )
    };
    e.file_type().is_ok_and(|t| t.is_dir())
        && is_hex(&e.file_name(), 2)
        && fs::read_dir(e.path()).is_ok_and(|files| {
            files
                .filter_map(Result::ok)
                .all(|f| f.file_type().is_ok_and(|t| t.is_file()) && named(&f.file_name()))
        })
}

/// Whether `name` is `digits` lowercase hexadecimal digits.
fn is_hex(name: &std::ffi::OsStr, digits: usize) -> bool {
    let name = name.as_encoded_bytes();
    name.len() == digits && name.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}
