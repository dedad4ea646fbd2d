//! Stage configuration: command-line flags (each also an `SLUICE_*`
//! environment variable) over an optional YAML file, validated into a
//! [`StageConfig`] that cannot be invalid.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;
use sluice_policy::{ByteRate, ByteSize, Millis, OpsRate};
use sluice_proto::tls::TlsFiles;
use tonic::transport::ClientTlsConfig;

use crate::cache::CachePolicy;
use crate::job_config::{JobConfig, MAX_BURST, MAX_READERS};
use crate::source::S3Options;

use crate::token_bucket::Limits;
use crate::trust::{TrainerAccess, TrainerRule};
use crate::tuner::Bounds;

/// The default most readers (reads in flight) per job on a stage that
/// serves an object store or a network file system: enough for 100 KiB
/// samples at 50 ms each to reach about 1 GiB/s. On a local disk the
/// default is [`LOCAL_MAX_READERS`].
const REMOTE_MAX_READERS: u32 = 512;
/// The default most readers per job when every data set is on a local
/// disk, where more reads in flight than this only add threads.
const LOCAL_MAX_READERS: u32 = 64;

const MIB: u64 = 1 << 20;
/// The least of the memory budget the cache must leave to prefetch buffers.
const MIN_PREFETCH: u64 = 16 * MIB;
/// The least a cache tier may hold (a smaller one holds next to no sample:
/// a size given with no unit, which is bytes, was meant in GiB).
const MIN_CACHE: u64 = 64 << 10;

/// The trainer socket unless --socket says otherwise.
const DEFAULT_SOCKET: &str = "/tmp/sluice-stage.sock";

/// Command-line flags of `sluice-stage`.
#[derive(Debug, Default, Parser)]
#[command(
    name = "sluice-stage",
    version,
    about = "The sluice data-plane stage: prefetches training samples and serves them to trainers"
)]
pub struct Args {
    /// YAML configuration file; flags given on the command line override it.
    #[arg(long, env = "SLUICE_CONFIG")]
    pub config: Option<PathBuf>,
    /// UNIX socket trainers connect to [default: /tmp/sluice-stage.sock].
    #[arg(long, env = "SLUICE_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Also accept trainers over TCP on this address.
    #[arg(long, env = "SLUICE_LISTEN", value_parser = parse_addr)]
    pub listen: Option<SocketAddr>,
    /// A dataset to serve, as NAME=DIR or NAME=s3://BUCKET/PREFIX
    /// (repeatable; the whole value is the path, commas and all)
    /// [env: SLUICE_DATASETS, comma-separated, read when no --dataset is
    /// given].
    #[arg(long = "dataset", value_parser = parse_dataset)]
    pub datasets: Vec<(String, PathBuf)>,
    /// The datasets as NAME=DIR, comma-separated (read when no `--dataset`
    /// is given; a path with a comma is given with `--dataset` or in the
    /// file). A value split at commas broke such paths given as flags.
    #[arg(long = "datasets", env = "SLUICE_DATASETS", value_delimiter = ',', value_parser = parse_dataset, hide = true)]
    pub env_datasets: Vec<(String, PathBuf)>,
    /// Memory for all jobs' prefetch buffers together, e.g. `1GiB` [default: 1GiB].
    #[arg(long, env = "SLUICE_MEMORY_BUDGET")]
    pub memory_budget: Option<ByteSize>,
    /// Address of the HTTP server for `/metrics` and `/healthz` [default: 127.0.0.1:7190].
    #[arg(long, env = "SLUICE_METRICS_ADDR", value_parser = parse_addr)]
    pub metrics_addr: Option<SocketAddr>,
    /// This stage's id, for the controller (one session per id) and
    /// trainers [default: the host name; with a --socket other than
    /// /tmp/sluice-stage.sock, the host name, `-` and 8 hex digits of a
    /// hash of the socket's absolute path, so stages on one host differ].
    #[arg(long, env = "SLUICE_STAGE_ID")]
    pub stage_id: Option<String>,
    /// Run exactly this many readers per job and switch the tuner off.
    #[arg(long, env = "SLUICE_READERS")]
    pub readers: Option<u32>,
    /// Fewest readers the tuner may use per job [default: 1].
    #[arg(long, env = "SLUICE_MIN_READERS")]
    pub min_readers: Option<u32>,
    /// Most readers the tuner may use per job [default: 64; 512 when a
    /// dataset is in an object store, where a reader is a request in
    /// flight, not a thread].
    #[arg(long, env = "SLUICE_MAX_READERS")]
    pub max_readers: Option<u32>,
    /// Readers a new job starts with [default: 16].
    #[arg(long, env = "SLUICE_INITIAL_READERS")]
    pub initial_readers: Option<u32>,
    /// Smallest buffer the tuner may give a job [default: 4MiB].
    #[arg(long, env = "SLUICE_MIN_BUFFER")]
    pub min_buffer: Option<ByteSize>,
    /// Largest buffer the tuner may give a job [default: the memory budget].
    #[arg(long, env = "SLUICE_MAX_BUFFER")]
    pub max_buffer: Option<ByteSize>,
    /// Buffer a new job starts with [default: 256MiB or the budget if smaller].
    #[arg(long, env = "SLUICE_INITIAL_BUFFER")]
    pub initial_buffer: Option<ByteSize>,
    /// Per-job storage bandwidth limit, e.g. `200MiB/s`.
    #[arg(long, env = "SLUICE_RATE_LIMIT")]
    pub rate_limit: Option<ByteRate>,
    /// Per-job storage operations limit, e.g. `2000` or `2k ops/s`.
    #[arg(long, env = "SLUICE_OPS_LIMIT")]
    pub ops_limit: Option<OpsRate>,
    /// Burst window of the limiters in milliseconds [default: 100].
    #[arg(long, env = "SLUICE_BURST_MS")]
    pub burst_ms: Option<u64>,
    /// Prefetch with O_DIRECT, bypassing the page cache (falls back to
    /// buffered reads where the file system refuses it) [default: false:
    /// buffered reads].
    #[arg(long, env = "SLUICE_DIRECT_IO")]
    pub direct_io: Option<bool>,
    /// Offer trainers on the UNIX socket shared-memory delivery: a job's
    /// prefetch buffers live in a memory region its local trainers map,
    /// and samples are handed over by offset instead of copied through the
    /// socket [default: true].
    #[arg(long, env = "SLUICE_SHARED_MEMORY")]
    pub shared_memory: Option<bool>,
    /// The controller's gRPC address, e.g. `http://controller:7070`
    /// (`https://` with the --tls-* flags); without it the stage runs
    /// standalone on its own configuration.
    #[arg(long, env = "SLUICE_CONTROLLER")]
    pub controller: Option<String>,
    /// This stage's certificate chain (PEM) for mutual TLS with the
    /// controller; goes with --tls-key and --tls-ca.
    #[arg(long, env = "SLUICE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "SLUICE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The CA certificates (PEM) that must have signed the controller's
    /// certificate.
    #[arg(long, env = "SLUICE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// An S3-compatible object store's URL for `s3://` datasets, e.g.
    /// `http://minio:9000` [default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or the
    /// AWS profile's endpoint_url, else AWS S3].
    #[arg(long, env = "SLUICE_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,
    /// The object store's region [default: AWS_REGION, AWS_DEFAULT_REGION,
    /// the profile's region, else us-east-1].
    #[arg(long, env = "SLUICE_S3_REGION")]
    pub s3_region: Option<String>,
    /// Path-style addressing (ENDPOINT/BUCKET/KEY), which most
    /// S3-compatible servers need [default: true with an endpoint, false
    /// for AWS S3 (virtual-hosted style)].
    #[arg(long, env = "SLUICE_S3_PATH_STYLE")]
    pub s3_path_style: Option<bool>,
    /// Send unsigned requests, for public buckets [default: false].
    #[arg(long, env = "SLUICE_S3_ANONYMOUS")]
    pub s3_anonymous: Option<bool>,
    /// How long one sample from an object store may take, retries
    /// included, before it fails, e.g. `30s` [default: 30s].
    #[arg(long, env = "SLUICE_S3_DEADLINE")]
    pub s3_deadline: Option<Millis>,
    /// Memory for the node cache, taken from --memory-budget (the rest is
    /// for prefetch buffers), e.g. `8GiB` [default: 0, no cache].
    #[arg(long, env = "SLUICE_CACHE_MEMORY")]
    pub cache_memory: Option<ByteSize>,
    /// What a full cache keeps: `stable` (a fixed subset of each data set,
    /// the best hit ratio under per-epoch random order) or `lru`
    /// [default: stable].
    #[arg(long, env = "SLUICE_CACHE_POLICY")]
    pub cache_policy: Option<CachePolicy>,
    /// A local directory (e.g. on NVMe) for the cache's disk tier: samples
    /// memory does not keep, kept across restarts; needs --cache-disk.
    #[arg(long, env = "SLUICE_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// How much of --cache-dir the disk tier may fill, e.g. `200GiB`.
    #[arg(long, env = "SLUICE_CACHE_DISK")]
    pub cache_disk: Option<ByteSize>,
    /// Serve every dataset read-only under this directory, as
    /// DIR/<dataset>/... (reads belong to --mount-job) and
    /// DIR/@<job>/<dataset>/... (reads belong to <job>); needs /dev/fuse.
    #[arg(long, env = "SLUICE_MOUNT")]
    pub mount: Option<PathBuf>,
    /// The job of reads through the mount that name none [default: mount].
    #[arg(long, env = "SLUICE_MOUNT_JOB")]
    pub mount_job: Option<String>,
    /// A directory of order files for the mount: a file DIR/<job>/<dataset>
    /// listing one file name per line is that job's next epoch, prefetched
    /// in that order (write it elsewhere and rename it into place).
    #[arg(long, env = "SLUICE_MOUNT_ORDERS")]
    pub mount_orders: Option<PathBuf>,
    /// Let the kernel read files of 1 MiB or more that no plan holds
    /// straight from a local data set (FUSE passthrough; charged to the job
    /// whole when opened); `false` reads them through the stage in windows
    /// [default: true, where the kernel allows it].
    #[arg(long, env = "SLUICE_MOUNT_PASSTHROUGH")]
    pub mount_passthrough: Option<bool>,
    /// The node this stage runs on, as the controller shows it [default: the
    /// host name].
    #[arg(long, env = "SLUICE_NODE")]
    pub node: Option<String>,
    /// A label for the controller, as KEY=VALUE (repeatable; the whole
    /// value is the label's, commas and all) [env: SLUICE_LABELS,
    /// comma-separated, read when no --label is given].
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// The labels as KEY=VALUE, comma-separated (read when no `--label` is
    /// given; a value with a comma is given with `--label` or in the file).
    /// A flag's value split at commas was refused, or made two labels of
    /// one (`--label note=x,team=admin`).
    /// Read (and refused) only when no `--label` is given.
    #[arg(long = "labels", env = "SLUICE_LABELS", hide = true)]
    pub env_labels: Option<String>,
}

fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse().map_err(|_| {
        format!("`{s}` is not an address: write IP:PORT, e.g. 127.0.0.1:7190 (0.0.0.0:7190 for every interface)")
    })
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("`{s}` is not KEY=VALUE, e.g. `zone=eu-1`")),
    }
}

fn parse_dataset(s: &str) -> Result<(String, PathBuf), String> {
    let (name, dir) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}` is not NAME=DIR, e.g. `imagenet=/data/imagenet`"))?;
    if name.is_empty() || dir.is_empty() {
        return Err(format!("`{s}` is not NAME=DIR: both parts are needed"));
    }
    Ok((name.to_owned(), PathBuf::from(dir)))
}

/// The YAML configuration file (`--config`). Every field is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageFile {
    /// This stage's id.
    pub stage_id: Option<String>,
    /// UNIX socket for trainers.
    pub socket: Option<PathBuf>,
    /// Directory the data sets are mounted under (read-only FUSE).
    pub mount: Option<PathBuf>,
    /// Job of mount reads that name none.
    pub mount_job: Option<String>,
    /// Directory of order files for the mount.
    pub mount_orders: Option<PathBuf>,
    /// Large files read by the kernel from local data sets.
    pub mount_passthrough: Option<bool>,
    /// Optional TCP address for trainers.
    pub listen: Option<SocketAddr>,
    /// Address for `/metrics` and `/healthz`.
    pub metrics_addr: Option<SocketAddr>,
    /// Memory for all prefetch buffers together.
    pub memory_budget: Option<ByteSize>,
    /// Prefetch with O_DIRECT (default false).
    pub direct_io: Option<bool>,
    /// Offer shared-memory delivery to local trainers (default true).
    pub shared_memory: Option<bool>,
    /// The controller's gRPC address.
    pub controller: Option<String>,
    /// The node name.
    pub node: Option<String>,
    /// Labels for the controller.
    #[serde(default, deserialize_with = "unique_keys")]
    pub labels: BTreeMap<String, String>,
    /// Datasets by name: `imagenet: /data/imagenet`.
    #[serde(default, deserialize_with = "unique_keys")]
    pub datasets: BTreeMap<String, PathBuf>,
    /// Reader-thread settings per job.
    #[serde(default)]
    pub readers: ReadersFile,
    /// Buffer settings per job.
    #[serde(default)]
    pub buffer: BufferFile,
    /// QoS limits per job.
    #[serde(default)]
    pub limits: LimitsFile,
    /// Which jobs and labels trainers may claim (left out: any; an empty
    /// list, or the key with nothing under it, is refused).
    #[serde(default, deserialize_with = "given")]
    pub trainers: Option<Vec<TrainerRule>>,
    /// How to reach the object store of `s3://` datasets.
    #[serde(default)]
    pub s3: S3File,
    /// The node cache.
    #[serde(default)]
    pub cache: CacheFile,
}

/// `cache:` in the YAML file (the `--cache-*` flags).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheFile {
    /// Memory for the cache, inside `memory_budget`.
    pub memory: Option<ByteSize>,
    /// `stable` or `lru`.
    pub policy: Option<String>,
    /// The disk tier's directory.
    pub dir: Option<PathBuf>,
    /// The disk tier's size.
    pub disk: Option<ByteSize>,
    /// Weights of data sets in the split of the cache (1 unless given).
    #[serde(default)]
    pub weights: BTreeMap<String, u32>,
}

/// `s3:` in the YAML file (the `--s3-*` flags).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3File {
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub path_style: Option<bool>,
    pub anonymous: Option<bool>,
    pub deadline: Option<Millis>,
}

/// `readers:` in the YAML file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadersFile {
    /// Fewest readers the tuner may use.
    pub min: Option<u32>,
    /// Most readers the tuner may use.
    pub max: Option<u32>,
    /// Readers a new job starts with.
    pub initial: Option<u32>,
    /// Exactly this many readers, tuner off.
    pub fixed: Option<u32>,
}

/// `buffer:` in the YAML file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BufferFile {
    /// Smallest buffer the tuner may choose.
    pub min: Option<ByteSize>,
    /// Largest buffer the tuner may choose.
    pub max: Option<ByteSize>,
    /// Buffer a new job starts with.
    pub initial: Option<ByteSize>,
}

/// `limits:` in the YAML file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsFile {
    /// Storage bandwidth per job, e.g. `200MiB/s`.
    pub bytes_per_second: Option<ByteRate>,
    /// Storage operations per job, e.g. `2k ops/s`.
    pub ops_per_second: Option<OpsRate>,
    /// Burst window in milliseconds.
    pub burst_ms: Option<u64>,
}

/// A validated stage configuration.
#[derive(Debug, Clone)]
pub struct StageConfig {
    pub stage_id: String,
    pub socket: PathBuf,
    pub listen: Option<SocketAddr>,
    pub metrics_addr: SocketAddr,
    pub memory_budget: u64,
    pub datasets: Vec<(String, PathBuf)>,
    pub direct_io: bool,
    pub shared_memory: bool,
    pub job: JobConfig,
    pub controller: Option<String>,
    /// Mutual TLS with the controller (`https://` URLs only).
    pub controller_tls: Option<ClientTlsConfig>,
    pub node: String,
    pub labels: BTreeMap<String, String>,
    /// Which jobs and labels trainers may claim.
    pub trainer_access: TrainerAccess,
    /// How `s3://` datasets are reached.
    pub s3: S3Options,
    /// The node cache (its memory is part of `memory_budget`).
    pub cache: CacheOptions,
    /// The read-only mount.
    pub mount: Option<MountOptions>,
}

/// The read-only mount's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    /// Where the data sets are mounted.
    pub dir: PathBuf,
    /// The job of reads that name none.
    pub job: String,
    /// Where order files are picked up, if anywhere.
    pub orders: Option<PathBuf>,
    /// Whether large files may be passed through to local data sets.
    pub passthrough: bool,
}

/// The node cache's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CacheOptions {
    /// Bytes of memory (0: no cache).
    pub memory: u64,
    pub policy: CachePolicy,
    /// Data sets' weights in the split of the capacity (others: 1).
    pub weights: BTreeMap<String, u32>,
    /// The disk tier: its directory and size.
    pub disk: Option<(PathBuf, u64)>,
}

impl CacheOptions {
    /// Whether the stage has a cache at all.
    pub fn enabled(&self) -> bool {
        self.memory > 0 || self.disk.is_some()
    }
}

impl StageConfig {
    /// The part of the memory budget left for prefetch buffers.
    pub fn prefetch_budget(&self) -> u64 {
        self.memory_budget - self.cache.memory
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(String);

impl ConfigError {
    /// A refusal found once the stage begins to start (a `--cache-dir` it
    /// cannot take), which exits as the others do.
    pub(crate) fn new(why: String) -> Self {
        Self(why)
    }
}

impl StageConfig {
    /// Reads the YAML file named by `--config` (if any), lays the flags
    /// over it and validates the result.
    pub fn from_args(args: Args) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => load_file(path)?,
            None => StageFile::default(),
        };
        Self::merge(args, file)
    }

