//! The read-only mount (`--mount DIR`): every data set as `DIR/<dataset>/...`
//! with its listing's tree and sizes, read by opening files, so that code
//! which does not use the client (a torchvision `ImageFolder`, `tf.data`,
//! DLIO) reads through the stage.
//!
//! Reads through the mount are a job's reads, by path, which works across
//! containers (the stage cannot see readers' PIDs in other PID
//! namespaces): `DIR/@<job>/<dataset>/...` belongs to `<job>`, and
//! `DIR/<dataset>/...` to the default job (`--mount-job`, `mount`). They go
//! through the same engine calls as the socket's: an `open` of a file that
//! one of the job's plans holds undelivered is served from the prefetch
//! buffer and counts as that entry's delivery (so a sampler that submitted
//! the epoch's order gets each file exactly once, whoever opens it), its
//! bytes put into the kernel's page cache before the open returns
//! (`FUSE_NOTIFY_STORE`), so that the reads which follow are answered by
//! the kernel, with no request to the stage; a
//! large file of a local data set that no plan holds is read by the kernel
//! from the file itself (passthrough), charged to the job whole when
//! opened; any other read is a range read through the job's limiter and
//! the node cache.
//! A job's labels are the ones its trainers declared (`HELLO`): the mount
//! never changes them.
//!
//! The kernel keeps names, attributes and file pages (`FOPEN_KEEP_CACHE`)
//! for [`TTL`]; the data sets are listed again at most once a [`TTL`],
//! off the request path (see `tree.rs`). Reads are answered on the
//! stage's runtime, so a slow read does not hold the others, and requests
//! that may wait for a slow source (an open that opens its file, a look
//! whose listing is due) on its blocking threads (see [`MountFs::answer`]).
//! Writes of any kind are refused with `EROFS`.

mod io_mode;
mod orders;
mod tree;

use std::collections::HashMap;
use std::collections::hash_map::Entry as Slot;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};
use tokio_util::sync::CancellationToken;

use anyhow::Context;
use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, MountOption, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, Request,
};
use prometheus::{IntCounter, IntGauge};
use tokio::runtime::Handle;
use tracing::{info, warn};

use crate::chunk::Chunk;
use crate::config::{ConfigError, MountOptions, on_network_file_system};
use crate::dataset::Dataset;
use crate::engine::{Engine, Job, JobHandle, PlannedClaim, Reservation};
use crate::entry::Owner;
use crate::metrics::DatasetMetrics;
use crate::metrics::Metrics;
use crate::pace::Sparse;
use crate::protocol::{ErrorCode, Payload, ProtocolError, valid_job_id};
use crate::server::read_range_now;
use crate::source::{Pinned, changed, grown};
use crate::sync::lock;
use crate::trust::{Peer, TrainerAccess};
use io_mode::{Way, WayHeld, Ways};
use orders::Orders;
use tree::{Entry, Tree, Trees};

/// How long the kernel may keep names, attributes and pages.
pub const TTL: Duration = Duration::from_secs(60);

/// The inode of the mount's root.
const ROOT: u64 = fuser::FUSE_ROOT_ID;

/// A live mount; unmounted when dropped.
pub struct Mount {
    session: Option<fuser::BackgroundSession>,
    dir: PathBuf,
    /// Its FUSE connection (see [`abort_connection`]), when known.
    connection: Option<u32>,
    /// Its background tasks (detaching idle jobs, taking order files).
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Cancelled when the session ends (see [`Mount::ended`]).
    ended: CancellationToken,
}

impl std::fmt::Debug for Mount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mount({})", self.dir.display())
    }
}

impl Mount {
    /// Where the data sets are mounted.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Cancelled once the kernel ends the mount's session: unmounted, by
    /// the stage as it stops or from outside (`umount`, `fusermount3 -u`)
    /// while it runs, which leaves its readers an empty directory.
    pub fn ended(&self) -> CancellationToken {
        self.ended.clone()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        info!(dir = %self.dir.display(), "unmounting");
        // The session's own unmount fails while a reader holds a file or
        // a working directory in the mount; the mount then outlives the
        // stage, dead, until it is detached.
        drop(self.session.take());
        if sluice_mount_at(&self.dir) && !detach(&self.dir) {
            warn!(dir = %self.dir.display(), "the mount is left behind: run `fusermount3 -u -z` or `umount -l` on it as root");
        }
        // Requests still waiting (readers of files whose source open or
        // read hangs) fail now, not when the source answers.
        if let Some(id) = self.connection
            && !abort_connection(id)
        {
            tracing::debug!(
                connection = id,
                "the mount's FUSE connection was not aborted (no fusectl?)"
            );
        }
    }
}

/// Mounts the engine's data sets at `options.dir` (recovering a stale
/// mount a crashed stage left there); reads that name no job belong to
/// `options.job`; order files are taken from `options.orders`. Requests are
/// answered on `runtime`.
pub fn mount(
    engine: Arc<Engine>,
    options: &MountOptions,
    access: Arc<TrainerAccess>,
    runtime: Handle,
) -> anyhow::Result<Mount> {
    let (dir, default_job) = (options.dir.as_path(), options.job.as_str());
    if !Path::new("/dev/fuse").exists() {
        anyhow::bail!(
            "cannot mount at {}: /dev/fuse does not exist (load the fuse module, or give the container the device)",
            dir.display()
        );
    }
    if detach_stale(dir)? {
        warn!(dir = %dir.display(), "a stale mount was in the way (a stage that crashed?): it is unmounted");
    }
    let canonical = dir
        .canonicalize()
        .with_context(|| format!("the mount directory {}", dir.display()))?;
    if sluice_mount_at(&canonical) {
        anyhow::bail!(
            "{} is already served by a running sluice stage: stop that stage or pick another --mount directory",
            dir.display()
        );
    }
    let orders = match &options.orders {
        Some(orders) => {
            std::fs::create_dir_all(orders)
                .with_context(|| format!("the directory of order files {}", orders.display()))?;
            Some(Orders::new(
                Arc::clone(&engine),
                Arc::clone(&access),
                orders.clone(),
                dir,
                default_job.to_owned(),
            ))
        }
        None => None,
    };
    let readers = Arc::new(Readers::default());
    let notifier: Arc<OnceLock<fuser::Notifier>> = Arc::default();
    let sweeper = {
        let (readers, notifier) = (Arc::clone(&readers), Arc::clone(&notifier));
        runtime.spawn(async move {
            let mut every = tokio::time::interval(ATTACHED_IDLE / 2);
            loop {
                every.tick().await;
                let gone = readers.sweep();
                let Some(notifier) = notifier.get().filter(|_| !gone.is_empty()) else {
                    continue;
                };
                let notifier = notifier.clone();
                // A write to /dev/fuse that the kernel handles then and there
                // (with no thread for it, the kernel's entries time out).
                let _ = crate::blocking::run(move || {
                    for job in gone {
                        let name = format!("@{job}");
                        if let Err(e) = notifier.inval_entry(fuser::FUSE_ROOT_ID, OsStr::new(&name)) {
                            tracing::debug!(job = %job, error = %e, "the kernel kept a gone job's directory");
                        }
                    }
                })
                .await;
            }
        })
    };
    let ended = CancellationToken::new();
    let fs = MountFs(Arc::new(Shared {
        readers,
        runtime: runtime.clone(),
        default_job: Arc::from(default_job),
        nodes: Arc::default(),
        trees: Arc::default(),
        open: Arc::new(Mutex::new(HashMap::new())),
        most_open: sluice_proto::fd_limit::connections_per_listener(),
        dirs: Mutex::default(),
        next_fh: AtomicU64::new(1),
        started: SystemTime::now(),
        passthrough: Arc::new(AtomicBool::new(options.passthrough)),
        notifier: Arc::clone(&notifier),
        backings: Arc::default(),
        ways: Ways::default(),
        access,
        counters: Counters::new(engine.metrics()),
        open_costs: OpenCosts::new(&engine),
        openings: Arc::default(),
        ended: ended.clone(),
        engine,
    }));
    let mount_options = [
        MountOption::RO,
        MountOption::FSName("sluice".to_owned()),
        MountOption::Subtype("sluice".to_owned()),
        MountOption::AllowOther,
        MountOption::DefaultPermissions,
    ];
    let session = fuser::spawn_mount2(fs, dir, &mount_options).with_context(|| {
        format!(
            "cannot mount at {} (mounting needs root or fusermount3, /dev/fuse, and an existing directory)",
            dir.display()
        )
    })?;
    let _ = notifier.set(session.notifier());
    let connection = sluice_connection_at(&canonical);
    info!(dir = %dir.display(), default_job, "data sets mounted read-only");
    let mut tasks = vec![sweeper];
    if let Some(orders) = orders {
        info!(dir = %options.orders.as_ref().expect("set").display(), "taking order files");
        tasks.push(runtime.spawn(orders.watch()));
    }
    Ok(Mount {
        session: Some(session),
        dir: canonical,
        connection,
        tasks,
        ended,
    })
}

/// Detaches a dead mount at `dir` (its `stat` fails with `ENOTCONN`:
/// "transport endpoint is not connected"), one a crashed stage left or
/// one whose session ended while a reader still held it; returns whether
/// there was one.
fn detach_stale(dir: &Path) -> anyhow::Result<bool> {
    match metadata_within(dir, STAT_PATIENCE)? {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            if !detach(dir) {
                anyhow::bail!(
                    "a stale mount at {} cannot be removed: run `fusermount3 -u {}` or `umount -l {}` as root",
                    dir.display(),
                    dir.display(),
                    dir.display()
                );
            }
            Ok(true)
        }
        // Refused as configuration (64), naming the flag: the stage
        // exited 1 with "is not a directory" alone. (Checked here, with
        // the patience a hung mount needs, not with the other flags.)
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(ConfigError::new(format!(
            "--mount {} does not exist: create the directory to show the data sets in",
            dir.display()
        ))
        .into()),
        Err(e) => Err(e).with_context(|| format!("the mount directory {}", dir.display())),
        Ok(meta) if !meta.is_dir() => Err(ConfigError::new(format!(
            "--mount {} is not a directory: give an empty directory to show the data sets in",
            dir.display()
        ))
        .into()),
        Ok(_) => Ok(false),
    }
}

/// How long the mount directory's `stat` may take at start before the
/// stage gives up on it.
const STAT_PATIENCE: Duration = Duration::from_secs(5);

/// `stat` of `dir`, on a thread of its own so that a directory that never
/// answers (a sluice mount whose stage is stopped or hung, a hung network
/// file system) fails the start in `patience` instead of holding it
/// forever, in a wait no signal ends. The thread is left to its `stat`.
fn metadata_within(
    dir: &Path,
    patience: Duration,
) -> anyhow::Result<std::io::Result<std::fs::Metadata>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = dir.to_owned();
    std::thread::Builder::new()
        .name("mount-stat".to_owned())
        .spawn(move || {
            let _ = tx.send(std::fs::metadata(&path));
        })
        .context("cannot start a thread")?;
    rx.recv_timeout(patience).map_err(|_| {
        anyhow::anyhow!(
            "the mount directory {} does not answer within {} s: a mount there is served by a stage that is stopped or hung (stop it, or run `umount -l {}` as root), or it is on a file system that does not answer",
            dir.display(),
            patience.as_secs(),
            dir.display()
        )
    })
}

/// Takes the stage's mount at `dir` away as the process exits without
/// dropping it (a second signal): lazily, so that readers inside it get
/// errors instead of a dead mount left behind.
pub fn detach_at_exit(dir: &Path) {
    let Some(connection) = sluice_connection_at(dir) else {
        return;
    };
    if detach(dir) {
        info!(dir = %dir.display(), "unmounted");
    }
    abort_connection(connection);
}

/// Unmounts `dir` lazily (it goes once nothing uses it); whether that
/// worked.
fn detach(dir: &Path) -> bool {
    let lazy = |program: &str, args: &[&str]| {
        std::process::Command::new(program)
            .args(args)
            .arg(dir)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    lazy("fusermount3", &["-u", "-z"]) || lazy("umount", &["-l"])
}

/// Whether a sluice mount is at `dir` (canonical) itself: a FUSE mount
/// whose source is `sluice` (its type is `fuse` when the stage mounted it
/// itself, `fuse.sluice` through `fusermount3`).
fn sluice_mount_at(dir: &Path) -> bool {
    sluice_connection_at(dir).is_some()
}

/// The FUSE connection (its number under `/sys/fs/fuse/connections`: the
/// mount's device number as the kernel keeps it, major in the bits above
/// the 20 of the minor) of the sluice mount at `dir` (canonical), if one is
/// there.
fn sluice_connection_at(dir: &Path) -> Option<u32> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    crate::config::mounts(&mountinfo)
        .filter(|(point, kind, source, _)| {
            (*kind == "fuse" || kind.starts_with("fuse."))
                && *source == "sluice"
                && Path::new(point) == dir
        })
        .last()
        .and_then(|(_, _, _, device)| {
            let (major, minor) = device.split_once(':')?;
            let (major, minor): (u32, u32) = (major.parse().ok()?, minor.parse().ok()?);
            Some((major << 20) | minor)
        })
}

