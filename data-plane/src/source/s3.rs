//! The S3-compatible object-store source: `s3://bucket/prefix`.
//!
//! Signing, GETs and their retries are `object_store`'s, over a hyper
//! client of our own (rustls on ring, like the controller session), so the
//! stage has one TLS stack and one runtime. Every request passes through
//! [`Http`], which counts it by outcome and times it. Listing is our own
//! (`s3/list.rs`): it judges each key alone, skipping folder markers and
//! keys that are not servable names instead of failing the dataset.
//!
//! Reads are asynchronous: a job's readers start them on the runtime and go
//! on, so hundreds are in flight on a few threads. An object of
//! [`PART_BYTES`] or more is fetched as parallel ranged GETs. Throttling
//! (503 SlowDown, 429), other 5xx answers, resets and timeouts are retried
//! with capped exponential backoff and jitter, within the per-sample
//! deadline; a missing object, a denied request or the deadline ends the
//! sample with its error.

use std::collections::HashMap;
use std::fmt;
use std::future::Future as _;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use futures::StreamExt;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::client::{
    HttpClient, HttpError, HttpErrorKind, HttpRequest, HttpRequestBody, HttpResponse,
    HttpResponseBody, HttpService,
};
use object_store::path::Path as Key;
use object_store::{
    BackoffConfig, ClientOptions, GetOptions, ObjectStore, ObjectStoreExt, RetryConfig,
};
use tokio::runtime::Handle;

use super::{Pinned, changed};
use crate::chunk::{Buffer, Chunk};
use crate::entry::{FileEntry, Fnv64, Walked};
use crate::metrics::{Metrics, SourceMetrics};
use crate::protocol::{ErrorCode, ProtocolError};
use crate::storage::{MAX_FILE_BYTES, clamp_range};
use list::{ListError, Listed, Lister, Version, busy};

mod list;

/// Objects this large or larger are fetched as parallel ranged GETs of
/// this size.
pub const PART_BYTES: u64 = 8 << 20;
/// How long the start-up check waits for the store to answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Listing: split the prefix until there are this many sub-prefixes...
const LIST_SPLIT: usize = 64;
/// ...or this many levels were split,
const LIST_DEPTH: usize = 3;
/// and list this many sub-prefixes at a time.
const LIST_CONCURRENCY: usize = 16;

/// How to reach the object store (flags and the stage file).
#[derive(Debug, Clone, PartialEq)]
pub struct S3Options {
    /// `--s3-endpoint`: an S3-compatible server's URL (else the one the AWS
    /// variables and files name, see [`configured_endpoint`], both resolved
    /// by the configuration; `None`: AWS itself).
    pub endpoint: Option<String>,
    /// `--s3-region` (else AWS_REGION, AWS_DEFAULT_REGION, the profile's
    /// region, `us-east-1`).
    pub region: Option<String>,
    /// Path-style addressing (`endpoint/bucket/key`), which most
    /// S3-compatible servers need; virtual-hosted style otherwise.
    pub path_style: bool,
    /// Send unsigned requests (public buckets).
    pub anonymous: bool,
    /// How long one sample may take, retries included.
    pub deadline: Duration,
}

impl Default for S3Options {
    fn default() -> Self {
        Self {
            endpoint: None,
            region: None,
            path_style: false,
            anonymous: false,
            deadline: Duration::from_secs(30),
        }
    }
}

/// A bucket prefix served as a dataset.
pub struct S3Source {
    url: String,
    bucket: String,
    /// What the data set's keys begin with: `prefix/`, or nothing for a
    /// whole bucket.
    key_prefix: String,
    /// Sample reads: requests and retries within the sample deadline.
    store: AmazonS3,
    /// Listings: requests as long as a page takes.
    lister: Lister,
    runtime: Handle,
    deadline: Duration,
    metrics: SourceMetrics,
    /// Whether the store's listings name objects by modification time (no
    /// ETags): a read's version is then taken the same way, so that it
    /// matches the listing's (the node cache keeps only the version it
    /// was asked for).
    versions_by_time: AtomicBool,
    /// Keys the listing in progress skipped, and what the last warning
    /// said of them (so that each listing, every few seconds, does not
    /// repeat it).
    skipped: std::sync::Mutex<Skipped>,
}

/// Keys a listing skipped: how many of each kind, and the first one's key
/// (in key order: pages come in any order).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct SkippedKeys {
    slash: (u64, Option<String>),
    unservable: (u64, Option<String>),
}

/// The keys the listing in progress skipped, and those the last warning
/// named (none at first: a listing that skips nothing says nothing).
#[derive(Debug, Default)]
struct Skipped {
    now: SkippedKeys,
    said: SkippedKeys,
}

impl Skipped {
    fn note(kind: &mut (u64, Option<String>), key: &str) {
        kind.0 += 1;
        if kind.1.as_deref().is_none_or(|first| key < first) {
            kind.1 = Some(key.to_owned());
        }
    }

    /// Starts a listing's count (one that failed left its part behind).
    fn begin(&mut self) {
        self.now = SkippedKeys::default();
    }

    /// Warns of what this listing skipped unless the last warning said
    /// the same, and returns whether it did.
    fn report(&mut self, url: &str) -> bool {
        let now = std::mem::take(&mut self.now);
        let warn = now != self.said;
        let kinds = [
            (
                &now.slash,
                "whose keys end in `/`: they hold bytes, but a name ending in `/` is a folder's",
            ),
            (&now.unservable, "whose keys are not servable names"),
        ];
        for ((n, first), why) in kinds.into_iter().filter(|_| warn) {
            if let Some(first) = first {
                tracing::warn!(
                    dataset = url,
                    skipped = n,
                    first = %first,
                    "skipping objects {why} (said again only when this changes)"
                );
            }
        }
        let warned = warn && now.slash.0 + now.unservable.0 > 0;
        self.said = now;
        warned
    }
}

/// What the pages beneath one prefix held.
#[derive(Debug, Default)]
struct Found {
    entries: Vec<FileEntry>,
    /// Folder markers' directories.
    folders: Vec<String>,
    /// Sub-prefixes, when listed with a delimiter.
    prefixes: Vec<String>,
}

/// The folders with nothing listed beneath them (neither an object nor
/// another folder), sorted: a folder with objects shows by them.
fn empty_folders(files: &[FileEntry], mut folders: Vec<String>) -> Vec<String> {
    if folders.is_empty() {
        return folders;
    }
    folders.sort_unstable();
    folders.dedup();
    let mut names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
    names.extend(folders.iter().map(String::as_str));
    names.sort_unstable();
    let holds_any = |folder: &str| {
        let beneath = format!("{folder}/");
        let at = names.partition_point(|name| *name < beneath.as_str());
        names.get(at).is_some_and(|name| name.starts_with(&beneath))
    };
    folders.iter().filter(|f| !holds_any(f)).cloned().collect()
}

impl fmt::Debug for S3Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Source").field("url", &self.url).finish()
    }
}

/// Splits `s3://bucket/prefix` into the bucket and the prefix.
pub fn parse_url(url: &str) -> Result<(String, Key), String> {
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| format!("`{url}` is not an s3:// URL"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(format!("`{url}` names no bucket: write s3://BUCKET/PREFIX"));
    }
    let prefix = prefix.trim_end_matches('/');
    let prefix =
        Key::parse(prefix).map_err(|e| format!("`{url}`: the prefix is not a valid key: {e}"))?;
    Ok((bucket.to_owned(), prefix))
}

/// The URL of the objects under `prefix` in `bucket`, in one form.
fn canonical_url(bucket: &str, prefix: &Key) -> String {
    match prefix.as_ref() {
        "" => format!("s3://{bucket}"),
        prefix => format!("s3://{bucket}/{prefix}"),
    }
}

