//! The controller's Prometheus metrics (`sluice_controller_*`).

mod allocation;

use std::sync::Arc;

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder, exponential_buckets,
};

pub use allocation::{AllocationMetrics, Throughput};

/// Every metric the controller exports, registered in its own registry.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// Stages by state (`connected`, `lost`).
    pub stages: IntGaugeVec,
    /// Settings versions pushed to stages.
    pub settings_pushes: IntCounter,
    /// Settings versions stages acknowledged.
    pub acks: IntCounter,
    /// Settings versions stages rejected.
    pub nacks: IntCounter,
    /// Policy revisions this controller stored (applies and deletes).
    pub policy_revisions: IntCounter,
    /// Jobs known to the controller.
    pub jobs: IntGauge,
    /// Live policies (pools and job policies).
    pub policies: IntGauge,
    /// Pools' and jobs' allocations.
    pub allocation: Arc<AllocationMetrics>,
    /// 1 while this controller holds the leader lease, 0 while it is a
    /// standby.
    pub leader: IntGauge,
    /// 0 while the leader cannot reach its store (stages keep their
    /// settings, changes are refused), 1 otherwise.
    pub store_up: IntGauge,
    /// How long each pass of the control loop took (marking silent stages
    /// lost, deciding, publishing).
    pub tick_seconds: Histogram,
}

impl Metrics {
    /// Returns the metrics, registered.
    pub fn new() -> Self {
        let registry = Registry::new();
        let stages = IntGaugeVec::new(
            Opts::new(
                "sluice_controller_stages",
                "Stages known to the controller, by state",
            ),
            &["state"],
        )
        .expect("valid metric");
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("valid metric");
        let gauge = |name: &str, help: &str| IntGauge::new(name, help).expect("valid metric");
        let m = Self {
            settings_pushes: counter(
                "sluice_controller_settings_pushes_total",
                "Settings versions pushed to stages",
            ),
            acks: counter(
                "sluice_controller_settings_acks_total",
                "Settings versions acknowledged by stages",
            ),
            nacks: counter(
                "sluice_controller_settings_nacks_total",
                "Settings versions rejected by stages",
            ),
            policy_revisions: counter(
                "sluice_controller_policy_revisions_total",
                "Policy revisions stored by this controller (applies and deletes)",
            ),
            jobs: gauge(
                "sluice_controller_jobs",
                "Jobs some stage serves now (trainers connected); jobs that left are not counted",
            ),
            policies: gauge("sluice_controller_policies", "Live policies"),
            allocation: Arc::new(AllocationMetrics::new(&registry)),
            leader: gauge(
                "sluice_controller_leader",
                "1 while this controller holds the leader lease, 0 while it is a standby",
            ),
            store_up: gauge(
                "sluice_controller_store_up",
                "0 while the leader cannot reach its store (changes are refused), 1 otherwise",
            ),
            tick_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "sluice_controller_tick_seconds",
                    "Duration of each pass of the control loop",
                )
                // 0.25 ms to about 18 s, 25% apart: fine enough for a p99.
                .buckets(exponential_buckets(0.000_25, 1.25, 51).expect("valid buckets")),
            )
            .expect("valid metric"),
            stages,
            registry,
        };
        m.store_up.set(1);
        let collectors: [Box<dyn prometheus::core::Collector>; 10] = [
            Box::new(m.stages.clone()),
            Box::new(m.settings_pushes.clone()),
            Box::new(m.acks.clone()),
            Box::new(m.nacks.clone()),
            Box::new(m.policy_revisions.clone()),
            Box::new(m.jobs.clone()),
            Box::new(m.policies.clone()),
            Box::new(m.leader.clone()),
            Box::new(m.store_up.clone()),
            Box::new(m.tick_seconds.clone()),
        ];
        for c in collectors {
            m.registry.register(c).expect("metric names are unique");
        }
        m
    }

    /// Sets the stage gauges.
    pub fn set_stages(&self, connected: usize, stopped: usize, lost: usize) {
        for (state, n) in [
            ("connected", connected),
            ("stopped", stopped),
            ("lost", lost),
        ] {
            self.stages.with_label_values(&[state]).set(n as i64);
        }
    }

    /// Returns the Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
