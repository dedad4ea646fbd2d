//! The node cache's series (`sluice_stage_cache_*`), by data set and tier
//! (`memory`, `disk`).

use prometheus::{IntCounterVec, IntGaugeVec, Opts};

use super::Registrar;

/// The handles the cache updates.
#[derive(Debug, Clone)]
pub struct CacheMetrics {
    pub capacity: IntGaugeVec,
    pub used: IntGaugeVec,
    bytes: IntGaugeVec,
    entries: IntGaugeVec,
    hits: IntCounterVec,
    hit_bytes: IntCounterVec,
    misses: IntCounterVec,
    admitted_bytes: IntCounterVec,
    rejected: IntCounterVec,
    disk_skipped: IntCounterVec,
    evictions: IntCounterVec,
    pub staging_bytes: IntCounterVec,
    pub staging_samples: IntGaugeVec,
    /// Disk tier failures, by kind (`write`, `check`).
    pub disk_failures: IntCounterVec,
}

/// A data set's cache counters, over the tiers asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DatasetCounts {
    pub hits: u64,
    pub misses: u64,
    pub hit_bytes: u64,
    pub evictions: u64,
}

impl CacheMetrics {
    pub(super) fn new(r: &Registrar) -> Self {
        let ds = &["dataset"];
        let tiered = &["dataset", "tier"];
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            r.add(IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"))
        };
        Self {
            capacity: gauge(
                "sluice_stage_cache_capacity_bytes",
                "The node cache's capacity by tier (memory: inside the memory budget).",
                &["tier"],
            ),
            used: gauge(
                "sluice_stage_cache_used_bytes",
                "Bytes the node cache holds, by tier.",
                &["tier"],
            ),
            bytes: gauge(
                "sluice_stage_cache_bytes",
                "Bytes the node cache holds, by data set and tier.",
                tiered,
            ),
            entries: gauge(
                "sluice_stage_cache_entries",
                "Samples the node cache holds, by data set and tier.",
                tiered,
            ),
            hits: r.counter(
                "sluice_stage_cache_hits_total",
                "Lookups the cache answered, by tier.",
                tiered,
            ),
            hit_bytes: r.counter(
                "sluice_stage_cache_hit_bytes_total",
                "Bytes served from the cache instead of the source, by tier.",
                tiered,
            ),
            misses: r.counter(
                "sluice_stage_cache_misses_total",
                "Lookups the cache could not answer (the sample was read from the source, \
                 or joined a read of it already in flight).",
                ds,
            ),
            admitted_bytes: r.counter(
                "sluice_stage_cache_admitted_bytes_total",
                "Bytes a tier kept (read from the source, or let go by memory).",
                tiered,
            ),
            rejected: r.counter(
                "sluice_stage_cache_rejected_total",
                "Samples read from the source and not kept in memory (the data set's share \
                 is full: the stable policy keeps what it holds); a disk tier may take them.",
                ds,
            ),
            disk_skipped: r.counter(
                "sluice_stage_cache_disk_skipped_total",
                "Samples meant for the disk tier and not written: its writer was that far \
                 behind (32 MiB queued); they are read from the source when next wanted.",
                ds,
            ),
            evictions: r.counter(
                "sluice_stage_cache_evictions_total",
                "Samples a tier let go (to make room, or a disk file that failed its check).",
                tiered,
            ),
            staging_bytes: r.counter(
                "sluice_stage_cache_staging_bytes_total",
                "Bytes staging read from the source to load a data set into the cache.",
                ds,
            ),
            staging_samples: gauge(
                "sluice_stage_cache_staging_samples",
                "The latest staging round of a data set: samples looked at (state=done) \
                 of all its samples (state=total).",
                &["dataset", "state"],
            ),
            disk_failures: r.counter(
                "sluice_stage_cache_disk_failures_total",
                "Disk tier failures: samples it could not write (kind=write: a full or failing \
                 disk, or a directory removed under the stage) and files that failed their check \
                 or could not be read (kind=check); each sample is read from its source instead.",
                &["kind"],
            ),
        }
    }

    /// Returns a data set's counters summed over `tiers`.
    pub(crate) fn counts(&self, dataset: &str, tiers: &[&str]) -> DatasetCounts {
        let mut c = DatasetCounts {
            misses: self.misses.with_label_values(&[dataset]).get(),
            ..DatasetCounts::default()
        };
        for tier in tiers {
            c.hits += self.hits.with_label_values(&[dataset, tier]).get();
            c.hit_bytes += self.hit_bytes.with_label_values(&[dataset, tier]).get();
            c.evictions += self.evictions.with_label_values(&[dataset, tier]).get();
        }
        c
    }

    pub(crate) fn hit(&self, dataset: &str, tier: &str, bytes: u64) {
        self.hits.with_label_values(&[dataset, tier]).inc();
        self.hit_bytes
            .with_label_values(&[dataset, tier])
            .inc_by(bytes);
    }

    pub(crate) fn miss(&self, dataset: &str) {
        self.misses.with_label_values(&[dataset]).inc();
    }

    pub(crate) fn admitted(&self, dataset: &str, tier: &str, bytes: u64) {
        self.admitted_bytes
            .with_label_values(&[dataset, tier])
            .inc_by(bytes);
        self.held(dataset, tier, bytes);
    }

    /// A sample the tier holds without admitting it now (a disk tier's
    /// file found at start): held, not written.
    pub(crate) fn held(&self, dataset: &str, tier: &str, bytes: u64) {
        self.bytes
            .with_label_values(&[dataset, tier])
            .add(bytes as i64);
        self.entries.with_label_values(&[dataset, tier]).inc();
    }

    pub(crate) fn rejected(&self, dataset: &str) {
        self.rejected.with_label_values(&[dataset]).inc();
    }

    pub(crate) fn disk_skipped(&self, dataset: &str) {
        self.disk_skipped.with_label_values(&[dataset]).inc();
    }

    pub(crate) fn evicted(&self, dataset: &str, tier: &str, bytes: u64) {
        self.evictions.with_label_values(&[dataset, tier]).inc();
        self.bytes
            .with_label_values(&[dataset, tier])
            .sub(bytes as i64);
        self.entries.with_label_values(&[dataset, tier]).dec();
    }
}