impl S3Source {
    /// Connects to the bucket of `url` and checks, with one listing
    /// request, that the credentials, the bucket and the endpoint work;
    /// the error says what to fix.
    pub async fn open(
        dataset: &str,
        url: &str,
        options: &S3Options,
        metrics: &Metrics,
    ) -> Result<Self, String> {
        let (bucket, prefix) = parse_url(url).map_err(|e| format!("dataset `{dataset}`: {e}"))?;
        let source_metrics = metrics.source(dataset);
        let retry = RetryConfig {
            // object_store draws each wait between `init_backoff` and `base`
            // times the last: 4 doubles it on average (with 2 the waits
            // drift around their start and a throttling store is asked
            // again every few tens of milliseconds).
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_secs(2),
                base: 4.0,
            },
            // Retried until the sample's deadline, however many tries
            // that takes: a store refusing connections for a few seconds
            // (a restart) exhausts 16 tries of 20 ms backoff in one.
            max_retries: usize::MAX,
            retry_timeout: options.deadline,
        };
        let (builder, addressing, credentials) =
            builder(&bucket, options, &source_metrics)
                .await
                .map_err(|e| format!("dataset `{dataset}` ({url}): {e}"))?;
        let endpoint_set = options.endpoint.is_some();
        let endpoint = options.endpoint.clone().unwrap_or_else(|| "AWS S3".into());
        // The start-up check gives up after a few tries: a wrong endpoint
        // should fail the start, not stall it.
        let probe = builder
            .clone()
            // Not counted: its HEAD of a key that does not exist would show
            // as a `not_found` request on every healthy stage.
            .with_http_connector(Connector {
                metrics: None,
                answer_within: Some(PROBE_TIMEOUT),
            })
            .with_retry(RetryConfig {
                max_retries: 3,
                retry_timeout: PROBE_TIMEOUT,
                backoff: BackoffConfig::default(),
            })
            .build()
            .map_err(|e| format!("dataset `{dataset}` ({url}): {e}"))?;
        // Its requests' timeout is the connector's (`builder`): a request
        // that hangs (a half-open connection, a stalled store) is given up
        // and tried again on a new connection within the sample's deadline.
        let store = builder
            .with_retry(retry)
            .build()
            .map_err(|e| format!("dataset `{dataset}` ({url}): {e}"))?;
        // Listing requests are not bound by the sample deadline.
        let lister = Lister {
            http: object_store::client::HttpConnector::connect(
                &Connector {
                    metrics: Some(source_metrics.clone()),
                    answer_within: None,
                },
                &ClientOptions::new(),
            )
            .map_err(|e| format!("dataset `{dataset}` ({url}): {e}"))?,
            bucket_url: addressing.bucket_url,
            region: addressing.region,
            credentials: (!options.anonymous).then(|| store.credentials().clone()),
            timeout: PROBE_TIMEOUT.max(options.deadline),
        };
        let probed = Probed {
            bucket: &bucket,
            endpoint: &endpoint,
            virtual_hosted_compatible: endpoint_set && !options.path_style,
            anonymous: options.anonymous,
            credentials: &credentials,
        };
        check(&lister, &probe, &prefix, &probed)
            .await
            .map_err(|e| without_userinfo(&format!("dataset `{dataset}` ({url}): {e}")))?;
        Ok(Self {
            // As parsed (`s3://b/p/` and `s3://b/p` are one data set, and
            // the node cache keeps its samples under this name).
            url: canonical_url(&bucket, &prefix),
            bucket,
            key_prefix: key_prefix(&prefix),
            store,
            lister,
            runtime: Handle::current(),
            deadline: options.deadline,
            metrics: source_metrics,
            versions_by_time: AtomicBool::new(false),
            skipped: std::sync::Mutex::default(),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Runs `work` to completion from a thread outside the runtime (a
    /// reader thread or a blocking task).
    pub fn block_on<F: Future>(&self, work: F) -> F::Output {
        self.runtime.block_on(work)
    }

    pub fn runtime(&self) -> &Handle {
        &self.runtime
    }

    /// Lists the dataset. A listing page holds 1,000 keys and costs a
    /// round trip, so a million keys listed one page after another take
    /// minutes; the prefix is split at its `/` levels (until there are
    /// [`LIST_SPLIT`] sub-prefixes, at most [`LIST_DEPTH`] levels down) and
    /// the sub-prefixes are listed [`LIST_CONCURRENCY`] at a time. Folder
    /// markers (`valid/`, empty, as consoles make them) with no object
    /// beneath them are the listing's empty directories.
    pub async fn list(&self) -> std::io::Result<Walked> {
        let failed =
            |e: ListError| std::io::Error::other(format!("listing {} failed: {e}", self.url));
        let (mut files, mut folders) = (Vec::new(), Vec::new());
        let mut prefixes = vec![self.key_prefix.clone()];
        crate::sync::lock(&self.skipped).begin();
        for _ in 0..LIST_DEPTH {
            if prefixes.len() >= LIST_SPLIT {
                break;
            }
            let levels = futures::stream::iter(prefixes.iter())
                .map(|prefix| self.list_all(prefix, true))
                .buffer_unordered(LIST_CONCURRENCY)
                .collect::<Vec<_>>()
                .await;
            let mut deeper = Vec::new();
            for level in levels {
                let found = level.map_err(failed)?;
                files.extend(found.entries);
                folders.extend(found.folders);
                deeper.extend(found.prefixes);
            }
            prefixes = deeper;
        }
        let rest = futures::stream::iter(prefixes.iter())
            .map(|prefix| self.list_all(prefix, false))
            .buffer_unordered(LIST_CONCURRENCY)
            .collect::<Vec<_>>()
            .await;
        for listed in rest {
            let found = listed.map_err(failed)?;
            files.extend(found.entries);
            folders.extend(found.folders);
        }
        let _ = crate::sync::lock(&self.skipped).report(&self.url);
        let empty_dirs = empty_folders(&files, folders);
        Ok(Walked {
            files,
            empty_dirs,
            ..Walked::default()
        })
    }

    /// Every page beneath `prefix`: its entries (each page's objects made
    /// entries as it comes: a page's keys and ETags are not kept), its
    /// folder markers and (when `delimited`) its sub-prefixes.
    async fn list_all(&self, prefix: &str, delimited: bool) -> Result<Found, ListError> {
        let mut found = Found::default();
        let mut token = None;
        loop {
            let page = self
                .lister
                .page(prefix, delimited, token.as_ref(), list::BUSY_PATIENCE)
                .await?;
            for listed in &page.objects {
                match self.folder_of(listed) {
                    Some(folder) => found.folders.push(folder),
                    None => found.entries.extend(self.entry_of(listed)),
                }
            }
            found.prefixes.extend(page.prefixes);
            match page.next {
                None => return Ok(found),
                // A store that sends the same token again, or goes on from
                // a key not past the last one, would list for ever; stopping
                // there would leave the rest out unsaid.
                Some(next) if !advances(token.as_ref(), &next) => {
                    return Err(ListError::Paging(format!(
                        "a page asked to go on from where the one before it did ({next:?}), so the listing would never end"
                    )));
                }
                next => token = next,
            }
        }
    }

    /// The directory a folder marker (an empty object whose key ends in
    /// `/`, beneath the prefix) stands for, when it is a servable name.
    fn folder_of(&self, listed: &Listed) -> Option<String> {
        let folder = listed
            .key
            .strip_prefix(&self.key_prefix)?
            .strip_suffix('/')?;
        let servable = listed.size == 0 && !folder.is_empty();
        (servable && crate::entry::check_name(folder).is_ok()).then(|| folder.to_owned())
    }

    /// The entry of a listed object; its version is a hash of the ETag
    /// (else of the modification time, to the second).
    fn entry_of(&self, listed: &Listed) -> Option<FileEntry> {
        let name = self.name_of(&listed.key, listed.size)?;
        let version = match &listed.version {
            Version::Tag(tag) => version_of(tag),
            Version::Modified(time) => {
                self.versions_by_time.store(true, Ordering::Relaxed);
                // `2026-01-02T03:04:05.000Z`: seconds, as a HEAD gives it.
                version_of_time(time.get(..19).unwrap_or(time))
            }
        };
        Some(FileEntry::new(name, listed.size, version))
    }

    /// Requests the store throttled so far (503 SlowDown, 429).
    pub fn throttled_total(&self) -> u64 {
        self.metrics.throttled_total()
    }

    /// The dataset name of a listed key (of an object of `size` bytes), or
    /// `None` for a folder marker (`cats/`: no sample, the folder shows by
    /// the keys beneath it) and for keys that are not servable names or
    /// cannot be read back as they are.
    fn name_of(&self, raw: &str, size: u64) -> Option<String> {
        let name = raw.strip_prefix(&self.key_prefix)?;
        if name.is_empty() || name.ends_with('/') {
            if size > 0 {
                Skipped::note(&mut crate::sync::lock(&self.skipped).now.slash, raw);
            }
            return None;
        }
        let addressable = || Key::parse(raw).is_ok_and(|key| key.as_ref() == raw);
        if crate::entry::check_name(name).is_err() || !addressable() {
            Skipped::note(&mut crate::sync::lock(&self.skipped).now.unservable, raw);
            return None;
        }
        Some(name.to_owned())
    }

    /// The key of checked name `name`: always beneath the prefix, since a
    /// checked name has no `.`, `..` or empty component.
    fn key(&self, name: &str) -> Result<Key, ProtocolError> {
        Key::parse(format!("{}{name}", self.key_prefix)).map_err(|e| {
            ProtocolError::new(
                ErrorCode::ForbiddenPath,
                format!("`{name}` is refused: it is not a valid object key ({e})"),
            )
        })
    }

    /// Reads listed object `name` (`listed` bytes) whole into `buf` (of at
    /// least `listed` bytes), in parallel ranges when it is large. An
    /// object that grew since it was listed is read whole into the heap.
    pub async fn read_listed(
        &self,
        name: &str,
        listed: u64,
        buf: Buffer,
    ) -> Result<Chunk, ProtocolError> {
        let key = self.key(name)?;
        if listed > MAX_FILE_BYTES {
            // Served in ranges (`READ`), as a local file that large is.
            return Err(too_large(name, listed));
        }
        let read = async {
            if listed >= 2 * PART_BYTES {
                self.read_parts(&key, listed, buf).await
            } else {
                let result = self.store.get_opts(&key, GetOptions::default()).await?;
                into_chunk(result, buf).await
            }
        };
        match self.within_deadline(name, read).await? {
            Ok(chunk) => Ok(chunk),
            Err(Grown(size)) => Err(too_large(name, size)),
        }
    }

    /// Reads object `name` whole (a name a trainer gave, not from a plan).
    pub async fn read_unlisted(
        &self,
        name: &str,
        alloc: &dyn Fn(usize) -> Buffer,
    ) -> Result<Chunk, ProtocolError> {
        let key = self.key(name)?;
        let read = async {
            let result = self.store.get_opts(&key, GetOptions::default()).await?;
            let size = result.meta.size;
            if size > MAX_FILE_BYTES {
                return Ok(Err(too_large(name, size)));
            }
            let chunk = into_chunk(result, alloc(size as usize)).await?;
            Ok(chunk.map_err(|Grown(size)| too_large(name, size)))
        };
        self.within_deadline(name, read).await?
    }

    /// The size of object `name`.
    pub async fn stat(&self, name: &str) -> Result<u64, ProtocolError> {
        let key = self.key(name)?;
        self.within_deadline(name, async { Ok(self.store.head(&key).await?.size) })
            .await
    }

    /// Reads `length` bytes (or to the end) of `name` from `offset`, of
    /// the object `pin` names when given (its ETag: a replaced object is
    /// refused by the store, not read), and returns the version read.
    pub async fn read_range(
        &self,
        name: &str,
        offset: u64,
        length: u64,
        pin: Option<&Pinned>,
    ) -> Result<(Chunk, Pinned), ProtocolError> {
        let key = self.key(name)?;
        let read = async {
            // A read with no version to keep to takes the object as it is:
            // one replaced between its HEAD and its GET is read again.
            let mut tries = 0;
            let outcome = loop {
                tries += 1;
                match self.try_range(&key, offset, length, pin).await? {
                    Ranged::Changed if pin.is_none() && tries < 3 => {}
                    Ranged::Changed => break Err(changed(name)),
                    Ranged::TooLarge(want) => break Err(too_large(name, want)),
                    Ranged::Read(chunk, pinned) => break Ok((chunk, pinned)),
                }
            };
            Ok(outcome)
        };
        self.within_deadline(name, read).await?
    }

    /// One try of [`S3Source::read_range`]: a read from an object's start
    /// that holds no ETag yet is one ranged GET, whose answer names the
    /// object's ETag and size; any other read is a HEAD unless `pin` holds
    /// the ETag, then a ranged GET of that ETag.
    async fn try_range(
        &self,
        key: &Key,
        offset: u64,
        length: u64,
        pin: Option<&Pinned>,
    ) -> object_store::Result<Ranged> {
        let held = pin.filter(|p| p.held_e_tag().is_some());
        // An object listed empty has no range to ask for (416).
        if held.is_none() && offset == 0 && length > 0 && pin.is_none_or(|p| p.size > 0) {
            match self.first_range(key, length, pin).await {
                Ok(ranged) => return Ok(ranged),
                Err(
                    e @ (object_store::Error::NotFound { .. }
                    | object_store::Error::PermissionDenied { .. }
                    | object_store::Error::Unauthenticated { .. }),
                ) => return Err(e),
                // An empty object (416), a store that answers a range with
                // the whole object, a GET that failed: the HEAD first.
                Err(_) => {}
            }
        }
        let pinned = match held {
            Some(pinned) => pinned.clone(),
            None => {
                let meta = self.store.head(key).await?;
                let now = self.pinned(&meta);
                if pin.is_some_and(|p| !p.same(&now)) {
                    return Ok(Ranged::Changed);
                }
                now
            }
        };
        let (start, want) = clamp_range(pinned.size, offset, length);
        if want > MAX_FILE_BYTES {
            return Ok(Ranged::TooLarge(want));
        }
        if want == 0 {
            return Ok(Ranged::Read(Chunk::from_vec(Vec::new()), pinned));
        }
        let options = GetOptions {
            range: Some((start..start + want).into()),
            if_match: pinned.held_e_tag().map(str::to_owned),
            ..GetOptions::default()
        };
        let result = match self.store.get_opts(key, options).await {
            Err(object_store::Error::Precondition { .. }) => return Ok(Ranged::Changed),
            result => result?,
        };
        // A store that does not check `If-Match` still names what it sent.
        if result.meta.e_tag.is_some() && result.meta.e_tag.as_deref() != pinned.held_e_tag() {
            return Ok(Ranged::Changed);
        }
        let bytes = result.bytes().await?;
        Ok(Ranged::Read(Chunk::from_vec(bytes.to_vec()), pinned))
    }

    /// The first `length` bytes of the object at `key`, with one ranged
    /// GET (a HEAD to pin its ETag first would double the requests of
    /// every file read through the mount without an order): the answer's
    /// ETag and size pin the object. `Changed` when it is not the version
    /// `pin` names.
    async fn first_range(
        &self,
        key: &Key,
        length: u64,
        pin: Option<&Pinned>,
    ) -> object_store::Result<Ranged> {
        // One byte past what a frame carries tells a larger read apart.
        let asked = length.min(MAX_FILE_BYTES + 1);
        let options = GetOptions {
            range: Some((0..asked).into()),
            ..GetOptions::default()
        };
        let result = self.store.get_opts(key, options).await?;
        let now = self.pinned(&result.meta);
        if pin.is_some_and(|p| !p.same(&now)) {
            return Ok(Ranged::Changed);
        }
        let (_, want) = clamp_range(now.size, 0, length);
        if want > MAX_FILE_BYTES {
            return Ok(Ranged::TooLarge(want));
        }
        let bytes = result.bytes().await?;
        if bytes.len() as u64 != want {
            return Ok(Ranged::Changed);
        }
        Ok(Ranged::Read(Chunk::from_vec(bytes.to_vec()), now))
    }

    /// What pins the object `meta` describes: its version (as the listing
    /// takes it), size and ETag.
    fn pinned(&self, meta: &object_store::ObjectMeta) -> Pinned {
        let version = if self.versions_by_time.load(Ordering::Relaxed) {
            let time = meta.last_modified.format("%Y-%m-%dT%H:%M:%S").to_string();
            version_of_time(&time)
        } else {
            version_of(meta.e_tag.as_deref().unwrap_or_default())
        };
        Pinned::object(version, meta.size, meta.e_tag.clone())
    }

    /// Reads a large object as parallel ranged GETs. Every part reports
    /// the object's size and ETag; if they are not all the listed size
    /// and one ETag (the object was replaced mid-read), the parts are of
    /// different versions and the object is read again in one GET.
    async fn read_parts(
        &self,
        key: &Key,
        size: u64,
        mut buf: Buffer,
    ) -> object_store::Result<Result<Chunk, Grown>> {
        let parts = (0..size).step_by(PART_BYTES as usize).map(|start| {
            let options = GetOptions {
                range: Some((start..(start + PART_BYTES).min(size)).into()),
                ..GetOptions::default()
            };
            async move {
                let result = self.store.get_opts(key, options).await?;
                let meta = result.meta.clone();
                Ok::<_, object_store::Error>((meta, result.bytes().await?))
            }
        });
        let parts = match futures::future::try_join_all(parts).await {
            Ok(parts) => Some(parts),
            // The object shrank below a part's range since it was listed.
            Err(e) if e.to_string().contains("416") => None,
            Err(e) => return Err(e),
        };
        let replaced = parts.as_ref().is_none_or(|parts| {
            let etag = &parts[0].0.e_tag;
            parts
                .iter()
                .any(|(meta, _)| meta.size != size || &meta.e_tag != etag)
        });
        let Some(parts) = parts.filter(|_| !replaced) else {
            let whole = self.store.get_opts(key, GetOptions::default()).await?;
            return into_chunk(whole, buf).await;
        };
        let bytes = buf.as_mut_slice();
        let mut len = 0;
        for (_, piece) in parts {
            bytes[len..len + piece.len()].copy_from_slice(&piece);
            len += piece.len();
        }
        Ok(Ok(Chunk::pooled(buf, 0, len)))
    }

    /// Runs one sample's requests within the deadline, counting and
    /// explaining a failure.
    async fn within_deadline<T>(
        &self,
        name: &str,
        work: impl Future<Output = object_store::Result<T>>,
    ) -> Result<T, ProtocolError> {
        let past_deadline = |cause: &str| {
            (
                "deadline",
                ProtocolError::new(
                    ErrorCode::IoError,
                    format!(
                        "reading `{name}` from {} took longer than its {:?} deadline (retries included){cause}",
                        self.url, self.deadline
                    ),
                ),
            )
        };
        let started = tokio::time::Instant::now();
        let failed = match tokio::time::timeout(self.deadline, work).await {
            Ok(Ok(value)) => return Ok(value),
            // object_store's own clock (the end of its retries, set to the
            // deadline) or the last try's answer timeout ran out first.
            Ok(Err(e))
                if started.elapsed() >= self.deadline.mul_f64(0.9)
                    && ["timed out", "retr", "elapsed"]
                        .iter()
                        .any(|t| e.to_string().contains(t)) =>
            {
                past_deadline(&format!(": {e}"))
            }
            Ok(Err(e)) => self.sample_error(name, &e),
            Err(_) => match self.metrics.retried_since(started.into_std()) {
                Some(why) => past_deadline(&format!("; its last failed try: {why}")),
                None => past_deadline("; no try failed, the store was slow to answer"),
            },
        };
        self.metrics.sample_errors(failed.0).inc();
        Err(failed.1)
    }

    fn sample_error(&self, name: &str, e: &object_store::Error) -> (&'static str, ProtocolError) {
        use object_store::Error as E;
        match e {
            E::NotFound { .. } => (
                "not_found",
                ProtocolError::new(
                    ErrorCode::NotFound,
                    format!(
                        "`{name}` does not exist in the dataset (no such object in {})",
                        self.url
                    ),
                ),
            ),
            E::PermissionDenied { .. } | E::Unauthenticated { .. } => (
                "denied",
                ProtocolError::new(
                    ErrorCode::IoError,
                    format!(
                        "reading `{name}` was denied by the object store ({}): {e}",
                        self.bucket
                    ),
                ),
            ),
            _ => (
                "other",
                ProtocolError::new(
                    ErrorCode::IoError,
                    format!("reading `{name}` from {} failed: {e}", self.url),
                ),
            ),
        }
    }
}

/// Whether a listing's `next` page starts past the one before it, `last`.
fn advances(last: Option<&list::Next>, next: &list::Next) -> bool {
    match (last, next) {
        (Some(list::Next::After(last)), list::Next::After(next)) => next > last,
        (Some(last), next) => last != next,
        (None, _) => true,
    }
}

/// An object's version as its listing has it: a hash of its ETag (else
/// of its modification time).
fn version_of(tag: &str) -> u64 {
    // Some stores list an ETag bare and send it quoted in a GET's header
    // (or weak, `W/"..."`): the same tag either way. Hashed quoted, as most
    // stores send it everywhere (their versions, and so the node cache's
    // keys, are as before).
    let bare = tag.strip_prefix("W/").unwrap_or(tag).trim_matches('"');
    hash(&format!("\"{bare}\""))
}

fn hash(text: &str) -> u64 {
    let mut h = Fnv64::new();
    h.write(text.as_bytes());
    h.0
}

/// The version of an object known by its modification time
/// (`2026-01-02T03:04:05`, UTC), apart from any ETag's.
fn version_of_time(time: &str) -> u64 {
    hash(&format!("modified {time}"))
}

fn too_large(name: &str, bytes: u64) -> ProtocolError {
    ProtocolError::new(
        ErrorCode::TooLarge,
        format!(
            "`{name}`: {bytes} bytes is more than one response frame carries ({MAX_FILE_BYTES} bytes); read it in ranges with READ offset/length"
        ),
    )
}

/// An object that grew since it was listed past what one response frame
/// carries: its size now.
struct Grown(u64);

/// What one try of a range read found.
enum Ranged {
    Read(Chunk, Pinned),
    /// Another object than the one pinned.
    Changed,
    /// More bytes than one response frame carries.
    TooLarge(u64),
}

/// Streams a GET's body into `buf`, or into the heap when it does not fit
/// (the object grew since it was listed), unless it grew past what one
/// response frame carries.
async fn into_chunk(
    result: object_store::GetResult,
    mut buf: Buffer,
) -> object_store::Result<Result<Chunk, Grown>> {
    let size = result.meta.size;
    if size as usize > buf.as_mut_slice().len() {
        buf.recycle();
        if size > MAX_FILE_BYTES {
            return Ok(Err(Grown(size)));
        }
        return Ok(Ok(Chunk::from_vec(result.bytes().await?.to_vec())));
    }
    let mut stream = result.into_stream();
    let mut len = 0;
    while let Some(piece) = stream.next().await {
        let piece = piece?;
        let bytes = buf.as_mut_slice();
        if len + piece.len() > bytes.len() {
            return Err(object_store::Error::Generic {
                store: "S3",
                source: "the object grew while it was read".into(),
            });
        }
        bytes[len..len + piece.len()].copy_from_slice(&piece);
        len += piece.len();
    }
    Ok(Ok(Chunk::pooled(buf, 0, len)))
}

/// `text` with the user and password of every URL in it left out
/// (`http://user:secret@host` shows as `http://host`): an endpoint given
/// with credentials in it must not reach the log.
fn without_userinfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        let authority_end = after
            .find(|c: char| c == '/' || c.is_whitespace() || c == ')' || c == '`')
            .unwrap_or(after.len());
        rest = match after[..authority_end].rfind('@') {
            Some(userinfo_end) => &after[userinfo_end + 1..],
            None => after,
        };
    }
    out.push_str(rest);
    out
}

/// How long one request of a sample may take: a third of the sample's
/// deadline, so that a hung request leaves time for two more tries (at
/// least a second, unless the deadline is shorter).
fn attempt_timeout(deadline: Duration) -> Duration {
    (deadline / 3).max(Duration::from_secs(1)).min(deadline)
}

/// Lists one page beneath the prefix and asks for a key that does not
/// exist, turning each way that can fail into a sentence that says what
/// to fix. A prefix with no objects is only warned about (the data may
/// not be uploaded yet).
async fn check(
    lister: &Lister,
    store: &AmazonS3,
    prefix: &Key,
    at: &Probed<'_>,
) -> Result<(), String> {
    let (bucket, endpoint, not_s3) = (at.bucket, at.endpoint, at.not_s3());
    // A store that answers it is busy (503 SlowDown, 429, another 5xx) is
    // there: it is asked again for as long as a listing page would be
    // (stages of a fleet started at once are throttled together, and one
    // that gave up after 5 s did not start); one that does not answer is
    // reported within the probe's time.
    let first_prefix = key_prefix(prefix);
    let started = Instant::now();
    let mut told = false;
    let first = loop {
        let page = lister.page(&first_prefix, false, None, PROBE_TIMEOUT / 2);
        match tokio::time::timeout(PROBE_TIMEOUT, page).await {
            Ok(Ok(page)) => break page,
            Ok(Err(ListError::Status(status, body)))
                if busy(status) && started.elapsed() < list::BUSY_PATIENCE =>
            {
                if !std::mem::replace(&mut told, true) {
                    tracing::warn!(
                        bucket,
                        %endpoint,
                        answer = %ListError::Status(status, body),
                        "the object store is busy: asking again for up to {:?} before giving up",
                        list::BUSY_PATIENCE
                    );
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Ok(Err(e @ ListError::Status(status, _))) if busy(status) => {
                return Err(format!(
                    "the object store at {endpoint} answered every listing of bucket `{bucket}` for {} s that it is busy ({e}): it is reachable but throttling or failing; start the stage again when it answers, or ask its operator",
                    started.elapsed().as_secs()
                ));
            }
            Ok(Err(e)) => return Err(list_failure(&e, at)),
            Err(_) => return Err(no_answer(endpoint)),
        }
    };
    // A server that is not an object store (a web server answering every
    // path) may pass for an empty one; it also "finds" a key that cannot
    // exist.
    let absent = prefix.clone().join(".sluice-probe-no-such-key");
    use object_store::Error as E;
    match tokio::time::timeout(PROBE_TIMEOUT, store.head(&absent)).await {
        Ok(Err(E::NotFound { .. } | E::PermissionDenied { .. } | E::Unauthenticated { .. })) => {}
        Ok(Ok(_)) => {
            return Err(format!(
                "the server at {endpoint} does not answer like an S3 object store (it found an object that cannot exist): {not_s3}"
            ));
        }
        Ok(Err(e)) => {
            return Err(format!(
                "the server at {endpoint} does not answer like an S3 object store ({e}): {not_s3}"
            ));
        }
        Err(_) => {
            return Err(no_answer(endpoint));
        }
    }
    if first.objects.is_empty() && first.prefixes.is_empty() {
        tracing::warn!(
            bucket,
            prefix = %prefix,
            "the dataset's prefix holds no objects (yet?): check the dataset URL"
        );
    }
    Ok(())
}

/// What the keys beneath `prefix` begin with (`prefix/`, or nothing for a
/// whole bucket).
fn key_prefix(prefix: &Key) -> String {
    match prefix.as_ref() {
        "" => String::new(),
        p => format!("{p}/"),
    }
}

/// What to fix when the store at `endpoint` did not answer the start-up
/// check in time.
fn no_answer(endpoint: &str) -> String {
    format!(
        "the object store at {endpoint} did not answer within {PROBE_TIMEOUT:?}: check --s3-endpoint and the network"
    )
}

/// The store the start-up check asked, as its messages name it.
struct Probed<'a> {
    bucket: &'a str,
    /// The endpoint's URL, or `AWS S3`.
    endpoint: &'a str,
    /// Virtual-hosted addressing (`BUCKET.HOST`) on a server of one's own.
    virtual_hosted_compatible: bool,
    anonymous: bool,
    /// Where the credentials come from: what to check when they cannot be
    /// had.
    credentials: &'a str,
}

impl Probed<'_> {
    /// What to fix when the server does not answer as an object store.
    fn not_s3(&self) -> &'static str {
        if self.virtual_hosted_compatible {
            "check --s3-endpoint: with --s3-path-style false it must name the bucket (https://BUCKET.HOST); most S3-compatible servers want --s3-path-style true and their own URL"
        } else {
            "check --s3-endpoint"
        }
    }
}

