//! The node cache: sample bytes kept in memory (and, with a disk tier, on
//! a local disk) for later epochs and for every other job on the node that
//! reads the same data set. A lookup tries memory, then disk; what memory
//! does not keep is offered to the disk tier (see `cache/disk.rs`).
//!
//! An entry is keyed by the sample's identity ([`SampleKey`]: the source,
//! the name, and the version and size the listing gave), so a sample that
//! changed on its storage is a different key and is never served stale.
//!
//! **Admission.** Training reads every sample once per epoch in a fresh
//! random order, so recency says nothing about what is read next: an LRU
//! smaller than the data set evicts each sample shortly before it is wanted
//! again and hits about as often as chance leaves it (CoorDL measured the
//! thrashing). The default policy, [`CachePolicy::Stable`], admits samples
//! while there is room and then keeps what it holds: a data set larger than
//! its share keeps a fixed subset, and every epoch hits on exactly that
//! subset, share / data set size of the reads, which is the best any cache
//! of that size can do under uniform random order. [`CachePolicy::Lru`]
//! is kept to measure the difference (`python -m sluice.bench cache`).
//!
//! **Shares.** Each tier's capacity is split among the data sets looked
//! up in the last [`ACTIVE`] by weight (1 each unless set). Room nobody uses is free
//! for anyone; when the cache is full, a data set under its share takes
//! room from those over theirs (data sets no longer read first: their
//! share is nothing), evicting their newest entries so their older subset
//! stays stable.
//!
//! **One read per sample.** Two jobs that miss the same sample at once
//! share one source read: the first gets a [`Fill`] and reads, the others
//! get the [`Flight`] and wait for its bytes, or its error. A job under a
//! QoS limit claims a read (takes the [`Fill`]) only once its limiter lets
//! it read ([`Cache::lookup_unclaimed`] before): others never wait out a
//! limit that is not theirs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use disk::DiskFile;
use tier::Tier;

use crate::metrics::CacheMetrics;
use crate::pace::Sparse;
use crate::protocol::{ErrorCode, ProtocolError};
use crate::sync::{lock, wait};

/// How long after its last lookup a data set still counts for the shares.
pub const ACTIVE: Duration = Duration::from_secs(60);

/// What the cache keeps when it is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CachePolicy {
    /// Keep a stable subset (the default; see the module docs).
    #[default]
    Stable,
    /// Evict the least recently used sample (for comparison).
    Lru,
}

impl std::str::FromStr for CachePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stable" => Ok(Self::Stable),
            "lru" => Ok(Self::Lru),
            _ => Err(format!(
                "unknown cache policy `{s}`: use `stable` (keep a stable subset) or `lru`"
            )),
        }
    }
}

/// A sample's identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SampleKey {
    /// The source (its directory or URL), shared by every key of it.
    pub source: Arc<str>,
    pub name: Box<str>,
    /// The listing's version of the sample (mtime or ETag hash).
    pub version: u64,
    pub size: u64,
}

/// The answer to a lookup.
pub enum Lookup {
    /// The sample's bytes.
    Hit(Arc<[u8]>),
    /// On the disk tier: read it where it is wanted ([`DiskHit::read_into`]),
    /// so that no copy outside the caller's budget holds it meanwhile.
    Disk(DiskHit),
    /// Not cached and nobody reads it: read it, then [`Fill::complete`].
    Miss(Fill),
    /// Another reader is reading it: wait for its outcome.
    Wait(Arc<Flight>),
}

/// A sample the disk tier holds, found by [`Cache::lookup`].
#[derive(Debug)]
pub struct DiskHit {
    cache: Arc<Cache>,
    key: SampleKey,
    found: OnDisk,
}

impl DiskHit {
    /// The sample's length in bytes.
    pub fn len(&self) -> usize {
        self.key.size as usize
    }

    /// Reads the sample into `buf` (exactly [`DiskHit::len`] bytes) and
    /// checks it, counting the hit. False when the file failed (it is
    /// dropped from the tier): look the sample up again.
    pub fn read_into(self, buf: &mut [u8]) -> bool {
        self.cache.read_whole_into(&self.key, &self.found, buf)
    }
}

/// What a shared read gives its waiters.
pub type Outcome = Result<Arc<[u8]>, ProtocolError>;

/// A source read others may be waiting for.
#[derive(Debug, Default)]
pub struct Flight {
    done: Mutex<Option<Outcome>>,
    ready: Condvar,
    notify: tokio::sync::Notify,
}

impl Flight {
    fn finish(&self, outcome: Outcome) {
        *lock(&self.done) = Some(outcome);
        self.ready.notify_all();
        self.notify.notify_waiters();
    }

    /// Waits for the read's bytes or error. Blocking.
    pub fn wait_blocking(&self) -> Outcome {
        let mut done = lock(&self.done);
        loop {
            if let Some(outcome) = done.as_ref() {
                return outcome.clone();
            }
            done = wait(&self.ready, done);
        }
    }

    /// Waits for the read's bytes or error on the runtime.
    pub async fn wait(&self) -> Outcome {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(outcome) = lock(&self.done).as_ref() {
                return outcome.clone();
            }
            notified.await;
        }
    }
}

/// The right, and the duty, to read a missed sample and tell the cache
/// and the waiters how it went ([`Fill::complete`], [`Fill::fail`]);
/// dropped unfinished (a reader that panicked), it fails the waiters.
pub struct Fill {
    cache: Arc<Cache>,
    key: Option<SampleKey>,
    flight: Arc<Flight>,
}