/// Ends the FUSE connection `id` (`/sys/fs/fuse/connections/<id>/abort`):
/// every request of it still waiting fails at once. A stage stopping while
/// some of its threads are stuck in a source that does not answer (a
/// stopped filer) cannot close its `/dev/fuse` until they come back, and
/// the readers of its mount would wait as long; returns whether it was
/// ended.
fn abort_connection(id: u32) -> bool {
    let abort = Path::new("/sys/fs/fuse/connections")
        .join(id.to_string())
        .join("abort");
    std::fs::write(&abort, "1").is_ok()
}

/// What an inode is.
#[derive(Debug, Clone)]
enum Node {
    Root,
    /// `@<job>`: the data sets, read as `job`.
    JobRoot(Arc<str>),
    /// A directory of a data set (`path` "" is its root), read as `job`.
    Dir {
        job: Arc<str>,
        dataset: Arc<Dataset>,
        path: String,
        meta: Option<Meta>,
        /// How many directories it holds.
        subdirs: u32,
    },
    File {
        job: Arc<str>,
        dataset: Arc<Dataset>,
        name: String,
        size: u64,
        meta: Option<Meta>,
        /// The listing's version of the file (an object's ETag hash).
        version: u64,
    },
}

/// What a local data set's listing says of a file or directory: the
/// mount shows its permission bits (less the write bits), owner and
/// modification time, so the kernel checks every reader's access as the
/// source's own permissions would (the mount is `default_permissions`),
/// and a file changed in place shows a new size and time once the stage
/// has listed it again (the kernel then drops its cached pages:
/// `FUSE_AUTO_INVAL_DATA`). An object store's entries have none: they show
/// as readable by all, owned by root. Nothing here asks the source: a
/// lookup on a slow file system costs no round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Meta {
    perm: u16,
    uid: u32,
    gid: u32,
    /// A file's modification time (a directory shows the mount's start).
    mtime: Option<SystemTime>,
}

impl Meta {
    fn of(owner: Option<Owner>, mtime: Option<SystemTime>) -> Option<Self> {
        owner.map(|o| Self {
            perm: o.perm & !0o222,
            uid: o.uid,
            gid: o.gid,
            mtime,
        })
    }
}

impl Node {
    /// The node of a data set's tree entry, read as `job`.
    fn of_entry(job: &Arc<str>, dataset: &Arc<Dataset>, entry: Entry) -> Self {
        let (job, dataset) = (Arc::clone(job), Arc::clone(dataset));
        match entry {
            Entry::Dir {
                path,
                owner,
                subdirs,
            } => Self::Dir {
                job,
                dataset,
                path,
                meta: Meta::of(owner, None),
                subdirs,
            },
            Entry::File(name, shown) => Self::File {
                job,
                dataset,
                name,
                size: shown.size,
                version: shown.version,
                meta: Meta::of(shown.owner, Some(time_of(shown.mtime_ns))),
            },
        }
    }

    /// The job reads of this node belong to (none for the mount's root).
    fn job(&self) -> Option<&Arc<str>> {
        match self {
            Self::Root => None,
            Self::JobRoot(job) | Self::Dir { job, .. } | Self::File { job, .. } => Some(job),
        }
    }
}

/// The inodes the kernel holds: one is made by a `lookup` and dropped when
/// the kernel has forgotten every lookup of it (it evicts inodes it no
/// longer caches), so the table follows the kernel's inode cache, not
/// every file ever listed. An inode's number is a hash of its parent's and
/// its name, so a directory listing gives its entries' numbers without
/// keeping anything, and a file looked up again gets the same number.
#[derive(Debug, Default)]
struct Nodes {
    known: HashMap<u64, Known>,
    by_name: HashMap<(u64, Box<[u8]>), u64>,
}

#[derive(Debug)]
struct Known {
    node: Node,
    parent: u64,
    name: Box<[u8]>,
    /// Lookups answered and not forgotten yet (the kernel's count of them).
    lookups: u64,
    /// A file's version and size whose pages the kernel may keep: what it
    /// was when an open last let the kernel keep them (see
    /// [`may_keep_pages`]).
    kept: Option<(u64, u64)>,
    /// Of an object: the pages the kernel keeps (see [`object_pages`]).
    object: ObjectKept,
    /// A file an open found another size than its listing says (replaced
    /// since it was listed): the listing's version, and the size shown
    /// for it until a listing has another version (see [`ask_size_again`]).
    sized: Option<(u64, u64)>,
    /// Opens that had the kernel drop the file's pages, until it has (see
    /// [`Dropping`]), and when the last was answered so.
    dropping: Arc<AtomicUsize>,
    dropped_at: Option<Instant>,
}

impl Known {
    /// Notes that an open has the kernel drop the file's pages (called
    /// under the lock its decision was made under); the guard counts it
    /// until the kernel has.
    fn drops_pages(&mut self) -> Dropping {
        self.dropping.fetch_add(1, Ordering::AcqRel);
        self.dropped_at = Some(Instant::now());
        Dropping(Arc::clone(&self.dropping))
    }

    /// Whether the kernel's pages may still be of an earlier file: an open
    /// that has them dropped may not have been finished by the kernel yet
    /// (it finishes one within microseconds of its answer; an open not
    /// read for a second after is taken as finished, so that a reader that
    /// opens and waits does not have every other open of the file read
    /// past the pages, where `mmap` fails).
    fn pages_settling(&self) -> bool {
        self.dropping.load(Ordering::Acquire) > 0
            && self
                .dropped_at
                .is_some_and(|at| at.elapsed() < PAGES_SETTLE)
    }
}

/// The longest an open that had the kernel drop its file's pages keeps
/// other opens of the file from keeping them (see [`Known::pages_settling`]).
const PAGES_SETTLE: Duration = Duration::from_secs(1);

/// An open answered without `FOPEN_KEEP_CACHE`, counted until its first
/// read or its release: the kernel drops the inode's pages as it finishes
/// that open, before either, and not at the answer. Meanwhile an open of
/// the file as it is now does not keep the pages (they may be the earlier
/// file's yet: two readers' opens of a file replaced at the same size read
/// pages of two versions as one) but reads past them.
struct Dropping(Arc<AtomicUsize>);

impl Drop for Dropping {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the kernel's pages of an object are of. Its store is not asked on
/// every open (a request each), so they are known by what the reads that
/// filled them read.
#[derive(Debug, Default)]
enum ObjectKept {
    /// None read yet (or all dropped).
    #[default]
    Nothing,
    /// Of this version (its ETag when a read named it): later opens read
    /// only this version, so a part of it the kernel no longer holds is not
    /// read of a newer object and joined to the old pages.
    Of(Pinned),
    /// A read pinned to them failed (the object replaced, or gone): the
    /// next open drops them.
    Stale,
}

impl Nodes {
    fn get(&self, ino: u64) -> Option<&Node> {
        match ino {
            ROOT => Some(&Node::Root),
            _ => self.known.get(&ino).map(|k| &k.node),
        }
    }

    /// The number of `name` in `parent`: the inode's if the kernel holds
    /// it, else the one a lookup would give it.
    fn number(&self, parent: u64, name: &[u8]) -> u64 {
        match self.by_name.get(&(parent, Box::from(name))) {
            Some(&ino) => ino,
            None => inode_number(parent, name),
        }
    }

    /// Counts a lookup of `name` in `parent` answered with `node` (as the
    /// data set has it now: a file may have changed since the last lookup)
    /// and returns the inode's number.
    fn looked_up(&mut self, parent: u64, name: &[u8], node: Node) -> u64 {
        let key = (parent, Box::from(name));
        if let Some(&ino) = self.by_name.get(&key)
            && let Some(known) = self.known.get_mut(&ino)
        {
            known.lookups += 1;
            known.node = node;
            return ino;
        }
        let mut ino = inode_number(parent, name);
        // Two names whose hashes meet (about one chance in 16 million
        // among a million names held at once) take the next free number.
        while self.known.contains_key(&ino) {
            ino = (ino + 1).max(ROOT + 1);
        }
        self.known.insert(
            ino,
            Known {
                node,
                parent,
                name: key.1.clone(),
                lookups: 1,
                kept: None,
                object: ObjectKept::Nothing,
                sized: None,
                dropping: Arc::default(),
                dropped_at: None,
            },
        );
        self.by_name.insert(key, ino);
        ino
    }

    /// Replaces the node of a known `ino` (its metadata refreshed).
    fn set(&mut self, ino: u64, node: Node) {
        if let Some(known) = self.known.get_mut(&ino) {
            known.node = node;
        }
    }

    /// `node` (as the listing has it) as shown for `ino`: a file an open
    /// found larger or smaller than the listing says shows the size it
    /// found until a listing has another version of it.
    fn sized(&self, ino: u64, mut node: Node) -> Node {
        if let (Some((of, now)), Node::File { version, size, .. }) =
            (self.known.get(&ino).and_then(|k| k.sized), &mut node)
            && *version == of
        {
            *size = now;
        }
        node
    }

    /// The kernel dropped `n` of its lookups of `ino`: the inode goes
    /// with the last.
    fn forget(&mut self, ino: u64, n: u64) {
        let Some(known) = self.known.get_mut(&ino) else {
            return;
        };
        known.lookups = known.lookups.saturating_sub(n);
        if known.lookups == 0
            && let Some(gone) = self.known.remove(&ino)
        {
            self.by_name.remove(&(gone.parent, gone.name));
            // A table the kernel mostly emptied gives its room back.
            if self.known.capacity() > 4096 && self.known.len() * 8 < self.known.capacity() {
                self.known.shrink_to(self.known.len() * 2);
                self.by_name.shrink_to(self.by_name.len() * 2);
            }
        }
    }

    fn len(&self) -> usize {
        self.known.len()
    }
}

/// The number a lookup gives `name` in `parent` (unless another name took
/// it first): a hash of both, never the root's.
fn inode_number(parent: u64, name: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    // Fixed keys: the same number for the same name for the mount's life.
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    name.hash(&mut h);
    (h.finish() >> 1).max(ROOT + 1)
}

/// Bytes a read through the mount fetches at once (aligned): a file up to
/// this size is one source read, a larger one is read in windows of it.
const WINDOW: u64 = 4 << 20;

/// Most entries one `readdir` answer is made from (the kernel's buffer
/// holds fewer): a page of a huge directory costs a page.
const READDIR_PAGE: usize = 1024;

/// Files at least this large that no plan holds are read by the kernel
/// straight from a local data set's file system (FUSE passthrough), where
/// the kernel and the stage's privileges allow: no copy through the stage.
/// Smaller ones go through windows, and stay in the mount's page cache.
const PASSTHROUGH_MIN: u64 = 1 << 20;

/// The largest planned file whose bytes an open puts into the kernel's page
/// cache (a store is one write, made before the open is answered: a larger
/// file is read through requests, which the kernel makes in parallel).
const STORE_MAX: u64 = WINDOW;

/// The block size files report (`st_blksize`): a local file system's, so
/// that programs, which size their buffers by it (Python's `open` does),
/// read through the mount as they read the directory. A reader that asks
/// for less than its buffer gets every byte copied twice: with 1 MiB here,
/// `numpy.load` of a hot 16 MiB `.npz` took 9-11 ms through the mount
/// against 7.5-8.3 on the directory; with 4 KiB (or 128 KiB) 8.1-8.3.
const BLOCK_SIZE: u32 = 4096;

/// Windows fetched ahead of the last one a read touched: a file read
/// front to back finds the next [`AHEAD`] windows in flight or done.
const AHEAD: u64 = 2;

/// How far a read may start from where the previous one ended and still
/// go through the file in order (a page read again, a short skip).
const IN_ORDER_SLACK: u64 = 128 << 10;

/// How far a reader must have gone through a file in order, from where
/// it last jumped to, before its reads fetch whole windows and the ones
/// ahead of it (from the file's start: windows at once, the ones ahead
/// from here): a reader that jumps and reads a header and the body after
/// it (zip members, HDF5 chunks) gets what it reads, not 12 MiB a jump.
const RUN: u64 = 1 << 20;

/// Windows an open file keeps: the ones being read and the ones ahead.
const WINDOWS: usize = AHEAD as usize + 2;

/// The most an open file read in windows holds; a planned file larger
/// than this that no reader has fetched yet is read in windows too when
/// opened, not whole into memory for as long as it is open.
const WINDOWED_MAX: u64 = WINDOWS as u64 * WINDOW;

/// One window of a file: fetched once, by whichever read needs it first.
type Window = Arc<tokio::sync::OnceCell<Result<Arc<Held>, i32>>>;

/// Bytes an open file keeps (a window, or the whole file a plan entry
/// delivered), counted in the node memory budget while it keeps them: a
/// reader holding many files open cannot take the stage's memory past it
/// (40 files of 32 MiB open at once took a stage with a 128 MiB budget to
/// 490 MiB when windows were outside it).
struct Held {
    chunk: Chunk,
    _budget: Reservation,
}

impl std::ops::Deref for Held {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.chunk
    }
}