/// What to fix, when the start-up listing failed with `e`.
fn list_failure(e: &ListError, at: &Probed<'_>) -> String {
    let (bucket, endpoint) = (at.bucket, at.endpoint);
    let refused = || {
        if at.anonymous {
            format!(
                "the object store at {endpoint} refused unsigned requests for bucket `{bucket}` ({e}): the bucket is not public; drop --s3-anonymous and give credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
            )
        } else {
            format!(
                "the object store at {endpoint} refused the credentials for bucket `{bucket}` ({e}): check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket's policy"
            )
        }
    };
    let no_bucket = || {
        format!(
            "bucket `{bucket}` does not exist at {endpoint}: check the dataset URL (and --s3-endpoint)"
        )
    };
    match e {
        // AWS names the bucket's region when it is signed for another one
        // (301 PermanentRedirect, 400 AuthorizationHeaderMalformed).
        ListError::Status(_, body)
            if body.contains("PermanentRedirect")
                || body.contains("AuthorizationHeaderMalformed")
                || body.contains("IncorrectEndpoint") =>
        {
            match list::xml_field(body, "Region") {
                Some(region) => format!(
                    "bucket `{bucket}` is in region {region}, not the one the stage signs for: set --s3-region {region} (or AWS_REGION)"
                ),
                None => format!(
                    "bucket `{bucket}` is in another region than the one the stage signs for ({e}): set --s3-region (or AWS_REGION) to the bucket's"
                ),
            }
        }
        ListError::Status(_, body) if body.contains("NoSuchBucket") => no_bucket(),
        // A 404 without S3's error document: a web server that is no
        // object store (a wrong port, a path that is not the store's).
        ListError::Status(status, body)
            if *status == http::StatusCode::NOT_FOUND && !body.contains("<Error") =>
        {
            if body.trim().is_empty() {
                format!(
                    "bucket `{bucket}` was not found at {endpoint} (404 with no S3 error document: the bucket does not exist, or the server is not an S3 object store): check the dataset URL and --s3-endpoint"
                )
            } else {
                format!(
                    "the server at {endpoint} does not answer like an S3 object store: listing bucket `{bucket}` got 404 with a body that is not an S3 error document (it begins `{}`); {}",
                    body.trim_start().chars().take(80).collect::<String>(),
                    at.not_s3()
                )
            }
        }
        ListError::Status(status, _) if *status == http::StatusCode::NOT_FOUND => no_bucket(),
        ListError::Status(status, _)
            if *status == http::StatusCode::FORBIDDEN
                || *status == http::StatusCode::UNAUTHORIZED =>
        {
            refused()
        }
        ListError::Transport(_) => format!(
            "cannot reach the object store at {endpoint} ({e}): check --s3-endpoint and the network"
        ),
        ListError::Timeout(_) => no_answer(endpoint),
        ListError::Credentials(_) => format!("{e}: {}", at.credentials),
        ListError::NotS3(_) => format!(
            "the server at {endpoint} does not answer like an S3 object store: {e}; {}",
            at.not_s3()
        ),
        ListError::Status(..) | ListError::Paging(_) => {
            format!("listing bucket `{bucket}` at {endpoint} failed: {e}")
        }
    }
}