impl Fill {
    /// Offers the bytes read to the cache and to the readers waiting.
    pub fn complete(mut self, bytes: &[u8]) {
        let Some(key) = self.key.take() else {
            return;
        };
        if bytes.len() as u64 != key.size {
            // The sample changed again while it was read: those bytes are
            // not kept under this version, but whoever waits gets them, as
            // its own read of the source would have.
            lock(&self.cache.state).pending.remove(&key);
            self.flight.finish(Ok(Arc::from(bytes)));
            return;
        }
        let shared = self.cache.admit(&key, bytes, &self.flight);
        self.flight.finish(shared.ok_or_else(|| abandoned(&key)));
    }

    /// Gives the waiters the read's error.
    pub fn fail(mut self, error: &ProtocolError) {
        if let Some(key) = self.key.take() {
            lock(&self.cache.state).pending.remove(&key);
            self.flight.finish(Err(error.clone()));
        }
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            lock(&self.cache.state).pending.remove(&key);
            self.flight.finish(Err(abandoned(&key)));
        }
    }
}

/// The error of waiters whose shared read ended without an outcome.
fn abandoned(key: &SampleKey) -> ProtocolError {
    ProtocolError::new(
        ErrorCode::IoError,
        format!(
            "the stage failed internally reading `{}` (its log has the details)",
            key.name
        ),
    )
}

/// A data set's standing in the cache.
#[derive(Debug)]
struct Share {
    /// The stage's name of the data set (the metrics label); `a+b` for
    /// data sets served from one source.
    label: String,
    /// The stage's names of the data sets served from this source.
    names: Vec<String>,
    /// The weight of the stage's configuration (`cache.weights`).
    configured_weight: u32,
    terms: Terms,
    /// The data set's bytes, when its listing was known at the last
    /// [`Cache::steer`]: what a pin of `all` keeps at most.
    size: Option<u64>,
    /// None until the data set is first looked up.
    last_lookup: Option<Instant>,
}

/// A pin of the whole data set (`pin: all`).
pub const PIN_ALL: u64 = u64::MAX;

/// How a data set shares the cache: its tenant's weight among the tenants
/// read lately, its weight within the tenant, and bytes pinned whatever
/// the others want. The stage's configuration gives every data set the
/// tenant `""` (weight 1) and no pin; a cache policy from the controller
/// may say otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terms {
    pub tenant: String,
    pub tenant_weight: u32,
    pub weight: u32,
    /// Bytes kept in each tier whatever others want ([`PIN_ALL`]: the
    /// whole data set, as far as the tier has room after the other pins).
    pub pin: u64,
}

impl Terms {
    fn configured(weight: u32) -> Self {
        Self {
            tenant: String::new(),
            tenant_weight: 1,
            weight: weight.max(1),
            pin: 0,
        }
    }
}

/// The local-disk tier.
#[derive(Debug)]
struct Disk {
    dir: PathBuf,
    tier: Tier<DiskFile>,
    /// The directory's marker, locked while this stage uses it.
    _claimed: std::fs::File,
    /// Its identity: written into only while the directory holds it.
    marker: disk::Marker,
    /// Writes that failed (a full or failing disk warns once a minute,
    /// not once a sample).
    failed_writes: Sparse,
    /// Likewise files that failed their check when read (a directory
    /// removed under the stage fails every one).
    failed_checks: Sparse,
}

#[derive(Debug)]
struct State {
    memory: Tier<Arc<[u8]>>,
    disk: Option<Disk>,
    shares: HashMap<Arc<str>, Share>,
    pending: HashMap<SampleKey, Arc<Flight>>,
    /// Samples on their way to the disk tier (the writer's queue holds the
    /// same bytes): found here until written, so that another job's lookup
    /// meanwhile does not read them from the source again.
    queued: Queued,
    tick: u64,
}

/// The samples on their way to the disk tier, and their bytes: at most
/// [`DISK_QUEUE_BYTES`], which the node's stated memory overhead counts
/// (a sample the writer has no room for is not kept on disk).
#[derive(Debug, Default)]
struct Queued {
    samples: HashMap<SampleKey, Arc<[u8]>>,
    bytes: u64,
}

impl Queued {
    fn get(&self, key: &SampleKey) -> Option<&Arc<[u8]>> {
        self.samples.get(key)
    }

    /// Queues `bytes` under `key` when they fit; whether they did.
    fn insert(&mut self, key: &SampleKey, bytes: &Arc<[u8]>) -> bool {
        let size = bytes.len() as u64;
        let full = self.bytes + size > DISK_QUEUE_BYTES || self.samples.len() >= DISK_QUEUE;
        if full && !self.samples.is_empty() {
            return false;
        }
        if let Some(old) = self.samples.insert(key.clone(), Arc::clone(bytes)) {
            self.bytes -= old.len() as u64;
        }
        self.bytes += size;
        true
    }

    fn remove(&mut self, key: &SampleKey) {
        if let Some(old) = self.samples.remove(key) {
            self.bytes -= old.len() as u64;
        }
    }
}

/// Where a looked-up sample is.
enum Found {
    Memory(Arc<[u8]>),
    /// On disk; the label of the data set's share.
    Disk(OnDisk),
    Nowhere,
}

/// A sample the disk tier holds, as [`Cache::locate`] found it.
#[derive(Debug)]
struct OnDisk {
    path: PathBuf,
    label: String,
}