/// A file opened through the mount: the job it is read as, its bytes when
/// a plan entry delivered it whole, else the windows read so far.
struct Open {
    job: Arc<Job>,
    dataset: Arc<Dataset>,
    name: String,
    size: u64,
    whole: Option<Held>,
    windows: Vec<(u64, Window)>,
    /// How the reader goes through the file.
    reads: Reads,
    /// Whether a read of the file was counted as a delivered sample.
    counted: bool,
    metrics: DatasetMetrics,
    /// The source file the kernel reads itself (passthrough), registered
    /// until every open of the inode is released.
    backing: Option<Arc<fuser::BackingId>>,
    /// The way the kernel reads a large file's inode, counted while open.
    _way: Option<WayHeld>,
    /// The version of the file its first window read, which the others
    /// are read of.
    pin: Arc<Mutex<Option<Pinned>>>,
    /// Whether its reads fill the kernel's pages (not past them).
    fills_pages: bool,
    /// Counted as an open of its inode that decided the kernel's pages.
    _opening: Option<Opening>,
    /// Counted as an open that has the kernel drop them, until its first
    /// read or release.
    dropping: Option<Dropping>,
}

impl Open {
    fn new(
        job: Arc<Job>,
        dataset: Arc<Dataset>,
        name: String,
        size: u64,
        whole: Option<Held>,
    ) -> Self {
        let metrics = job.metrics_for(&dataset.name);
        Self {
            job,
            dataset,
            name,
            size,
            whole,
            windows: Vec::new(),
            reads: Reads::default(),
            counted: false,
            metrics,
            backing: None,
            _way: None,
            pin: Arc::default(),
            fills_pages: true,
            _opening: None,
            dropping: None,
        }
    }

    /// This open, its reads of version `pin` when given (what the source
    /// said the file is as it was opened), doing `pages` with the kernel's
    /// pages of the file; counted as `opening` where it decided them.
    fn pinned(self, pin: Option<Pinned>, decided: Decided, opening: Option<Opening>) -> Self {
        Self {
            pin: Arc::new(Mutex::new(pin)),
            fills_pages: decided.pages != Pages::Bypass,
            _opening: opening,
            dropping: decided.dropping,
            ..self
        }
    }

    /// The window starting at `start`, made if new (the oldest is
    /// dropped past [`WINDOWS`]).
    fn window(&mut self, start: u64) -> Window {
        if let Some((_, w)) = self.windows.iter().find(|(s, _)| *s == start) {
            return Arc::clone(w);
        }
        if self.windows.len() >= WINDOWS {
            self.windows.remove(0);
        }
        let w = Window::default();
        self.windows.push((start, Arc::clone(&w)));
        w
    }
}

/// Where a reader of an open file has read.
#[derive(Debug, Default)]
struct Reads {
    /// Where the previous read ended: a read that starts about there goes
    /// through the file in order.
    read_to: Option<u64>,
    /// Where the reads going through the file in order began.
    run_from: u64,
}

impl Reads {
    /// How a read of `offset..end` goes on from the previous ones, which
    /// it is recorded after: whether it is answered from whole windows (a
    /// reader going through the file in order: from its start, or for
    /// [`RUN`] bytes), and whether the windows after them are fetched too
    /// (in order for [`RUN`] bytes). The kernel sends a reader's requests,
    /// its read-ahead included, in the order it makes them, and the mount
    /// takes them in that order.
    fn follow(&mut self, offset: u64, end: u64) -> (bool, bool) {
        let in_order = match self.read_to {
            None => offset == 0,
            Some(to) => offset.abs_diff(to) <= IN_ORDER_SLACK,
        };
        if !in_order {
            self.run_from = offset;
        }
        self.read_to = Some(end);
        let run = end.saturating_sub(self.run_from);
        let windows = in_order && (self.run_from == 0 || run >= RUN);
        (windows, windows && run >= RUN)
    }
}

/// What a read needs to fetch a window: the job, data set and file, and
/// the version of it the open file reads.
#[derive(Clone)]
struct Source {
    job: Arc<Job>,
    dataset: Arc<Dataset>,
    name: String,
    size: u64,
    metrics: DatasetMetrics,
    pin: Arc<Mutex<Option<Pinned>>>,
    /// An object's open whose reads fill the kernel's pages: where they
    /// record what they read.
    object: Option<ObjectPages>,
}

impl Source {
    /// The window at `start`, fetched if nobody has yet and the node
    /// budget has room for it (made from read-ahead nobody asked for yet
    /// with `reclaim`, for a read that waits on the window). `None` when it
    /// has not: the reader reads its range without keeping a window.
    async fn fetch(
        &self,
        start: u64,
        window: &Window,
        reclaim: bool,
    ) -> Option<Result<Arc<Held>, i32>> {
        struct NoRoom;
        window
            .get_or_try_init(|| async {
                let len = WINDOW.min(self.size.saturating_sub(start));
                let budget = self.job.try_hold(len, reclaim).ok_or(NoRoom)?;
                let read = self.read(start, len).await;
                Ok::<_, NoRoom>(read.map(|chunk| {
                    Arc::new(Held {
                        chunk,
                        _budget: budget,
                    })
                }))
            })
            .await
            .ok()
            .cloned()
    }

    /// Answers a read of `offset..end` straight from the source, keeping
    /// nothing: a jump (random access), or windows the budget has no room
    /// for. `first_read`: the open file's first read, which counts it as
    /// a delivered sample.
    async fn answer_directly(self, offset: u64, end: u64, first_read: bool, reply: ReplyData) {
        match self.read(offset, end - offset).await {
            Ok(chunk) => {
                self.job.count_delivered_bytes(
                    &self.metrics,
                    chunk.len() as u64,
                    u64::from(first_read),
                );
                reply.data(&chunk);
            }
            Err(e) => reply.error(e),
        }
    }

    /// `len` bytes of the file from `offset`, read now, or the errno. Every
    /// read of an open file is of the version its first read pinned: a
    /// file replaced since fails the read (`EIO`) rather than giving the
    /// reader a file of two versions.
    async fn read(&self, offset: u64, len: u64) -> Result<Chunk, i32> {
        let (dataset, name) = (Arc::clone(&self.dataset), self.name.clone());
        let pin = lock(&self.pin).clone();
        let pinned = pin.is_some();
        let read = read_range_now(&self.job, dataset, name, offset, len, pin, &self.metrics);
        let (sample, read) = read.await;
        if let Some(read) = read {
            // Windows read at once, before any of them pinned a version.
            let now = {
                let mut pin = lock(&self.pin);
                match pin.take() {
                    Some(first) if !first.same(&read) => {
                        *pin = Some(first);
                        drop(pin);
                        if let Some(object) = &self.object {
                            object.set(ObjectKept::Stale);
                        }
                        return Err(failed(&changed(&self.name)));
                    }
                    Some(first) => *pin = Some(first.or_held(read)),
                    // An object grown since it was listed: the kernel reads
                    // it to the size it was listed at, so its new version
                    // would read cut short (a shrunk one reads whole: the
                    // kernel takes the end of a short read as the size).
                    None if read.size > self.size => {
                        drop(pin);
                        if let Some(object) = &self.object {
                            object.set(ObjectKept::Stale);
                        }
                        return Err(failed(&grown(&self.name, self.size, read.size)));
                    }
                    None => *pin = Some(read),
                }
                pin.clone()
            };
            if let (Some(object), Some(now)) = (&self.object, now) {
                object.set(ObjectKept::Of(now));
            }
        } else if pinned && let Some(object) = &self.object {
            // A read of the version the pages are of failed (the object
            // replaced, or gone): they go at the next open.
            object.set(ObjectKept::Stale);
        }
        match sample.data {
            Ok(Payload::Bytes(chunk)) => Ok(chunk),
            Ok(Payload::Shared { .. }) => Err(libc::EIO),
            Err(e) => Err(failed(&e)),
        }
    }
}

/// Whether an open of the file `name` at `ino`, listed as `listed`
/// (version and size), may let the kernel keep the pages it holds of it
/// (`FOPEN_KEEP_CACHE`), and the version its reads are pinned to. A local
/// file is opened here, as a local reader's open would open it: the
/// open's reads read that file, whatever is renamed over it afterwards
/// (its first read opened the file, so a file replaced between the open
/// and that read failed it with EIO, two readers' first reads could fill
/// one buffer from two versions, a file replaced since it was listed was
/// cut at its listed size, and a file deleted since it was read opened
/// with its old bytes). The pages the kernel keeps are kept while they
/// are of the file opened; when they are not (a file replaced between
/// epochs, before the stage lists it again) the kernel drops them, so
/// the reader never gets the old file's cached pages joined to the new
/// one's read through the stage. An object store's files are not asked
/// (a request each); its objects' pages go when the listing shows a new
/// version (`FUSE_AUTO_INVAL_DATA`).
///
/// The pages are the inode's, shared by every open of it: while another
/// open reads the file as it was (`held`: one of the same job, data set
/// and name is alive), they are neither dropped nor refilled with the new
/// file, which this open reads past them ([`Pages::Bypass`]).
///
/// The pin also keeps the open's reads of a file the node cache holds by
/// the listing's version to the file as it is now, while the stage's
/// listing still shows it as it was.
fn may_keep_pages(
    nodes: &Mutex<Nodes>,
    ino: u64,
    dataset: &Dataset,
    name: &str,
    listed: (u64, u64),
    held: impl FnOnce() -> bool,
) -> Result<(Decided, Option<Pinned>), ProtocolError> {
    let pin = match dataset.source().open_local(name) {
        Some(opened) => opened?,
        None => return Ok(object_pages(nodes, ino, listed, held)),
    };
    let now = (pin.version, pin.size);
    let kept = match lock(nodes).known.get_mut(&ino) {
        // A new inode: the kernel holds no pages of it yet.
        Some(Known {
            kept: kept @ None, ..
        }) => {
            *kept = Some(now);
            return Ok((Decided::KEEP, Some(pin)));
        }
        Some(known) if known.kept == Some(now) => {
            return Ok((Decided::keep_unless_settling(known), Some(pin)));
        }
        Some(known) => known.kept,
        None => return Ok((Decided::KEEP, Some(pin))),
    };
    if held() {
        return Ok((Decided::BYPASS, Some(pin)));
    }
    let decided = match lock(nodes).known.get_mut(&ino) {
        // Another open decided meanwhile: its pages are left to it.
        Some(known) if known.kept != kept => Decided::BYPASS,
        Some(known) => {
            known.kept = Some(now);
            Decided::drop(known)
        }
        None => Decided::KEEP,
    };
    Ok((decided, Some(pin)))
}

/// [`may_keep_pages`] for an object. The pages the kernel keeps of it are
/// kept while they are of the version the listing shows, and the open's
/// reads are pinned to that version (its ETag): an object replaced since
/// (not listed again yet) fails the first read the kernel's pages do not
/// answer (`EIO`) rather than joining the new object's bytes to the old
/// pages, and the next open drops them. Pages of another version than
/// the listing's are dropped at the open.
fn object_pages(
    nodes: &Mutex<Nodes>,
    ino: u64,
    listed: (u64, u64),
    held: impl FnOnce() -> bool,
) -> (Decided, Option<Pinned>) {
    {
        let nodes = lock(nodes);
        let known = nodes.known.get(&ino);
        match known.map(|k| &k.object) {
            None => return (Decided::KEEP, None),
            Some(ObjectKept::Nothing) => {
                return (Decided::keep_unless_settling(known.expect("known")), None);
            }
            Some(ObjectKept::Of(pin)) if (pin.version, pin.size) == listed => {
                let decided = Decided::keep_unless_settling(known.expect("known"));
                return (decided, Some(pin.clone()));
            }
            Some(_) => {}
        }
    }
    // Another open reads the old pages: left to it, read past here.
    if held() {
        return (Decided::BYPASS, None);
    }
    let decided = match lock(nodes).known.get_mut(&ino) {
        Some(known) => {
            known.object = ObjectKept::Nothing;
            Decided::drop(known)
        }
        None => Decided::KEEP,
    };
    (decided, None)
}

/// What an open does with the kernel's pages of its file, and the count
/// of it while the kernel has yet to drop them.
struct Decided {
    pages: Pages,
    dropping: Option<Dropping>,
}

impl Decided {
    const KEEP: Self = Self {
        pages: Pages::Keep,
        dropping: None,
    };
    const BYPASS: Self = Self {
        pages: Pages::Bypass,
        dropping: None,
    };

