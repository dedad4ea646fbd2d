//! Datasets: a name, the source its samples come from, and its sorted
//! listing (reused for a few seconds).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::cache::{Cache, SampleKey};
use crate::chunk::{Buffer, Chunk};
use crate::entry::{FileEntry, Fnv64, Owner, Walked, check_name};
use crate::protocol::{ErrorCode, ProtocolError};
use crate::source::Source;
use crate::sync::lock;

/// How long a listing is reused before `OPEN` walks the root again.
const LISTING_TTL: Duration = Duration::from_secs(5);

/// How old a listing may be and still be served when listing again fails.
const STALE_LISTING: Duration = Duration::from_secs(300);

/// A dataset's files sorted by name, as `LIST` pages them. A name is found
/// by binary search, so a listing costs its entries and nothing more (a
/// million entries of ImageNet-like names: about 90 bytes each, and 16 more
/// for a local file's permissions and owner).
#[derive(Debug)]
pub struct Listing {
    pub files: Vec<FileEntry>,
    /// Directories with nothing listed beneath them (the mount shows them).
    pub empty_dirs: Vec<String>,
    /// A local data set's directories with their owners, sorted by path.
    pub dir_owners: Vec<(String, Owner)>,
    pub total_bytes: u64,
    pub digest: u64,
    /// Changes with the digest and with any file's version or any owner:
    /// what the mount shows of the listing.
    pub shown_digest: u64,
    /// Whether every entry could be examined (see [`Walked::unexamined`]).
    pub complete: bool,
}

impl Listing {
    #[cfg(test)]
    pub(crate) fn new(files: Vec<FileEntry>) -> Self {
        Self::of(Walked {
            files,
            ..Walked::default()
        })
    }

    /// The listing of what a source walked: files sorted by name, and a
    /// digest that changes with any name or size (and empty directory).
    pub(crate) fn of(walked: Walked) -> Self {
        let Walked {
            mut files,
            mut empty_dirs,
            mut dir_owners,
            unexamined,
        } = walked;
        files.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        // A store whose pages overlap (one that goes on from a page's last
        // key inclusive) lists a key twice: it is one sample.
        files.dedup_by(|a, b| a.name == b.name);
        empty_dirs.sort_unstable();
        dir_owners.sort_unstable();
        let mut digest = Fnv64::new();
        let mut shown = Fnv64::new();
        let owned = |h: &mut Fnv64, owner: &Owner| {
            h.write(&owner.perm.to_be_bytes());
            h.write(&owner.uid.to_be_bytes());
            h.write(&owner.gid.to_be_bytes());
        };
        for f in &files {
            digest.write(f.name.as_bytes());
            digest.write(&[0]);
            digest.write(&f.size.to_be_bytes());
            shown.write(&f.version.to_be_bytes());
            if let Some(owner) = &f.owner {
                owned(&mut shown, owner);
            }
        }
        for dir in &empty_dirs {
            digest.write(b"/");
            digest.write(dir.as_bytes());
            digest.write(&[0]);
        }
        for (dir, owner) in &dir_owners {
            shown.write(dir.as_bytes());
            owned(&mut shown, owner);
        }
        shown.write(&digest.0.to_be_bytes());
        files.shrink_to_fit();
        Self {
            total_bytes: files.iter().map(|f| f.size).sum(),
            digest: digest.0,
            shown_digest: shown.0,
            files,
            empty_dirs,
            dir_owners,
            complete: unexamined == 0,
        }
    }

    /// Returns the index of the file called `name`.
    pub fn position(&self, name: &str) -> Option<u32> {
        self.files
            .binary_search_by(|f| f.name.as_str().cmp(name))
            .ok()
            .map(|i| i as u32)
    }

    /// The listed size of the file called `name`.
    pub fn size_of(&self, name: &str) -> Option<u64> {
        self.position(name).map(|i| self.files[i as usize].size)
    }

