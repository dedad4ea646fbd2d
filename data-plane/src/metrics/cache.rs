//! The node cache's series (`sluice_stage_cache_*`), by data set.

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts};

use super::Registrar;

/// The handles the cache updates.
#[derive(Debug, Clone)]
pub struct CacheMetrics {
    pub capacity: IntGauge,
    pub used: IntGauge,
    bytes: IntGaugeVec,
    entries: IntGaugeVec,
    hits: IntCounterVec,
    hit_bytes: IntCounterVec,
    misses: IntCounterVec,
    admitted_bytes: IntCounterVec,
    rejected: IntCounterVec,
    evictions: IntCounterVec,
}

impl CacheMetrics {
    pub(super) fn new(r: &Registrar) -> Self {
        let ds = &["dataset"];
        Self {
            capacity: r.scalar(
                "sluice_stage_cache_capacity_bytes",
                "The node cache's memory capacity (inside the memory budget).",
            ),
            used: r.scalar(
                "sluice_stage_cache_used_bytes",
                "Bytes the node cache holds.",
            ),
            bytes: r.add(
                IntGaugeVec::new(
                    Opts::new(
                        "sluice_stage_cache_bytes",
                        "Bytes the node cache holds, by data set.",
                    ),
                    ds,
                )
                .expect("valid metric"),
            ),
            entries: r.add(
                IntGaugeVec::new(
                    Opts::new(
                        "sluice_stage_cache_entries",
                        "Samples the node cache holds, by data set.",
                    ),
                    ds,
                )
                .expect("valid metric"),
            ),
            hits: r.counter(
                "sluice_stage_cache_hits_total",
                "Lookups the cache answered.",
                ds,
            ),
            hit_bytes: r.counter(
                "sluice_stage_cache_hit_bytes_total",
                "Bytes served from the cache instead of the source.",
                ds,
            ),
            misses: r.counter(
                "sluice_stage_cache_misses_total",
                "Lookups the cache could not answer (the sample was read from the source, \
                 or joined a read of it already in flight).",
                ds,
            ),
            admitted_bytes: r.counter(
                "sluice_stage_cache_admitted_bytes_total",
                "Bytes read from the source and kept.",
                ds,
            ),
            rejected: r.counter(
                "sluice_stage_cache_rejected_total",
                "Samples read from the source and not kept (the data set's share is full: \
                 the stable policy keeps what it holds).",
                ds,
            ),
            evictions: r.counter(
                "sluice_stage_cache_evictions_total",
                "Samples evicted to make room.",
                ds,
            ),
        }
    }

    pub(crate) fn hit(&self, dataset: &str, bytes: u64) {
        self.hits.with_label_values(&[dataset]).inc();
        self.hit_bytes.with_label_values(&[dataset]).inc_by(bytes);
    }

    pub(crate) fn miss(&self, dataset: &str) {
        self.misses.with_label_values(&[dataset]).inc();
    }

    pub(crate) fn admitted(&self, dataset: &str, bytes: u64) {
        self.admitted_bytes
            .with_label_values(&[dataset])
            .inc_by(bytes);
        self.bytes.with_label_values(&[dataset]).add(bytes as i64);
        self.entries.with_label_values(&[dataset]).inc();
    }

    pub(crate) fn rejected(&self, dataset: &str) {
        self.rejected.with_label_values(&[dataset]).inc();
    }

    pub(crate) fn evicted(&self, dataset: &str, bytes: u64) {
        self.evictions.with_label_values(&[dataset]).inc();
        self.bytes.with_label_values(&[dataset]).sub(bytes as i64);
        self.entries.with_label_values(&[dataset]).dec();
    }
}