/// The node cache: a memory tier and an optional local-disk tier.
#[derive(Debug)]
pub struct Cache {
    policy: CachePolicy,
    state: Mutex<State>,
    /// Samples on their way to the disk tier's writer thread.
    to_disk: Option<Sender<(SampleKey, Arc<[u8]>)>>,
    metrics: CacheMetrics,
}

/// What a cache holds and in which tiers (`--cache-*` flags).
#[derive(Debug, Clone, Default)]
pub struct Tiers {
    pub memory: u64,
    pub policy: CachePolicy,
    /// `--cache-dir` and `--cache-disk`.
    pub disk: Option<(PathBuf, u64)>,
}

/// What one data set holds and did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ShareUse {
    pub dataset: String,
    /// The data sets it serves (one, or several served from one source).
    #[serde(skip)]
    pub names: Vec<String>,
    pub tenant: String,
    pub tenant_weight: u32,
    pub weight: u32,
    /// Its pin in bytes; for a pin of `all` ([`ShareUse::pin_all`]), the
    /// data set's size where it is known, else 0.
    pub pin_bytes: u64,
    /// Whether the whole data set is pinned.
    pub pin_all: bool,
    /// Bytes of the memory tier it is entitled to now.
    pub share_bytes: u64,
    pub bytes: u64,
    pub entries: u64,
    pub disk_bytes: u64,
    pub disk_entries: u64,
    pub hits: u64,
    pub misses: u64,
    pub hit_bytes: u64,
    pub evictions: u64,
}

/// The cache as `/api/v1/cache` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CacheReport {
    pub policy: &'static str,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub disk_capacity_bytes: u64,
    pub disk_used_bytes: u64,
    pub datasets: Vec<ShareUse>,
}

/// Samples waiting for the disk writer, at most: [`DISK_QUEUE_BYTES`]
/// bounds them first but for samples under 2 KiB (a bound of 256 held
/// 1.3 MB of 5 KB samples, and the rest of an epoch was never written).
const DISK_QUEUE: usize = 16_384;

/// Bytes waiting for the disk writer, at most (one sample larger than
/// this is queued alone).
const DISK_QUEUE_BYTES: u64 = 32 << 20;

impl Cache {
    /// Builds the cache. With a disk tier, the samples a previous stage left
    /// in its directory for `datasets` (source, name) are indexed again
    /// (others are removed), and a thread writes new ones.
    pub fn new(
        tiers: &Tiers,
        datasets: &[(Arc<str>, String)],
        metrics: CacheMetrics,
    ) -> std::io::Result<Arc<Self>> {
        metrics
            .capacity
            .with_label_values(&[MEMORY])
            .set(tiers.memory as i64);
        let mut state = State {
            memory: Tier::new(tiers.memory),
            disk: None,
            shares: HashMap::new(),
            pending: HashMap::new(),
            queued: Queued::default(),
            tick: 0,
        };
        for (source, name) in datasets {
            // Data sets served from one source share its entries; the
            // share is named for all of them (`a+b`).
            state
                .shares
                .entry(Arc::clone(source))
                .and_modify(|share| {
                    share.label = format!("{}+{name}", share.label);
                    share.names.push(name.clone());
                })
                .or_insert_with(|| Share::new(name));
        }
        let mut to_disk = None;
        let mut writer = None;
        if let Some((dir, capacity)) = &tiers.disk {
            state.disk = Some(open_disk(dir, *capacity, &mut state, &metrics)?);
            // As long as `queued`, which bounds it (a bounded channel
            // holds its slots from the start).
            let (tx, rx) = std::sync::mpsc::channel();
            to_disk = Some(tx);
            writer = Some(rx);
        }
        let cache = Arc::new(Self {
            policy: tiers.policy,
            state: Mutex::new(state),
            to_disk,
            metrics,
        });
        if let Some(rx) = writer {
            let weak = Arc::downgrade(&cache);
            std::thread::Builder::new()
                .name("cache-writer".into())
                .spawn(move || {
                    for (key, bytes) in rx {
                        let Some(cache) = weak.upgrade() else { break };
                        // A failed write is counted and logged there.
                        let _ = cache.write_to_disk(key.clone(), &bytes);
                        lock(&cache.state).queued.remove(&key);
                    }
                })?;
        }
        Ok(cache)
    }

    /// Capacities, policy and what each data set holds.
    pub fn report(&self) -> CacheReport {
        let st = lock(&self.state);
        let memory_shares = shares_now(&st.shares, st.memory.capacity);
        let tiers: &[&str] = if st.disk.is_some() {
            &[MEMORY, DISK]
        } else {
            &[MEMORY]
        };
        let mut datasets: Vec<ShareUse> = st
            .shares
            .iter()
            .map(|(source, share)| {
                let held =
                    |t: Option<&tier::Held>| t.map_or((0, 0), |h| (h.bytes, h.order.len() as u64));
                let (bytes, entries) = held(st.memory.held.get(source));
                let (disk_bytes, disk_entries) =
                    held(st.disk.as_ref().and_then(|d| d.tier.held.get(source)));
                let counts = self.metrics.counts(&share.label, tiers);
                ShareUse {
                    dataset: share.label.clone(),
                    names: share.names.clone(),
                    tenant: share.terms.tenant.clone(),
                    tenant_weight: share.terms.tenant_weight,
                    weight: share.terms.weight,
                    pin_bytes: match share.terms.pin {
                        PIN_ALL => share.size.unwrap_or(0),
                        pin => pin,
                    },
                    pin_all: share.terms.pin == PIN_ALL,
                    share_bytes: memory_shares.get(source).copied().unwrap_or(0),
                    bytes,
                    entries,
                    disk_bytes,
                    disk_entries,
                    hits: counts.hits,
                    misses: counts.misses,
                    hit_bytes: counts.hit_bytes,
                    evictions: counts.evictions,
                }
            })
            .collect();
        datasets.sort_by(|a, b| a.dataset.cmp(&b.dataset));
        CacheReport {
            policy: match self.policy {
                CachePolicy::Stable => "stable",
                CachePolicy::Lru => "lru",
            },
            capacity_bytes: st.memory.capacity,
            used_bytes: st.memory.used,
            disk_capacity_bytes: st.disk.as_ref().map_or(0, |d| d.tier.capacity),
            disk_used_bytes: st.disk.as_ref().map_or(0, |d| d.tier.used),
            datasets,
        }
    }

