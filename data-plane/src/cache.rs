//! The node cache: sample bytes kept in memory for later epochs and for
//! every other job on the node that reads the same data set.
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
//! **Shares.** The capacity is split among the data sets looked up in the
//! last [`ACTIVE`] by weight (1 each unless set). Room nobody uses is free
//! for anyone; when the cache is full, a data set under its share takes
//! room from those over theirs (data sets no longer read first: their
//! share is nothing), evicting their newest entries so their older subset
//! stays stable.
//!
//! **One read per sample.** Two jobs that miss the same sample at once
//! share one source read: the first gets a [`Fill`] and reads, the others
//! get the [`Flight`] and wait for its bytes, or its error.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::CacheMetrics;
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
    /// Not cached and nobody reads it: read it, then [`Fill::complete`].
    Miss(Fill),
    /// Another reader is reading it: wait for its outcome.
    Wait(Arc<Flight>),
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

/// One data set's part of the cache.
#[derive(Debug)]
struct Share {
    /// The stage's name of the data set (the metrics label).
    label: String,
    weight: u32,
    bytes: u64,
    last_lookup: Instant,
    /// Its entries by the tick of their admission (stable) or last use
    /// (LRU), oldest first.
    order: BTreeMap<u64, SampleKey>,
}

#[derive(Debug)]
struct Entry {
    bytes: Arc<[u8]>,
    tick: u64,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<SampleKey, Entry>,
    shares: HashMap<Arc<str>, Share>,
    pending: HashMap<SampleKey, Arc<Flight>>,
    used: u64,
    tick: u64,
}

/// The node cache (memory tier).
#[derive(Debug)]
pub struct Cache {
    capacity: u64,
    policy: CachePolicy,
    state: Mutex<State>,
    metrics: CacheMetrics,
}

/// What one data set holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ShareUse {
    pub dataset: String,
    pub bytes: u64,
    pub entries: u64,
    pub weight: u32,
}

/// The cache as `/api/v1/cache` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CacheReport {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub policy: &'static str,
    pub datasets: Vec<ShareUse>,
}

impl Cache {
    pub fn new(capacity: u64, policy: CachePolicy, metrics: CacheMetrics) -> Arc<Self> {
        metrics.capacity.set(capacity as i64);
        Arc::new(Self {
            capacity,
            policy,
            state: Mutex::new(State::default()),
            metrics,
        })
    }

    /// Capacity, policy and what each data set holds.
    pub fn report(&self) -> CacheReport {
        let datasets = self.usage();
        CacheReport {
            capacity_bytes: self.capacity,
            used_bytes: datasets.iter().map(|d| d.bytes).sum(),
            policy: match self.policy {
                CachePolicy::Stable => "stable",
                CachePolicy::Lru => "lru",
            },
            datasets,
        }
    }

    /// Looks a sample up; `dataset` is the stage's name for its data set.
    pub fn lookup(self: &Arc<Self>, dataset: &str, key: &SampleKey) -> Lookup {
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.tick += 1;
        let tick = st.tick;
        let share = st
            .shares
            .entry(Arc::clone(&key.source))
            .or_insert_with(|| Share {
                label: dataset.to_owned(),
                weight: 1,
                bytes: 0,
                last_lookup: Instant::now(),
                order: BTreeMap::new(),
            });
        share.last_lookup = Instant::now();
        if let Some(entry) = st.entries.get_mut(key) {
            if self.policy == CachePolicy::Lru {
                let key = share.order.remove(&entry.tick).expect("ordered");
                share.order.insert(tick, key);
                entry.tick = tick;
            }
            self.metrics.hit(&share.label, entry.bytes.len() as u64);
            return Lookup::Hit(Arc::clone(&entry.bytes));
        }
        self.metrics.miss(&share.label);
        if let Some(flight) = st.pending.get(key) {
            return Lookup::Wait(Arc::clone(flight));
        }
        let flight = Arc::new(Flight::default());
        st.pending.insert(key.clone(), Arc::clone(&flight));
        Lookup::Miss(Fill {
            cache: Arc::clone(self),
            key: Some(key.clone()),
            flight,
        })
    }

    /// Returns a cached sample's bytes, counting a hit, or `None` (counting
    /// nothing: a read of part of a sample is not offered to the cache).
    pub fn peek(&self, key: &SampleKey) -> Option<Arc<[u8]>> {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let entry = st.entries.get(key)?;
        let share = st.shares.get_mut(&key.source)?;
        share.last_lookup = Instant::now();
        self.metrics.hit(&share.label, entry.bytes.len() as u64);
        Some(Arc::clone(&entry.bytes))
    }

    /// Sets a data set's weight in the split of the capacity.
    pub fn set_weight(&self, source: &Arc<str>, dataset: &str, weight: u32) {
        let mut st = lock(&self.state);
        let share = st
            .shares
            .entry(Arc::clone(source))
            .or_insert_with(|| Share {
                label: dataset.to_owned(),
                weight,
                bytes: 0,
                last_lookup: Instant::now(),
                order: BTreeMap::new(),
            });
        share.weight = weight.max(1);
    }