    /// Lays the flags over the file and validates the result.
    fn merge(args: Args, file: StageFile) -> Result<Self, ConfigError> {
        let flags = if args.datasets.is_empty() {
            &args.env_datasets
        } else {
            &args.datasets
        };
        let datasets = merge_datasets(&file.datasets, flags)?;
        let memory_budget = memory_budget(args.memory_budget.or(file.memory_budget))?;
        let cache = cache_options(&args, &file.cache, memory_budget, &datasets)?;
        // Read once for every data set (unreadable: every one counts as local).
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let in_store =
            |location: &PathBuf| location.to_str().is_some_and(|l| l.starts_with("s3://"));
        let remote = datasets
            .iter()
            .any(|(_, location)| in_store(location) || on_network_file_system(&mounts, location));
        let job = job_config(&args, &file, memory_budget - cache.memory, remote)?;
        let any_in_store = datasets.iter().any(|(_, l)| in_store(l));
        let s3 = s3_options(&args, &file.s3, any_in_store)?;
        if !any_in_store && let Some(flag) = s3_given(&args, &file.s3) {
            // Not refused: a chart's values may set the object store for
            // every stage while this one reads local data sets only.
            tracing::warn!(
                "{flag} has no effect: no data set is in an object store (`--dataset NAME=s3://BUCKET/PREFIX`)"
            );
        }
        for (key, value) in &file.labels {
            sluice_policy::check_label(key, value)
                .map_err(|e| ConfigError(format!("`labels:` in the configuration file: {e}")))?;
        }
        let (flags, given) = match (args.labels, args.env_labels) {
            (labels, Some(listed)) if labels.is_empty() => {
                let labels = listed
                    .split(',')
                    .map(parse_label)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| ConfigError(format!("SLUICE_LABELS: {e}")))?;
                (labels, "SLUICE_LABELS: ")
            }
            (labels, _) => (labels, "--label "),
        };
        for (key, value) in &flags {
            sluice_policy::check_label(key, value)
                .map_err(|e| ConfigError(format!("{given}{key}={value}: {e}")))?;
        }
        let mut labels = file.labels;
        labels.extend(flags);
        let controller = args.controller.or(file.controller);
        // Mutual TLS with the controller: the stage presents its
        // certificate and accepts only a controller whose certificate
        // --tls-ca signed, for the host of the `https://` URL.
        let controller_tls = TlsFiles::read_all_or_none(
            args.tls_cert.as_deref(),
            args.tls_key.as_deref(),
            args.tls_ca.as_deref(),
        )
        .and_then(|files| files.map(TlsFiles::client).transpose())
        .map_err(|e| ConfigError(e.to_string()))?;
        check_controller(controller.as_deref(), controller_tls.is_some())?;
        let socket = args
            .socket
            .or(file.socket)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET));
        check_socket_path(&socket).map_err(ConfigError)?;
        let stage_id = args
            .stage_id
            .or(file.stage_id)
            .unwrap_or_else(|| default_stage_id(&hostname(), &socket));
        if stage_id.trim().is_empty() {
            return Err(ConfigError(
                "the stage id is empty: give --stage-id (or `stage_id:`) a name, or leave it out for the default"
                    .into(),
            ));
        }
        let node = args.node.or(file.node).unwrap_or_else(hostname);
        if node.trim().is_empty() {
            return Err(ConfigError(
                "the node name is empty: give --node (or `node:`) a name, or leave it out for the host name"
                    .into(),
            ));
        }
        for (what, name) in [("--stage-id", &stage_id), ("--node", &node)] {
            // What the controller would refuse in the stage's hello.
            if name.len() > 253 || name.chars().any(char::is_control) {
                return Err(ConfigError(format!(
                    "{what} `{}` must be at most 253 bytes with no control characters (line breaks, escapes)",
                    name.escape_debug()
                )));
            }
        }
        if file.trainers.as_ref().is_some_and(Vec::is_empty) {
            return Err(ConfigError(
                "`trainers:` holds no rule (an empty list, or nothing under the key: every rule commented out?), which would let every trainer claim any job: give at least one rule, or leave `trainers:` out for no restriction"
                    .into(),
            ));
        }
        let trainers = file.trainers.unwrap_or_default();
        for (i, rule) in trainers.iter().enumerate() {
            rule.validate(i).map_err(ConfigError)?;
        }
        let trainer_access = TrainerAccess::new(trainers);
        let given_job = args.mount_job.or(file.mount_job);
        if let Some(job) = &given_job
            && !crate::protocol::valid_job_id(job)
        {
            return Err(ConfigError(format!(
                "--mount-job `{job}` is not a job id: use 1 to 128 letters, digits, `.`, `_` and `-`"
            )));
        }
        let mount_job = given_job
            .clone()
            .unwrap_or_else(|| DEFAULT_MOUNT_JOB.to_owned());
        let passthrough = args.mount_passthrough.or(file.mount_passthrough);
        let orders = args.mount_orders.or(file.mount_orders);
        let mount = match args.mount.or(file.mount) {
            Some(dir) => Some(MountOptions {
                dir: {
                    apart_from_datasets("--mount", &dir, &datasets)?;
                    if let Some(orders) = &orders {
                        apart_from_datasets("--mount-orders", orders, &datasets)?;
                        if orders.exists() && !orders.is_dir() {
                            return Err(ConfigError(format!(
                                "--mount-orders {} is not a directory: give the directory order files are written into (it is made if missing)",
                                orders.display()
                            )));
                        }
                    }
                    let cache_dir = cache.disk.as_ref().map(|(d, _)| d);
                    for (flag, path) in [
                        ("--socket", Some(socket.as_path())),
                        ("--mount-orders", orders.as_deref()),
                        ("--cache-dir", cache_dir.map(PathBuf::as_path)),
                    ] {
                        if let Some(path) = path {
                            outside_mount(flag, path, &dir)?;
                        }
                    }
                    dir
                },
                job: mount_job,
                orders,
                passthrough: passthrough.unwrap_or(true),
            }),
            None if orders.is_some() => {
                return Err(ConfigError(
                    "--mount-orders needs --mount: order files say in which order the mount's files will be opened".into(),
                ));
            }
            // Said without the mount it shapes, a flag would be ignored.
            None if given_job.is_some() => {
                return Err(ConfigError(
                    "--mount-job needs --mount: it names the job of reads through the mount that name none".into(),
                ));
            }
            None if passthrough.is_some() => {
                return Err(ConfigError(
                    "--mount-passthrough needs --mount: it says whether the mount's large files are passed through".into(),
                ));
            }
            None => None,
        };
        Ok(Self {
            stage_id,
            socket,
            listen: args.listen.or(file.listen),
            metrics_addr: args
                .metrics_addr
                .or(file.metrics_addr)
                .unwrap_or_else(|| ([127, 0, 0, 1], 7190).into()),
            memory_budget,
            datasets,
            direct_io: args.direct_io.or(file.direct_io).unwrap_or(false),
            shared_memory: args.shared_memory.or(file.shared_memory).unwrap_or(true),
            controller,
            controller_tls,
            node,
            labels,
            trainer_access,
            job,
            s3,
            cache,
            mount,
        })
    }
}

/// The job of reads through the mount that name none.
pub const DEFAULT_MOUNT_JOB: &str = "mount";

/// A list whose key is given with nothing under it (YAML's null: every
/// item commented out) as an empty one, not as a key left out.
fn given<'de, D, T>(deserializer: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<Vec<T>>::deserialize(deserializer).map(|list| Some(list.unwrap_or_default()))
}

/// A map in which a key given twice is an error (YAML keeps the last).
fn unique_keys<'de, D, V>(deserializer: D) -> Result<BTreeMap<String, V>, D::Error>
where
    D: serde::Deserializer<'de>,
    V: Deserialize<'de>,
{
    struct Unique<V>(std::marker::PhantomData<V>);
    impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Unique<V> {
        type Value = BTreeMap<String, V>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a map of names")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some((key, value)) = map.next_entry::<String, V>()? {
                if out.contains_key(&key) {
                    return Err(serde::de::Error::custom(format!(
                        "`{key}` is given twice: give each name once"
                    )));
                }
                out.insert(key, value);
            }
            Ok(out)
        }
    }
    deserializer.deserialize_map(Unique(std::marker::PhantomData))
}

/// Returns the file's datasets with the `--dataset` flags laid over them (a
/// flag replaces the file's dataset of the same name), refusing none at all
/// and names that cannot be a dataset's.
fn merge_datasets(
    file: &BTreeMap<String, PathBuf>,
    flags: &[(String, PathBuf)],
) -> Result<Vec<(String, PathBuf)>, ConfigError> {
    let mut datasets: Vec<(String, PathBuf)> = file.clone().into_iter().collect();
    for (i, (name, dir)) in flags.iter().enumerate() {
        if flags[..i].iter().any(|(n, _)| n == name) {
            return Err(ConfigError(format!(
                "dataset `{name}` is given twice in --dataset (or SLUICE_DATASETS): give each name once"
            )));
        }
        datasets.retain(|(n, _)| n != name);
        datasets.push((name.clone(), dir.clone()));
    }
    if datasets.is_empty() {
        return Err(ConfigError(
            "no dataset configured: pass --dataset NAME=DIR (or `datasets:` in --config)".into(),
        ));
    }
    if let Some((name, _)) = datasets
        .iter()
        .find(|(n, _)| !sluice_policy::valid_dataset_name(n))
    {
        return Err(ConfigError(format!(
            "dataset name `{}` is invalid: at most 128 bytes, no `/` or control characters (line breaks, escapes), not `.` or `..`, not starting with `@` (the mount's job directories), e.g. `imagenet`",
            name.escape_debug()
        )));
    }
    // A URL of another kind (or a mistyped `s3://`) would be read as a
    // relative directory that does not exist.
    for (name, location) in &datasets {
        let text = location.to_string_lossy();
        if text.starts_with("s3://") {
            crate::source::parse_s3_url(&text)
                .map_err(|e| ConfigError(format!("dataset `{name}`: {e}")))?;
            continue;
        }
        let scheme = text.split_once(':').map_or("", |(scheme, _)| scheme);
        let url_like = !scheme.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
        if url_like && !location.exists() {
            let hint = if scheme.eq_ignore_ascii_case("s3") {
                "an object store is `s3://BUCKET/PREFIX`"
            } else {
                "sources are local directories and `s3://BUCKET/PREFIX` (S3 and its compatibles)"
            };
            return Err(ConfigError(format!(
                "dataset `{name}`: `{text}` is neither a directory nor a URL the stage reads: {hint}"
            )));
        }
        match std::fs::metadata(location) {
            Ok(meta) if meta.is_dir() => readable(name, &text, location)?,
            Ok(_) => {
                return Err(ConfigError(format!(
                    "dataset `{name}` root {text} is not a directory: give the directory that holds its files"
                )));
            }
            Err(e) => {
                return Err(ConfigError(format!(
                    "dataset `{name}` root {text}: {e}: give an existing directory (or s3://BUCKET/PREFIX)"
                )));
            }
        }
    }
    Ok(datasets)
}