    pub fn len(&self) -> u32 {
        self.files.len() as u32
    }

    /// What identifies a plan of `files` (indices) over this listing: two
    /// plans share an active plan only when their fingerprints agree.
    pub fn fingerprint(&self, files: &[u32]) -> u64 {
        let mut h = Fnv64::new();
        h.write(&self.digest.to_be_bytes());
        for f in files {
            h.write(&f.to_be_bytes());
        }
        h.0
    }
}

/// A dataset the stage serves: a name and its source.
#[derive(Debug)]
pub struct Dataset {
    pub name: String,
    /// Where its samples are (a directory or URL): the source part of
    /// every cache key of its samples.
    pub identity: Arc<str>,
    source: Source,
    cached: Mutex<Cached>,
    /// Held while listing: one listing of the data set at a time.
    lister: Mutex<()>,
    /// Listings tried since the start; read before waiting for `cached`,
    /// so a caller that waited through a failed listing shares its error.
    tried: AtomicU64,
    /// A reader met the listing older than [`refresh_after`]: the stage
    /// lists again in the background ([`Dataset::refresh_wanted`]).
    stale_seen: AtomicBool,
    /// A background listing runs.
    refreshing: AtomicBool,
    /// The node cache its samples are kept in, if any (see
    /// [`Dataset::keep_cache_listed`]).
    cache: OnceLock<Arc<Cache>>,
}

/// The last listing and the last failure to list again.
#[derive(Debug, Default)]
struct Cached {
    listed: Option<(Instant, Arc<Listing>)>,
    failed: Option<Failed>,
    /// How long listing takes: the shorter of the last two listings, so
    /// that one slowed by a stall (a filer that stopped for a while) does
    /// not stretch the refresh interval, while a data set that lists slowly
    /// twice running is listed less often.
    took: Duration,
    /// How long the last listing took.
    last_took: Option<Duration>,
}

/// A listing this quick is made again by the lookup that finds it stale,
/// rather than in the background.
const INLINE_LISTING: Duration = Duration::from_millis(250);

/// How old a listing may be before readers' lookups ask for a new one:
/// [`LISTING_TTL`], or ten times as long as listing took (a data set that
/// takes a minute to list is not listed over and over while it is read).
fn refresh_after(took: Duration) -> Duration {
    LISTING_TTL.max(took * 10)
}

/// A failure to list, kept for [`LISTING_TTL`] and for the callers that
/// waited while it was tried.
#[derive(Debug)]
struct Failed {
    /// The `tried` count it ended.
    tried: u64,
    at: Instant,
    kind: io::ErrorKind,
    message: String,
}

impl Cached {
    /// Notes that a listing took `took`.
    fn listed_in(&mut self, took: Duration) {
        self.took = self.last_took.map_or(took, |last| took.min(last));
        self.last_took = Some(took);
    }

    /// The last listing while it may stand in for one that failed.
    fn stale(&self) -> Option<&Arc<Listing>> {
        self.listed
            .as_ref()
            .filter(|(at, _)| at.elapsed() < STALE_LISTING)
            .map(|(_, listing)| listing)
    }

    fn stale_or(&self, e: io::Error) -> io::Result<Arc<Listing>> {
        self.stale().map(Arc::clone).ok_or(e)
    }
}

impl Dataset {
    pub fn new(name: &str, source: Source) -> Self {
        Self {
            name: name.to_owned(),
            identity: source.describe().into(),
            source,
            cached: Mutex::new(Cached::default()),
            lister: Mutex::new(()),
            tried: AtomicU64::new(0),
            stale_seen: AtomicBool::new(false),
            refreshing: AtomicBool::new(false),
            cache: OnceLock::new(),
        }
    }