    /// Looks a sample up; `dataset` is the stage's name for its data set.
    /// A miss claims the sample's read: others that look it up wait for it.
    pub fn lookup(self: &Arc<Self>, dataset: &str, key: &SampleKey) -> Lookup {
        self.look(dataset, key, true)
            .expect("a lookup that claims always answers")
    }

    /// [`Cache::lookup`] that claims nothing: `None` where it would answer
    /// [`Lookup::Miss`]. A reader that waits for its job's QoS limit before
    /// it reads looks with this first and claims only once the limit lets
    /// it read: a claim makes every other job that wants the sample wait
    /// for it, and they must not wait out a limit that is not theirs.
    pub fn lookup_unclaimed(self: &Arc<Self>, dataset: &str, key: &SampleKey) -> Option<Lookup> {
        self.look(dataset, key, false)
    }

    fn look(self: &Arc<Self>, dataset: &str, key: &SampleKey, claim: bool) -> Option<Lookup> {
        match self.locate(dataset, key) {
            Found::Memory(bytes) => return Some(Lookup::Hit(bytes)),
            Found::Disk(found) => {
                return Some(Lookup::Disk(DiskHit {
                    cache: Arc::clone(self),
                    key: key.clone(),
                    found,
                }));
            }
            Found::Nowhere => {}
        }
        let mut st = lock(&self.state);
        let label = label_of(&st.shares, key);
        // Another reader's fill may have landed since `locate` let go of
        // the lock: it must not be read a second time.
        let landed = (st.memory.get(key).map(|b| (b, MEMORY)))
            .or_else(|| st.queued.get(key).map(|b| (b, DISK)));
        if let Some((bytes, tier)) = landed {
            self.metrics.hit(label, tier, bytes.len() as u64);
            return Some(Lookup::Hit(Arc::clone(bytes)));
        }
        if let Some(flight) = st.pending.get(key) {
            self.metrics.miss(label);
            return Some(Lookup::Wait(Arc::clone(flight)));
        }
        if !claim {
            return None;
        }
        self.metrics.miss(label);
        let flight = Arc::new(Flight::default());
        st.pending.insert(key.clone(), Arc::clone(&flight));
        Some(Lookup::Miss(Fill {
            cache: Arc::clone(self),
            key: Some(key.clone()),
            flight,
        }))
    }

    /// `len` bytes from `offset` of a cached sample (a range within it),
    /// counting a hit of those bytes, or `None`. Of a disk file, the blocks
    /// the range touches are read and checked: a large sample read in
    /// windows (as the mount reads one) costs its size once, not once a
    /// window.
    pub fn peek_range(
        &self,
        dataset: &str,
        key: &SampleKey,
        offset: u64,
        len: u64,
    ) -> Option<Vec<u8>> {
        if offset.checked_add(len)? > key.size {
            return None;
        }
        let range = |bytes: &[u8]| {
            let start = usize::try_from(offset).ok()?;
            let end = start.checked_add(usize::try_from(len).ok()?)?;
            bytes.get(start..end).map(<[u8]>::to_vec)
        };
        let found = match self.locate(dataset, key) {
            Found::Memory(bytes) => return range(&bytes),
            Found::Disk(found) => found,
            Found::Nowhere => return None,
        };
        let mut buf = vec![0; usize::try_from(len).ok()?];
        match disk::read_range(&found.path, key, offset, &mut buf) {
            Ok(()) => {
                self.metrics.hit(&found.label, DISK, len);
                Some(buf)
            }
            Err(e) => {
                self.drop_failed(key, &found, &e);
                None
            }
        }
    }

    /// Reads a sample the disk tier holds, whole, into `buf` (its length)
    /// and checks it, counting the hit; a file that fails is removed
    /// (false).
    fn read_whole_into(&self, key: &SampleKey, found: &OnDisk, buf: &mut [u8]) -> bool {
        match disk::read_into(&found.path, key, buf) {
            Ok(()) => {
                self.metrics.hit(&found.label, DISK, buf.len() as u64);
                true
            }
            Err(e) => {
                self.drop_failed(key, found, &e);
                false
            }
        }
    }

    /// Removes a disk file that failed a read or its check.
    fn drop_failed(&self, key: &SampleKey, found: &OnDisk, e: &std::io::Error) {
        let mut st = lock(&self.state);
        if let Some(disk) = st.disk.as_mut() {
            self.metrics
                .disk_failures
                .with_label_values(&["check"])
                .inc();
            if let Some(failed) = disk.failed_checks.note(WARN_EVERY) {
                tracing::warn!(path = %found.path.display(), error = %e, failed, "dropping disk cache files that failed their check (read again from their source; this warning repeats at most once a minute)");
            }
            if let Some((file, len)) = disk.tier.remove(key) {
                let _ = std::fs::remove_file(&file.path);
                self.metrics.evicted(&found.label, DISK, len);
            }
        }
    }