    /// What each data set holds, by name.
    pub fn usage(&self) -> Vec<ShareUse> {
        let st = lock(&self.state);
        let mut usage: Vec<_> = st
            .shares
            .values()
            .map(|s| ShareUse {
                dataset: s.label.clone(),
                bytes: s.bytes,
                entries: s.order.len() as u64,
                weight: s.weight,
            })
            .collect();
        usage.sort_by(|a, b| a.dataset.cmp(&b.dataset));
        usage
    }

    /// Admits `bytes` under `key` if the policy lets it; returns them
    /// shared when admitted or when someone waits for them on `flight`.
    fn admit(&self, key: &SampleKey, bytes: &[u8], flight: &Arc<Flight>) -> Option<Arc<[u8]>> {
        let mut st = lock(&self.state);
        st.pending.remove(key);
        // With the flight out of `pending`, nobody new can join it.
        let wanted = Arc::strong_count(flight) > 1;
        let size = bytes.len() as u64;
        if size > self.capacity || !self.make_room(&mut st, &key.source, size) {
            if let Some(share) = st.shares.get(&key.source) {
                self.metrics.rejected(&share.label);
            }
            return wanted.then(|| Arc::from(bytes));
        }
        let shared: Arc<[u8]> = Arc::from(bytes);
        st.tick += 1;
        let tick = st.tick;
        let share = st.shares.get_mut(&key.source).expect("looked up first");
        share.bytes += size;
        share.order.insert(tick, key.clone());
        self.metrics.admitted(&share.label, size);
        st.used += size;
        self.metrics.used.set(st.used as i64);
        if let Some(old) = st.entries.insert(
            key.clone(),
            Entry {
                bytes: Arc::clone(&shared),
                tick,
            },
        ) {
            // Two fills of one key (the first's bytes came back after a
            // failed flight let a waiter read too): keep the newer.
            let size = old.bytes.len() as u64;
            let share = st.shares.get_mut(&key.source).expect("looked up first");
            share.order.remove(&old.tick);
            share.bytes -= size;
            self.metrics.evicted(&share.label, size);
            st.used -= size;
        }
        Some(shared)
    }

    /// Evicts until `size` more bytes fit, as the policy allows; false
    /// when they may not be admitted.
    fn make_room(&self, st: &mut State, source: &Arc<str>, size: u64) -> bool {
        if st.used + size <= self.capacity {
            return true;
        }
        match self.policy {
            CachePolicy::Lru => {
                while st.used + size > self.capacity {
                    let victim = st
                        .shares
                        .iter()
                        .filter_map(|(s, share)| {
                            share.order.keys().next().map(|&t| (t, Arc::clone(s)))
                        })
                        .min();
                    let Some((_, victim)) = victim else {
                        return false;
                    };
                    self.evict(st, &victim, true);
                }
                true
            }
            CachePolicy::Stable => {
                let shares = self.shares_now(st);
                let within = |st: &State, s: &Arc<str>| {
                    st.shares.get(s).map_or(0, |sh| sh.bytes) + size
                        <= shares.get(s).copied().unwrap_or(0)
                };
                if !within(st, source) {
                    return false;
                }
                while st.used + size > self.capacity {
                    let victim = st
                        .shares
                        .iter()
                        .filter(|(s, _)| *s != source)
                        .map(|(s, sh)| {
                            let over =
                                sh.bytes as i128 - shares.get(s).copied().unwrap_or(0) as i128;
                            (over, Arc::clone(s))
                        })
                        .filter(|(over, _)| *over > 0)
                        .max();
                    let Some((_, victim)) = victim else {
                        return false;
                    };
                    self.evict(st, &victim, false);
                }
                true
            }
        }
    }

    /// Each data set's share of the capacity: by weight among those
    /// looked up lately, nothing for the others.
    fn shares_now(&self, st: &State) -> HashMap<Arc<str>, u64> {
        let now = Instant::now();
        let active = |sh: &Share| now.duration_since(sh.last_lookup) < ACTIVE;
        let total: u64 = st
            .shares
            .values()
            .filter(|sh| active(sh))
            .map(|sh| u64::from(sh.weight))
            .sum();
        st.shares
            .iter()
            .map(|(s, sh)| {
                let share = if active(sh) && total > 0 {
                    (u128::from(self.capacity) * u128::from(sh.weight) / u128::from(total)) as u64
                } else {
                    0
                };
                (Arc::clone(s), share)
            })
            .collect()
    }

    /// Evicts one entry of `source`: its oldest, or its newest.
    fn evict(&self, st: &mut State, source: &Arc<str>, oldest: bool) {
        let share = st.shares.get_mut(source).expect("a victim has entries");
        let entry = if oldest {
            share.order.pop_first()
        } else {
            share.order.pop_last()
        };
        let Some((_, key)) = entry else {
            return;
        };
        if let Some(entry) = st.entries.remove(&key) {
            let size = entry.bytes.len() as u64;
            share.bytes -= size;
            st.used -= size;
            self.metrics.evicted(&share.label, size);
            self.metrics.used.set(st.used as i64);
        }
    }
}

#[cfg(test)]
mod tests;