    /// Has each new listing drop from the node cache what it holds of this
    /// data set's samples under a key the listing does not give (files
    /// deleted, renamed or rewritten since they were kept): no read asks
    /// for them again, and they would hold the data set's room in the
    /// cache for good (the disk tier's across restarts too).
    pub fn keep_cache_listed(&self, cache: Arc<Cache>) {
        let _ = self.cache.set(cache);
    }

    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The listing as last listed, without listing again.
    pub fn listed(&self) -> Option<Arc<Listing>> {
        lock(&self.cached)
            .listed
            .as_ref()
            .map(|(_, l)| Arc::clone(l))
    }

    /// The latest listing, for telling a sample's current version (the
    /// node cache's key) from the one a connection's listing or a plan
    /// holds. When it is older than [`refresh_after`], a data set that
    /// lists quickly (under [`INLINE_LISTING`]) is listed again now; a
    /// slower one is listed in the background ([`Dataset::refresh_wanted`])
    /// and this listing is given meanwhile. Blocking (at most a quick
    /// listing).
    pub fn latest(&self) -> Option<Arc<Listing>> {
        let (listing, took) = {
            let cached = lock(&self.cached);
            let (at, listing) = cached.listed.as_ref()?;
            if at.elapsed() < refresh_after(cached.took) {
                return Some(Arc::clone(listing));
            }
            (Arc::clone(listing), cached.took)
        };
        if took <= INLINE_LISTING {
            // A failure gives the last listing while it may stand in.
            return Some(self.listing().unwrap_or(listing));
        }
        self.stale_seen.store(true, Ordering::Relaxed);
        Some(listing)
    }

    /// The node cache's key of listed file `file`.
    pub fn key_of(&self, file: &FileEntry) -> SampleKey {
        SampleKey {
            source: Arc::clone(&self.identity),
            name: file.name.as_str().into(),
            version: file.version,
            size: file.size,
        }
    }

    /// The node cache's key of `name` as the latest listing has it (see
    /// [`Dataset::latest`]); `None` when it lists no such file.
    pub fn latest_key(&self, name: &str) -> Option<SampleKey> {
        let listing = self.latest()?;
        Some(self.key_of(&listing.files[listing.position(name)? as usize]))
    }

    /// [`Dataset::latest_key`], but of a local file as it is now (a
    /// `stat`: a file replaced since the listing, between epochs, was read
    /// from the cache as it was for every epoch its plan began before the
    /// next listing); `None` also when the file cannot be examined.
    pub fn current_key(&self, name: &str) -> Option<SampleKey> {
        let mut key = self.latest_key(name)?;
        if self.source().remote().is_none() {
            (key.version, key.size) = self.source().local_version(name)?;
        }
        Some(key)
    }

    /// How old this data set's listing may be before a reader's look asks
    /// for a new one (see [`refresh_after`]).
    pub fn refresh_interval(&self) -> Duration {
        refresh_after(lock(&self.cached).took)
    }

    /// Whether a background listing is due: a reader met a stale listing
    /// and none runs. Marks one as running; [`Dataset::refreshed`] ends it.
    pub fn refresh_wanted(&self) -> bool {
        if !self.stale_seen.load(Ordering::Relaxed) || self.refreshing.swap(true, Ordering::AcqRel)
        {
            return false;
        }
        self.stale_seen.store(false, Ordering::Relaxed);
        true
    }

    /// A background listing ended.
    pub fn refreshed(&self) {
        self.refreshing.store(false, Ordering::Release);
    }