    /// Finds the sample in memory, or where it is on disk, marking it used.
    fn locate(&self, dataset: &str, key: &SampleKey) -> Found {
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.tick += 1;
        let tick = st.tick;
        let share = st
            .shares
            .entry(Arc::clone(&key.source))
            .or_insert_with(|| Share::new(dataset));
        share.last_lookup = Some(Instant::now());
        if let Some(bytes) = st.memory.get(key).cloned() {
            if self.policy == CachePolicy::Lru {
                st.memory.touch(key, tick);
            }
            self.metrics.hit(&share.label, MEMORY, bytes.len() as u64);
            return Found::Memory(bytes);
        }
        // On its way to the disk tier (the writer's queue): a hit of that
        // tier, which the memory tier (perhaps of no bytes) does not hold.
        if let Some(bytes) = st.queued.get(key).cloned() {
            self.metrics.hit(&share.label, DISK, bytes.len() as u64);
            return Found::Memory(bytes);
        }
        // Not in memory: what memory holds of an older version of the
        // sample will never be asked for again.
        self.drop_other_versions(&mut st.memory, MEMORY, key, &share.label);
        let Some(disk) = st.disk.as_mut() else {
            return Found::Nowhere;
        };
        if let Some(file) = disk.tier.get(key)
            && file.ready
        {
            let found = OnDisk {
                path: file.path.clone(),
                label: share.label.clone(),
            };
            if self.policy == CachePolicy::Lru {
                disk.tier.touch(key, tick);
            }
            return Found::Disk(found);
        }
        for file in self.drop_other_versions(&mut disk.tier, DISK, key, &share.label) {
            // Unlinked under the lock: a writer of the same path (the
            // same name and version cannot be both stale and current)
            // is not racing this.
            let _ = std::fs::remove_file(&file.path);
        }
        Found::Nowhere
    }

    /// Drops what `tier` (named `which`) holds of other versions of
    /// `key`'s sample, which will never be read again, counting them as
    /// evictions of `label`; returns the dropped values.
    fn drop_other_versions<V>(
        &self,
        tier: &mut Tier<V>,
        which: &str,
        key: &SampleKey,
        label: &str,
    ) -> Vec<V> {
        let stale = tier.remove_other_versions(key);
        self.dropped(tier, which, label, stale)
    }

    /// Counts `stale`, just removed from `tier` (named `which`), as
    /// evictions of `label`; returns their values.
    fn dropped<V>(
        &self,
        tier: &Tier<V>,
        which: &str,
        label: &str,
        stale: Vec<(SampleKey, V, u64)>,
    ) -> Vec<V> {
        if stale.is_empty() {
            return Vec::new();
        }
        for (_, _, len) in &stale {
            self.metrics.evicted(label, which, *len);
        }
        self.metrics
            .used
            .with_label_values(&[which])
            .set(tier.used as i64);
        stale.into_iter().map(|(_, value, _)| value).collect()
    }

    /// Drops what the tiers hold of data set `source`'s samples under a
    /// key its newest listing does not give (`listed` says whether it
    /// does): files deleted, renamed or rewritten since they were kept,
    /// which no read will ask for again. Their room goes back to what is
    /// read now; they would otherwise hold the data set's share for good
    /// (the disk tier's across restarts too). The keys are checked against
    /// the listing with the cache unlocked. Blocking (the disk tier's files
    /// are unlinked).
    pub fn forget_unlisted(&self, source: &Arc<str>, listed: impl Fn(&SampleKey) -> bool) {
        let (in_memory, on_disk) = {
            let st = lock(&self.state);
            let on_disk = st.disk.as_ref().map(|d| d.tier.keys_of(source));
            (st.memory.keys_of(source), on_disk.unwrap_or_default())
        };
        let unlisted = |keys: Vec<SampleKey>| -> Vec<SampleKey> {
            keys.into_iter().filter(|k| !listed(k)).collect()
        };
        let (in_memory, on_disk) = (unlisted(in_memory), unlisted(on_disk));
        if in_memory.is_empty() && on_disk.is_empty() {
            return;
        }
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        let label = st
            .shares
            .get(source)
            .map_or(String::new(), |s| s.label.clone());
        let stale = st.memory.remove_all(&in_memory);
        self.dropped(&st.memory, MEMORY, &label, stale);
        let Some(disk) = st.disk.as_mut() else {
            return;
        };
        let stale = disk.tier.remove_all(&on_disk);
        for file in self.dropped(&disk.tier, DISK, &label, stale) {
            // Under the lock, as in `lookup`: no writer of the same path
            // can be racing this.
            let _ = std::fs::remove_file(&file.path);
        }
    }

    /// Sets a data set's weight in the split of the capacity, as the
    /// stage's configuration gives it.
    pub fn set_weight(&self, source: &Arc<str>, dataset: &str, weight: u32) {
        let mut st = lock(&self.state);
        let share = st
            .shares
            .entry(Arc::clone(source))
            .or_insert_with(|| Share::new(dataset));
        share.configured_weight = weight.max(1);
        share.terms = Terms::configured(weight);
    }

    /// Sets how a data set shares the cache (a cache policy's terms), or
    /// with `None` goes back to the stage's configuration; `size` is the
    /// data set's bytes when its listing is known.
    pub fn steer(&self, source: &Arc<str>, dataset: &str, terms: Option<Terms>, size: Option<u64>) {
        let mut st = lock(&self.state);
        let share = st
            .shares
            .entry(Arc::clone(source))
            .or_insert_with(|| Share::new(dataset));
        share.terms = terms.unwrap_or_else(|| Terms::configured(share.configured_weight));
        if size.is_some() {
            share.size = size;
        }
    }