    /// Dropped at the open (under the lock the decision was made under).
    fn drop(known: &mut Known) -> Self {
        Self {
            pages: Pages::Drop,
            dropping: Some(known.drops_pages()),
        }
    }

    /// Kept, as they are of the file as it is now, unless an open that has
    /// them dropped may not have been finished by the kernel yet: they may
    /// still be the earlier file's then, and this open reads past them.
    fn keep_unless_settling(known: &Known) -> Self {
        if known.pages_settling() {
            Self::BYPASS
        } else {
            Self::KEEP
        }
    }
}

/// Where an open of an object whose reads fill the kernel's pages records
/// what they read (see [`object_pages`]).
#[derive(Clone)]
struct ObjectPages {
    ino: u64,
    nodes: Arc<Mutex<Nodes>>,
}

impl ObjectPages {
    fn set(&self, kept: ObjectKept) {
        if let Some(known) = lock(&self.nodes).known.get_mut(&self.ino) {
            known.object = kept;
        }
    }
}

/// What an open does with the kernel's pages of its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pages {
    /// They are of the file as it is: read from them.
    Keep,
    /// They are of a file since replaced: dropped at the open.
    Drop,
    /// They are of a file since replaced that another open still reads:
    /// kept for it, and this open's reads all come to the stage
    /// (`FOPEN_DIRECT_IO`), filling none of them.
    Bypass,
}

impl Pages {
    /// The open flags that say it to the kernel.
    fn flags(self) -> u32 {
        use fuser::consts::{FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE};
        match self {
            Self::Keep => FOPEN_KEEP_CACHE,
            Self::Drop => 0,
            Self::Bypass => FOPEN_KEEP_CACHE | FOPEN_DIRECT_IO,
        }
    }
}

/// Has the kernel ask for the attributes of the file at `ino` again: an
/// open found it another size than the kernel took (it keeps attributes
/// 60 s), which would cut its reads at the old size (`file` is the open,
/// of the size found). The listing the attributes come from may be older
/// than the file too (nothing listed the data set while its trainer was
/// idle): it is listed again first, when older than the listing interval.
async fn ask_size_again(
    file: &Open,
    nodes: &Mutex<Nodes>,
    notifier: &OnceLock<fuser::Notifier>,
    ino: u64,
    listed_version: u64,
) {
    let (dataset, name) = (Arc::clone(&file.dataset), &file.name);
    let _ = crate::blocking::run(move || dataset.listing()).await;
    // Shown at the size it has until a listing has its new version (one
    // taken before the file was replaced may still be the latest).
    if let Some(known) = lock(nodes).known.get_mut(&ino) {
        known.sized = Some((listed_version, file.size));
    }
    if let Some(notifier) = notifier.get()
        && let Err(e) = notifier.inval_inode(ino, -1, 0)
    {
        tracing::debug!(file = %name, error = %e, "the kernel kept a file's old attributes");
    }
}

/// Whether an open file of `job`'s `dataset`/`name` (the identity of the
/// inode, within a job's path) other than `fh` is alive.
fn held_elsewhere(
    open: &Mutex<HashMap<u64, Open>>,
    fh: u64,
    job: &str,
    dataset: &str,
    name: &str,
) -> bool {
    lock(open).iter().any(|(other, file)| {
        *other != fh && file.name == name && file.dataset.name == dataset && file.job.id() == job
    })
}

/// The reader of `req`, for the `trainers:` rules: its uid and gid as the
/// kernel gives them.
fn reader_of(req: &Request<'_>) -> Peer {
    Peer::Unix {
        uid: req.uid(),
        gid: req.gid(),
    }
}

/// The errno of a read through the mount that failed with `e`; a failure
/// of the source is logged (once a minute, with how many there were).
fn failed(e: &ProtocolError) -> i32 {
    static FAILURES: Mutex<Sparse> = Mutex::new(Sparse::new());
    if e.code == ErrorCode::IoError
        && let Some(n) = lock(&FAILURES).note(Duration::from_secs(60))
    {
        warn!(
            failures = n,
            "a read through the mount failed: {}", e.message
        );
    }
    errno(e)
}

/// How long a job stays attached after its last file through the mount
/// was closed: a reader opening one file after another keeps its job
/// attached (no telemetry burst per file), and a job read no more leaves.
const ATTACHED_IDLE: Duration = Duration::from_secs(10);

/// The jobs being read through the mount, each attached (a connection, for
/// the engine) while any of its files is open and for [`ATTACHED_IDLE`]
/// after.
#[derive(Default)]
struct Readers {
    jobs: Mutex<HashMap<Arc<str>, Attached>>,
    /// Jobs detached by [`Readers::sweep`], and since when.
    detached: Mutex<HashMap<Arc<str>, Instant>>,
}

/// How long after a job was detached the kernel is told to drop its
/// `@<job>` directory: the names and inodes under it are the job's own
/// (the same file under another job is another inode), so a node that
/// runs job after job would otherwise keep every one's until memory is
/// short. Past the engine's keeping of an idle job; a job that comes back
/// later looks its files up again.
const DROP_JOB_PATHS: Duration = Duration::from_secs(90);

/// Jobs kept attached with no file open through the mount, at most: a
/// reader opening files under one `@<job>` name after another would
/// otherwise keep every one attached for [`ATTACHED_IDLE`] (4,196 names in
/// five seconds held 4,196 jobs), past what the engine keeps idle.
const MAX_IDLE_ATTACHED: usize = 16;

/// Why an open through the mount was refused.
enum Refused {
    /// By the `trainers:` rules, or the stage's job table (see [`errno`]).
    Claim(ProtocolError),
    /// The mount, or the job, holds its share of open files.
    Full,
}

struct Attached {
    handle: JobHandle,
    open: usize,
    idle_since: Option<Instant>,
}

impl Readers {
    /// The job of a file being opened by `peer`, if the `trainers:` rules
    /// let it read as the job (the check and the attach one step, see
    /// [`Engine::claim`]) and the job holds fewer than `most` files open.
    fn open(
        &self,
        engine: &Engine,
        access: &TrainerAccess,
        peer: &Peer,
        job: &Arc<str>,
        most: usize,
    ) -> Result<Arc<Job>, Refused> {
        let mut jobs = lock(&self.jobs);
        let attached = match jobs.entry(Arc::clone(job)) {
            Slot::Occupied(attached) => {
                engine.may_join(access, peer, job).map_err(|why| {
                    Refused::Claim(ProtocolError::new(ErrorCode::ClaimRefused, why))
                })?;
                if attached.get().open >= most {
                    return Err(Refused::Full);
                }
                attached.into_mut()
            }
            Slot::Vacant(slot) => slot.insert(Attached {
                handle: engine
                    .claim(access, peer, job, None)
                    .map_err(Refused::Claim)?,
                open: 0,
                idle_since: None,
            }),
        };
        attached.open += 1;
        attached.idle_since = None;
        let job = Arc::clone(attached.handle.job());
        drop(jobs);
        lock(&self.detached).remove(job.id());
        Ok(job)
    }

    /// A file of `job` was closed. Past [`MAX_IDLE_ATTACHED`] jobs with
    /// no file open, the one idle longest is detached at once.
    fn close(&self, job: &str) {
        let detached = {
            let mut jobs = lock(&self.jobs);
            let Some(attached) = jobs.get_mut(job) else {
                return;
            };
            attached.open = attached.open.saturating_sub(1);
            if attached.open > 0 {
                return;
            }
            attached.idle_since = Some(Instant::now());
            let idle = jobs.values().filter(|a| a.idle_since.is_some());
            if idle.count() <= MAX_IDLE_ATTACHED {
                return;
            }
            let oldest = jobs
                .iter()
                .filter_map(|(job, a)| a.idle_since.map(|t| (t, Arc::clone(job))))
                .min()
                .map(|(_, job)| job)
                .expect("more than none are idle");
            lock(&self.detached).insert(Arc::clone(&oldest), Instant::now());
            jobs.remove(&oldest)
        };
        // Dropped outside the lock: the last handle of a job reports it.
        drop(detached);
    }

    /// Notes that `@<job>` was looked up: a job whose files are only listed
    /// or looked at, never opened, is never attached, and its directory is
    /// dropped [`DROP_JOB_PATHS`] after its first look unless it opens a
    /// file meanwhile (ten jobs' `ls -l` of 20,000 files held 200,042
    /// inodes for good).
    fn looked_up(&self, job: &Arc<str>) {
        if !lock(&self.jobs).contains_key(job) {
            lock(&self.detached)
                .entry(Arc::clone(job))
                .or_insert_with(Instant::now);
        }
    }

    /// Detaches the jobs idle for [`ATTACHED_IDLE`]; returns the jobs
    /// detached [`DROP_JOB_PATHS`] ago and not read since.
    fn sweep(&self) -> Vec<Arc<str>> {
        let idle: Vec<JobHandle> = {
            let mut jobs = lock(&self.jobs);
            let gone: Vec<Arc<str>> = jobs
                .iter()
                .filter(|(_, a)| a.idle_since.is_some_and(|t| t.elapsed() >= ATTACHED_IDLE))
                .map(|(job, _)| Arc::clone(job))
                .collect();
            let mut detached = lock(&self.detached);
            for job in &gone {
                detached.insert(Arc::clone(job), Instant::now());
            }
            gone.iter()
                .filter_map(|job| jobs.remove(job).map(|a| a.handle))
                .collect()
        };
        // Dropped outside the lock: the last handle of a job reports it.
        drop(idle);
        let mut detached = lock(&self.detached);
        let done: Vec<Arc<str>> = detached
            .iter()
            .filter(|(_, at)| at.elapsed() >= DROP_JOB_PATHS)
            .map(|(job, _)| Arc::clone(job))
            .collect();
        for job in &done {
            detached.remove(job);
        }
        done
    }
}

/// The mount's file system, as the FUSE session holds it: its one thread
/// answers what needs no wait for the source itself, and hands the rest
/// to the runtime's blocking threads ([`MountFs::answer`]).
struct MountFs(Arc<Shared>);

impl std::ops::Deref for MountFs {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl MountFs {
    /// Answers a request with `answer`: here, or, when it `waits` for the
    /// source (its data set's listing is due), on one of the runtime's
    /// blocking threads, so that a slow source holds its own readers and
    /// not every request of the mount. (The opens that open a source file
    /// are handed over by [`Shared::open`].)
    fn answer(&self, waits: bool, answer: impl FnOnce(&Arc<Shared>) + Send + 'static) {
        if !waits {
            return answer(&self.0);
        }
        let shared = Arc::clone(&self.0);
        crate::blocking::spawn_or_reserve(&self.runtime, move || answer(&shared));
    }

    /// Whether a request about inode `ino` (a lookup of `name` in it) may
    /// wait for its data set's listing.
    fn may_wait(&self, ino: u64, name: Option<&OsStr>) -> bool {
        // The node's data set, read in place (no copy of the node per request).
        let of_node = match lock(&self.nodes).get(ino) {
            None => return false,
            Some(Node::Dir { dataset, .. } | Node::File { dataset, .. }) => {
                Some(Arc::clone(dataset))
            }
            Some(Node::Root | Node::JobRoot(_)) => None,
        };
        let dataset = of_node.or_else(|| {
            name.and_then(OsStr::to_str)
                .and_then(|n| self.engine.dataset(n))
        });
        dataset.is_some_and(|dataset| self.trees.may_wait(&dataset))
    }
}

struct Shared {
    engine: Arc<Engine>,
    readers: Arc<Readers>,
    runtime: Handle,
    default_job: Arc<str>,
    nodes: Arc<Mutex<Nodes>>,
    trees: Arc<Trees>,
    open: Arc<Mutex<HashMap<u64, Open>>>,
    /// Files open at once, at most: a quarter of the descriptor limit, as
    /// each listener holds.
    most_open: usize,
    /// The tree each open data set directory is read from: the listing it
    /// began with, so that a listing taken again meanwhile does not shift
    /// the offsets of one read in pages (names twice, or none).
    dirs: Mutex<HashMap<u64, Arc<Tree>>>,
    next_fh: AtomicU64,
    started: SystemTime,
    /// Whether large files are passed through (see [`PASSTHROUGH_MIN`]):
    /// as configured until `init`, then only while the kernel allows it.
    passthrough: Arc<AtomicBool>,
    /// Puts file pages into the kernel's cache; set once the session runs.
    notifier: Arc<OnceLock<fuser::Notifier>>,
    /// The passed-through source file of each inode open that way: the
    /// kernel takes one backing file per inode, so every open of the inode
    /// while one is registered shares it (a second registration of the
    /// same inode fails the open).
    backings: Arc<Mutex<HashMap<u64, std::sync::Weak<fuser::BackingId>>>>,
    /// How the open large files of each inode are read (one way at a time).
    ways: Ways,
    /// Which jobs each reader (by uid and gid) may read as.
    access: Arc<TrainerAccess>,
    counters: Counters,
    /// How long each local data set's files take to open.
    open_costs: OpenCosts,
    /// Opens of each inode being decided or alive (see [`Opening`]).
    openings: Arc<Mutex<HashMap<u64, usize>>>,
    /// Cancelled when the session ends ([`Filesystem::destroy`]).
    ended: CancellationToken,
}

/// How long opening each local data set's files takes (a moving mean of
/// the source's `open` and `fstat` for the open of a file no plan holds),
/// so that the mount opens a slow source's files off its FUSE thread, and
/// a fast one's on it, with no hand-over to another thread. A data set on
/// a network or FUSE file system (a filer: NFS, Lustre, ...) counts as
/// slow whatever it measured: its round trips vary, and a filer that
/// stops answering would hold the thread for good.
struct OpenCosts {
    means: Mutex<HashMap<String, Duration>>,
    /// The data sets on a network or FUSE file system.
    networked: std::collections::HashSet<String>,
}

/// Opens slower than this on average are made off the FUSE thread.
const SLOW_OPEN: Duration = Duration::from_micros(250);

impl OpenCosts {
    /// For the engine's data sets (their file systems are looked up now).
    fn new(engine: &Engine) -> Self {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let networked = engine
            .dataset_names()
            .into_iter()
            .filter(|name| {
                engine.dataset(name).is_some_and(|d| match d.source() {
                    crate::source::Source::Dir(dir) => {
                        on_network_file_system(&mountinfo, &dir.root())
                    }
                    crate::source::Source::S3(_) => false,
                })
            })
            .collect();
        Self {
            means: Mutex::default(),
            networked,
        }
    }