    /// Returns the listing, listing the source again when the cached one is
    /// older than a few seconds. Blocking: call off the async runtime.
    ///
    /// A listing again that fails while the last one is younger than
    /// [`STALE_LISTING`] gives the last one (a store that restarts does not
    /// fail the trainers who open the data set meanwhile; their reads ride
    /// the outage out within the sample deadline). A failure is kept for
    /// [`LISTING_TTL`] and given to the callers that waited while it was
    /// tried, rather than each trying again in turn (a store that hangs
    /// would hold the last of N trainers N times as long).
    pub fn listing(&self) -> io::Result<Arc<Listing>> {
        let seen = self.tried.load(Ordering::Acquire);
        // One listing at a time; `cached` itself is held only to look and
        // to store, so readers asking for the latest listing never wait
        // for a listing to end.
        let _lister = lock(&self.lister);
        {
            let cached = lock(&self.cached);
            if let Some((at, listing)) = cached.listed.as_ref()
                && at.elapsed() < LISTING_TTL
            {
                return Ok(Arc::clone(listing));
            }
            if let Some(failed) = &cached.failed
                && (failed.tried > seen || failed.at.elapsed() < LISTING_TTL)
            {
                let e = io::Error::new(failed.kind, failed.message.clone());
                return cached.stale_or(e);
            }
        }
        let tried = self.tried.fetch_add(1, Ordering::AcqRel) + 1;
        let began = Instant::now();
        let listed = self.source.list();
        let mut cached = lock(&self.cached);
        match listed {
            Ok(walked) => {
                let listing = Arc::new(Listing::of(walked));
                crate::heap::give_back_freed_memory();
                cached.listed_in(began.elapsed());
                cached.listed = Some((Instant::now(), Arc::clone(&listing)));
                cached.failed = None;
                drop(cached);
                // Not by a listing that left entries out unexamined (a
                // directory unreadable for a moment emptied the cache of
                // its unchanged files), nor by an empty one (a volume not
                // mounted yet at start unlinked the whole disk tier).
                let whole = listing.complete && !listing.files.is_empty();
                if let Some(cache) = self.cache.get().filter(|_| whole) {
                    // Still this data set's one lister: listings and the
                    // cache's pruning by them go in turn.
                    cache.forget_unlisted(&self.identity, |key| {
                        listing
                            .position(&key.name)
                            .is_some_and(|i| self.key_of(&listing.files[i as usize]) == *key)
                    });
                }
                Ok(listing)
            }
            Err(e) => {
                cached.failed = Some(Failed {
                    tried,
                    at: Instant::now(),
                    kind: e.kind(),
                    message: e.to_string(),
                });
                if cached.stale().is_some() {
                    tracing::warn!(dataset = %self.name, error = %e, "listing the data set again failed: serving its last listing");
                }
                cached.stale_or(e)
            }
        }
    }

    /// Reads the whole sample `name` of the listing (`listed` bytes) for
    /// prefetching into a buffer from `alloc`. Blocking.
    pub fn read_whole(
        &self,
        name: &str,
        listed: u64,
        alloc: &dyn Fn(usize) -> Buffer,
    ) -> Result<Chunk, ProtocolError> {
        check_name(name)?;
        self.source
            .read_listed(name, listed, alloc)
            .map_err(|e| self.explained(e))
    }

    /// `e`, a failure to find or read a sample, saying why the listing the
    /// sample was named by may be out of date: while the data set cannot
    /// be listed again (its directory removed, the store away), its last
    /// listing stands in, and a sample error alone would send the trainer
    /// looking for one missing file.
    pub fn explained(&self, mut e: ProtocolError) -> ProtocolError {
        if !matches!(e.code, ErrorCode::NotFound | ErrorCode::IoError) {
            return e;
        }
        let cached = lock(&self.cached);
        if let (Some(failed), Some((at, _))) = (&cached.failed, &cached.listed) {
            e.message = format!(
                "{} (the data set cannot be listed again: {}; its listing of {}s ago stands in meanwhile)",
                e.message,
                failed.message,
                at.elapsed().as_secs()
            );
        }
        e
    }

