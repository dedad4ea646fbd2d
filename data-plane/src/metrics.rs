//! The stage's Prometheus metrics (`sluice_stage_*`). Labels are bounded:
//! job, dataset, and fixed enumerations (error code, tuner reason); never a
//! path. A job's series are removed when the job is forgotten.

use std::sync::Arc;

use crate::protocol::ErrorCode;
use crate::tuner::Reason;
use prometheus::{
    CounterVec, Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

mod cache;
pub use cache::CacheMetrics;

/// Read latency buckets: 50 µs to 5 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0,
];

/// Every metric the stage exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    datasets: DatasetSeries,
    pub job: JobSeries,
    pub connections: IntGauge,
    pub connections_refused: IntCounter,
    pub protocol_errors: IntCounterVec,
    pub memory_budget: IntGauge,
    pub memory_used: IntGauge,
    pub jobs: IntGauge,
    pub settings_version: IntGauge,
    pub controller_connected: IntGauge,
    /// Inodes of the mount the kernel holds (looked up, not yet forgotten).
    pub mount_inodes: IntGauge,
    /// Requests the kernel sent the mount, by operation.
    pub mount_requests: IntCounterVec,
    /// Bytes of planned files the mount put into the kernel's page cache.
    pub mount_stored_bytes: IntCounter,
    pub settings_rejected: IntCounter,
    /// Jobs started, by how their first read was cleared: `settings` (the
    /// controller's settings named the job), `timeout` (they did not come
    /// in time), `no-controller` (no session was up).
    pub job_starts: IntCounterVec,
    source: SourceSeries,
    pub cache: CacheMetrics,
}

/// The series of remote sources' requests, by dataset.
#[derive(Debug)]
struct SourceSeries {
    requests: IntCounterVec,
    request_latency: HistogramVec,
    retried: IntCounterVec,
    sample_errors: IntCounterVec,
}

/// The handles one remote dataset's requests update.
#[derive(Debug, Clone)]
pub struct SourceMetrics {
    dataset: String,
    requests: IntCounterVec,
    request_latency: prometheus::Histogram,
    retried: IntCounter,
    sample_errors: IntCounterVec,
    /// The last request that failed and was tried again, and why: what a
    /// sample that runs out of its deadline while requests are retried
    /// names as the cause.
    last_retried: Arc<std::sync::Mutex<Option<(std::time::Instant, String)>>>,
}

impl SourceMetrics {
    /// Notes why a request that will be tried again failed.
    pub fn note_retried(&self, why: String) {
        *crate::sync::lock(&self.last_retried) = Some((std::time::Instant::now(), why));
    }

    /// Why the last request tried again failed, if it did after `since`.
    pub fn retried_since(&self, since: std::time::Instant) -> Option<String> {
        crate::sync::lock(&self.last_retried)
            .as_ref()
            .filter(|(at, _)| *at >= since)
            .map(|(_, why)| why.clone())
    }

    /// Counts one request that ended with `outcome` (one the source
    /// retries, if `retried`) after `elapsed`.
    pub fn request(&self, outcome: &str, retried: bool, elapsed: std::time::Duration) {
        self.answered(elapsed);
        self.ended(outcome, retried);
    }

    /// Times one request's head, `elapsed` after it was sent: a request
    /// whose head says `ok` is counted by [`ended`](Self::ended) once its
    /// body has come (or failed).
    pub fn answered(&self, elapsed: std::time::Duration) {
        self.request_latency.observe(elapsed.as_secs_f64());
    }

    /// Counts one request that ended with `outcome` (one the source
    /// retries, if `retried`).
    pub fn ended(&self, outcome: &str, retried: bool) {
        self.requests
            .with_label_values(&[&self.dataset, outcome])
            .inc();
        if retried {
            self.retried.inc();
        }
    }

    /// Notes a transfer whose body stopped coming (nothing for `idle`)
    /// after its head, given up and asked for again, as why its sample
    /// runs out of its deadline if it does.
    pub fn note_stalled(&self, idle: std::time::Duration) {
        self.note_retried(format!(
            "the answer stopped coming: no bytes of it for {idle:?} (a connection that died mid-transfer, or a store that stalled)"
        ));
    }

    /// Requests the store answered with 503 SlowDown or 429 so far.
    pub fn throttled_total(&self) -> u64 {
        self.requests
            .with_label_values(&[&self.dataset, "throttled"])
            .get()
    }