    /// Which of `samples` (an index and a key each, in order) a staging
    /// round should read: those neither tier holds, as far as the room the
    /// data set has in the tiers goes (free room, or what it holds below
    /// its share, which the stable policy takes from others). Returns them,
    /// how many were held already, and whether some were left out for want
    /// of room. Counts the data set as read from now (its share).
    pub fn to_stage(
        &self,
        source: &Arc<str>,
        dataset: &str,
        samples: impl Iterator<Item = (u32, SampleKey)>,
    ) -> (Vec<u32>, u32, bool) {
        let samples: Vec<(u32, SampleKey)> = samples.collect();
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        let share = st
            .shares
            .entry(Arc::clone(source))
            .or_insert_with(|| Share::new(dataset));
        share.last_lookup = Some(Instant::now());
        // What the tiers hold of older versions of these samples will
        // never be read again: it is not room the data set has used.
        for (_, key) in &samples {
            self.drop_other_versions(&mut st.memory, MEMORY, key, &share.label);
            if let Some(disk) = st.disk.as_mut() {
                for file in self.drop_other_versions(&mut disk.tier, DISK, key, &share.label) {
                    let _ = std::fs::remove_file(&file.path);
                }
            }
        }
        let room =
            |capacity: u64, used: u64, held: Option<&tier::Held>, share: u64| match self.policy {
                CachePolicy::Lru => capacity,
                CachePolicy::Stable => capacity
                    .saturating_sub(used)
                    .max(share.saturating_sub(held.map_or(0, |h| h.bytes))),
            };
        let shares = shares_now(&st.shares, st.memory.capacity);
        let share = |shares: &HashMap<Arc<str>, u64>| shares.get(source).copied().unwrap_or(0);
        let mut memory = room(
            st.memory.capacity,
            st.memory.used,
            st.memory.held.get(source),
            share(&shares),
        );
        let mut disk = st.disk.as_ref().map_or(0, |d| {
            let shares = shares_now(&st.shares, d.tier.capacity);
            room(
                d.tier.capacity,
                d.tier.used,
                d.tier.held.get(source),
                share(&shares),
            )
        });
        let (mut chosen, mut held, mut short) = (Vec::new(), 0, false);
        for (i, key) in samples {
            let on_disk = st.disk.as_ref().is_some_and(|d| d.tier.get(&key).is_some());
            if on_disk || st.memory.get(&key).is_some() {
                // Counted wherever it is in the listing: the round's
                // progress says how much of the data set the cache holds.
                held += 1;
            } else if !short {
                if key.size <= memory {
                    memory -= key.size;
                    chosen.push(i);
                } else if st.disk.is_some() && disk::footprint(&key, key.size) <= disk {
                    disk -= disk::footprint(&key, key.size);
                    chosen.push(i);
                } else {
                    // The first that does not fit ends what is read.
                    short = true;
                }
            }
        }
        (chosen, held, short)
    }

    /// Admits `bytes` under `key` if the policy lets it (in memory, else
    /// offered to the disk); returns them shared when kept in memory or
    /// when someone waits for them on `flight`.
    fn admit(&self, key: &SampleKey, bytes: &[u8], flight: &Arc<Flight>) -> Option<Arc<[u8]>> {
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        let label = st
            .shares
            .get(&key.source)
            .map_or(String::new(), |s| s.label.clone());
        let size = bytes.len() as u64;
        let shares = shares_now(&st.shares, st.memory.capacity);
        let Some(evicted) = st.memory.make_room(self.policy, &shares, &key.source, size) else {
            self.metrics.rejected(&label);
            if self.to_disk.is_none() {
                st.pending.remove(key);
                // With the flight out of `pending`, nobody new can join it.
                let wanted = Arc::strong_count(flight) > 1;
                drop(guard);
                return wanted.then(|| Arc::from(bytes));
            }
            // On its way to the disk tier: the flight stays joinable until
            // the bytes are queued (where lookups find them), so no lookup
            // in between reads the sample again; whoever joined gets them.
            drop(guard);
            let shared: Arc<[u8]> = Arc::from(bytes);
            let queued = {
                let mut st = lock(&self.state);
                let queued = st.queued.insert(key, &shared);
                st.pending.remove(key);
                queued
            };
            if queued {
                self.send_to_disk(key, &shared);
            } else {
                self.metrics.disk_skipped(&label);
            }
            return Some(shared);
        };
        st.pending.remove(key);
        let shared: Arc<[u8]> = Arc::from(bytes);
        st.tick += 1;
        if let Some((_, len)) = st
            .memory
            .insert(key.clone(), Arc::clone(&shared), size, st.tick)
        {
            self.metrics.evicted(&label, MEMORY, len);
        }
        self.metrics.admitted(&label, MEMORY, size);
        self.metrics
            .used
            .with_label_values(&[MEMORY])
            .set(st.memory.used as i64);
        let shares = &st.shares;
        let demoted: Vec<_> = evicted
            .into_iter()
            .map(|(k, v, len)| {
                let label = label_of(shares, &k);
                self.metrics.evicted(label, MEMORY, len);
                (k, v)
            })
            .collect();
        drop(guard);
        // What memory lets go of (LRU) may still fit on disk.
        for (k, v) in demoted {
            self.offer_to_disk(&k, &v);
        }
        Some(shared)
    }