    /// Whether `dataset`'s files open slowly (an object store's open no
    /// file).
    fn slow(&self, dataset: &Dataset) -> bool {
        if dataset.source().remote().is_some() {
            return false;
        }
        self.networked.contains(&dataset.name)
            || lock(&self.means)
                .get(&dataset.name)
                .is_some_and(|mean| *mean >= SLOW_OPEN)
    }

    /// Notes that an open of `dataset`'s file took `took`.
    fn note(&self, dataset: &str, took: Duration) {
        let mut means = lock(&self.means);
        match means.get_mut(dataset) {
            Some(mean) => *mean = (*mean * 7 + took) / 8,
            None => drop(means.insert(dataset.to_owned(), took)),
        }
    }
}

/// How an open no plan delivers is answered: the size the kernel has,
/// the version and size listed, the inode's way, and a plan entry of the
/// file to deliver first.
type OpenedAs = (u64, (u64, u64), Option<WayHeld>, Option<PlannedClaim>);

/// An open of a file no plan delivers (or one that reads the file past
/// the buffer), from when its pages are decided until it is released,
/// counted per inode: while another of the inode is counted, the kernel's
/// pages of the file are held by it (see [`may_keep_pages`]). Opens of one
/// file decided at once on several threads, the file replaced between
/// them, would otherwise each take the pages as theirs to drop.
struct Opening {
    ino: u64,
    counts: Arc<Mutex<HashMap<u64, usize>>>,
}

impl Opening {
    /// An open of `ino`, counted in `counts` from now.
    fn new(ino: u64, counts: &Arc<Mutex<HashMap<u64, usize>>>) -> Self {
        *lock(counts).entry(ino).or_default() += 1;
        Self {
            ino,
            counts: Arc::clone(counts),
        }
    }

    /// Whether another open of the inode is counted.
    fn others(&self) -> bool {
        lock(&self.counts).get(&self.ino).is_some_and(|n| *n > 1)
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        let mut counts = lock(&self.counts);
        if let Slot::Occupied(mut n) = counts.entry(self.ino) {
            *n.get_mut() -= 1;
            if *n.get() == 0 {
                n.remove();
            }
        }
    }
}

/// Runs blocking `work` (a source file's open or `stat`) on the runtime's
/// blocking threads: an answer that went on on the runtime's workers
/// would hold one of them for as long as the source takes. `None` when
/// the runtime is shutting down or the OS refuses a thread.
async fn off_workers<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    crate::blocking::run(work).await.ok()
}

/// The mount's metrics, resolved once.
struct Counters {
    inodes: IntGauge,
    lookup: IntCounter,
    getattr: IntCounter,
    readdir: IntCounter,
    open: IntCounter,
    read: IntCounter,
    release: IntCounter,
    stored_bytes: IntCounter,
}

impl Counters {
    fn new(metrics: &Metrics) -> Self {
        let op = |name: &str| metrics.mount_requests.with_label_values(&[name]);
        Self {
            inodes: metrics.mount_inodes.clone(),
            lookup: op("lookup"),
            getattr: op("getattr"),
            readdir: op("readdir"),
            open: op("open"),
            read: op("read"),
            release: op("release"),
            stored_bytes: metrics.mount_stored_bytes.clone(),
        }
    }
}

impl Shared {
    /// The [`Opening`] of an open of `ino`, counted from now.
    fn opening(&self, ino: u64) -> Opening {
        Opening::new(ino, &self.openings)
    }

    /// [`may_keep_pages`] for `opening`, open `fh` of `job`'s file: the
    /// pages are held by another open when one of the same file is alive
    /// or being decided (or always, with `held`). Blocking (it opens a
    /// local file), and timed for [`OpenCosts`].
    #[allow(clippy::too_many_arguments)]
    fn may_keep_pages(
        &self,
        opening: &Opening,
        fh: u64,
        job: &Job,
        dataset: &Dataset,
        name: &str,
        listed: (u64, u64),
        held: bool,
    ) -> Result<(Decided, Option<Pinned>), ProtocolError> {
        let ino = opening.ino;
        let held = || {
            held || opening.others()
                || held_elsewhere(&self.open, fh, job.id(), &dataset.name, name)
        };
        let began = Instant::now();
        let kept = may_keep_pages(&self.nodes, ino, dataset, name, listed, held);
        if dataset.source().remote().is_none() {
            self.open_costs.note(&dataset.name, began.elapsed());
        }
        kept
    }

    /// Runs `answer` (which replies to a request) on the FUSE thread as far
    /// as it goes without waiting, and on the runtime from there: a planned
    /// sample already in the buffer is answered at once, with no hand-over
    /// to another thread (a wakeup each way, which on a virtual machine can
    /// cost more than the answer).
    fn answer_soon(&self, answer: impl Future<Output = ()> + Send + 'static) {
        let mut answer = Box::pin(answer);
        let _runtime = self.runtime.enter();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if answer.as_mut().poll(&mut cx).is_pending() {
            self.runtime.spawn(answer);
        }
    }

    /// Answers the open of a large file that no plan holds: the kernel
    /// reads it from the source file itself (charged to the job whole, as
    /// it is opened). Where the data set is not a local directory, or the
    /// kernel refuses the file, it is read through windows instead; the
    /// first refusal ends passthrough for the mount (logged once). A plan
    /// entry `planned` of the file (claimed while another open of it was
    /// passed through) is delivered first, and the open charged as that.
    /// A file found another size than the kernel has (`resized`, with the
    /// version listed) has the kernel ask its attributes again first: the
    /// kernel reads the source file whole, but `stat` and `mmap` would keep
    /// the old size.
    #[allow(clippy::too_many_arguments)]
    fn open_passthrough(
        &self,
        opener: u32,
        ino: u64,
        fh: u64,
        (file, keep, mut way): (Open, u32, WayHeld),
        planned: Option<PlannedClaim>,
        resized: Option<u64>,
        reply: ReplyOpen,
    ) {
        let (open, readers) = (Arc::clone(&self.open), Arc::clone(&self.readers));
        let (passthrough, backings) = (Arc::clone(&self.passthrough), Arc::clone(&self.backings));
        let charged = planned.is_some();
        let (job, name) = (Arc::clone(&file.job), file.name.clone());
        let answer = move |file: Open| {
            let metrics = file.job.metrics_for(&file.dataset.name);
            // The kernel waits for this answer even for a killed opener (the
            // stage cannot hear interrupts), so a throttled open ends when
            // the opener is being killed.
            let mut killed = false;
            let wanted = || {
                killed = being_killed(opener);
                !killed
            };
            let opened =
                file.job
                    .open_passthrough(&file.dataset, &file.name, &metrics, wanted, charged);
            let backing = match opened {
                Some(Ok(source)) => {
                    let mut backings = lock(&backings);
                    match backings.get(&ino).and_then(std::sync::Weak::upgrade) {
                        Some(shared) => Ok(shared),
                        None => match reply.open_backing(&source) {
                            Ok(backing) => {
                                let backing = Arc::new(backing);
                                backings.insert(ino, Arc::downgrade(&backing));
                                Ok(backing)
                            }
                            Err(e) => {
                                if passthrough.swap(false, Ordering::Relaxed) {
                                    warn!(file = %file.name, error = %e, "the kernel refused to read a file through passthrough (privileges? a file system it cannot stack on?): the mount reads every file through the stage from now on");
                                }
                                Err(())
                            }
                        },
                    }
                }
                Some(Err(e)) => {
                    readers.close(file.job.id());
                    return reply.error(if killed { libc::EINTR } else { errno(&e) });
                }
                None => Err(()),
            };
            // Recorded before a release of `fh` can be handled.
            let mut open = lock(&open);
            match backing {
                Ok(backing) => {
                    reply.opened_passthrough(fh, 0, &backing);
                    let (backing, way) = (Some(backing), Some(way));
                    open.insert(
                        fh,
                        Open {
                            backing,
                            _way: way,
                            ..file
                        },
                    );
                }
                Err(()) => {
                    way.through_page_cache();
                    open.insert(
                        fh,
                        Open {
                            _way: Some(way),
                            ..file
                        },
                    );
                    reply.opened(fh, keep);
                }
            }
        };
        if planned.is_none() && resized.is_none() {
            return crate::blocking::spawn_or_reserve(&self.runtime, move || answer(file));
        }
        let runtime = self.runtime.clone();
        let (notifier, nodes) = (Arc::clone(&self.notifier), Arc::clone(&self.nodes));
        self.runtime.spawn(async move {
            if let Some(version) = resized {
                ask_size_again(&file, &nodes, &notifier, ino, version).await;
            }
            if let Some(claim) = planned {
                // Its bytes are the file's, which the kernel reads.
                drop(job.deliver_claimed(claim, &name).await);
            }
            crate::blocking::spawn_or_reserve(&runtime, move || answer(file));
        });
    }

    /// Whether a file of `size` bytes may be passed through (see
    /// [`PASSTHROUGH_MIN`]); whether it is depends on its source too.
    fn may_pass_through(&self, size: u64) -> bool {
        size >= PASSTHROUGH_MIN && self.passthrough.load(Ordering::Relaxed)
    }

    fn attr(&self, ino: u64, node: &Node) -> FileAttr {
        let mut attr = attr(self.started, ino, node);
        if let Node::Root | Node::JobRoot(_) = node {
            // It holds the data sets (`@<job>` directories are not listed).
            let datasets = self.engine.dataset_count();
            attr.nlink = u32::try_from(datasets).map_or(u32::MAX, |n| n.saturating_add(2));
        }
        attr
    }

    /// Whether the reader of `req` may read as `job` (the `trainers:`
    /// rules, as for a trainer on the socket with the reader's uid and
    /// gid); refusals are logged.
    fn may_read_as(&self, req: &Request<'_>, job: &str) -> bool {
        match self.engine.may_join(&self.access, &reader_of(req), job) {
            Ok(()) => true,
            Err(why) => {
                warn!(%why, "a read through the mount was refused");
                false
            }
        }
    }

    /// The child `name` of `parent`, as a node not yet interned.
    fn child(&self, parent: &Node, name: &OsStr) -> Result<Node, i32> {
        let text = name.to_str().ok_or(libc::ENOENT)?;
        match parent {
            Node::Root => {
                if let Some(job) = text.strip_prefix('@') {
                    return if valid_job_id(job) {
                        let job: Arc<str> = Arc::from(job);
                        self.readers.looked_up(&job);
                        Ok(Node::JobRoot(job))
                    } else {
                        Err(libc::ENOENT)
                    };
                }
                self.dataset_root(&self.default_job, text)
            }
            Node::JobRoot(job) => self.dataset_root(job, text),
            Node::Dir {
                job, dataset, path, ..
            } => {
                let tree = self
                    .trees
                    .of(dataset, &self.runtime)
                    .map_err(|e| errno(&e))?;
                let entry = tree.entry(path, text).ok_or(libc::ENOENT)?;
                Ok(Node::of_entry(job, dataset, entry))
            }
            Node::File { .. } => Err(libc::ENOTDIR),
        }
    }