    /// Reads `length` bytes (or to the end) of `name` from `offset`. The
    /// stage reads through its jobs (`Job::read_now`, under the limiter);
    /// the tests read directly.
    #[cfg(test)]
    pub fn read(&self, name: &str, offset: u64, length: u64) -> Result<Chunk, ProtocolError> {
        check_name(name)?;
        self.source
            .read_range(name, offset, length, None)
            .map(|(chunk, _)| chunk)
    }
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
        let source = crate::source::DirSource::open("d", &root, true).unwrap();
        let ds = Dataset::new("d", Source::Dir(source));
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
        assert_eq!(dir.code, ErrorCode::NotFound, "no such file: a directory");
        assert!(
            dir.message.contains("not a regular file"),
            "{}",
            dir.message
        );
    }

    #[test]
    fn digest_tracks_the_listing() {
        let a = Listing::new(vec![FileEntry::new("a".into(), 1, 0)]);
        let b = Listing::new(vec![FileEntry::new("a".into(), 2, 0)]);
        assert_ne!(a.digest, b.digest);
        // FNV-1a of "a", 0x00, 1u64 BE: the Python client's tests check the same value.
        assert_eq!(
            a.digest,
            Listing::new(vec![FileEntry::new("a".into(), 1, 7)]).digest
        );
    }

    /// Makes the cached listing and failure `by` older.
    fn age(ds: &Dataset, by: Duration) {
        let mut cached = lock(&ds.cached);
        if let Some((at, _)) = cached.listed.as_mut() {
            *at -= by;
        }
        if let Some(failed) = cached.failed.as_mut() {
            failed.at -= by;
        }
    }

    #[test]
    fn a_listing_again_that_fails_serves_the_last_one_while_it_is_recent() {
        let (dir, ds) = fixture();
        let first = ds.listing().unwrap();
        let root = dir.path().join("root");
        let away = dir.path().join("away");
        std::fs::rename(&root, &away).unwrap();
        age(&ds, LISTING_TTL);
        assert!(
            Arc::ptr_eq(&ds.listing().unwrap(), &first),
            "the store is away: the last listing"
        );
        age(&ds, STALE_LISTING);
        assert!(ds.listing().is_err(), "too old to stand in");
        // The failure stands for a few seconds: nobody lists again meanwhile.
        std::fs::rename(&away, &root).unwrap();
        assert!(ds.listing().is_err());
        age(&ds, LISTING_TTL);
        assert_eq!(ds.listing().unwrap().digest, first.digest);
    }

    #[test]
    fn a_new_listing_drops_what_the_cache_holds_of_files_it_no_longer_gives() {
        use crate::cache::{CachePolicy, Lookup, Tiers};
        for on_disk in [false, true] {
            let (dir, ds) = fixture();
            let root = dir.path().join("root");
            std::fs::write(root.join("keep.bin"), b"kept as it is").unwrap();
            let tiers = Tiers {
                memory: if on_disk { 0 } else { 1 << 20 },
                policy: CachePolicy::Stable,
                disk: on_disk.then(|| (dir.path().join("cache"), 1 << 20)),
            };
            let metrics = crate::metrics::Metrics::new().cache.clone();
            let cache = Cache::new(&tiers, &[], metrics).unwrap();
            cache.set_weight(&ds.identity, "d", 1);
            ds.keep_cache_listed(Arc::clone(&cache));
            ds.listing().unwrap();
            for name in ["keep.bin", "top.bin", "train/a/1.bin"] {
                let key = ds.current_key(name).unwrap();
                let bytes = std::fs::read(root.join(name)).unwrap();
                if on_disk {
                    assert!(cache.keep(&key, &bytes).unwrap());
                } else {
                    let Lookup::Miss(fill) = cache.lookup("d", &key) else {
                        panic!("{name} was not cached yet");
                    };
                    fill.complete(&bytes);
                }
            }
            let held = |cache: &Cache| {
                let d = &cache.report().datasets[0];
                if on_disk { d.disk_entries } else { d.entries }
            };
            assert_eq!(held(&cache), 3);
            // One deleted and one rewritten (so "inside", its link, too).
            let kept = ds.current_key("keep.bin").unwrap();
            std::fs::remove_file(root.join("top.bin")).unwrap();
            std::fs::write(root.join("train/a/1.bin"), b"hello again").unwrap();
            age(&ds, LISTING_TTL);
            ds.listing().unwrap();
            assert_eq!(held(&cache), 1, "on disk: {on_disk}");
            assert!(
                matches!(
                    cache.lookup_unclaimed("d", &kept),
                    Some(Lookup::Hit(_) | Lookup::Disk(_))
                ),
                "the file listed as it was is still held"
            );
            if on_disk {
                let files = disk_files(&dir.path().join("cache"));
                assert_eq!(files, 1, "the dropped entries' files are unlinked");
            }
            // A listing of nothing (a volume not mounted yet at start) drops
            // nothing: it unlinked the whole disk tier.
            std::fs::remove_dir_all(&root).unwrap();
            std::fs::create_dir(&root).unwrap();
            age(&ds, LISTING_TTL);
            assert!(ds.listing().unwrap().files.is_empty());
            assert_eq!(held(&cache), 1, "emptied, on disk: {on_disk}");
        }
    }

    /// The sample files of a disk tier in `dir` (in its subdirectories;
    /// its marker is at the top).
    fn disk_files(dir: &std::path::Path) -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_type().unwrap().is_dir())
            .map(|e| std::fs::read_dir(e.path()).unwrap().count())
            .sum()
    }

    #[test]
    fn a_sample_missing_while_the_last_listing_stands_in_says_so() {
        let (dir, ds) = fixture();
        ds.listing().unwrap();
        let alloc = |len: usize| Buffer::heap(len);
        let missing = ds.read_whole("nope.bin", 1, &alloc).unwrap_err();
        assert!(
            !missing.message.contains("listed again"),
            "{}",
            missing.message
        );
        std::fs::remove_dir_all(dir.path().join("root")).unwrap();
        age(&ds, LISTING_TTL);
        ds.listing().unwrap();
        let e = ds.read_whole("top.bin", 10, &alloc).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound, "{}", e.message);
        assert!(
            e.message.contains("`top.bin`")
                && e.message.contains("the data set cannot be listed again")
                && e.message.contains("stands in"),
            "{}",
            e.message
        );
    }

    #[test]
    fn one_stalled_listing_does_not_stretch_the_refresh_interval() {
        let mut cached = Cached::default();
        cached.listed_in(Duration::from_millis(30));
        assert_eq!(refresh_after(cached.took), LISTING_TTL);
        // A filer stopped for 8 s while it was listed.
        cached.listed_in(Duration::from_secs(8));
        assert_eq!(refresh_after(cached.took), LISTING_TTL);
        cached.listed_in(Duration::from_millis(30));
        assert_eq!(refresh_after(cached.took), LISTING_TTL);
        // A data set that takes 8 s to list, twice running.
        cached.listed_in(Duration::from_secs(8));
        cached.listed_in(Duration::from_secs(8));
        assert_eq!(refresh_after(cached.took), Duration::from_secs(80));
        // The first listing of all is all there is to go by.
        let mut first = Cached::default();
        first.listed_in(Duration::from_secs(8));
        assert_eq!(refresh_after(first.took), Duration::from_secs(80));
    }

    #[test]
    fn callers_that_waited_while_a_listing_failed_share_its_error() {
        let (dir, ds) = fixture();
        std::fs::remove_dir_all(dir.path().join("root")).unwrap();
        // A caller that read the count before another's try ended.
        let seen = ds.tried.load(Ordering::Acquire);
        assert!(ds.listing().is_err());
        let failed = lock(&ds.cached).failed.as_ref().map(|f| f.tried);
        assert!(failed > Some(seen), "{failed:?}");
        age(&ds, LISTING_TTL);
        let tried = ds.tried.load(Ordering::Acquire);
        assert!(ds.listing().is_err());
        assert_eq!(
            ds.tried.load(Ordering::Acquire),
            tried + 1,
            "an old failure is tried again"
        );
    }
}