/// Refuses a data set directory the stage's user may not list, or look
/// into (its first entry): such a stage said it was ready, and every
/// trainer's listing of the data set failed with "Permission denied".
/// Other failures are left to the listing, which says what it left out
/// (a stale mount among the entries, an entry deleted meanwhile).
fn readable(name: &str, text: &str, dir: &Path) -> Result<(), ConfigError> {
    let looked = std::fs::read_dir(dir).and_then(|mut entries| match entries.next() {
        Some(Ok(first)) => std::fs::symlink_metadata(first.path()).map(drop),
        _ => Ok(()),
    });
    match looked {
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(ConfigError(format!(
            "dataset `{name}` root {text} cannot be read by the user the stage runs as ({e}): give that user read and search permission on it, or run the stage as one that has them"
        ))),
        _ => Ok(()),
    }
}

/// Returns the memory budget in bytes (1GiB unless given), refusing one
/// below 1MiB.
fn memory_budget(given: Option<ByteSize>) -> Result<u64, ConfigError> {
    let memory_budget = given.map_or(1 << 30, ByteSize::bytes);
    if memory_budget < MIB {
        return Err(ConfigError(format!(
            "memory budget of {memory_budget} bytes is too small: give at least 1MiB, e.g. `--memory-budget 1GiB`"
        )));
    }
    Ok(memory_budget)
}

/// Returns the node cache's configuration: the `--cache-*` flags laid over
/// the file's `cache:`, refusing a cache that leaves the prefetch buffers
/// less than [`MIN_PREFETCH`] of the budget.
fn cache_options(
    args: &Args,
    file: &CacheFile,
    budget: u64,
    datasets: &[(String, PathBuf)],
) -> Result<CacheOptions, ConfigError> {
    let memory = args.cache_memory.or(file.memory).map_or(0, ByteSize::bytes);
    let disk_size = args.cache_disk.or(file.disk).map_or(0, ByteSize::bytes);
    for (flag, size) in [("--cache-memory", memory), ("--cache-disk", disk_size)] {
        if size > 0 && size < MIN_CACHE {
            // Under a KiB, the unit was most likely left out (`--cache-disk
            // 200` meant GiB); the hint named such a number for `10KiB` too.
            let hint = if size < 1024 {
                format!(
                    " (a size written with no unit, as `{size}`, is in bytes: write `{size}GiB` for that many GiB)"
                )
            } else {
                String::new()
            };
            return Err(ConfigError(format!(
                "{flag} of {} holds next to no sample: give at least {}{hint}",
                ByteSize(size),
                ByteSize(MIN_CACHE)
            )));
        }
    }
    if memory > 0 && memory.saturating_add(MIN_PREFETCH) > budget {
        return Err(ConfigError(format!(
            "a cache of {} leaves the prefetch buffers less than {} of the memory budget ({}): \
             raise --memory-budget or lower --cache-memory",
            ByteSize(memory),
            ByteSize(MIN_PREFETCH),
            ByteSize(budget)
        )));
    }
    let policy = match (args.cache_policy, &file.policy) {
        (Some(policy), _) => policy,
        (None, Some(name)) => name
            .parse()
            .map_err(|e| ConfigError(format!("cache.policy: {e}")))?,
        (None, None) => CachePolicy::default(),
    };
    for (name, &weight) in &file.weights {
        if !datasets.iter().any(|(n, _)| n == name) {
            return Err(ConfigError(format!(
                "cache.weights names `{name}`, which is not a configured dataset"
            )));
        }
        if weight == 0 {
            return Err(ConfigError(format!(
                "cache.weights.{name} is 0: give a weight of at least 1"
            )));
        }
    }
    let disk = match (
        args.cache_dir.clone().or_else(|| file.dir.clone()),
        args.cache_disk.or(file.disk),
    ) {
        (Some(dir), Some(size)) if size.bytes() > 0 => {
            apart_from_datasets("--cache-dir", &dir, datasets)?;
            if std::fs::metadata(&dir).is_ok_and(|m| !m.is_dir()) {
                return Err(ConfigError(format!(
                    "--cache-dir {} is not a directory: give the directory the disk tier lives in (it is made if missing)",
                    dir.display()
                )));
            }
            Some((dir, size.bytes()))
        }
        (None, None) => None,
        (Some(_), Some(_)) => {
            return Err(ConfigError(
                "--cache-disk is 0 with --cache-dir: give how much of the directory the cache may fill, e.g. `100GiB` (or leave both out for no disk tier)".into(),
            ));
        }
        (Some(_), None) => {
            return Err(ConfigError(
                "--cache-dir needs --cache-disk: how much of the directory the cache may fill, e.g. `100GiB`".into(),
            ));
        }
        (None, Some(_)) => {
            return Err(ConfigError(
                "--cache-disk needs --cache-dir: the directory the disk tier lives in".into(),
            ));
        }
    };
    if memory == 0 && disk.is_none() && (args.cache_policy.is_some() || file.policy.is_some()) {
        return Err(ConfigError(
            "a cache policy is given but there is no cache: add --cache-memory or --cache-dir and --cache-disk, or leave the policy out".into(),
        ));
    }
    Ok(CacheOptions {
        memory,
        policy,
        weights: file.weights.clone(),
        disk,
    })
}

/// Refuses a path of the stage's own (`flag`) at or beneath the mount
/// directory `mount`: the mount hides it (a socket no trainer could reach,
/// order files no one could write, a cache on a read-only view).
fn outside_mount(flag: &str, path: &Path, mount: &Path) -> Result<(), ConfigError> {
    if resolved(path).starts_with(resolved(mount)) {
        return Err(ConfigError(format!(
            "{flag} {} is inside --mount {}, which the mount hides once it is up: give a path outside the mount",
            path.display(),
            mount.display()
        )));
    }
    Ok(())
}

/// Why `path` cannot be the trainer socket, if it cannot: empty, or longer
/// than a UNIX socket address holds (`sun_path`, 108 bytes with the NUL).
pub fn check_socket_path(path: &Path) -> Result<(), String> {
    let bytes = path.as_os_str().len();
    if bytes == 0 {
        return Err("--socket is empty: give the path of the UNIX socket trainers connect to, e.g. /run/sluice/stage.sock".into());
    }
    if bytes >= 108 {
        return Err(format!(
            "--socket {} is {bytes} bytes long: a UNIX socket path must be at most 107 bytes; choose a shorter one",
            path.display()
        ));
    }
    Ok(())
}

/// Refuses a directory of the stage's own (`flag`: `--cache-dir`, whose
/// files would be listed as samples; `--mount`, where the stage would
/// read its data set through itself) at or inside a local data set's
/// root, or holding one.
fn apart_from_datasets(
    flag: &str,
    dir: &Path,
    datasets: &[(String, PathBuf)],
) -> Result<(), ConfigError> {
    let own = resolved(dir);
    let why = if flag == "--mount" {
        "the stage would read the data set through its own mount"
    } else {
        "its files would be read as samples"
    };
    for (name, root) in datasets {
        let Ok(root) = std::fs::canonicalize(root) else {
            // An object store's URL, or a root that is missing (refused
            // when the stage opens it).
            continue;
        };
        if own.starts_with(&root) {
            return Err(ConfigError(format!(
                "{flag} {} is inside data set `{name}` ({}): {why}; give a directory outside \
                 every data set",
                dir.display(),
                root.display()
            )));
        }
        if root.starts_with(&own) {
            return Err(ConfigError(format!(
                "data set `{name}` ({}) is inside {flag} {}: {why}; give {flag} a directory of \
                 its own",
                root.display(),
                dir.display()
            )));
        }
    }
    Ok(())
}

/// `path` with symlinks resolved as far as it exists (the rest appended).
pub(crate) fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = std::fs::canonicalize(existing) {
            return rest.iter().rev().fold(real, |p: PathBuf, c| p.join(c));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                existing = parent;
            }
            _ => return absolute,
        }
    }
}