    /// The counter of samples that failed for `kind`.
    pub fn sample_errors(&self, kind: &str) -> IntCounter {
        self.sample_errors.with_label_values(&[&self.dataset, kind])
    }
}

/// The series labelled by job and dataset.
#[derive(Debug)]
struct DatasetSeries {
    delivered_bytes: IntCounterVec,
    delivered_samples: IntCounterVec,
    storage_reads: IntCounterVec,
    storage_read_bytes: IntCounterVec,
    stall_seconds: CounterVec,
    read_latency: HistogramVec,
    errors: IntCounterVec,
}

/// The series labelled by job alone.
#[derive(Debug)]
pub struct JobSeries {
    pub buffer_used: IntGaugeVec,
    pub buffer_capacity: IntGaugeVec,
    pub readers_active: IntGaugeVec,
    pub reader_threads: IntGaugeVec,
    pub job_connections: IntGaugeVec,
    pub shared_lent: IntGaugeVec,
    pub shared_kept: IntGaugeVec,
    pub shared_samples: IntCounterVec,
    pub tuner_changes: IntCounterVec,
    throttled_seconds: CounterVec,
}

/// The handles one (job, dataset) pair updates on the hot path.
#[derive(Debug, Clone)]
pub struct DatasetMetrics {
    pub delivered_bytes: IntCounter,
    pub delivered_samples: IntCounter,
    pub storage_reads: IntCounter,
    pub storage_read_bytes: IntCounter,
    pub stall_seconds: prometheus::Counter,
    pub read_latency: prometheus::Histogram,
    job: String,
    dataset: String,
    errors: IntCounterVec,
}

impl DatasetMetrics {
    /// Counts a failed sample or read under its error code.
    pub fn error(&self, code: ErrorCode) {
        self.errors
            .with_label_values(&[&self.job, &self.dataset, code.name()])
            .inc();
    }
}

/// Creates metrics and registers each in one registry.
struct Registrar(Registry);