/// The builder for `bucket` with the endpoint, region, addressing and
/// credentials the options and the standard AWS variables and files give,
/// the bucket's URL and region for the listing requests (as object_store
/// addresses them), and what to check when the credentials cannot be had.
async fn builder(
    bucket: &str,
    options: &S3Options,
    metrics: &SourceMetrics,
) -> Result<(AmazonS3Builder, Addressing, String), String> {
    let keys_from_env = credentials_from_env();
    // A session token from the environment belongs to keys from there: with
    // none there (a profile's keys), a stale one left from an earlier
    // assume-role must not be signed in beside the profile's.
    let mut b = builder_from_env(!matches!(keys_from_env, Ok(None)))
        .with_bucket_name(bucket)
        .with_virtual_hosted_style_request(!options.path_style)
        .with_http_connector(Connector {
            metrics: Some(metrics.clone()),
            answer_within: Some(attempt_timeout(options.deadline)),
        });
    let profile = Profile::load();
    let endpoint = &options.endpoint;
    if let Some(endpoint) = endpoint {
        if !endpoint.starts_with("http://") && !endpoint.starts_with("https://") {
            return Err(format!(
                "the S3 endpoint `{endpoint}` is not an http:// or https:// URL"
            ));
        }
        b = b
            .with_endpoint(endpoint)
            .with_allow_http(endpoint.starts_with("http://"));
    }
    let region = options
        .region
        .clone()
        .filter(|r| !r.is_empty())
        .or_else(|| env_value("AWS_REGION"))
        .or_else(|| env_value("AWS_DEFAULT_REGION"))
        .or_else(|| profile.config.get("region").cloned())
        .unwrap_or_else(|| "us-east-1".into());
    b = b.with_region(&region);
    // A virtual-hosted endpoint already names the bucket (object_store's rule).
    let bucket_url = match (&endpoint, options.path_style) {
        (Some(endpoint), false) => endpoint.trim_end_matches('/').to_owned(),
        (Some(endpoint), true) => format!("{}/{bucket}", endpoint.trim_end_matches('/')),
        (None, false) => format!("https://{bucket}.s3.{region}.amazonaws.com"),
        (None, true) => format!("https://s3.{region}.amazonaws.com/{bucket}"),
    };
    let addressing = Addressing { bucket_url, region };
    if options.anonymous {
        return Ok((b.with_skip_signature(true), addressing, String::new()));
    }
    if let Some(check) = keys_from_env? {
        return Ok((b, addressing, check.into()));
    }
    match (
        profile.credentials.get("aws_access_key_id"),
        profile.credentials.get("aws_secret_access_key"),
    ) {
        (Some(id), Some(secret)) => {
            b = b.with_access_key_id(id).with_secret_access_key(secret);
            if let Some(token) = profile.credentials.get("aws_session_token") {
                b = b.with_token(token);
            }
            return Ok((b, addressing, CHECK_KEYS.into()));
        }
        (Some(_), None) | (None, Some(_)) => {
            return Err(format!(
                "profile `{}` in {} has only one of aws_access_key_id and aws_secret_access_key: give both",
                profile.name,
                profile.credentials_file.display()
            ));
        }
        (None, None) => {}
    }
    // Last, as the AWS tools do: the role of the machine (an EC2 instance
    // profile, a Kubernetes node's role), from its metadata service.
    let no_credentials = format!(
        "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or put profile `{}` in {} (AWS_PROFILE picks another), or run where the instance metadata service gives a role, or pass --s3-anonymous for a public bucket",
        profile.name,
        profile.credentials_file.display()
    );
    if env_is("AWS_EC2_METADATA_DISABLED", "true") {
        return Err(format!(
            "{no_credentials} (AWS_EC2_METADATA_DISABLED is set)"
        ));
    }
    let metadata = std::env::var("AWS_METADATA_ENDPOINT")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| DEFAULT_METADATA_ENDPOINT.into());
    match metadata_answers(&metadata).await {
        Ok(()) => Ok((
            b,
            addressing,
            format!(
                "the instance metadata service at {metadata} gave no credentials: give the machine a role, or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            ),
        )),
        Err(e) => Err(format!(
            "{no_credentials} (no instance metadata service at {metadata}: {e})"
        )),
    }
}