/// Returns how `s3://` datasets are reached: the `--s3-*` flags laid over
/// the file's `s3:`. The environment's endpoint is looked for only when
/// `in_store` (some data set is in an object store): a stage reading local
/// data sets leaves the AWS settings it finds to other tools.
fn s3_options(args: &Args, file: &S3File, in_store: bool) -> Result<S3Options, ConfigError> {
    // Resolved here, once: an endpoint from the environment is a server of
    // one's own too, and takes path-style addressing unless told otherwise.
    let endpoint = match args.s3_endpoint.clone().or_else(|| file.endpoint.clone()) {
        Some(endpoint) => Some((endpoint, "--s3-endpoint".to_owned())),
        None if in_store => crate::source::configured_endpoint(),
        None => None,
    };
    if let Some((endpoint, from)) = &endpoint {
        check_endpoint(endpoint, from)?;
    }
    let endpoint = endpoint.map(|(endpoint, _)| endpoint);
    let deadline = args
        .s3_deadline
        .or(file.deadline)
        .map_or(S3Options::default().deadline, Millis::duration);
    if deadline < Duration::from_millis(100) {
        return Err(ConfigError(format!(
            "an S3 deadline of {deadline:?} leaves no time for a request: give at least 100ms"
        )));
    }
    Ok(S3Options {
        path_style: args
            .s3_path_style
            .or(file.path_style)
            .unwrap_or(endpoint.is_some()),
        endpoint,
        region: args.s3_region.clone().or_else(|| file.region.clone()),
        anonymous: args.s3_anonymous.or(file.anonymous).unwrap_or(false),
        deadline,
    })
}

/// Returns the first of the `--s3-*` flags (or `s3:` keys) given, if any.
fn s3_given(args: &Args, file: &S3File) -> Option<&'static str> {
    [
        (
            "--s3-endpoint",
            args.s3_endpoint.is_some() || file.endpoint.is_some(),
        ),
        (
            "--s3-region",
            args.s3_region.is_some() || file.region.is_some(),
        ),
        (
            "--s3-path-style",
            args.s3_path_style.is_some() || file.path_style.is_some(),
        ),
        (
            "--s3-anonymous",
            args.s3_anonymous.is_some() || file.anonymous.is_some(),
        ),
        (
            "--s3-deadline",
            args.s3_deadline.is_some() || file.deadline.is_some(),
        ),
    ]
    .into_iter()
    .find_map(|(flag, given)| given.then_some(flag))
}

/// Refuses an object store's endpoint that is not an `http(s)://HOST[:PORT]`
/// URL (`from`: where it was given, a flag, a variable or a file), before
/// any request is tried with it.
fn check_endpoint(endpoint: &str, from: &str) -> Result<(), ConfigError> {
    let why = match url::Url::parse(endpoint) {
        Ok(url) if !matches!(url.scheme(), "http" | "https") => {
            format!("the scheme is `{}://`", url.scheme())
        }
        Ok(url) if url.host_str().is_none_or(str::is_empty) => "it names no host".to_owned(),
        Ok(_) => return Ok(()),
        Err(url::ParseError::RelativeUrlWithoutBase) => "it has no scheme".to_owned(),
        Err(e) => e.to_string(),
    };
    Err(ConfigError(format!(
        "{from} `{}` is not an object store's URL ({why}): write http(s)://HOST[:PORT], e.g. `http://minio:9000`",
        endpoint.escape_debug()
    )))
}

/// Whether `dir` is on a file system whose every read is a round trip over
/// a network or to a user-space server (NFS, SMB, Lustre, GPFS, CephFS,
/// BeeGFS, 9P, AFS, FUSE): reads there take milliseconds, so keeping a
/// read rate needs many more in flight than on a local disk. `mountinfo`
/// is the text of `/proc/self/mountinfo`; a path that cannot be examined
/// counts as local.
pub(crate) fn on_network_file_system(mountinfo: &str, dir: &Path) -> bool {
    let Ok(dir) = dir.canonicalize() else {
        return false;
    };
    mount_type(mountinfo, &dir).is_some_and(network_file_system)
}

/// The type of the file system `path` (canonical) is on, from the text of
/// `/proc/self/mountinfo`: the mount with the longest mount point above
/// it (the last one mounted, where several are on one point).
fn mount_type<'a>(mountinfo: &'a str, path: &Path) -> Option<&'a str> {
    let mut best: Option<(usize, &str)> = None;
    for (point, kind, _, _) in mounts(mountinfo) {
        if path.starts_with(&point) && best.is_none_or(|(len, _)| point.len() >= len) {
            best = Some((point.len(), kind));
        }
    }
    best.map(|(_, kind)| kind)
}

/// The mounts of a `/proc/self/mountinfo` text: mount point (unescaped),
/// file system type, source and device (`MAJ:MIN`).
pub(crate) fn mounts(mountinfo: &str) -> impl Iterator<Item = (String, &str, &str, &str)> {
    mountinfo.lines().filter_map(|line| {
        // ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER-OPTIONS
        let mut fields = line.split(' ');
        let device = fields.nth(2)?;
        let point = unescape_octal(fields.nth(1)?);
        let mut tail = fields.skip_while(|f| *f != "-").skip(1);
        Some((point, tail.next()?, tail.next().unwrap_or(""), device))
    })
}