impl Registrar {
    fn add<T: prometheus::core::Collector + Clone + 'static>(&self, metric: T) -> T {
        self.0
            .register(Box::new(metric.clone()))
            .expect("metric names are unique");
        metric
    }

    fn counter(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add(IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    fn seconds(&self, name: &str, help: &str, labels: &[&str]) -> CounterVec {
        self.add(CounterVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    /// A gauge per job.
    fn gauge(&self, name: &str, help: &str) -> IntGaugeVec {
        self.add(IntGaugeVec::new(Opts::new(name, help), &["job"]).expect("valid metric"))
    }

    fn scalar(&self, name: &str, help: &str) -> IntGauge {
        self.add(IntGauge::new(name, help).expect("valid metric"))
    }
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let r = Registrar(Registry::new());
        Arc::new(Self {
            datasets: DatasetSeries::new(&r),
            job: JobSeries::new(&r),
            connections: r.scalar("sluice_stage_connections", "Open trainer connections."),
            connections_refused: r.add(
                IntCounter::new(
                    "sluice_stage_connections_refused_total",
                    "Trainer connections closed as soon as accepted: their listener held its most (a quarter of the stage's file descriptor limit).",
                )
                .expect("valid metric"),
            ),
            protocol_errors: r.counter(
                "sluice_stage_protocol_errors_total",
                "Error frames sent to trainers, by code.",
                &["code"],
            ),
            memory_budget: r.scalar(
                "sluice_stage_memory_budget_bytes",
                "The node memory budget for all prefetch buffers.",
            ),
            memory_used: r.scalar(
                "sluice_stage_memory_used_bytes",
                "Bytes reserved across all jobs' prefetch buffers.",
            ),
            jobs: r.scalar("sluice_stage_jobs", "Jobs the stage currently knows."),
            settings_version: r.scalar(
                "sluice_stage_settings_version",
                "Version of the controller's settings in force (0: none).",
            ),
            controller_connected: r.scalar(
                "sluice_stage_controller_connected",
                "1 while the session with the controller is up.",
            ),
            mount_inodes: r.scalar(
                "sluice_stage_mount_inodes",
                "Inodes of the mount the kernel holds (looked up and not yet forgotten); the stage keeps nothing for the others.",
            ),
            mount_requests: r.counter(
                "sluice_stage_mount_requests_total",
                "Requests the kernel sent the mount, by operation (lookup, getattr, readdir, open, read, release); \
                 reads the page cache answered are not requests.",
                &["op"],
            ),
            mount_stored_bytes: r.add(
                IntCounter::new(
                    "sluice_stage_mount_stored_bytes_total",
                    "Bytes of planned files the mount put into the kernel's page cache as they were opened.",
                )
                .expect("valid metric"),
            ),
            settings_rejected: r.add(
                IntCounter::new(
                    "sluice_stage_settings_rejected_total",
                    "Settings pushes the stage refused (Nack).",
                )
                .expect("valid metric"),
            ),
            job_starts: r.counter(
                "sluice_stage_job_starts_total",
                "Jobs started, by how their first storage read was cleared: settings \
                 (the controller's settings named the job), timeout (they did not come in \
                 time), no-controller (no session was up).",
                &["how"],
            ),
            source: SourceSeries {
                requests: r.counter(
                    "sluice_stage_source_requests_total",
                    "Requests to remote sources, by how they ended: ok, throttled (503 SlowDown, 429), \
                     server_error (other 5xx), denied (401, 403), not_found, out_of_range (416: the \
                     first read of an empty object), client_error (other 4xx), \
                     connection (refused, reset, timed out, or cut off mid-answer), stalled (the \
                     answer stopped coming after its head), abandoned (given up before its answer \
                     ended: its sample's deadline ran out, or the sample was no longer wanted). \
                     A request whose head says ok is counted once its whole answer has come.",
                    &["dataset", "outcome"],
                ),
                request_latency: r.add(
                    HistogramVec::new(
                        HistogramOpts::new(
                            "sluice_stage_source_request_seconds",
                            "Latency of one request to a remote source, until its answer's head (retries count separately).",
                        )
                        .buckets(LATENCY_BUCKETS.to_vec()),
                        &["dataset"],
                    )
                    .expect("valid metric"),
                ),
                retried: r.counter(
                    "sluice_stage_source_retries_total",
                    "Requests to remote sources that failed in a way the stage retries \
                     (throttled, server_error, connection, or a transfer that stalled after \
                     its head): each is tried again while its sample's deadline lasts, so one \
                     that failed just before the deadline counts too.",
                    &["dataset"],
                ),
                sample_errors: r.counter(
                    "sluice_stage_source_errors_total",
                    "Samples a remote source failed, by kind: not_found, denied, deadline \
                     (retries ran out of time), other.",
                    &["dataset", "kind"],
                ),
            },
            cache: CacheMetrics::new(&r),
            registry: r.0,
        })
    }

    /// Returns the handles of remote dataset `dataset`'s requests.
    pub fn source(&self, dataset: &str) -> SourceMetrics {
        let s = &self.source;
        SourceMetrics {
            dataset: dataset.to_owned(),
            requests: s.requests.clone(),
            request_latency: s.request_latency.with_label_values(&[dataset]),
            retried: s.retried.with_label_values(&[dataset]),
            sample_errors: s.sample_errors.clone(),
            last_retried: Arc::default(),
        }
    }

    /// Returns the hot-path handles for one job reading one dataset.
    pub fn dataset(&self, job: &str, dataset: &str) -> DatasetMetrics {
        self.datasets.handles(job, dataset)
    }

    pub fn throttled(&self, job: &str) -> prometheus::Counter {
        self.job.throttled_seconds.with_label_values(&[job])
    }

    /// Removes every series of a forgotten job.
    pub fn forget_job(&self, job: &str, datasets: &[String]) {
        for ds in datasets {
            self.datasets.forget(job, ds);
        }
        self.job.forget(job);
    }

    /// Renders the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

impl DatasetSeries {
    fn new(r: &Registrar) -> Self {
        let job_ds = &["job", "dataset"];
        Self {
            delivered_bytes: r.counter(
                "sluice_stage_delivered_bytes_total",
                "Sample bytes delivered to trainers.",
                job_ds,
            ),
            delivered_samples: r.counter(
                "sluice_stage_delivered_samples_total",
                "Samples delivered to trainers (including failed ones).",
                job_ds,
            ),
            storage_reads: r.counter(
                "sluice_stage_storage_reads_total",
                "Reads issued to storage.",
                job_ds,
            ),
            storage_read_bytes: r.counter(
                "sluice_stage_storage_read_bytes_total",
                "Bytes read from storage.",
                job_ds,
            ),
            stall_seconds: r.seconds(
                "sluice_stage_consumer_stall_seconds_total",
                "Time trainers waited for data that was not yet buffered.",
                job_ds,
            ),
            read_latency: r.add(
                HistogramVec::new(
                    HistogramOpts::new(
                        "sluice_stage_read_latency_seconds",
                        "Latency of one storage read.",
                    )
                    .buckets(LATENCY_BUCKETS.to_vec()),
                    job_ds,
                )
                .expect("valid metric"),
            ),
            errors: r.counter(
                "sluice_stage_errors_total",
                "Failed samples and reads, by error code.",
                &["job", "dataset", "code"],
            ),
        }
    }

    fn handles(&self, job: &str, dataset: &str) -> DatasetMetrics {
        let l = &[job, dataset];
        DatasetMetrics {
            delivered_bytes: self.delivered_bytes.with_label_values(l),
            delivered_samples: self.delivered_samples.with_label_values(l),
            storage_reads: self.storage_reads.with_label_values(l),
            storage_read_bytes: self.storage_read_bytes.with_label_values(l),
            stall_seconds: self.stall_seconds.with_label_values(l),
            read_latency: self.read_latency.with_label_values(l),
            job: job.to_owned(),
            dataset: dataset.to_owned(),
            errors: self.errors.clone(),
        }
    }

    fn forget(&self, job: &str, dataset: &str) {
        let l = &[job, dataset];
        let _ = self.delivered_bytes.remove_label_values(l);
        let _ = self.delivered_samples.remove_label_values(l);
        let _ = self.storage_reads.remove_label_values(l);
        let _ = self.storage_read_bytes.remove_label_values(l);
        let _ = self.stall_seconds.remove_label_values(l);
        let _ = self.read_latency.remove_label_values(l);
        for code in ErrorCode::ALL {
            let _ = self
                .errors
                .remove_label_values(&[job, dataset, code.name()]);
        }
    }
}

impl JobSeries {
    fn new(r: &Registrar) -> Self {
        Self {
            shared_lent: r.gauge(
                "sluice_stage_shared_lent_bytes",
                "Bytes of the job's samples its trainers hold in shared memory (lent, not yet returned).",
            ),
            shared_kept: r.gauge(
                "sluice_stage_shared_kept_bytes",
                "Bytes of freed slots the job's shared-memory region keeps resident for reuse, outside the node budget (at most an eighth of it; given back once the job hands out no slot for 5 s). Updated every tuner tick.",
            ),
            shared_samples: r.counter(
                "sluice_stage_shared_samples_total",
                "Samples handed to the job's trainers in shared memory (the rest of sluice_stage_delivered_samples_total went through the socket).",
                &["job"],
            ),
            buffer_used: r.gauge(
                "sluice_stage_buffer_used_bytes",
                "Bytes held in the job's prefetch buffer (buffered and in flight).",
            ),
            buffer_capacity: r.gauge(
                "sluice_stage_buffer_capacity_bytes",
                "The job's prefetch buffer capacity in force.",
            ),
            readers_active: r.gauge(
                "sluice_stage_readers_active",
                "Reader threads reading from storage right now.",
            ),
            reader_threads: r.gauge(
                "sluice_stage_readers",
                "Reader threads the job runs (the tuner's choice).",
            ),
            job_connections: r.gauge(
                "sluice_stage_job_connections",
                "Trainer connections of the job (stall seconds per second divided by this is the fraction of time its trainers waited).",
            ),
            tuner_changes: r.counter(
                "sluice_stage_tuner_changes_total",
                "Changes the auto-tuner made, by reason.",
                &["job", "reason"],
            ),
            throttled_seconds: r.seconds(
                "sluice_stage_throttled_seconds_total",
                "Reader time spent waiting on the job's QoS limiter.",
                &["job"],
            ),
        }
    }

    fn forget(&self, job: &str) {
        for reason in Reason::ALL {
            let _ = self
                .tuner_changes
                .remove_label_values(&[job, reason.name()]);
        }
        for g in [
            &self.buffer_used,
            &self.buffer_capacity,
            &self.readers_active,
            &self.reader_threads,
            &self.job_connections,
            &self.shared_lent,
            &self.shared_kept,
        ] {
            let _ = g.remove_label_values(&[job]);
        }
        let _ = self.throttled_seconds.remove_label_values(&[job]);
        let _ = self.shared_samples.remove_label_values(&[job]);
    }
}