/// Where object_store's own instance-role credentials come from unless
/// AWS_METADATA_ENDPOINT names another.
const DEFAULT_METADATA_ENDPOINT: &str = "http://169.254.169.254";
/// How long the metadata service has to accept a connection before the
/// stage says there is none (on a machine without one the address is
/// usually unroutable, refused at once, but may also swallow the attempt).
const METADATA_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether variable `name` is set to `value` (in any case).
fn env_is(name: &str, value: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v.trim().eq_ignore_ascii_case(value))
}

/// What to check when keys (from the environment or a profile) are not
/// accepted.
const CHECK_KEYS: &str = "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)";

/// The credentials the environment names, in object_store's order, as
/// what to check when they cannot be had (keys, or the provider they are
/// fetched from); `None` when it names none. Half of a pair is an error
/// here, where object_store would silently fall back to the instance
/// metadata service.
fn credentials_from_env() -> Result<Option<&'static str>, String> {
    let set = |name| std::env::var_os(name).is_some_and(|v| !v.is_empty());
    let (id, secret) = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY");
    let half = |have: &str, lack: &str| {
        format!(
            "{have} is set but {lack} is not: set both, or neither to use a profile (AWS_PROFILE, ~/.aws/credentials)"
        )
    };
    match (set(id), set(secret)) {
        (true, true) => return Ok(Some(CHECK_KEYS)),
        (true, false) => return Err(half(id, secret)),
        (false, true) => return Err(half(secret, id)),
        (false, false) => {}
    }
    // The variable naming a provider, the one it needs beside it (and
    // why), and what to check when the provider fails.
    let providers = [
        (
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            Some((
                "AWS_ROLE_ARN",
                "a Kubernetes service account annotated with a role gets both",
            )),
            "check the web identity token file (AWS_WEB_IDENTITY_TOKEN_FILE), the role it assumes (AWS_ROLE_ARN) and that STS answers",
        ),
        (
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            None,
            "check the container credentials endpoint (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI) and the task's role",
        ),
        (
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            Some((
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                "the stage reads the token from that file; EKS Pod Identity sets both",
            )),
            "check the pod identity agent (AWS_CONTAINER_CREDENTIALS_FULL_URI), its token file (AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE) and the pod's role association",
        ),
    ];
    for (var, needs, check) in providers {
        if !set(var) {
            continue;
        }
        if let Some((other, why)) = needs
            && !set(other)
        {
            return Err(format!("{var} is set but {other} is not: set both ({why})"));
        }
        return Ok(Some(check));
    }
    Ok(None)
}