/// A mountinfo field with its `\ooo` escapes (space, tab, newline, `\`)
/// undone.
fn unescape_octal(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        match rest
            .get(i + 1..i + 4)
            .and_then(|o| u8::from_str_radix(o, 8).ok())
        {
            Some(byte) => {
                out.push(char::from(byte));
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Whether a mountinfo file system type is one read over a network or
/// through a user-space server.
fn network_file_system(kind: &str) -> bool {
    const NETWORK: &[&str] = &[
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "ceph",
        "beegfs",
        "9p",
        "afs",
        "fuse",
        "glusterfs",
        "wekafs",
    ];
    NETWORK.contains(&kind) || kind.starts_with("fuse.")
}

/// Returns the configuration every job starts with: the reader, buffer and
/// limit flags laid over the file's `readers:`, `buffer:` and `limits:`.
/// With a dataset in an object store or on a network file system
/// (`remote`), reads take milliseconds and the default ceiling of reads
/// in flight is higher.
fn job_config(
    args: &Args,
    file: &StageFile,
    memory_budget: u64,
    remote: bool,
) -> Result<JobConfig, ConfigError> {
    let fixed = fixed_readers(args, &file.readers)?;
    let (min_readers, max_readers, initial_readers) =
        reader_counts(args, &file.readers, fixed, remote)?;
    let (min_buffer, max_buffer, initial_buffer) = buffer_sizes(args, &file.buffer, memory_budget)?;
    Ok(JobConfig {
        bounds: Bounds {
            min_readers,
            max_readers,
            min_buffer,
            max_buffer,
        },
        initial_readers,
        initial_buffer,
        tuner: fixed.is_none(),
        limits: limits(args, &file.limits)?,
    })
}

/// The fixed reader count (the tuner off), if any. A fixed count beside
/// bounds given the same way is refused (they would be ignored); given
/// the other way, the flags win over the file, as everywhere: `--readers`
/// sets aside the file's bounds, and flags' bounds its fixed count.
fn fixed_readers(args: &Args, file: &ReadersFile) -> Result<Option<u32>, ConfigError> {
    let flag_bounds = [args.min_readers, args.max_readers, args.initial_readers]
        .iter()
        .any(Option::is_some);
    let file_bounds = [file.min, file.max, file.initial]
        .iter()
        .any(Option::is_some);
    let refuse = |fixed: u32, how: &str| {
        Err(ConfigError(format!(
            "a fixed count of {fixed} readers turns the tuner off, so reader bounds beside it would be ignored: {how}"
        )))
    };
    match (args.readers, file.fixed) {
        (Some(fixed), _) if flag_bounds => refuse(
            fixed,
            "give either --readers or --min-readers/--max-readers/--initial-readers",
        ),
        (Some(fixed), _) => Ok(Some(fixed)),
        (None, Some(_)) if flag_bounds => Ok(None),
        (None, Some(fixed)) if file_bounds => refuse(
            fixed,
            "give either `readers: {fixed: N}` or the `min`/`max`/`initial` bounds in the configuration file",
        ),
        (None, fixed) => Ok(fixed),
    }
}

/// Returns the fewest, most and initial readers per job; a `fixed` count
/// is all three.
fn reader_counts(
    args: &Args,
    file: &ReadersFile,
    fixed: Option<u32>,
    remote: bool,
) -> Result<(u32, u32, u32), ConfigError> {
    let min_readers = fixed.or(args.min_readers).or(file.min).unwrap_or(1);
    let default_max = if remote {
        REMOTE_MAX_READERS
    } else {
        LOCAL_MAX_READERS
    };
    let max_readers = fixed
        .or(args.max_readers)
        .or(file.max)
        .unwrap_or(default_max);
    if min_readers == 0 || max_readers > MAX_READERS || min_readers > max_readers {
        return Err(ConfigError(format!(
            "reader bounds {min_readers}..{max_readers} are impossible: use 1 <= min <= max <= {MAX_READERS}"
        )));
    }
    let initial_readers = fixed
        .or(args.initial_readers)
        .or(file.initial)
        .unwrap_or(16.clamp(min_readers, max_readers));
    if !(min_readers..=max_readers).contains(&initial_readers) {
        return Err(ConfigError(format!(
            "initial readers {initial_readers} is outside the bounds {min_readers}..{max_readers}"
        )));
    }
    Ok((min_readers, max_readers, initial_readers))
}

/// Returns the smallest, largest and initial buffer per job in bytes, all
/// within the memory budget.
fn buffer_sizes(
    args: &Args,
    file: &BufferFile,
    memory_budget: u64,
) -> Result<(u64, u64, u64), ConfigError> {
    // The default comes down to a small budget; a minimum given does not
    // (it was lowered to the budget without a word).
    let min_buffer = args
        .min_buffer
        .or(file.min)
        .map_or((4 * MIB).min(memory_budget), ByteSize::bytes);
    let max_buffer = args
        .max_buffer
        .or(file.max)
        .map_or(memory_budget, ByteSize::bytes);
    // The default comes within the bounds given (`--max-buffer 64MiB`
    // alone was refused: the default 256MiB start was outside it).
    let initial_buffer = args.initial_buffer.or(file.initial).map_or(
        (256 * MIB).clamp(min_buffer, max_buffer.max(min_buffer)),
        ByteSize::bytes,
    );
    if min_buffer > max_buffer || max_buffer > memory_budget {
        return Err(ConfigError(format!(
            "buffer bounds {}..{} are impossible with {} for the prefetch buffers (the memory budget, less the node cache's memory): use min <= max <= that",
            ByteSize(min_buffer),
            ByteSize(max_buffer),
            ByteSize(memory_budget)
        )));
    }
    if !(min_buffer..=max_buffer).contains(&initial_buffer) {
        return Err(ConfigError(format!(
            "initial buffer {} is outside the bounds {}..{}: give --initial-buffer a size between them",
            ByteSize(initial_buffer),
            ByteSize(min_buffer),
            ByteSize(max_buffer)
        )));
    }
    Ok((min_buffer, max_buffer, initial_buffer))
}

/// Returns the per-job QoS limits, refusing a limit of 0 and a burst window
/// outside 1 ms to 60 s.
fn limits(args: &Args, file: &LimitsFile) -> Result<Limits, ConfigError> {
    let limits = Limits {
        bytes_per_s: args
            .rate_limit
            .or(file.bytes_per_second)
            .map(ByteRate::bytes_per_second),
        ops_per_s: args
            .ops_limit
            .or(file.ops_per_second)
            .map(OpsRate::per_second),
        burst: Duration::from_millis(args.burst_ms.or(file.burst_ms).unwrap_or(100)),
    };
    if limits.bytes_per_s == Some(0) || limits.ops_per_s == Some(0) {
        return Err(ConfigError(
            "a limit of 0 would stop every read: leave the limit out for unlimited".into(),
        ));
    }
    if limits.burst.is_zero() || limits.burst > MAX_BURST {
        return Err(ConfigError("the burst window must be 1 ms to 60 s".into()));
    }
    Ok(limits)
}

/// Checks that the controller URL's scheme matches the TLS flags: `https://`
/// with all three, `http://` with none, and no TLS flags without a
/// controller.
fn check_controller(controller: Option<&str>, tls: bool) -> Result<(), ConfigError> {
    let refuse = |m: String| Err(ConfigError(m));
    match (controller, tls) {
        (Some(url), _) if !(url.starts_with("http://") || url.starts_with("https://")) => {
            refuse(match url.split_once("://") {
                Some((scheme, rest)) => format!(
                    "controller address `{url}` is `{scheme}://`: the controller speaks gRPC over `http://` (`https://` with --tls-*), e.g. `http://{rest}`"
                ),
                None => format!("controller address `{url}` needs a scheme: write `http://{url}`"),
            })
        }
        (Some(url), false) if url.starts_with("https://") => refuse(format!(
            "controller address `{url}` is https: give --tls-cert, --tls-key and \
             --tls-ca for mutual TLS"
        )),
        (Some(url), true) if url.starts_with("http://") => {
            let rest = url.trim_start_matches("http://");
            refuse(format!(
                "--tls-* are given but controller address `{url}` is plain text: write \
                 `https://{rest}`"
            ))
        }
        (None, true) => refuse("--tls-cert, --tls-key and --tls-ca need --controller".into()),
        // Checked here, not when the session starts: a stage with a URL
        // that names no host (a templated host that rendered empty) said
        // it was ready, then stopped.
        (Some(url), _) => match tonic::transport::Endpoint::from_shared(url.to_owned()) {
            Ok(endpoint) if endpoint.uri().host().is_some_and(|h| !h.is_empty()) => Ok(()),
            Ok(_) => refuse(format!(
                "controller address `{url}` names no host: write http://HOST:PORT, e.g. `http://sluice-controller:7070`"
            )),
            Err(e) => refuse(format!(
                "controller address `{url}` is not a URL ({e}): write http://HOST:PORT, e.g. `http://sluice-controller:7070`"
            )),
        },
        (None, false) => Ok(()),
    }
}

fn load_file(path: &Path) -> Result<StageFile, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("reading {}: {e}", path.display())))?;
    if text.lines().all(|l| {
        let l = l.trim();
        l.is_empty() || l.starts_with('#') || l == "---" || l == "null" || l == "~"
    }) {
        return Err(ConfigError(format!(
            "{} holds no settings: write a mapping such as `datasets: {{imagenet: /data/imagenet}}`",
            path.display()
        )));
    }
    serde_yaml_ng::from_str(&text).map_err(|e| {
        let at = e
            .location()
            .map(|l| format!(":{}:{}", l.line(), l.column()))
            .unwrap_or_default();
        ConfigError(format!("{}{at}: {e}", path.display()))
    })
}