    /// Queues a sample for the disk tier, if there is one and its writer
    /// keeps up (a sample the queue has no room for is not kept).
    fn offer_to_disk(&self, key: &SampleKey, bytes: &Arc<[u8]>) {
        if self.to_disk.is_some() {
            // Findable before the writer can take it off the queue.
            let mut st = lock(&self.state);
            if st.queued.insert(key, bytes) {
                drop(st);
                self.send_to_disk(key, bytes);
            } else {
                self.metrics.disk_skipped(label_of(&st.shares, key));
            }
        }
    }

    /// Puts a sample already in `queued` (which bounds the queue) on the
    /// writer's queue, or takes it out of `queued` when the writer is gone.
    fn send_to_disk(&self, key: &SampleKey, bytes: &Arc<[u8]>) {
        let Some(tx) = &self.to_disk else { return };
        if tx.send((key.clone(), Arc::clone(bytes))).is_err() {
            let mut st = lock(&self.state);
            st.queued.remove(key);
            self.metrics.disk_skipped(label_of(&st.shares, key));
        }
    }

    /// Writes one sample to the disk tier, if the policy admits it there;
    /// returns whether the tier holds it (written now or before; no: no
    /// room, or a newer version came), or the write's error. Blocking.
    fn write_to_disk(&self, key: SampleKey, bytes: &[u8]) -> std::io::Result<bool> {
        let (path, (dir, marker), size, evicted, label) = {
            let mut st = lock(&self.state);
            let st = &mut *st;
            let Some(disk) = st.disk.as_mut() else {
                return Ok(false);
            };
            if disk.tier.get(&key).is_some() {
                return Ok(true);
            }
            let size = disk::footprint(&key, bytes.len() as u64);
            let shares = shares_now(&st.shares, disk.tier.capacity);
            let Some(evicted) = disk.tier.make_room(self.policy, &shares, &key.source, size) else {
                return Ok(false);
            };
            let path = disk::path_of(&disk.dir, &key);
            let dir = (disk.dir.clone(), disk.marker);
            st.tick += 1;
            let file = DiskFile {
                path: path.clone(),
                ready: false,
            };
            disk.tier.insert(key.clone(), file, size, st.tick);
            let label = |k: &SampleKey| {
                st.shares
                    .get(&k.source)
                    .map_or(String::new(), |s| s.label.clone())
            };
            let evicted: Vec<_> = evicted
                .into_iter()
                .map(|(k, f, len)| (label(&k), f, len))
                .collect();
            (path, dir, size, evicted, label(&key))
        };
        for (label, file, len) in evicted {
            let _ = std::fs::remove_file(&file.path);
            self.metrics.evicted(&label, DISK, len);
        }
        let written = disk::write(&dir, marker, &path, &key, bytes);
        let mut st = lock(&self.state);
        let Some(disk) = st.disk.as_mut() else {
            return Ok(false);
        };
        let kept = match written {
            Ok(()) => match disk.tier.get_mut(&key) {
                Some(file) => {
                    file.ready = true;
                    self.metrics.admitted(&label, DISK, size);
                    Ok(true)
                }
                // Dropped meanwhile (a newer version was looked up).
                None => {
                    let _ = std::fs::remove_file(&path);
                    Ok(false)
                }
            },
            Err(e) => {
                self.metrics
                    .disk_failures
                    .with_label_values(&["write"])
                    .inc();
                if let Some(failed) = disk.failed_writes.note(WARN_EVERY) {
                    tracing::warn!(
                        path = %path.display(),
                        error = %e,
                        failed,
                        "cannot write to the disk cache (samples it cannot keep are read from their source; this warning repeats at most once a minute)"
                    );
                }
                disk.tier.remove(&key);
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        };
        self.metrics
            .used
            .with_label_values(&[DISK])
            .set(disk.tier.used as i64);
        kept
    }

    /// Makes sure a sample staging read is kept: in memory if it is there,
    /// else written to the disk tier now rather than queued (staging waits
    /// for the disk; a trainer's reads do not). Returns whether either
    /// tier holds it, or why the disk tier could not write it. Blocking.
    pub fn keep(&self, key: &SampleKey, bytes: &[u8]) -> std::io::Result<bool> {
        {
            let st = lock(&self.state);
            if st.memory.get(key).is_some() {
                return Ok(true);
            }
            if st.disk.is_none() {
                return Ok(false);
            }
        }
        self.write_to_disk(key.clone(), bytes)
    }
}

/// How often a failing disk tier may warn.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Metrics label values of the tiers.
const MEMORY: &str = "memory";
const DISK: &str = "disk";

impl Share {
    fn new(label: &str) -> Self {
        Self {
            label: label.to_owned(),
            names: vec![label.to_owned()],
            configured_weight: 1,
            terms: Terms::configured(1),
            size: None,
            last_lookup: None,
        }
    }
}

/// Opens the disk tier in `dir` (created if missing; see [`disk::claim`]
/// for which directories it takes), indexing the files a previous stage
/// left for the data sets in `st.shares`.
fn open_disk(
    dir: &Path,
    capacity: u64,
    st: &mut State,
    metrics: &CacheMetrics,
) -> std::io::Result<Disk> {
    if std::fs::metadata(dir).is_ok_and(|m| !m.is_dir()) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("--cache-dir {} is not a directory", dir.display()),
        ));
    }
    std::fs::create_dir_all(dir)?;
    let claimed = disk::claim(dir)?;
    let sources: Vec<Arc<str>> = st.shares.keys().cloned().collect();
    let mut tier = Tier::new(capacity);
    for (key, path, len) in disk::scan(dir, &sources)? {
        if tier.used + len > capacity {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let label = label_of(&st.shares, &key);
        // Found, not written: the write rate operators read from
        // `admitted_bytes_total` shows no burst at a restart.
        metrics.held(label, DISK, len);
        st.tick += 1;
        let file = DiskFile { path, ready: true };
        tier.insert(key, file, len, st.tick);
    }
    metrics
        .capacity
        .with_label_values(&[DISK])
        .set(capacity as i64);
    metrics
        .used
        .with_label_values(&[DISK])
        .set(tier.used as i64);
    if tier.used > 0 {
        tracing::info!(dir = %dir.display(), bytes = tier.used, "disk cache kept from before");
    }
    // The tier stops at its size or where the file system runs out,
    // whichever comes first: say so at start, not as failed writes later.
    if let Some(free) = crate::fs_room::free_bytes(dir)
        && capacity > free + tier.used
    {
        // In the largest unit that leaves a whole number in front (a 20 MiB
        // file system read `0.0 GiB free`).
        let human = |b: u64| {
            let (unit, factor) = [("GiB", 30), ("MiB", 20), ("KiB", 10)]
                .into_iter()
                .find(|&(_, shift)| b >= 1 << shift)
                .unwrap_or(("B", 0));
            match factor {
                0 => format!("{b} B"),
                _ => format!("{:.1} {unit}", b as f64 / (1u64 << factor) as f64),
            }
        };
        tracing::warn!(
            "--cache-disk {} is more than the file system of --cache-dir {} has room for ({} free, {} of it the cache's already): the disk tier will fill it before its size, and writes that find no room are counted in sluice_stage_cache_disk_failures_total{{kind=\"write\"}}; give a smaller --cache-disk or free the space",
            human(capacity),
            dir.display(),
            human(free + tier.used),
            human(tier.used),
        );
    }
    Ok(Disk {
        dir: dir.to_owned(),
        tier,
        marker: disk::Marker::of(&claimed)?,
        _claimed: claimed,
        failed_writes: Sparse::default(),
        failed_checks: Sparse::default(),
    })
}