/// Whether something accepts connections at `endpoint` (an `http://` URL)
/// within [`METADATA_CONNECT_TIMEOUT`]: the quick look before relying on
/// an instance metadata service, which object_store would otherwise ask
/// with retries until the start-up check gives up.
async fn metadata_answers(endpoint: &str) -> Result<(), String> {
    let authority = endpoint
        .strip_prefix("http://")
        .and_then(|rest| rest.split('/').next())
        .filter(|a| !a.is_empty())
        .ok_or_else(|| "not an http:// URL".to_owned())?;
    // `host`, `host:port`, `[v6]` or `[v6]:port`.
    let address = if authority.ends_with(']') || !authority.contains(':') {
        format!("{authority}:80")
    } else {
        authority.to_owned()
    };
    match tokio::time::timeout(
        METADATA_CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect(&address),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no connection within {METADATA_CONNECT_TIMEOUT:?}")),
    }
}

/// Where a bucket's requests go.
struct Addressing {
    bucket_url: String,
    region: String,
}

/// The value of the environment variable `name`, unless it is unset or
/// empty (an empty one, as templates leave them, counts as unset).
fn env_value(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// A builder configured from the `AWS_*` variables, as object_store's
/// `from_env` does, but with empty variables left out and the session
/// token only when `session_token`.
fn builder_from_env(session_token: bool) -> AmazonS3Builder {
    let mut b = AmazonS3Builder::new();
    for (name, value) in std::env::vars_os() {
        let (Some(name), Some(value)) = (name.to_str(), value.to_str()) else {
            continue;
        };
        if !name.starts_with("AWS_") || value.is_empty() {
            continue;
        }
        let Ok(key) = name.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() else {
            continue;
        };
        // The endpoint is the options' (resolved by the configuration).
        if matches!(key, AmazonS3ConfigKey::Endpoint) {
            continue;
        }
        if session_token || !matches!(key, AmazonS3ConfigKey::Token) {
            b = b.with_config(key, value);
        }
    }
    b
}

/// Where the object store is when no flag names it, as the AWS tools find
/// it: `AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL`, else the profile's
/// `endpoint_url` in `~/.aws/config`, none of them when
/// `AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true`. Returns the URL and where it
/// came from (for an error about it).
pub(crate) fn configured_endpoint() -> Option<(String, String)> {
    endpoint_of(env_value, &Profile::load())
}

/// [`configured_endpoint`] with the environment read through `env`.
fn endpoint_of(
    env: impl Fn(&str) -> Option<String>,
    profile: &Profile,
) -> Option<(String, String)> {
    if env("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return None;
    }
    ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"]
        .into_iter()
        .find_map(|var| env(var).map(|url| (url, var.to_owned())))
        .or_else(|| {
            let url = profile
                .config
                .get("endpoint_url")
                .filter(|u| !u.is_empty())?;
            let from = format!(
                "endpoint_url of profile `{}` in {}",
                profile.name,
                profile.config_file.display()
            );
            Some((url.clone(), from))
        })
}

/// The named profile of the shared AWS files (`~/.aws/credentials` and
/// `~/.aws/config`, or the files AWS_SHARED_CREDENTIALS_FILE and
/// AWS_CONFIG_FILE name).
struct Profile {
    name: String,
    /// The profile's keys (`aws_access_key_id`, ...): its section of the
    /// credentials file, or of the config file when that holds none there
    /// (the AWS tools take keys from either, the credentials file first).
    credentials: HashMap<String, String>,
    /// The file `credentials` came from.
    credentials_file: PathBuf,
    config: HashMap<String, String>,
    config_file: PathBuf,
}

impl Profile {
    fn load() -> Self {
        let name = env_value("AWS_PROFILE").unwrap_or_else(|| "default".into());
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default();
        let file = |var: &str, default: &str| {
            env_value(var).map_or_else(|| home.join(".aws").join(default), PathBuf::from)
        };
        let credentials_file = file("AWS_SHARED_CREDENTIALS_FILE", "credentials");
        let config_file = file("AWS_CONFIG_FILE", "config");
        let read = |path: &PathBuf, section: &str| {
            std::fs::read_to_string(path)
                .map(|text| ini_section(&text, section))
                .unwrap_or_default()
        };
        let config_section = if name == "default" {
            "default".to_owned()
        } else {
            format!("profile {name}")
        };
        let config = read(&config_file, &config_section);
        let mut credentials = read(&credentials_file, &name);
        let mut keys_file = credentials_file;
        let keys = ["aws_access_key_id", "aws_secret_access_key"];
        if !keys.iter().any(|k| credentials.contains_key(*k))
            && keys.iter().any(|k| config.contains_key(*k))
        {
            credentials = config.clone();
            keys_file = config_file.clone();
        }
        Self {
            credentials,
            credentials_file: keys_file,
            config,
            config_file,
            name,
        }
    }
}

/// The `key = value` lines of `[section]` in an INI text, the keys in
/// lower case (the AWS tools take `AWS_ACCESS_KEY_ID = ...` there too).
fn ini_section(text: &str, section: &str) -> HashMap<String, String> {
    let mut values = HashMap::new();
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || line.starts_with(';') || line.is_empty() {
            continue;
        }
        if let Some(header) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = header.trim() == section;
        } else if inside && let Some((key, value)) = line.split_once('=') {
            values.insert(key.trim().to_ascii_lowercase(), value.trim().to_owned());
        }
    }
    values
}

/// Makes the [`Http`] client object_store sends its requests through.
#[derive(Debug)]
struct Connector {
    /// Where its requests are counted (none: the start-up probe's).
    metrics: Option<SourceMetrics>,
    /// How long a request may wait for its answer's head. The only request
    /// timeout: object_store applies `ClientOptions` timeouts to a client it
    /// builds, not to one of one's own.
    answer_within: Option<Duration>,
}

impl object_store::client::HttpConnector for Connector {
    fn connect(&self, _: &ClientOptions) -> object_store::Result<HttpClient> {
        let tls = hyper_rustls::HttpsConnectorBuilder::new();
        let tls = match tls.with_native_roots() {
            Ok(tls) => tls,
            // No system roots: http:// endpoints still work, and an https://
            // one fails its start-up check with the TLS error.
            Err(_) => hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(
                rustls::ClientConfig::builder()
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth(),
            ),
        };
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let connector = tls
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        Ok(HttpClient::new(Http {
            client,
            metrics: self.metrics.clone(),
            answer_within: self.answer_within,
        }))
    }
}