    fn dataset_root(&self, job: &Arc<str>, name: &str) -> Result<Node, i32> {
        let dataset = self.engine.dataset(name).ok_or(libc::ENOENT)?;
        dataset_root(&self.trees, &self.runtime, job, &dataset)
    }

    /// The job and data set that the lookup of `name` in `parent` opens,
    /// when that data set has never been listed.
    fn unlisted(&self, parent: &Node, name: &OsStr) -> Option<(Arc<str>, Arc<Dataset>)> {
        let job = match parent {
            Node::Root => Arc::clone(&self.default_job),
            Node::JobRoot(job) => Arc::clone(job),
            _ => return None,
        };
        let dataset = self.engine.dataset(name.to_str()?)?;
        dataset.listed().is_none().then_some((job, dataset))
    }

    fn node(&self, ino: u64) -> Option<Node> {
        lock(&self.nodes).get(ino).cloned()
    }

    /// The node as the data set's latest listing has it (a file may have
    /// changed); `None` when it is gone, or no listing could be had.
    fn refreshed(&self, node: &Node) -> Option<Node> {
        self.listed_now(node).ok().flatten()
    }

    /// The node as the data set's latest listing has it: `Ok(None)` when
    /// that listing no longer has it (or has a directory by a file's
    /// name, or a file by a directory's: another inode), `Err(())` when no
    /// listing could be had.
    fn listed_now(&self, node: &Node) -> Result<Option<Node>, ()> {
        let (job, dataset, full) = match node {
            Node::Dir {
                job, dataset, path, ..
            } if !path.is_empty() => (job, dataset, path),
            Node::File {
                job, dataset, name, ..
            } => (job, dataset, name),
            _ => return Ok(Some(node.clone())),
        };
        let (parent, last) = full.rsplit_once('/').unwrap_or(("", full));
        let tree = self.trees.of(dataset, &self.runtime).map_err(drop)?;
        let fresh = tree
            .entry(parent, last)
            .map(|entry| Node::of_entry(job, dataset, entry));
        Ok(fresh.filter(|fresh| std::mem::discriminant(fresh) == std::mem::discriminant(node)))
    }

    /// The entries of a directory node from the `skip`-th on, at most
    /// `limit`: (name, is a directory); a data set directory's from the
    /// tree its handle `fh` began reading (taken at its first page).
    fn entries(
        &self,
        node: &Node,
        fh: u64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<(String, bool)>, i32> {
        match node {
            Node::Root | Node::JobRoot(_) => Ok(self
                .engine
                .dataset_names()
                .into_iter()
                .skip(skip)
                .take(limit)
                .map(|n| (n, true))
                .collect()),
            Node::Dir { dataset, path, .. } => {
                let known = lock(&self.dirs).get(&fh).cloned();
                let tree = match known {
                    Some(tree) => tree,
                    None => {
                        let tree = self
                            .trees
                            .of(dataset, &self.runtime)
                            .map_err(|e| errno(&e))?;
                        if fh != 0 {
                            lock(&self.dirs).insert(fh, Arc::clone(&tree));
                        }
                        tree
                    }
                };
                Ok(tree.list(path, skip, limit))
            }
            Node::File { .. } => Err(libc::ENOTDIR),
        }
    }
}

/// The root directory node of `dataset` read as `job`.
fn dataset_root(
    trees: &Trees,
    runtime: &Handle,
    job: &Arc<str>,
    dataset: &Arc<Dataset>,
) -> Result<Node, i32> {
    let tree = trees.of(dataset, runtime).map_err(|e| errno(&e))?;
    Ok(Node::of_entry(job, dataset, tree.dir(String::new())))
}

/// A node's attributes (`started`: the time of nodes without one); a
/// directory's link count is two more than the directories it holds, as a
/// local directory's (`find` and others take it so).
fn attr(started: SystemTime, ino: u64, node: &Node) -> FileAttr {
    let (kind, perm, size, nlink, meta) = match node {
        Node::File { size, meta, .. } => (FileType::RegularFile, 0o444, *size, 1, *meta),
        Node::Dir { meta, subdirs, .. } => {
            let nlink = subdirs.saturating_add(2);
            (FileType::Directory, 0o555, 0, nlink, *meta)
        }
        _ => (FileType::Directory, 0o555, 0, 2, None),
    };
    let (perm, uid, gid, mtime) =
        meta.map_or((perm, 0, 0, None), |m| (m.perm, m.uid, m.gid, m.mtime));
    // An object has no time of its own here: the mount's start, moved by
    // its version within a second, so that an object replaced by one of
    // the same size shows a new time and the kernel drops its cached
    // pages (`FUSE_AUTO_INVAL_DATA`).
    let versioned = match node {
        Node::File { version, .. } => started + Duration::from_nanos(version % 1_000_000_000),
        _ => started,
    };
    let mtime = mtime.unwrap_or(versioned);
    FileAttr {
        ino,
        size,
        blocks: size.div_ceil(512),
        atime: mtime,
        mtime,
        ctime: mtime,
        crtime: mtime,
        kind,
        perm,
        nlink,
        uid,
        gid,
        rdev: 0,
        blksize: BLOCK_SIZE,
        flags: 0,
    }
}

/// The time `ns` nanoseconds from 1970 (before it when negative), as the
/// kernel is to be told it. `fuser` (0.16) sends a time before 1970 as
/// minus its whole seconds before and plus its nanoseconds, so that 0.5 s
/// before would reach the kernel as 0.5 s after: such a time is given as
/// the one whose seconds and nanoseconds before are the kernel's (whole
/// seconds rounded down, nanoseconds after them).
fn time_of(ns: i64) -> SystemTime {
    const NANOS: i64 = 1_000_000_000;
    if ns >= 0 {
        return SystemTime::UNIX_EPOCH + Duration::from_nanos(ns.unsigned_abs());
    }
    let (secs, nanos) = (ns.div_euclid(NANOS), ns.rem_euclid(NANOS));
    SystemTime::UNIX_EPOCH - Duration::new(secs.unsigned_abs(), nanos as u32)
}

/// Whether thread `pid` (as the stage sees it; 0 when it cannot) is gone
/// or has a fatal signal pending: `SIGKILL`, which the kernel also posts
/// for a signal that kills by default, such as `timeout`'s `SIGTERM`.
fn being_killed(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return true;
    };
    let kill = 1u64 << (libc::SIGKILL - 1);
    status.lines().any(|line| {
        ["SigPnd:", "ShdPnd:"].iter().any(|field| {
            line.strip_prefix(field)
                .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
                .is_some_and(|mask| mask & kill != 0)
        })
    })
}

/// The `errno` for an error of the stage.
fn errno(e: &ProtocolError) -> i32 {
    match e.code {
        ErrorCode::NotFound | ErrorCode::NoSuchDataset => libc::ENOENT,
        ErrorCode::ForbiddenPath | ErrorCode::ClaimRefused => libc::EACCES,
        ErrorCode::InvalidArgument => libc::EINVAL,
        ErrorCode::Unavailable => libc::EAGAIN,
        _ => libc::EIO,
    }
}

