//! One tier of the cache (memory, or local disk): its entries, what each
//! data set holds in it, and the admission and eviction policy.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::{CachePolicy, SampleKey};

/// What one data set holds in a tier.
#[derive(Debug, Default)]
pub(super) struct Held {
    pub bytes: u64,
    /// Its entries by the tick of their admission (stable) or last use
    /// (LRU), oldest first.
    pub order: BTreeMap<u64, SampleKey>,
}

#[derive(Debug)]
struct Entry<V> {
    value: V,
    len: u64,
    tick: u64,
}

/// A tier holding values of type `V` (the bytes, or where they are on
/// disk), at most `capacity` bytes.
#[derive(Debug)]
pub(super) struct Tier<V> {
    pub capacity: u64,
    pub used: u64,
    entries: HashMap<SampleKey, Entry<V>>,
    /// The keys held under each (source, name), by its hash: a sample
    /// rewritten on its storage is a new key, and the old one, which no
    /// listing will name again, is found here and dropped.
    versions: HashMap<u64, Vec<SampleKey>>,
    pub held: HashMap<Arc<str>, Held>,
}

/// The hash of a key's source and name (not its version).
fn name_hash(key: &SampleKey) -> u64 {
    let mut h = crate::entry::Fnv64::new();
    h.write(key.source.as_bytes());
    h.write(&[0]);
    h.write(key.name.as_bytes());
    h.0
}

impl<V> Tier<V> {
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            used: 0,
            entries: HashMap::new(),
            versions: HashMap::new(),
            held: HashMap::new(),
        }
    }

    pub fn get(&self, key: &SampleKey) -> Option<&V> {
        self.entries.get(key).map(|e| &e.value)
    }

    /// How many entries' values satisfy `f`.
    #[cfg(test)]
    pub fn count(&self, f: impl Fn(&V) -> bool) -> usize {
        self.entries.values().filter(|e| f(&e.value)).count()
    }

    pub fn get_mut(&mut self, key: &SampleKey) -> Option<&mut V> {
        self.entries.get_mut(key).map(|e| &mut e.value)
    }

    /// Marks `key` used at `tick` (LRU order).
    pub fn touch(&mut self, key: &SampleKey, tick: u64) {
        let Some(entry) = self.entries.get_mut(key) else {
            return;
        };
        let held = self.held.get_mut(&key.source).expect("held per entry");
        if let Some(k) = held.order.remove(&entry.tick) {
            held.order.insert(tick, k);
        }
        entry.tick = tick;
    }

    /// Inserts `value` of `len` bytes under `key` at `tick` (room must
    /// have been made); returns the value it replaced.
    pub fn insert(&mut self, key: SampleKey, value: V, len: u64, tick: u64) -> Option<(V, u64)> {
        let replaced = self.remove(&key);
        let held = self.held.entry(Arc::clone(&key.source)).or_default();
        held.bytes += len;
        held.order.insert(tick, key.clone());
        self.used += len;
        self.versions
            .entry(name_hash(&key))
            .or_default()
            .push(key.clone());
        self.entries.insert(key, Entry { value, len, tick });
        replaced
    }

    pub fn remove(&mut self, key: &SampleKey) -> Option<(V, u64)> {
        let entry = self.entries.remove(key)?;
        let held = self.held.get_mut(&key.source).expect("held per entry");
        held.order.remove(&entry.tick);
        held.bytes -= entry.len;
        self.used -= entry.len;
        let hash = name_hash(key);
        if let Some(keys) = self.versions.get_mut(&hash) {
            keys.retain(|k| k != key);
            if keys.is_empty() {
                self.versions.remove(&hash);
            }
        }
        Some((entry.value, entry.len))
    }

    /// Removes the entries of `key`'s sample under another version or size
    /// (the sample changed on its storage since they were kept).
    pub fn remove_other_versions(&mut self, key: &SampleKey) -> Vec<(SampleKey, V, u64)> {
        let stale: Vec<SampleKey> = self
            .versions
            .get(&name_hash(key))
            .into_iter()
            .flatten()
            .filter(|k| k.source == key.source && k.name == key.name && *k != key)
            .cloned()
            .collect();
        self.remove_all(&stale)
    }

    /// The keys of the entries of `source`.
    pub fn keys_of(&self, source: &Arc<str>) -> Vec<SampleKey> {
        self.held
            .get(source)
            .map_or_else(Vec::new, |held| held.order.values().cloned().collect())
    }

    /// Removes the entries under `keys` (those it holds).
    pub fn remove_all(&mut self, keys: &[SampleKey]) -> Vec<(SampleKey, V, u64)> {
        keys.iter()
            .filter_map(|k| {
                let (value, len) = self.remove(k)?;
                Some((k.clone(), value, len))
            })
            .collect()
    }

    /// Evicts what the policy says to make room for `size` more bytes of
    /// `source`, whose share of the tier is `shares[source]`. Returns the
    /// evicted entries, or `None` when the sample is not to be admitted
    /// (then at most entries above their shares were evicted).
    pub fn make_room(
        &mut self,
        policy: CachePolicy,
        shares: &HashMap<Arc<str>, u64>,
        source: &Arc<str>,
        size: u64,
    ) -> Option<Vec<(SampleKey, V, u64)>> {
        let mut evicted = Vec::new();
        if size > self.capacity {
            return None;
        }
        if policy == CachePolicy::Stable {
            let share = shares.get(source).copied().unwrap_or(0);
            let holds = self.held.get(source).map_or(0, |h| h.bytes);
            if self.used + size > self.capacity && holds + size > share {
                return None;
            }
        }
        while self.used + size > self.capacity {
            let victim = match policy {
                CachePolicy::Lru => self.least_recent(),
                CachePolicy::Stable => self.newest_above_share(shares, source),
            };
            let key = victim?;
            if let Some((value, len)) = self.remove(&key) {
                evicted.push((key, value, len));
            }
        }
        Some(evicted)
    }

    /// The least recently used entry of the tier.
    fn least_recent(&self) -> Option<SampleKey> {
        self.held
            .values()
            .filter_map(|h| h.order.first_key_value())
            .min_by_key(|(tick, _)| **tick)
            .map(|(_, key)| key.clone())
    }

    /// The newest entry of the data set (other than `source`) most above
    /// its share, so the subset it keeps is the one it had.
    fn newest_above_share(
        &self,
        shares: &HashMap<Arc<str>, u64>,
        source: &Arc<str>,
    ) -> Option<SampleKey> {
        self.held
            .iter()
            .filter(|(s, h)| *s != source && !h.order.is_empty())
            .map(|(s, h)| {
                (
                    h.bytes as i128 - shares.get(s).copied().unwrap_or(0) as i128,
                    h,
                )
            })
            .filter(|(over, _)| *over > 0)
            .max_by_key(|(over, _)| *over)
            .and_then(|(_, h)| h.order.last_key_value())
            .map(|(_, key)| key.clone())
    }
}