/// object_store's HTTP client: hyper over rustls, counting every request.
struct Http {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, HttpRequestBody>,
    metrics: Option<SourceMetrics>,
    answer_within: Option<Duration>,
}

impl Http {
    fn count(&self, outcome: Outcome, start: Instant) {
        if let Some(metrics) = &self.metrics {
            metrics.request(outcome.name(), outcome.retried(), start.elapsed());
        }
    }

    fn note_retried(&self, why: impl FnOnce() -> String) {
        if let Some(metrics) = &self.metrics {
            metrics.note_retried(why());
        }
    }
}

impl fmt::Debug for Http {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Http")
    }
}

#[async_trait::async_trait]
impl HttpService for Http {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let start = Instant::now();
        // Dropped before its answer: the sample's deadline ran out, or
        // the sample is no longer wanted.
        let mut pending = Abandoned(Some((self, start)));
        let request = self.client.request(req);
        let answer = match self.answer_within {
            Some(limit) => match tokio::time::timeout(limit, request).await {
                Ok(answer) => answer,
                Err(elapsed) => {
                    pending.0 = None;
                    // Dropping the request closes its connection; the
                    // retry goes out on another.
                    self.count(Outcome::Connection, start);
                    self.note_retried(|| format!("no answer within {limit:?}"));
                    return Err(HttpError::new(HttpErrorKind::Timeout, elapsed));
                }
            },
            None => request.await,
        };
        pending.0 = None;
        let outcome = match &answer {
            Ok(response) => Outcome::of_status(response.status().as_u16()),
            Err(_) => Outcome::Connection,
        };
        // An ok head is counted when its body ends: it may still stall or
        // be cut off.
        match (&self.metrics, outcome) {
            (Some(metrics), Outcome::Ok) => metrics.answered(start.elapsed()),
            _ => self.count(outcome, start),
        }
        if outcome.retried() {
            self.note_retried(|| match &answer {
                Ok(response) => format!("the store answered {}", response.status()),
                // hyper's own message says only "client error (Connect)".
                Err(e) => sluice_proto::error_chain(e),
            });
        }
        match answer {
            Ok(response) => {
                let (parts, body) = response.into_parts();
                let body = body.map_err(|e| HttpError::new(HttpErrorKind::Interrupted, e));
                let body = AnswerBody(std::sync::Mutex::new(Stalling {
                    body,
                    metrics: self.metrics.clone(),
                    uncounted: outcome == Outcome::Ok,
                    idle: self
                        .answer_within
                        .map(|limit| (limit, Box::pin(tokio::time::sleep(limit)))),
                }));
                Ok(HttpResponse::from_parts(parts, HttpResponseBody::new(body)))
            }
            Err(e) => {
                let kind = if e.is_connect() {
                    HttpErrorKind::Connect
                } else {
                    HttpErrorKind::Request
                };
                Err(HttpError::new(kind, e))
            }
        }
    }
}

/// Counts a request dropped before its answer as `abandoned`.
struct Abandoned<'a>(Option<(&'a Http, Instant)>);

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some((http, start)) = self.0.take() {
            http.count(Outcome::Abandoned, start);
        }
    }
}

/// How one request ended, as `sluice_stage_source_requests_total` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// 503 SlowDown or 429: retried.
    Throttled,
    /// Another 5xx: retried.
    ServerError,
    /// 403 or 401.
    Denied,
    NotFound,
    /// 416: a range past the object's end, as the first read of an empty
    /// object asks (a read from the start is one ranged GET, its size not
    /// known yet): an answer, not a fault.
    OutOfRange,
    /// Another 4xx.
    ClientError,
    /// No answer, or not all of it: refused, reset or timed out; retried.
    Connection,
    /// An `ok` head whose body stopped coming: retried.
    Stalled,
    /// Given up before its answer ended: its sample's deadline ran out, or
    /// the sample was no longer wanted.
    Abandoned,
}

impl Outcome {
    fn of_status(status: u16) -> Self {
        match status {
            503 | 429 => Self::Throttled,
            500..=599 => Self::ServerError,
            401 | 403 => Self::Denied,
            404 => Self::NotFound,
            416 => Self::OutOfRange,
            400..=499 => Self::ClientError,
            _ => Self::Ok,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Throttled => "throttled",
            Self::ServerError => "server_error",
            Self::Denied => "denied",
            Self::NotFound => "not_found",
            Self::OutOfRange => "out_of_range",
            Self::ClientError => "client_error",
            Self::Connection => "connection",
            Self::Stalled => "stalled",
            Self::Abandoned => "abandoned",
        }
    }

    /// Whether object_store tries a request that ended so again.
    pub fn retried(self) -> bool {
        matches!(
            self,
            Self::Throttled | Self::ServerError | Self::Connection | Self::Stalled
        )
    }
}

/// A response body made `Sync` (object_store's body type asks for it;
/// hyper's is `Send` only; polled from one task at a time, so the lock is
/// never contended) that fails when no bytes come for as long as a request
/// may wait for its answer: a transfer that stalled after the head (a
/// connection that died quietly) is then resumed by object_store, which
/// asks for the rest with a ranged GET on another connection.
struct AnswerBody<B: http_body::Body>(std::sync::Mutex<Stalling<B>>);

struct Stalling<B: http_body::Body> {
    body: B,
    /// Counts the request when its body ends (an `ok` head's); a stalled
    /// transfer is a retry (object_store asks again).
    metrics: Option<SourceMetrics>,
    /// The request is counted when the body ends: `ok` when all of it
    /// came, `connection` when it failed, `stalled`, or `abandoned` when it
    /// was dropped before its end.
    uncounted: bool,
    /// How long the body may send nothing, and the time it runs out.
    idle: Option<(Duration, Pin<Box<tokio::time::Sleep>>)>,
}

impl<B: http_body::Body> Stalling<B> {
    /// Counts the request, once, as ending with `outcome`.
    fn count(&mut self, outcome: Outcome) {
        if std::mem::take(&mut self.uncounted)
            && let Some(metrics) = &self.metrics
        {
            metrics.ended(outcome.name(), outcome.retried());
        }
    }
}

impl<B: http_body::Body> Drop for Stalling<B> {
    fn drop(&mut self) {
        let outcome = if self.body.is_end_stream() {
            Outcome::Ok
        } else {
            Outcome::Abandoned
        };
        self.count(outcome);
    }
}