/// The requests that may wait for the source (a listing due, a slow
/// file's open), answered on a blocking thread when they would.
impl Shared {
    fn lookup(self: &Arc<Self>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let Some(parent_node) = self.node(parent) else {
            return reply.error(libc::ENOENT);
        };
        if let Some((job, dataset)) = self.unlisted(&parent_node, name) {
            // A data set's first lookup lists it, off this thread: a source
            // that does not answer holds its own readers, not the mount.
            let (nodes, trees, runtime) = (
                Arc::clone(&self.nodes),
                Arc::clone(&self.trees),
                self.runtime.clone(),
            );
            let (name, inodes, started) =
                (name.to_owned(), self.counters.inodes.clone(), self.started);
            crate::blocking::spawn_or_reserve(&self.runtime, move || {
                let listed = dataset.listing().map_err(|e| {
                    warn!(dataset = %dataset.name, error = %e, "cannot list the data set for the mount");
                    libc::EIO
                });
                match listed.and_then(|_| dataset_root(&trees, &runtime, &job, &dataset)) {
                    Ok(node) => {
                        let mut nodes = lock(&nodes);
                        let ino = nodes.looked_up(parent, name.as_bytes(), node.clone());
                        inodes.set(nodes.len() as i64);
                        drop(nodes);
                        reply.entry(&TTL, &attr(started, ino, &node), 0);
                    }
                    Err(e) => reply.error(e),
                }
            });
            return;
        }
        match self.child(&parent_node, name) {
            Ok(node) => {
                let mut nodes = lock(&self.nodes);
                let ino = nodes.looked_up(parent, name.as_bytes(), node.clone());
                let node = nodes.sized(ino, node);
                nodes.set(ino, node.clone());
                self.counters.inodes.set(nodes.len() as i64);
                drop(nodes);
                reply.entry(&TTL, &self.attr(ino, &node), 0);
            }
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, ino: u64, reply: ReplyAttr) {
        let Some(node) = self.node(ino).and_then(|n| self.refreshed(&n)) else {
            return reply.error(libc::ENOENT);
        };
        let mut nodes = lock(&self.nodes);
        let node = nodes.sized(ino, node);
        let attr = self.attr(ino, &node);
        nodes.set(ino, node);
        drop(nodes);
        reply.attr(&TTL, &attr);
    }

    fn readdir(&self, ino: u64, fh: u64, offset: i64, mut reply: ReplyDirectory) {
        let Some(node) = self.node(ino) else {
            return reply.error(libc::ENOENT);
        };
        // Offsets 1 and 2 are "." and ".."; entry i of the directory is i + 3.
        let skip = usize::try_from(offset).unwrap_or(0);
        for (i, name) in [".", ".."].into_iter().enumerate().skip(skip) {
            if reply.add(ino, i as i64 + 1, FileType::Directory, name) {
                return reply.ok();
            }
        }
        let first = skip.saturating_sub(2);
        let page = match self.entries(&node, fh, first, READDIR_PAGE) {
            Ok(page) => page,
            Err(e) => return reply.error(e),
        };
        // The names of data sets need no checking (nor a listing of each).
        let checked = matches!(node, Node::Root | Node::JobRoot(_));
        for (i, (name, is_dir)) in page.iter().enumerate() {
            if !checked && self.child(&node, OsStr::new(name)).is_err() {
                continue;
            }
            let child_ino = lock(&self.nodes).number(ino, name.as_bytes());
            let kind = if *is_dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            };
            if reply.add(child_ino, (first + i + 3) as i64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    /// Answers the open `fh` of a file no plan delivers (`opened`: its
    /// size shown, the version and size listed, the inode's way, a plan
    /// entry of it delivered first), which opens the source file. Blocking.
    fn open_unplanned(
        self: &Arc<Self>,
        pid: u32,
        fh: u64,
        opening: Opening,
        (job, dataset, name): (Arc<Job>, Arc<Dataset>, String),
        (size, listed, way, delivered_first): OpenedAs,
        reply: ReplyOpen,
    ) {
        let (ino, open) = (opening.ino, Arc::clone(&self.open));
        let (decided, pin) =
            match self.may_keep_pages(&opening, fh, &job, &dataset, &name, listed, false) {
                Ok(kept) => kept,
                Err(e) => {
                    self.readers.close(job.id());
                    return reply.error(errno(&e));
                }
            };
        let (pages, keep) = (decided.pages, decided.pages.flags());
        // A local file found another size than the kernel has (replaced
        // since it took the attributes), or an object listed at another
        // since, reads as it is now; so does one found another size than
        // its latest listing (replaced since): it is shown at the size
        // found until a listing has another version of it.
        let now = pin.as_ref().map_or(listed.1, |p| p.size);
        let resized = (now != size || now != listed.1).then_some(now);
        let file = Open::new(job, dataset, name, resized.unwrap_or(size), None);
        let file = file.pinned(pin, decided, Some(opening));
        match way {
            Some(way) if way.way() == Way::Passthrough => {
                let resized = resized.filter(|_| pages != Pages::Bypass).map(|_| listed.0);
                let file = (file, keep, way);
                self.open_passthrough(pid, ino, fh, file, delivered_first, resized, reply)
            }
            // Not while another open reads the old file's pages (its
            // size is the one it reads to; this open reads past them).
            way if resized.is_some() && pages != Pages::Bypass => {
                let (notifier, nodes) = (Arc::clone(&self.notifier), Arc::clone(&self.nodes));
                self.answer_soon(async move {
                    ask_size_again(&file, &nodes, &notifier, ino, listed.0).await;
                    lock(&open).insert(fh, Open { _way: way, ..file });
                    reply.opened(fh, keep);
                });
            }
            way => {
                lock(&open).insert(fh, Open { _way: way, ..file });
                reply.opened(fh, keep)
            }
        }
    }

    fn open(self: &Arc<Self>, reader: Peer, pid: u32, ino: u64, flags: i32, reply: ReplyOpen) {
        if flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0 {
            return reply.error(libc::EROFS);
        }
        let Some(node @ Node::File { .. }) = self.node(ino) else {
            return reply.error(libc::EISDIR);
        };
        // The version and size the latest listing has: the kernel keeps a
        // file's attributes (and pages) for 60 s, so an object replaced and
        // listed again since was read whole as the old one, or failed its
        // first open with EIO, for up to a minute.
        let listed_now = self.listed_now(&node);
        let latest = match &listed_now {
            Ok(Some(Node::File { version, size, .. })) => Some((*version, *size)),
            _ => None,
        };
        // Deleted (or made a directory) since the kernel looked it up.
        let gone = matches!(listed_now, Ok(None));
        let Node::File {
            job,
            dataset,
            name,
            size,
            version,
            ..
        } = node
        else {
            unreachable!("matched above");
        };
        let listed = latest.unwrap_or((version, size));
        // Each open file may hold a descriptor of the stage: past a quarter
        // of them, the other jobs' reads would fail for want of one (4,079
        // files held open made a socket trainer's reads fail with "Too
        // many open files"); and one job holds at most half of those, so
        // that a reader holding files open leaves the other jobs' readers
        // of the mount room.
        let opened = if lock(&self.open).len() >= self.most_open {
            Err(Refused::Full)
        } else {
            let most = (self.most_open / 2).max(1);
            self.readers
                .open(&self.engine, &self.access, &reader, &job, most)
        };
        let job = match opened {
            Ok(job) => job,
            Err(Refused::Full) => {
                static FULL: Mutex<Sparse> = Mutex::new(Sparse::new());
                if let Some(n) = lock(&FULL).note(Duration::from_secs(60)) {
                    warn!(
                        refused = n,
                        most = self.most_open,
                        job = %job,
                        "files held open through the mount take a quarter of the stage's descriptors, or this job half of those: further opens fail (ENFILE) until some are closed"
                    );
                }
                return reply.error(libc::ENFILE);
            }
            Err(Refused::Claim(e)) => {
                warn!(why = %e.message, "a read through the mount was refused");
                return reply.error(errno(&e));
            }
        };
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        // A plan entry of the job is delivered whole, exactly once; a file
        // no plan holds is answered without a task, and so is a large
        // entry no reader has started: it is read as an unplanned file is,
        // not whole into memory for as long as it is open (four readers of
        // 95 MiB files held 380 MiB on a 64 MiB budget).
        let claim = match job.claim_planned(&dataset.name, &name, None) {
            Some(claim) if size > WINDOWED_MAX => job.deliver_unread(claim),
            claim => claim,
        };
        // A large file is passed through unless another open of it reads
        // through the page cache, and a planned open of it reads through
        // the page cache unless another open of it is passed through: the
        // kernel takes one way per inode. Such a planned entry is delivered
        // before its open is passed through.
        let (mut claim, mut delivered_first) = (claim, None);
        let way = match &claim {
            // Not to be passed through, but the inode's way all the same
            // (one open of a file that grew past the least passed through,
            // or shrank below it, took the other way, and a second open
            // while it was alive failed with EIO).
            _ if !self.may_pass_through(size) => {
                let way = self.ways.open_small(ino);
                if way.way() == Way::Passthrough {
                    delivered_first = claim.take().and_then(|c| job.deliver_unread(c));
                }
                Some(way)
            }
            Some(_) => self.ways.open_planned(ino).or_else(|| {
                delivered_first = claim.take().and_then(|c| job.deliver_unread(c));
                Some(self.ways.open_unplanned(ino))
            }),
            None => Some(self.ways.open_unplanned(ino)),
        };
        let Some(claim) = claim else {
            if gone {
                // An object is not asked at open: the pages the kernel
                // keeps of it would answer with the deleted object's bytes.
                self.readers.close(job.id());
                return reply.error(libc::ENOENT);
            }
            // The source file is opened now: off this thread when that
            // may take a while.
            let slow = self.open_costs.slow(&dataset);
            let (fs, opening) = (Arc::clone(self), self.opening(ino));
            let file = (job, dataset, name);
            let opened = (size, listed, way, delivered_first);
            let answer = move || fs.open_unplanned(pid, fh, opening, file, opened, reply);
            if slow {
                crate::blocking::spawn_or_reserve(&self.runtime, answer);
            } else {
                answer();
            }
            return;
        };
        let fs = Arc::clone(self);
        let readers = Arc::clone(&self.readers);
        let notifier = Arc::clone(&self.notifier);
        let nodes = Arc::clone(&self.nodes);
        let stored_bytes = self.counters.stored_bytes.clone();
        let open = Arc::clone(&self.open);
        self.answer_soon(async move {
            let mut too_large = false;
            let whole = match job.deliver_claimed(claim, &name).await {
                Some((sample, reservation)) => match sample.data {
                    Ok(Payload::Bytes(chunk)) => Some(Held {
                        chunk,
                        _budget: reservation,
                    }),
                    Ok(Payload::Shared { .. }) => None,
                    // Larger than one buffered sample may be (or grown past
                    // what was reserved for it): delivered by this open all
                    // the same, its bytes read as an unplanned file's are.
                    Err(e) if e.code == ErrorCode::TooLarge => {
                        too_large = true;
                        None
                    }
                    Err(e) => {
                        readers.close(job.id());
                        return reply.error(errno(&e));
                    }
                },
                None => None,
            };
            // The size this open reads: the bytes delivered, or a local
            // file's now when it was too large for the buffer.
            let now = match &whole {
                Some(held) => Some(held.chunk.len() as u64),
                None if too_large => {
                    let (dataset, name) = (Arc::clone(&dataset), name.clone());
                    off_workers(move || dataset.source().local_version(&name))
                        .await
                        .flatten()
                        .map(|(_, n)| n)
                }
                None => None,
            };
            let resized = now.filter(|&now| now != size || now != listed.1);
            // Another open of the file reads the pages the kernel has: they
            // are left to it, and read by this open too while they are of
            // the file as it is (this open reads past them otherwise).
            let whole_held =
                whole.is_some() && held_elsewhere(&open, fh, job.id(), &dataset.name, &name);
            let mut stored = false;
            if let (Some(chunk), Some(notifier)) = (&whole, notifier.get())
                && resized.is_none()
                && !whole_held
                && size <= STORE_MAX
            {
                // Read from the page cache from here on; kept for a read
                // that comes anyway (pages reclaimed before it, O_DIRECT).
                match notifier.store(ino, 0, chunk) {
                    Ok(()) => {
                        stored_bytes.inc_by(size);
                        stored = true;
                    }
                    Err(e) => {
                        tracing::debug!(file = %name, error = %e, "the kernel took no pages of a planned file");
                    }
                }
            }
            // The pages the kernel keeps must be of the bytes this open
            // reads: all of them when the whole file was stored; else it
            // keeps none of a file read from the buffer (a sample read
            // since the kernel's pages were), and those of a file read as
            // an unplanned one only while it is as they were.
            let (decided, pin, opening) = if stored {
                if let Some(known) = lock(&nodes).known.get_mut(&ino) {
                    known.kept = Some(listed);
                    known.object = ObjectKept::Of(Pinned::cached(listed.0, listed.1));
                }
                (Decided::KEEP, None, None)
            } else if whole.is_some() && !whole_held {
                // Its pages are refilled from the buffer's bytes, of the
                // version they are of (not counted as a drop of another
                // file's: other opens keep them, and map).
                if let Some(known) = lock(&nodes).known.get_mut(&ino) {
                    known.object = ObjectKept::Of(Pinned::cached(listed.0, listed.1));
                }
                let decided = Decided {
                    pages: Pages::Drop,
                    dropping: None,
                };
                (decided, None, None)
            } else {
                // Reads past the page cache cannot be mapped (`mmap` fails
                // with ENODEV): they are only for pages of another file.
                // (A held file's bytes are the buffer's: one gone since is
                // read.)
                let (file, opening) = ((Arc::clone(&job), Arc::clone(&dataset), name.clone()), fs.opening(ino));
                let kept = off_workers(move || {
                    let (job, dataset, name) = file;
                    let kept = fs.may_keep_pages(&opening, fh, &job, &dataset, &name, listed, whole_held);
                    (kept, opening)
                });
                match kept.await {
                    Some((Ok((decided, pin)), opening)) => (decided, pin, Some(opening)),
                    Some((Err(_), opening)) if whole_held => (Decided::BYPASS, None, Some(opening)),
                    Some((Err(e), _)) => {
                        readers.close(job.id());
                        return reply.error(errno(&e));
                    }
                    None => {
                        readers.close(job.id());
                        return reply.error(libc::EIO);
                    }
                }
            };
            let pages = decided.pages;
            let file = Open::new(job, dataset, name, resized.unwrap_or(size), whole);
            let file = file.pinned(pin, decided, opening);
            if resized.is_some() && pages != Pages::Bypass {
                ask_size_again(&file, &nodes, &notifier, ino, listed.0).await;
            }
            lock(&open).insert(fh, Open { _way: way, ..file });
            reply.opened(fh, pages.flags());
        });
    }
}

impl Filesystem for MountFs {
    fn destroy(&mut self) {
        self.0.ended.cancel();
    }

    fn init(&mut self, _req: &Request<'_>, config: &mut KernelConfig) -> Result<(), i32> {
        // The session's one thread, which answers every request from here.
        tree::answers_the_kernel();
        // Many reads in flight at once, and large ones (1 MiB requests);
        // lookups in one directory in parallel.
        let _ = config.set_max_background(512);
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.add_capabilities(fuser::consts::FUSE_PARALLEL_DIROPS);
        // A file whose size or time changed has its cached pages dropped.
        let _ = config.add_capabilities(fuser::consts::FUSE_AUTO_INVAL_DATA);
        // Backing files may sit on a stacked file system (overlayfs).
        let passthrough = self.passthrough.load(Ordering::Relaxed)
            && config
                .add_capabilities(fuser::consts::FUSE_PASSTHROUGH)
                .is_ok()
            && config.set_max_stack_depth(2).is_ok();
        self.passthrough.store(passthrough, Ordering::Relaxed);
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        self.counters.lookup.inc();
        let waits = self.may_wait(parent, Some(name));
        let name = name.to_owned();
        self.answer(waits, move |fs| fs.lookup(parent, &name, reply));
    }

    fn forget(&mut self, _req: &Request<'_>, ino: u64, nlookup: u64) {
        let mut nodes = lock(&self.nodes);
        nodes.forget(ino, nlookup);
        self.counters.inodes.set(nodes.len() as i64);
    }

    fn batch_forget(&mut self, _req: &Request<'_>, nodes: &[fuser::fuse_forget_one]) {
        let mut known = lock(&self.nodes);
        for node in nodes {
            known.forget(node.nodeid, node.nlookup);
        }
        self.counters.inodes.set(known.len() as i64);
    }

    /// What `df` shows: the listed data sets' bytes and files, none free
    /// (a read-only file system; a data set not listed yet counts nothing).
    fn statfs(&mut self, _req: &Request<'_>, _ino: u64, reply: fuser::ReplyStatfs) {
        let (mut bytes, mut files) = (0u64, 0u64);
        for name in self.engine.dataset_names() {
            if let Some(listing) = self.engine.dataset(&name).and_then(|d| d.listed()) {
                bytes += listing.total_bytes;
                files += u64::from(listing.len());
            }
        }
        let block = u64::from(BLOCK_SIZE);
        reply.statfs(
            bytes.div_ceil(block),
            0,
            0,
            files,
            0,
            BLOCK_SIZE,
            255,
            BLOCK_SIZE,
        );
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        self.counters.getattr.inc();
        let waits = self.may_wait(ino, None);
        self.answer(waits, move |fs| fs.getattr(ino, reply));
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        fh: u64,
        offset: i64,
        reply: ReplyDirectory,
    ) {
        self.counters.readdir.inc();
        let waits = self.may_wait(ino, None);
        self.answer(waits, move |fs| fs.readdir(ino, fh, offset, reply));
    }

    fn open(&mut self, req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        self.counters.open.inc();
        let waits = self.may_wait(ino, None);
        let (reader, pid) = (reader_of(req), req.pid());
        self.answer(waits, move |fs| fs.open(reader, pid, ino, flags, reply));
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        self.counters.read.inc();
        let Ok(offset) = u64::try_from(offset) else {
            return reply.error(libc::EINVAL);
        };
        let (source, needed, end, first_read) = {
            let mut open = lock(&self.open);
            let Some(file) = open.get_mut(&fh) else {
                return reply.error(libc::EBADF);
            };
            // The kernel finished the open before its first read.
            file.dropping = None;
            if let Some(chunk) = &file.whole {
                let bytes: &[u8] = chunk;
                let start = usize::try_from(offset)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len());
                let end = start.saturating_add(size as usize).min(bytes.len());
                return reply.data(&bytes[start..end]);
            }
            let end = offset.saturating_add(u64::from(size)).min(file.size);
            if offset >= end {
                return reply.data(&[]);
            }
            let first = offset / WINDOW * WINDOW;
            let last = (end - 1) / WINDOW * WINDOW;
            let source = Source {
                job: Arc::clone(&file.job),
                dataset: Arc::clone(&file.dataset),
                name: file.name.clone(),
                size: file.size,
                metrics: file.metrics.clone(),
                pin: Arc::clone(&file.pin),
                object: (file.fills_pages && file.dataset.source().remote().is_some()).then(|| {
                    ObjectPages {
                        ino,
                        nodes: Arc::clone(&self.nodes),
                    }
                }),
            };
            let first_read = !std::mem::replace(&mut file.counted, true);
            let held = (first..=last).step_by(WINDOW as usize).all(|start| {
                file.windows
                    .iter()
                    .any(|(s, w)| *s == start && w.initialized())
            });
            let (windows, read_ahead) = file.reads.follow(offset, end);
            if !windows && !held {
                // Random access (a jump, or a short run after one): just
                // the range asked for, not windows the next read would not use.
                drop(open);
                return self.answer_soon(source.answer_directly(offset, end, first_read, reply));
            }
            let needed: Vec<(u64, Window)> = (first..=last)
                .step_by(WINDOW as usize)
                .map(|start| (start, file.window(start)))
                .collect();
            // Sequential read-ahead: the windows after the last one read,
            // for a reader going through the file in order.
            let ahead = if read_ahead { AHEAD } else { 0 };
            for ahead in (1..=ahead).map(|n| last + n * WINDOW) {
                if ahead >= file.size {
                    break;
                }
                let window = file.window(ahead);
                if window.initialized() {
                    continue;
                }
                let source = source.clone();
                self.runtime.spawn(async move {
                    let _ = source.fetch(ahead, &window, false).await;
                });
            }
            (source, needed, end, first_read)
        };
        // What the reader gets is what it was delivered (its file, once).
        let delivered = move |source: &Source| {
            let file = u64::from(first_read);
            source
                .job
                .count_delivered_bytes(&source.metrics, end - offset, file);
        };
        self.answer_soon(async move {
            let slice = |chunk: &[u8], start: u64| {
                let from = offset.max(start) - start;
                let to = (end.min(start + chunk.len() as u64)).saturating_sub(start);
                from.min(to) as usize..to as usize
            };
            if let [(start, window)] = needed.as_slice() {
                // Within one window (nearly every read): no copy here.
                return match source.fetch(*start, window, true).await {
                    Some(Ok(chunk)) => {
                        delivered(&source);
                        reply.data(&chunk[slice(&chunk, *start)]);
                    }
                    Some(Err(e)) => reply.error(e),
                    None => source.answer_directly(offset, end, first_read, reply).await,
                };
            }
            let mut out = Vec::with_capacity((end - offset) as usize);
            for (start, window) in &needed {
                let chunk = match source.fetch(*start, window, true).await {
                    Some(Ok(chunk)) => chunk,
                    Some(Err(e)) => return reply.error(e),
                    None => return source.answer_directly(offset, end, first_read, reply).await,
                };
                out.extend_from_slice(&chunk[slice(&chunk, *start)]);
            }
            delivered(&source);
            reply.data(&out);
        });
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.counters.release.inc();
        let closed = lock(&self.open).remove(&fh);
        if let Some(file) = closed {
            self.readers.close(file.job.id());
            if file.backing.is_some() {
                drop(file);
                // The inode's last passthrough open: its backing goes.
                let mut backings = lock(&self.backings);
                if backings.get(&ino).is_some_and(|b| b.strong_count() == 0) {
                    backings.remove(&ino);
                }
            }
        }
        reply.ok();
    }

    fn opendir(&mut self, req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        match self.node(ino) {
            Some(Node::File { .. }) => reply.error(libc::ENOTDIR),
            Some(node) if node.job().is_some_and(|job| !self.may_read_as(req, job)) => {
                reply.error(libc::EACCES)
            }
            // A data set directory's handle keeps the tree its first page
            // is read from (see `dirs`).
            Some(Node::Dir { .. }) => reply.opened(self.next_fh.fetch_add(1, Ordering::Relaxed), 0),
            Some(_) => reply.opened(0, 0),
            None => reply.error(libc::ENOENT),
        }
    }

    fn releasedir(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        _flags: i32,
        reply: ReplyEmpty,
    ) {
        lock(&self.dirs).remove(&fh);
        reply.ok();
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        reply.error(libc::EROFS);
    }

    fn mknod(
        &mut self,
        _req: &Request<'_>,
        _parent: u64,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(libc::EROFS);
    }

    fn mkdir(
        &mut self,
        _req: &Request<'_>,
        _parent: u64,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(libc::EROFS);
    }

    fn unlink(&mut self, _req: &Request<'_>, _parent: u64, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(libc::EROFS);
    }

    fn rmdir(&mut self, _req: &Request<'_>, _parent: u64, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(libc::EROFS);
    }

    fn rename(
        &mut self,
        _req: &Request<'_>,
        _parent: u64,
        _name: &OsStr,
        _newparent: u64,
        _newname: &OsStr,
        _flags: u32,
        reply: ReplyEmpty,
    ) {
        reply.error(libc::EROFS);
    }

    fn create(
        &mut self,
        _req: &Request<'_>,
        _parent: u64,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: fuser::ReplyCreate,
    ) {
        reply.error(libc::EROFS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job_root(job: &str) -> Node {
        Node::JobRoot(Arc::from(job))
    }

    #[test]
    fn a_job_only_looked_at_is_dropped_as_a_detached_one_is() {
        let readers = Readers::default();
        readers.looked_up(&Arc::from("listed"));
        let first = lock(&readers.detached)[&Arc::<str>::from("listed")];
        // Looked at again: its time runs from the first look.
        readers.looked_up(&Arc::from("listed"));
        assert_eq!(lock(&readers.detached)[&Arc::<str>::from("listed")], first);
        assert!(readers.sweep().is_empty(), "not before its time");
    }

    #[test]
    fn a_job_detached_long_enough_has_its_paths_dropped_once_unless_read_again() {
        let readers = Readers::default();
        let long_ago = Instant::now() - DROP_JOB_PATHS;
        {
            let mut detached = lock(&readers.detached);
            detached.insert(Arc::from("gone"), long_ago);
            detached.insert(Arc::from("recent"), Instant::now());
        }
        assert_eq!(readers.sweep(), [Arc::<str>::from("gone")]);
        assert!(readers.sweep().is_empty(), "told once");
        assert!(lock(&readers.detached).contains_key("recent"));
    }

    #[test]
    fn a_data_set_opens_off_the_fuse_thread_while_its_opens_are_slow_or_it_is_on_a_filer() {
        let dir = tempfile::tempdir().unwrap();
        let local = |name: &str| {
            let source = crate::source::DirSource::open(name, dir.path(), false).unwrap();
            Dataset::new(name, crate::source::Source::Dir(source))
        };
        let (disk, filer) = (local("disk"), local("filer"));
        let costs = OpenCosts {
            means: Mutex::default(),
            networked: ["filer".to_owned()].into_iter().collect(),
        };
        assert!(!costs.slow(&disk), "a local disk is fast until measured");
        assert!(costs.slow(&filer), "a filer is slow before any open");
        costs.note("disk", Duration::from_micros(20));
        costs.note("filer", Duration::from_micros(20));
        assert!(!costs.slow(&disk));
        assert!(costs.slow(&filer), "a filer measured fast stays slow");
        // One open of 300 ms (a disk busy elsewhere) is slow for a while,
        // and forgotten as fast opens follow.
        costs.note("disk", Duration::from_millis(300));
        assert!(costs.slow(&disk));
        let fast_again = (1..200).find(|_| {
            costs.note("disk", Duration::from_micros(20));
            !costs.slow(&disk)
        });
        assert!(fast_again.is_some_and(|n| n < 60), "{fast_again:?}");
    }

    #[test]
    fn an_open_counts_for_its_inode_until_dropped() {
        let counts: Arc<Mutex<HashMap<u64, usize>>> = Arc::default();
        let opening = |ino| Opening::new(ino, &counts);
        let (a, b, other) = (opening(7), opening(7), opening(8));
        assert!(a.others() && b.others());
        assert!(!other.others());
        drop(b);
        assert!(!a.others());
        drop((a, other));
        assert!(lock(&counts).is_empty());
    }

    #[test]
    fn an_object_replaced_by_one_of_the_same_size_shows_a_new_time() {
        let dir = tempfile::tempdir().unwrap();
        let source = crate::source::DirSource::open("d", dir.path(), false).unwrap();
        let dataset = Arc::new(Dataset::new("d", crate::source::Source::Dir(source)));
        // An object store's entry: no owner, so no time of its own.
        let object = |version| Node::File {
            job: Arc::from("j"),
            dataset: Arc::clone(&dataset),
            name: "a.bin".into(),
            size: 10,
            meta: None,
            version,
        };
        let started = SystemTime::now();
        let (before, after) = (attr(started, 2, &object(1)), attr(started, 2, &object(2)));
        assert_eq!(before.size, after.size);
        assert_ne!(
            before.mtime, after.mtime,
            "the kernel keeps pages while time and size agree"
        );
        assert!(after.mtime.duration_since(started).unwrap() < Duration::from_secs(1));
    }

    #[test]
    fn windows_and_read_ahead_wait_for_a_run_in_order() {
        const K: u64 = 1 << 10;
        let mut reads = Reads::default();
        // From the start: windows at once, the ones ahead after a run.
        assert_eq!(reads.follow(0, 128 * K), (true, false));
        assert_eq!(reads.follow(128 * K, RUN), (true, true));
        // A jump, a header and the body after it: the ranges read.
        assert_eq!(reads.follow(20 * RUN, 20 * RUN + 4 * K), (false, false));
        assert_eq!(
            reads.follow(20 * RUN + 4 * K, 20 * RUN + 8 * K),
            (false, false)
        );
        // Going on in order from there: windows and the ones ahead.
        assert_eq!(reads.follow(20 * RUN + 8 * K, 21 * RUN), (true, true));
        // A first read elsewhere than the start is a jump.
        let mut reads = Reads::default();
        assert_eq!(reads.follow(RUN, RUN + 4 * K), (false, false));
    }

    #[test]
    fn an_inode_lives_until_the_kernel_forgets_every_lookup_of_it() {
        let mut nodes = Nodes::default();
        let listed = nodes.number(ROOT, b"@a");
        let ino = nodes.looked_up(ROOT, b"@a", job_root("a"));
        assert_eq!(ino, listed, "a listing and a lookup agree on the number");
        // A lookup again answers with the node as it is now (a file may
        // have changed), under the same number.
        assert_eq!(nodes.looked_up(ROOT, b"@a", job_root("b")), ino);
        assert!(matches!(nodes.get(ino), Some(Node::JobRoot(job)) if &**job == "b"));
        nodes.forget(ino, 1);
        assert!(nodes.get(ino).is_some(), "one lookup is still held");
        nodes.forget(ino, 1);
        assert!(nodes.get(ino).is_none());
        assert_eq!(nodes.len(), 0);
        // Looked up again: the same number, a fresh count.
        assert_eq!(nodes.looked_up(ROOT, b"@a", job_root("a")), ino);
        nodes.forget(ino, 1);
        assert_eq!(nodes.len(), 0);
        assert!(nodes.get(ROOT).is_some(), "the root is never forgotten");
    }

    #[test]
    fn names_whose_numbers_meet_get_different_inodes() {
        let mut nodes = Nodes::default();
        let a = nodes.looked_up(ROOT, b"@a", job_root("a"));
        // Another name made to take the same number first.
        nodes.known.insert(
            a + 1,
            Known {
                node: job_root("x"),
                parent: ROOT,
                name: Box::from(&b"@x"[..]),
                lookups: 1,
                kept: None,
                object: ObjectKept::Nothing,
                sized: None,
                dropping: Arc::default(),
                dropped_at: None,
            },
        );
        nodes.forget(a, 1);
        let b = {
            // `@b` hashing onto `a`'s number is simulated by the table's
            // probe: take `a` itself and its neighbour.
            nodes.known.insert(
                a,
                Known {
                    node: job_root("y"),
                    parent: ROOT,
                    name: Box::from(&b"@y"[..]),
                    lookups: 1,
                    kept: None,
                    object: ObjectKept::Nothing,
                    sized: None,
                    dropping: Arc::default(),
                    dropped_at: None,
                },
            );
            nodes.looked_up(ROOT, b"@a", job_root("a"))
        };
        assert!(b != a && b != a + 1, "{a} {b}");
        assert!(matches!(nodes.get(b), Some(Node::JobRoot(j)) if &**j == "a"));
        assert_eq!(
            nodes.number(ROOT, b"@a"),
            b,
            "a listing names the inode the kernel holds"
        );
    }
}