/// The metrics label of the data set (or data sets) `key`'s source serves.
fn label_of<'a>(shares: &'a HashMap<Arc<str>, Share>, key: &SampleKey) -> &'a str {
    shares.get(&key.source).map_or("", |s| s.label.as_str())
}

/// Each data set's share of a tier of `capacity` bytes: its pin first
/// (pins scaled down together when they add up to more than the tier),
/// then the rest by weight among those looked up lately: among their
/// tenants by tenant weight, then within each tenant by data set weight.
/// A data set neither pinned nor read lately has no share.
fn shares_now(shares: &HashMap<Arc<str>, Share>, capacity: u64) -> HashMap<Arc<str>, u64> {
    let now = Instant::now();
    let active = |sh: &Share| {
        sh.last_lookup
            .is_some_and(|at| now.duration_since(at) < ACTIVE)
    };
    // Pins of a size first (scaled down together when they add up to more
    // than the tier), then pins of `all` in what those leave: the whole
    // data set where its size is known, scaled down together likewise.
    fn scaled(pins: Vec<(&Arc<str>, u128)>, room: u128) -> Vec<(Arc<str>, u64)> {
        let total: u128 = pins.iter().map(|(_, p)| p).sum();
        pins.into_iter()
            .map(|(s, pin)| {
                let kept = if total <= room {
                    pin
                } else {
                    pin * room / total
                };
                (Arc::clone(s), kept as u64)
            })
            .collect()
    }
    let sized = shares
        .iter()
        .filter(|(_, sh)| sh.terms.pin != PIN_ALL && sh.terms.pin > 0)
        .map(|(s, sh)| (s, u128::from(sh.terms.pin.min(capacity))))
        .collect();
    let mut pins: HashMap<Arc<str>, u64> =
        scaled(sized, u128::from(capacity)).into_iter().collect();
    let left = u128::from(capacity.saturating_sub(pins.values().sum()));
    let whole = shares
        .iter()
        .filter(|(_, sh)| sh.terms.pin == PIN_ALL)
        .map(|(s, sh)| (s, u128::from(sh.size.unwrap_or(capacity).min(capacity))))
        .collect();
    pins.extend(scaled(whole, left));
    let rest = u128::from(capacity.saturating_sub(pins.values().sum()));
    // Per tenant read lately: its weight, and the weight of its data sets.
    let mut tenants: HashMap<&str, (u128, u128)> = HashMap::new();
    for sh in shares.values().filter(|sh| active(sh)) {
        let t = tenants.entry(sh.terms.tenant.as_str()).or_default();
        t.0 = u128::from(sh.terms.tenant_weight.max(1));
        t.1 += u128::from(sh.terms.weight.max(1));
    }
    let tenant_total: u128 = tenants.values().map(|t| t.0).sum();
    shares
        .iter()
        .map(|(s, sh)| {
            let weighted = match tenants.get(sh.terms.tenant.as_str()) {
                Some(&(tenant_weight, weights)) if active(sh) => {
                    rest * tenant_weight * u128::from(sh.terms.weight.max(1))
                        / (tenant_total * weights)
                }
                _ => 0,
            };
            let pinned = pins.get(s).copied().unwrap_or(0);
            (Arc::clone(s), pinned + weighted as u64)
        })
        .collect()
}

mod disk;
mod tier;

#[cfg(test)]
mod tests;