impl<B> http_body::Body for AnswerBody<B>
where
    B: http_body::Body<Error = HttpError> + Unpin,
{
    type Data = B::Data;
    type Error = HttpError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self
            .get_mut()
            .0
            .get_mut()
            .unwrap_or_else(|p| p.into_inner());
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(frame) => {
                if let Some((limit, sleep)) = &mut this.idle {
                    sleep.as_mut().reset(tokio::time::Instant::now() + *limit);
                }
                match &frame {
                    None => this.count(Outcome::Ok),
                    Some(Err(_)) => this.count(Outcome::Connection),
                    Some(Ok(_)) if this.body.is_end_stream() => this.count(Outcome::Ok),
                    Some(Ok(_)) => {}
                }
                Poll::Ready(frame)
            }
            Poll::Pending => {
                let Some((limit, sleep)) = &mut this.idle else {
                    return Poll::Pending;
                };
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let stalled = std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no bytes of the answer for {limit:?}"),
                );
                let idle = *limit;
                this.idle = None;
                this.count(Outcome::Stalled);
                if let Some(metrics) = &this.metrics {
                    metrics.note_stalled(idle);
                }
                Poll::Ready(Some(Err(HttpError::new(HttpErrorKind::Timeout, stalled))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.0.lock().map_or_else(
            |p| p.into_inner().body.is_end_stream(),
            |b| b.body.is_end_stream(),
        )
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0
            .lock()
            .map_or_else(|p| p.into_inner().body.size_hint(), |b| b.body.size_hint())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn folders_with_nothing_beneath_are_the_empty_ones() {
        let files = ["a.bin", "full/x.bin", "fullness.bin"]
            .map(|name| crate::entry::FileEntry::new(name.to_owned(), 1, 0));
        let folders = ["valid", "full", "deep", "deep/er", "valid", "ful"].map(str::to_owned);
        assert_eq!(
            super::empty_folders(&files, folders.to_vec()),
            ["deep/er", "ful", "valid"]
        );
        assert!(super::empty_folders(&files, Vec::new()).is_empty());
    }

    #[test]
    fn credentials_in_an_endpoint_url_are_not_shown() {
        let said = super::without_userinfo(
            "cannot reach the object store at http://admin:hunter2@10.0.0.1:9000 (error sending request for url (http://admin:hunter2@10.0.0.1:9000/b?list-type=2)); s3://bucket/x",
        );
        assert!(
            !said.contains("hunter2") && !said.contains("admin"),
            "{said}"
        );
        assert!(
            said.contains("http://10.0.0.1:9000 (") && said.contains("s3://bucket/x"),
            "{said}"
        );
        assert_eq!(super::without_userinfo("no url here"), "no url here");
    }

    #[test]
    fn a_bucket_in_another_region_is_named_with_the_fix() {
        let wrong = super::ListError::Status(
            http::StatusCode::BAD_REQUEST,
            "<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region 'us-east-1' is wrong; expecting 'eu-west-1'</Message><Region>eu-west-1</Region></Error>".into(),
        );
        let aws = super::Probed {
            bucket: "b",
            endpoint: "AWS S3",
            virtual_hosted_compatible: false,
            anonymous: false,
            credentials: "check AWS_ACCESS_KEY_ID",
        };
        let said = super::list_failure(&wrong, &aws);
        assert!(said.contains("set --s3-region eu-west-1"), "{said}");
        let moved = super::ListError::Status(
            http::StatusCode::MOVED_PERMANENTLY,
            "<Error><Code>PermanentRedirect</Code><Message>use the endpoint</Message></Error>"
                .into(),
        );
        let said = super::list_failure(&moved, &aws);
        assert!(
            said.contains("another region") && said.contains("--s3-region"),
            "{said}"
        );
    }

    use super::*;

    #[tokio::test]
    async fn a_metadata_endpoint_is_looked_at_only_over_http() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        let open = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        drop(closed);
        let at = format!("http://{}", open.local_addr().unwrap());
        assert_eq!(metadata_answers(&at).await, Ok(()));
        assert_eq!(metadata_answers(&format!("{at}/latest/")).await, Ok(()));
        let refused = metadata_answers(&format!("http://127.0.0.1:{port}")).await;
        assert!(refused.unwrap_err().contains("refused"));
        for bad in [
            "https://169.254.169.254",
            "169.254.169.254",
            "http://",
            "http:///x",
        ] {
            assert_eq!(
                metadata_answers(bad).await,
                Err("not an http:// URL".to_owned()),
                "{bad}"
            );
        }
    }

    #[test]
    fn urls_split_into_bucket_and_prefix() {
        let (bucket, prefix) = parse_url("s3://data/imagenet/train/").unwrap();
        assert_eq!(
            (bucket.as_str(), prefix.as_ref()),
            ("data", "imagenet/train")
        );
        let (bucket, prefix) = parse_url("s3://data").unwrap();
        assert_eq!((bucket.as_str(), prefix.as_ref()), ("data", ""));
        // One data set, one name, however its URL is written.
        for url in ["s3://data/imagenet/train", "s3://data/imagenet/train/"] {
            let (bucket, prefix) = parse_url(url).unwrap();
            assert_eq!(canonical_url(&bucket, &prefix), "s3://data/imagenet/train");
        }
        for url in ["s3://data", "s3://data/"] {
            let (bucket, prefix) = parse_url(url).unwrap();
            assert_eq!(canonical_url(&bucket, &prefix), "s3://data");
        }
        for bad in [
            "s3://",
            "s3:///x",
            "http://data/x",
            "s3://data/a//b",
            "s3://data/../x",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_profile_section_is_read_alone() {
        let text = "[default]\naws_access_key_id = A\n# comment\n[profile train]\nregion=eu-west-1\n\n[train]\naws_access_key_id = B\n";
        assert_eq!(ini_section(text, "default")["aws_access_key_id"], "A");
        assert_eq!(ini_section(text, "profile train")["region"], "eu-west-1");
        assert_eq!(ini_section(text, "train")["aws_access_key_id"], "B");
        assert!(ini_section(text, "none").is_empty());
        // Key names in any case, as the AWS tools take them.
        let upper = "[default]\nAWS_ACCESS_KEY_ID = C\nAws_Secret_Access_Key=D\n";
        assert_eq!(ini_section(upper, "default")["aws_access_key_id"], "C");
        assert_eq!(ini_section(upper, "default")["aws_secret_access_key"], "D");
    }

    #[test]
    fn the_endpoint_is_the_s3_variable_the_general_one_or_the_profiles() {
        let profile = |endpoint: Option<&str>| Profile {
            name: "train".into(),
            credentials: HashMap::new(),
            credentials_file: PathBuf::from("/c"),
            config: endpoint
                .map(|e| HashMap::from([("endpoint_url".to_owned(), e.to_owned())]))
                .unwrap_or_default(),
            config_file: PathBuf::from("/home/u/.aws/config"),
        };
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        let both = &[
            ("AWS_ENDPOINT_URL", "http://all:1"),
            ("AWS_ENDPOINT_URL_S3", "http://s3:2"),
        ];
        let said = |url: &str, from: &str| Some((url.to_owned(), from.to_owned()));
        assert_eq!(
            endpoint_of(env(both), &profile(Some("http://p:3"))),
            said("http://s3:2", "AWS_ENDPOINT_URL_S3")
        );
        assert_eq!(
            endpoint_of(env(&both[..1]), &profile(Some("http://p:3"))),
            said("http://all:1", "AWS_ENDPOINT_URL")
        );
        assert_eq!(
            endpoint_of(env(&[]), &profile(Some("http://p:3"))),
            said(
                "http://p:3",
                "endpoint_url of profile `train` in /home/u/.aws/config"
            )
        );
        assert_eq!(endpoint_of(env(&[]), &profile(None)), None);
        let ignored = &[
            ("AWS_ENDPOINT_URL_S3", "http://s3:2"),
            ("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "TRUE"),
        ];
        assert_eq!(
            endpoint_of(env(ignored), &profile(Some("http://p:3"))),
            None
        );
    }

    #[test]
    fn an_etag_is_one_version_quoted_bare_or_weak() {
        let quoted = version_of("\"9b2cf535f27731c974343645a3985328\"");
        assert_eq!(version_of("9b2cf535f27731c974343645a3985328"), quoted);
        assert_eq!(version_of("W/\"9b2cf535f27731c974343645a3985328\""), quoted);
        assert_ne!(version_of("\"9b2cf535f27731c974343645a3985329\""), quoted);
    }

    #[test]
    fn a_listing_goes_on_only_past_where_it_was() {
        use list::Next::{After, Token};
        let (a, b) = (After("p/a".to_owned()), After("p/b".to_owned()));
        assert!(advances(None, &a));
        assert!(advances(Some(&a), &b));
        assert!(!advances(Some(&b), &a) && !advances(Some(&a), &a));
        let t = Token("t1".to_owned());
        assert!(advances(Some(&t), &Token("t2".to_owned())));
        assert!(!advances(Some(&t), &t));
    }

    #[test]
    fn skipped_keys_are_warned_of_again_only_when_they_change() {
        let mut skipped = Skipped::default();
        let listing = |skipped: &mut Skipped, keys: &[&str]| {
            skipped.begin();
            for key in keys {
                Skipped::note(&mut skipped.now.unservable, key);
            }
            skipped.report("s3://b/p")
        };
        assert!(!listing(&mut skipped, &[]), "nothing skipped");
        assert!(listing(&mut skipped, &["p/b\t", "p/a\t"]));
        // The same keys, their pages come in another order: said already.
        assert!(!listing(&mut skipped, &["p/a\t", "p/b\t"]));
        assert_eq!(skipped.said.unservable.1.as_deref(), Some("p/a\t"));
        assert!(listing(&mut skipped, &["p/a\t", "p/b\t", "p/c\t"]));
        assert!(!listing(&mut skipped, &[]), "none now: nothing to say");
        // A listing that failed part way leaves no count behind.
        Skipped::note(&mut skipped.now.unservable, "p/z\t");
        assert!(!listing(&mut skipped, &[]));
    }

    #[test]
    fn statuses_become_outcomes() {
        assert_eq!(Outcome::of_status(200), Outcome::Ok);
        assert_eq!(Outcome::of_status(206), Outcome::Ok);
        assert_eq!(Outcome::of_status(503), Outcome::Throttled);
        assert_eq!(Outcome::of_status(429), Outcome::Throttled);
        assert_eq!(Outcome::of_status(500), Outcome::ServerError);
        assert_eq!(Outcome::of_status(403), Outcome::Denied);
        assert_eq!(Outcome::of_status(404), Outcome::NotFound);
        assert_eq!(Outcome::of_status(416), Outcome::OutOfRange);
        assert_eq!(Outcome::of_status(400), Outcome::ClientError);
        assert!(Outcome::Throttled.retried() && Outcome::Connection.retried());
        assert!(!Outcome::Denied.retried() && !Outcome::NotFound.retried());
    }
}