/// Returns the stage id used without --stage-id: `host` for the default
/// socket, else `host-XXXXXXXX`, the hex digits a hash (FNV-1a, stable
/// across builds) of the socket's absolute path. Two live stages cannot
/// share a socket on one host, so their ids differ, and a restarted stage
/// keeps its id.
fn default_stage_id(host: &str, socket: &Path) -> String {
    if socket == Path::new(DEFAULT_SOCKET) {
        return host.to_owned();
    }
    let path = std::path::absolute(socket).unwrap_or_else(|_| socket.to_owned());
    let hash = path
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("{host}-{:08x}", hash as u32)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "stage".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut argv = vec!["sluice-stage"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).unwrap()
    }

    /// The message of the configuration `flags` (over the YAML `yaml`)
    /// is refused with; panics if it is taken.
    fn refusal(flags: &[&str], yaml: &str) -> String {
        let file: StageFile = serde_yaml_ng::from_str(yaml).unwrap();
        match StageConfig::merge(args(flags), file) {
            Ok(_) => panic!("{flags:?} over {yaml:?} was taken"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_dataset_flag_is_one_path_commas_and_all() {
        let dir = tempfile::tempdir().unwrap();
        let (run, other) = (dir.path().join("lr=0.1,bs=256"), dir.path().join("other"));
        std::fs::create_dir_all(&run).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        let flag = format!("d={}", run.display());
        let merged = StageConfig::merge(args(&["--dataset", &flag]), StageFile::default()).unwrap();
        assert_eq!(merged.datasets, vec![("d".to_owned(), run.clone())]);
        // SLUICE_DATASETS is a comma-separated list, used when no flag is.
        let listed = format!("d={},e={}", other.display(), other.display());
        let merged =
            StageConfig::merge(args(&["--datasets", &listed]), StageFile::default()).unwrap();
        assert_eq!(merged.datasets.len(), 2);
        let both = args(&["--dataset", &flag, "--datasets", &listed]);
        let merged = StageConfig::merge(both, StageFile::default()).unwrap();
        assert_eq!(merged.datasets, vec![("d".to_owned(), run)]);
    }

    #[test]
    fn a_label_flag_is_one_value_commas_and_all() {
        let flags = args(&[
            "--dataset",
            "d=/tmp",
            "--label",
            "gpus=a100,h100",
            "--label",
            "note=x,team=admin",
        ]);
        let merged = StageConfig::merge(flags, StageFile::default()).unwrap();
        let labels: Vec<(&str, &str)> = merged
            .labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(labels, [("gpus", "a100,h100"), ("note", "x,team=admin")]);
        // SLUICE_LABELS is a comma-separated list, used when no flag is.
        let listed = args(&["--dataset", "d=/tmp", "--labels", "a=1,b=2"]);
        let merged = StageConfig::merge(listed, StageFile::default()).unwrap();
        assert_eq!(merged.labels.len(), 2);
        let bad = args(&["--dataset", "d=/tmp", "--labels", "a=1,b c=2"]);
        let e = StageConfig::merge(bad, StageFile::default()).unwrap_err();
        assert!(e.to_string().starts_with("SLUICE_LABELS: b c=2"), "{e}");
        let bad = args(&["--dataset", "d=/tmp", "--labels", "novalue"]);
        let e = StageConfig::merge(bad, StageFile::default()).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("SLUICE_LABELS: `novalue` is not KEY=VALUE"),
            "{e}"
        );
        // Not read when a flag gives labels (as documented).
        let both = args(&[
            "--dataset",
            "d=/tmp",
            "--label",
            "a=1",
            "--labels",
            "novalue",
        ]);
        let merged = StageConfig::merge(both, StageFile::default()).unwrap();
        assert_eq!(merged.labels.len(), 1);
    }

    #[test]
    fn mistyped_settings_are_refused_with_what_to_write() {
        let dir = tempfile::tempdir().unwrap();
        let (data, mnt) = (dir.path().join("data"), dir.path().join("mnt"));
        std::fs::create_dir_all(&data).unwrap();
        std::fs::create_dir_all(&mnt).unwrap();
        let dataset = format!("d={}", data.display());
        let mount = mnt.to_str().unwrap();
        let in_mount = mnt.join("x");
        let in_mount = in_mount.to_str().unwrap();
        let in_data = data.join("orders");
        let long_socket = format!("/tmp/{}", "s".repeat(120));
        let cases: &[(&[&str], &str, &str)] = &[
            (
                &["--cache-memory", "18446744073709551615"],
                "",
                "leaves the prefetch buffers",
            ),
            (
                &["--dataset", "a\nb=/tmp"],
                "",
                "no `/` or control characters",
            ),
            (
                &["--label", "a b=c"],
                "",
                "--label a b=c: label key `a b` is not valid",
            ),
            (&["--label", "team=a\u{1b}b"], "", "label value"),
            (
                &[],
                "labels: {'bad key!': x}",
                "`labels:` in the configuration file",
            ),
            (&["--node", " "], "", "the node name is empty"),
            (&[], "trainers: []", "`trainers:` holds no rule"),
            (
                &[],
                "trainers:\n#  - any: true\n",
                "`trainers:` holds no rule",
            ),
            (&[], "socket: ''", "--socket is empty"),
            (&["--socket", &long_socket], "", "must be at most 107 bytes"),
            (
                &["--controller", "ftp://x:7070"],
                "",
                "is `ftp://`: the controller speaks gRPC over `http://`",
            ),
            (&["--controller", "http://"], "", "is not a URL"),
            (
                &["--controller", "http://host name:7070"],
                "",
                "is not a URL",
            ),
            (
                &[
                    "--mount",
                    mount,
                    "--mount-orders",
                    in_data.to_str().unwrap(),
                ],
                "",
                "--mount-orders",
            ),
            (&["--mount", mount, "--socket", in_mount], "", "--socket"),
            (
                &["--mount", mount, "--mount-orders", in_mount],
                "",
                "is inside --mount",
            ),
            (
                &["--mount", mount, "--mount-orders", "/etc/hostname"],
                "",
                "is not a directory",
            ),
            (
                &["--s3-endpoint", "http://127.0.0.1:99999"],
                "",
                "--s3-endpoint `http://127.0.0.1:99999` is not an object store's URL (invalid port number)",
            ),
            (
                &["--s3-endpoint", "http://:7877"],
                "",
                "is not an object store's URL",
            ),
            (
                &["--s3-endpoint", "minio:9000"],
                "",
                "is not an object store's URL",
            ),
            (
                &["--s3-endpoint", "127.0.0.1:9000"],
                "",
                "(it has no scheme)",
            ),
            (
                &["--initial-buffer", "1MiB"],
                "",
                "outside the bounds 4MiB..1GiB",
            ),
            (
                &["--cache-dir", "/etc/hostname", "--cache-disk", "1GiB"],
                "",
                "--cache-dir /etc/hostname is not a directory",
            ),
            (&["--mount-job", "train"], "", "--mount-job needs --mount"),
            (&[], "mount_job: train", "--mount-job needs --mount"),
            (
                &["--mount-passthrough", "false"],
                "",
                "--mount-passthrough needs --mount",
            ),
        ];
        for (flags, yaml, said) in cases {
            let mut all = vec!["--dataset", &dataset];
            all.extend_from_slice(flags);
            let e = refusal(&all, if yaml.is_empty() { "{}" } else { yaml });
            assert!(e.contains(said), "{flags:?} {yaml:?}: {e}");
        }
        let e = refusal(&["--dataset", "d=s3://"], "{}");
        assert!(e.contains("names no bucket"), "{e}");
        for bad in ["localhost:7190", "7190"] {
            let e = Args::try_parse_from(["sluice-stage", "--metrics-addr", bad]).unwrap_err();
            assert!(e.to_string().contains("write IP:PORT"), "{e}");
        }
    }

    #[test]
    fn the_file_system_of_a_path_is_the_deepest_mount_above_it() {
        let mountinfo = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:40 / /mnt/data rw,relatime shared:2 - nfs4 filer:/export rw,vers=4.2
41 40 0:41 / /mnt/data/scratch rw - tmpfs tmpfs rw
42 22 0:42 / /mnt/my\\040set rw - fuse.s3fs s3fs rw
43 22 0:43 / /mnt/lustre rw master:3 - lustre 10.0.0.1@tcp:/fs rw
";
        let kind = |p: &str| mount_type(mountinfo, Path::new(p));
        assert_eq!(kind("/home/x"), Some("ext4"));
        assert_eq!(kind("/mnt/data/imagenet/train"), Some("nfs4"));
        assert_eq!(kind("/mnt/data/scratch/x"), Some("tmpfs"));
        assert_eq!(
            kind("/mnt/datasets"),
            Some("ext4"),
            "a mount point is a whole component"
        );
        assert_eq!(kind("/mnt/my set/a"), Some("fuse.s3fs"), "escaped spaces");
        assert_eq!(
            kind("/mnt/lustre/x"),
            Some("lustre"),
            "optional fields skipped"
        );
        for (kind, network) in [
            ("nfs4", true),
            ("fuse.s3fs", true),
            ("fuse", true),
            ("lustre", true),
            ("cifs", true),
            ("ext4", false),
            ("xfs", false),
            ("tmpfs", false),
            ("overlay", false),
        ] {
            assert_eq!(network_file_system(kind), network, "{kind}");
        }
        assert!(!on_network_file_system(
            mountinfo,
            Path::new("/no/such/dir")
        ));
    }

    #[test]
    fn defaults_and_overrides() {
        let c = StageConfig::from_args(args(&["--dataset", "a=/tmp", "--memory-budget", "256MiB"]))
            .unwrap();
        assert_eq!(c.memory_budget, 256 * MIB);
        assert_eq!(c.job.initial_buffer, 256 * MIB);
        assert!(!c.direct_io);
        let small =
            StageConfig::from_args(args(&["--dataset", "a=/tmp", "--memory-budget", "100MiB"]))
                .unwrap();
        assert_eq!(small.job.initial_buffer, 100 * MIB);
        assert_eq!(c.job.bounds.max_buffer, 256 * MIB);
        assert!(c.job.tuner);
        let fixed = StageConfig::from_args(args(&[
            "--dataset",
            "a=/tmp",
            "--readers",
            "8",
            "--rate-limit",
            "200MiB/s",
        ]))
        .unwrap();
        assert!(!fixed.job.tuner);
        assert_eq!(
            (fixed.job.bounds.min_readers, fixed.job.initial_readers),
            (8, 8)
        );
        assert_eq!(fixed.job.limits.bytes_per_s, Some(200 * MIB));
    }

    #[test]
    fn bad_values_are_refused_with_a_sentence() {
        let cases: &[(&[&str], &str)] = &[
            (&[], "no dataset"),
            (
                &["--dataset", "a=/tmp", "--memory-budget", "10kB"],
                "too small",
            ),
            (
                &[
                    "--dataset",
                    "a=/tmp",
                    "--min-readers",
                    "9",
                    "--max-readers",
                    "2",
                ],
                "impossible",
            ),
            (&["--dataset", "a=/tmp", "--ops-limit", "0"], "limit of 0"),
            (
                &["--dataset", "a=/tmp", "--max-buffer", "2GiB"],
                "memory budget",
            ),
        ];
        for (flags, expected) in cases {
            let e = StageConfig::from_args(args(flags)).unwrap_err().to_string();
            assert!(e.contains(expected), "{flags:?}: {e}");
        }
        assert!(Args::try_parse_from(["s", "--dataset", "nodir"]).is_err());
        assert!(Args::try_parse_from(["s", "--memory-budget", "1KB"]).is_err());
    }

    #[test]
    fn dataset_names_the_mount_cannot_show_are_refused() {
        for name in [".", "..", "@a", "@", "a/b"] {
            let flag = format!("{name}=/tmp");
            let e = StageConfig::from_args(args(&["--dataset", &flag]))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("dataset name `{name}` is invalid")),
                "{name}: {e}"
            );
        }
        let file = BTreeMap::from([(String::new(), PathBuf::from("/tmp"))]);
        assert!(merge_datasets(&file, &[]).is_err());
        // A mistyped or unknown URL is not taken for a relative directory.
        for (url, hint) in [
            ("s3:/bucket/x", "`s3://BUCKET/PREFIX`"),
            ("gs://bucket/x", "local directories and `s3://"),
        ] {
            let e = merge_datasets(&BTreeMap::new(), &[("d".into(), url.into())]).unwrap_err();
            let e = e.to_string();
            assert!(
                e.contains("neither a directory nor a URL") && e.contains(hint),
                "{e}"
            );
        }
        // A fixed reader count beside bounds it would ignore.
        let both = StageConfig::from_args(args(&[
            "--dataset",
            "d=/tmp",
            "--readers",
            "4",
            "--max-readers",
            "8",
        ]));
        assert!(
            both.unwrap_err()
                .to_string()
                .contains("turns the tuner off")
        );
        // Given the other way, the flags win over the file: --readers sets
        // aside the file's bounds, flags' bounds the file's fixed count.
        let bounded: StageFile = serde_yaml_ng::from_str("readers: {max: 8}").unwrap();
        let flags = args(&["--dataset", "d=/tmp", "--readers", "4"]);
        let merged = StageConfig::merge(flags, bounded).unwrap();
        assert_eq!(
            (merged.job.bounds.min_readers, merged.job.bounds.max_readers),
            (4, 4)
        );
        assert!(!merged.job.tuner);
        let fixed: StageFile = serde_yaml_ng::from_str("readers: {fixed: 4}").unwrap();
        let flags = args(&["--dataset", "d=/tmp", "--max-readers", "8"]);
        let merged = StageConfig::merge(flags, fixed).unwrap();
        assert_eq!(merged.job.bounds.max_readers, 8);
        assert!(merged.job.tuner);
        let both: StageFile = serde_yaml_ng::from_str("readers: {fixed: 4, max: 8}").unwrap();
        let e = StageConfig::merge(args(&["--dataset", "d=/tmp"]), both).unwrap_err();
        assert!(e.to_string().contains("in the configuration file"), "{e}");
        // A config file with nothing in it.
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("stage.yaml");
        std::fs::write(&empty, "# nothing yet\n---\n").unwrap();
        assert!(
            load_file(&empty)
                .unwrap_err()
                .to_string()
                .contains("holds no settings")
        );
        let plain = [("d".into(), PathBuf::from("s3://bucket/x"))];
        assert!(merge_datasets(&BTreeMap::new(), &plain).is_ok());
        // A root that is missing or not a directory is a configuration error.
        for (root, said) in [
            ("/no/such/dir", "No such file"),
            ("/etc/hostname", "not a directory"),
        ] {
            let e = merge_datasets(&BTreeMap::new(), &[("d".into(), root.into())]).unwrap_err();
            assert!(e.to_string().contains(said), "{e}");
        }
        // A name given twice is refused, not the last one taken.
        let twice = StageConfig::from_args(args(&["--dataset", "d=/tmp", "--dataset", "d=/var"]));
        assert!(twice.unwrap_err().to_string().contains("given twice"));
        let yaml: Result<StageFile, _> = serde_yaml_ng::from_str("datasets: {d: /tmp, d: /var}");
        assert!(yaml.unwrap_err().to_string().contains("given twice"));
        // A repeated --label key: the last one wins (the chart gives the
        // stage's labels, then a sidecar job's).
        let labels = StageConfig::from_args(args(&[
            "--dataset",
            "d=/tmp",
            "--label",
            "a=b",
            "--label",
            "a=c",
        ]));
        assert_eq!(
            labels.unwrap().labels.get("a").map(String::as_str),
            Some("c")
        );
        let yaml: Result<StageFile, _> = serde_yaml_ng::from_str("labels: {a: b, a: c}");
        assert!(yaml.unwrap_err().to_string().contains("given twice"));
        let empty_id = StageConfig::from_args(args(&["--dataset", "d=/tmp", "--stage-id", ""]));
        assert!(
            empty_id
                .unwrap_err()
                .to_string()
                .contains("stage id is empty")
        );
        for (flag, value) in [("--stage-id", "evil\nstage"), ("--node", "n\u{1b}[31m")] {
            let refused = StageConfig::from_args(args(&["--dataset", "d=/tmp", flag, value]));
            let message = refused.unwrap_err().to_string();
            assert!(message.contains("no control characters"), "{message}");
        }
        for name in ["a", "a.b", "..a", "a@b", "_"] {
            let flag = format!("{name}=/tmp");
            assert!(
                StageConfig::from_args(args(&["--dataset", &flag])).is_ok(),
                "{name}"
            );
        }
    }

    #[test]
    fn default_stage_ids_differ_by_socket_and_stay_put() {
        let id = |socket: &str| default_stage_id("vm", Path::new(socket));
        assert_eq!(id(DEFAULT_SOCKET), "vm");
        // Pinned: a changed hash would rename every such stage.
        let a = id("/run/sluice/a.sock");
        assert_eq!(a, "vm-7ddd08a9");
        assert_ne!(a, id("/run/sluice/b.sock"));
        assert!(a.starts_with("vm-") && a.len() == "vm-".len() + 8, "{a}");
        // A relative socket is named by its absolute path.
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(id("s.sock"), id(cwd.join("s.sock").to_str().unwrap()));
        let c = StageConfig::from_args(args(&["--dataset", "a=/tmp", "--socket", "/x/y.sock"]))
            .unwrap();
        assert_eq!(
            c.stage_id,
            default_stage_id(&hostname(), Path::new("/x/y.sock"))
        );
        let c = StageConfig::from_args(args(&["--dataset", "a=/tmp", "--stage-id", "s1"])).unwrap();
        assert_eq!(c.stage_id, "s1");
    }

    #[test]
    fn yaml_file_with_line_and_column_errors() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.yaml");
        std::fs::write(&good, "datasets:\n  train: /tmp\nmemory_budget: 512MiB\nlimits:\n  bytes_per_second: 100MiB/s\n").unwrap();
        let c = StageConfig::from_args(args(&["--config", good.to_str().unwrap()])).unwrap();
        assert_eq!(c.memory_budget, 512 * MIB);
        assert_eq!(c.job.limits.bytes_per_s, Some(100 * MIB));
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "datasets:\n  train: /tmp\nmemory_budgett: 1GiB\n").unwrap();
        let e = StageConfig::from_args(args(&["--config", bad.to_str().unwrap()]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bad.yaml:3:1") && e.contains("memory_budgett"),
            "{e}"
        );
    }

    #[test]
    fn a_cache_directory_and_a_data_set_may_not_hold_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let data_set = format!("d={}", data.display());
        let with_cache = |cache: &Path| {
            StageConfig::from_args(args(&[
                "--dataset",
                &data_set,
                "--cache-dir",
                cache.to_str().unwrap(),
                "--cache-disk",
                "1GiB",
            ]))
        };
        let e = with_cache(&data.join("cache")).unwrap_err().to_string();
        assert!(e.contains("is inside data set `d`"), "{e}");
        let e = with_cache(&data).unwrap_err().to_string();
        assert!(e.contains("is inside data set `d`"), "{e}");
        let e = with_cache(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("data set `d`") && e.contains("is inside --cache-dir"),
            "{e}"
        );
        assert!(with_cache(&dir.path().join("cache")).is_ok());
        // A mount there would read the data set through itself.
        let with_mount = |mount: &Path| {
            StageConfig::from_args(args(&[
                "--dataset",
                &data_set,
                "--mount",
                mount.to_str().unwrap(),
            ]))
        };
        let e = with_mount(&data.join("mnt")).unwrap_err().to_string();
        assert!(
            e.contains("--mount") && e.contains("is inside data set `d`"),
            "{e}"
        );
        let e = with_mount(dir.path()).unwrap_err().to_string();
        assert!(e.contains("is inside --mount"), "{e}");
        assert!(with_mount(&dir.path().join("mnt")).is_ok());
    }

    #[test]
    fn the_default_initial_buffer_comes_within_the_bounds_given() {
        let merged = StageConfig::merge(
            args(&["--dataset", "d=/tmp", "--max-buffer", "64MiB"]),
            StageFile::default(),
        )
        .unwrap();
        assert_eq!(merged.job.initial_buffer, 64 * MIB);
        let merged = StageConfig::merge(
            args(&["--dataset", "d=/tmp", "--min-buffer", "512MiB"]),
            StageFile::default(),
        )
        .unwrap();
        assert_eq!(merged.job.initial_buffer, 512 * MIB);
    }

    #[test]
    fn the_cache_comes_out_of_the_budget() {
        let c = StageConfig::from_args(args(&[
            "--dataset",
            "a=/tmp",
            "--memory-budget",
            "1GiB",
            "--cache-memory",
            "768MiB",
        ]))
        .unwrap();
        assert_eq!(c.prefetch_budget(), 256 * MIB);
        assert_eq!(
            c.job.bounds.max_buffer,
            256 * MIB,
            "buffers fit in what is left"
        );
        assert_eq!(c.cache.policy, CachePolicy::Stable);
        let dir = tempfile::tempdir().unwrap();
        for (yaml, says) in [
            (
                "cache: {memory: 64MiB, weights: {b: 2}}",
                "`b`, which is not a configured dataset",
            ),
            (
                "cache: {memory: 64MiB, weights: {a: 0}}",
                "cache.weights.a is 0",
            ),
            (
                "cache: {memory: 64MiB, policy: mru}",
                "cache.policy: unknown cache policy `mru`",
            ),
            (
                "cache: {memory: 1GiB}",
                "leaves the prefetch buffers less than 16MiB",
            ),
            ("cache: {policy: lru}", "there is no cache"),
            (
                "cache: {dir: /tmp/c, disk: 0B}",
                "--cache-disk is 0 with --cache-dir",
            ),
        ] {
            let file = dir.path().join("stage.yaml");
            std::fs::write(&file, yaml).unwrap();
            let e = StageConfig::from_args(args(&[
                "--dataset",
                "a=/tmp",
                "--config",
                file.to_str().unwrap(),
            ]))
            .unwrap_err()
            .to_string();
            assert!(e.contains(says), "{yaml}: {e}");
        }
    }
}
