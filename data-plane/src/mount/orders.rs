//! Order files (`--mount-orders DIR`), for frameworks that can write down
//! an epoch's order but not call the client: `DIR/<job>/<dataset>` lists
//! the files `<job>` will open through the mount, one per line, in order.
//!
//! Each new version of the file (written elsewhere and renamed into place,
//! so that it is never read half-written) becomes that job's plan of the
//! data set, replacing the previous one: the stage prefetches it in that
//! order, and each open of a listed file through `MOUNT/@<job>/<dataset>/`
//! (or `MOUNT/<dataset>/` for the default job) is served from the buffer,
//! once. A line is a name relative to the data set, or a path under the
//! mount; empty lines and lines starting with `#` are skipped. A file that
//! cannot be used changes nothing and gets its reason written beside it,
//! in `<dataset>.error`; removing the order file drops its plan.
//!
//! A plan holds its job on the stage only while it is read: once every
//! file in it was opened, or when none was for [`ORDER_IDLE`] (its reader
//! crashed; [`ORDER_UNSTARTED`] before its first, for a trainer that loads
//! a model or validates first), the plan goes and the job may go idle and
//! be forgotten; the file is taken up again only when it changes. Order
//! files found at the stage's start that were written more than
//! [`ORDER_IDLE`] before it are left from an earlier stage's time and are
//! not taken up until they change.

use std::collections::{HashMap, HashSet};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use tracing::{info, warn};

use crate::engine::{Engine, JobHandle, ORDER_RANK, PlanHandle, PlanKey};
use crate::protocol::{ErrorCode, valid_job_id};
use crate::trust::{Peer, TrainerAccess};

/// How often the directory is looked at.
pub const POLL: Duration = Duration::from_millis(200);

/// An order plan none of whose files was opened for this long is dropped...
pub const ORDER_IDLE: Duration = Duration::from_secs(120);
/// ...or this long after it was made, when none was opened yet.
pub const ORDER_UNSTARTED: Duration = Duration::from_secs(15 * 60);

/// The longest line read: a name or mount path (the kernel's `PATH_MAX`).
const MAX_LINE: usize = 4096;

/// Lines an order file may have per file of its data set.
const MAX_LINES_PER_FILE: usize = 4;
/// Lines an order file may have whatever the data set's size.
const MIN_MAX_LINES: usize = 1024;

/// How much of a refused line an error message repeats.
const SHOWN: usize = 200;

/// How many ignored names of the directory are remembered (and warned
/// about, once each).
const MAX_IGNORED: usize = 1024;

/// What the error file of an order file is called.
const ERROR_SUFFIX: &str = ".error";

/// An order file's version: it changed when any of these did.
type Stamp = (SystemTime, u64, u64);

/// An order file found: `DIR/<job>/<dataset>`, named through its job's
/// open directory (`path`) and as the operator sees it (`shown`).
struct OrderFile {
    job: String,
    dataset: String,
    path: PathBuf,
    shown: PathBuf,
}

/// The plan made from one order file.
struct Current {
    stamp: Stamp,
    plan: Option<PlanHandle>,
    _job: Option<JobHandle>,
    /// The plan's entries not yet delivered when last looked at, when
    /// that count last moved, and whether it has (a file was opened).
    left: usize,
    moved: Instant,
    started: bool,
}

impl Current {
    /// A file looked at and not taken up (refused, or left from before the
    /// stage): read again only when it changes.
    fn passed_over(stamp: Stamp) -> Self {
        Self {
            stamp,
            plan: None,
            _job: None,
            left: 0,
            moved: Instant::now(),
            started: false,
        }
    }

    /// Whether the plan is still read, given its entries not yet delivered
    /// now (`None`: all were) at `now`; notes the count.
    fn still_read(&mut self, left: Option<usize>, now: Instant) -> bool {
        let Some(left) = left else {
            return false;
        };
        let idle = if left != self.left {
            (self.left, self.moved, self.started) = (left, now, true);
            Duration::ZERO
        } else {
            now.duration_since(self.moved)
        };
        idle < if self.started {
            ORDER_IDLE
        } else {
            ORDER_UNSTARTED
        }
    }
}

/// Order files found so far, by (job, dataset).
pub struct Orders {
    engine: Arc<Engine>,
    /// The `trainers:` rules: an order file's owner must be allowed the
    /// job it orders for, as a trainer claiming it would be.
    access: Arc<TrainerAccess>,
    dir: PathBuf,
    /// The mount directory as given and as resolved (a line may name a
    /// file under either): the first is the one errors show.
    mounts: Vec<PathBuf>,
    default_job: String,
    current: HashMap<(String, String), Current>,
    /// What in the directory was ignored (and said so) already.
    ignored: HashSet<PathBuf>,
    /// The epoch of the last plan made, of any job or data set: every
    /// order-file plan has its own key, so none is taken for one that
    /// completed before or for another data set's.
    epoch: u64,
    /// Files found at the first look (`None` after it) modified before
    /// this were written before the stage started (by more than
    /// [`ORDER_IDLE`]): left over, not taken up unchanged. One put in place
    /// later is taken whatever its time (a move keeps it).
    left_over_before: Option<SystemTime>,
}

impl Orders {
    pub fn new(
        engine: Arc<Engine>,
        access: Arc<TrainerAccess>,
        dir: PathBuf,
        mount: &Path,
        default_job: String,
    ) -> Self {
        let given = std::path::absolute(mount).unwrap_or_else(|_| mount.to_owned());
        let mut mounts = vec![given];
        if let Ok(real) = mount.canonicalize()
            && real != mounts[0]
        {
            mounts.push(real);
        }
        Self {
            engine,
            access,
            dir,
            mounts,
            default_job,
            current: HashMap::new(),
            ignored: HashSet::new(),
            epoch: 0,
            left_over_before: Some(SystemTime::now() - ORDER_IDLE),
        }
    }

    /// Looks at the directory every [`POLL`] until this future is dropped
    /// (the mount's tasks are aborted when it goes). The scans run on a
    /// thread of their own: one handed to the runtime's blocking pool five
    /// times a second woke its idle threads in turn, so that none ever
    /// lived out its idle time and every thread a burst of reads had
    /// started stayed for good.
    pub async fn watch(mut self) {
        struct Stop(Arc<AtomicBool>);
        impl Drop for Stop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let stop = Stop(Arc::new(AtomicBool::new(false)));
        let stopped = Arc::clone(&stop.0);
        let runtime = tokio::runtime::Handle::current();
        let started = std::thread::Builder::new()
            .name("mount-orders".to_owned())
            .spawn(move || {
                let _runtime = runtime.enter();
                while !stopped.load(Ordering::Relaxed) {
                    let began = std::time::Instant::now();
                    self.scan();
                    std::thread::sleep(POLL.saturating_sub(began.elapsed()));
                }
            });
        if let Err(e) = started {
            warn!(error = %e, "cannot start the thread that takes order files: none will be taken");
        }
        // Holds `stop` until the task is aborted.
        std::future::pending::<()>().await;
        drop(stop);
    }

    /// Takes up every new or changed order file and drops the plans of
    /// removed ones. Blocking.
    pub fn scan(&mut self) {
        let mut seen = Vec::new();
        let (files, _held) = self.files();
        for OrderFile {
            job,
            dataset,
            path,
            shown,
        } in files
        {
            // Not followed: a link could name any file the stage can read
            // (and its lines would be echoed into the error file).
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            let stamp = (
                meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                meta.len(),
                std::os::unix::fs::MetadataExt::ino(&meta),
            );
            let key = (job, dataset);
            seen.push(key.clone());
            if self.current.get(&key).is_some_and(|c| c.stamp == stamp) {
                continue;
            }
            if self.left_over_before.is_some_and(|before| stamp.0 < before) {
                info!(file = %shown.display(), "order file older than the stage left as it is: write it again to read in its order");
                self.current.insert(key, Current::passed_over(stamp));
                continue;
            }
            let error_path = path.with_file_name(format!("{}{ERROR_SUFFIX}", key.1));
            match self.take(&key.0, &key.1, &path, stamp) {
                Ok(length) => {
                    let _ = std::fs::remove_file(&error_path);
                    info!(job = %key.0, dataset = %key.1, length, "order file taken up as the next epoch's plan");
                }
                Err(e) => {
                    warn!(file = %shown.display(), "order file refused: {e}");
                    let shown_error = shown.with_file_name(format!("{}{ERROR_SUFFIX}", key.1));
                    write_error(&error_path, &shown_error, &e);
                    // Not read again until it changes; the plan before it stays.
                    self.current
                        .entry(key)
                        .and_modify(|c| c.stamp = stamp)
                        .or_insert_with(|| Current::passed_over(stamp));
                }
            }
        }
        self.left_over_before = None;
        self.current.retain(|key, _| seen.contains(key));
        // Plans read to their end, or left unread, let their jobs go.
        let now = Instant::now();
        for ((job, dataset), c) in &mut self.current {
            let Some(plan) = &c.plan else {
                continue;
            };
            let left = plan.remaining();
            if !c.still_read(left, now) {
                if left.is_some() {
                    info!(job = %job, dataset = %dataset, left = c.left, "no file of the order file's plan was opened for {}s: the plan is dropped (write the file again to read in its order)", ORDER_IDLE.as_secs());
                }
                (c.plan, c._job) = (None, None);
            }
        }
    }

    /// The order files present, each with the job directory it is read
    /// through (held open while the scan uses it). A job directory is
    /// opened without following a link (one in its place could make the
    /// stage read, and write `.error` files into, any directory), and the
    /// files in it are named through that open directory, so one swapped
    /// for a link meanwhile is not followed either. A name that is not a
    /// job's, or a link or a file where a job's directory should be, is
    /// ignored with a warning, once.
    fn files(&mut self) -> (Vec<OrderFile>, Vec<std::fs::File>) {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let (mut out, mut held) = (Vec::new(), Vec::new());
        let Ok(jobs) = std::fs::read_dir(&self.dir) else {
            return (out, held);
        };
        for job in jobs.flatten() {
            let shown = job.path();
            let job_name = job.file_name().to_str().map(str::to_owned);
            let why = match (&job_name, job.file_type()) {
                (Some(name), _) if !valid_job_id(name) => {
                    Some("its name is not a job's ([A-Za-z0-9._-], 1 to 128 bytes)")
                }
                (None, _) => Some("its name is not UTF-8"),
                (_, Ok(kind)) if kind.is_symlink() => {
                    Some("it is a symbolic link; make the job's directory itself")
                }
                (_, Ok(kind)) if !kind.is_dir() => {
                    Some("it is not a directory (order files go in DIR/<job>/<dataset>)")
                }
                _ => None,
            };
            if let Some(why) = why {
                // Said once each (of a bounded number, a runaway writer
                // being what it is).
                if self.ignored.len() < MAX_IGNORED && self.ignored.insert(shown.clone()) {
                    warn!(path = %shown.display(), "ignored in the order directory: {why}");
                }
                continue;
            }
            let (Some(job_name), Ok(dir)) = (
                job_name,
                std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
                    .open(&shown),
            ) else {
                continue;
            };
            let through = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
            let Ok(files) = std::fs::read_dir(&through) else {
                continue;
            };
            for file in files.flatten() {
                let Some(name) = file.file_name().to_str().map(str::to_owned) else {
                    continue;
                };
                if name.starts_with('.') || name.ends_with(ERROR_SUFFIX) {
                    continue;
                }
                out.push(OrderFile {
                    job: job_name.clone(),
                    path: through.join(&name),
                    shown: shown.join(&name),
                    dataset: name,
                });
            }
            held.push(dir);
        }
        (out, held)
    }

    /// Makes the order file at `path` the plan of `job` over `dataset`;
    /// returns its length, or why it cannot be used.
    fn take(&mut self, job: &str, dataset: &str, path: &Path, stamp: Stamp) -> Result<u32, String> {
        let ds = self.engine.dataset(dataset).ok_or_else(|| {
            format!(
                "`{dataset}` is not a data set of this stage (it serves {})",
                self.engine.dataset_names().join(", ")
            )
        })?;
        let listing = ds
            .listing()
            .map_err(|e| format!("data set `{dataset}` cannot be listed: {e}"))?;
        let file = open_regular(path)?;
        // The owner's claim, checked before the file is read and again
        // as the plan's job is attached (the job may have changed since).
        let owner = owner_of(&file)?;
        let refused = |why| format!("its owner may not order for job `{job}`: {why}");
        self.engine
            .may_join(&self.access, &owner, job)
            .map_err(refused)?;
        let mut reader = std::io::BufReader::new(file);
        // Each file at most a few times over, so a runaway file cannot take
        // the node's memory.
        let max_lines = listing
            .files
            .len()
            .saturating_mul(MAX_LINES_PER_FILE)
            .max(MIN_MAX_LINES);
        let prefixes = self.prefixes(job, dataset);
        let mut files = Vec::new();
        let mut raw = Vec::new();
        for i in 1.. {
            raw.clear();
            let n = std::io::Read::take(&mut reader, MAX_LINE as u64 + 1)
                .read_until(b'\n', &mut raw)
                .map_err(|e| format!("cannot read it: {e}"))?;
            if n == 0 {
                break;
            }
            if raw.len() > MAX_LINE {
                return Err(format!(
                    "line {i} is longer than {MAX_LINE} bytes (one name or mount path per line): `{}`",
                    shown(&String::from_utf8_lossy(&raw))
                ));
            }
            if i > max_lines {
                return Err(format!(
                    "it has more than {max_lines} lines, the most an order of data set `{dataset}` may have ({MAX_LINES_PER_FILE} per file of it, or {MIN_MAX_LINES})"
                ));
            }
            let exact = std::str::from_utf8(&raw)
                .map_err(|_| format!("line {i} is not UTF-8"))?
                .trim_end_matches(['\n', '\r']);
            let line = exact.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            // A name may begin or end with spaces; trimmed is what people mean.
            let index = [exact, line]
                .into_iter()
                .find_map(|l| listing.position(self.relative(&prefixes, &lexical(l))))
                .ok_or_else(|| {
                    format!(
                        "line {i}: `{}` is not a file of data set `{dataset}` (give names relative to the data set, or paths under {})",
                        shown(line),
                        self.mounts[0].join(format!("@{job}")).join(dataset).display()
                    )
                })?;
            files.push(index);
        }
        if files.is_empty() {
            return Err("it lists no file".to_owned());
        }
        let key = (job.to_owned(), dataset.to_owned());
        let handle = self
            .engine
            .claim(&self.access, &owner, job, None)
            .map_err(|e| match e.code {
                ErrorCode::ClaimRefused => refused(e.message),
                _ => e.message,
            })?;
        // A sampler already gives this job's order over the data set: a
        // second order would read every file again into a buffer nobody
        // takes from.
        if handle.job().plans_other_than(dataset, ORDER_RANK) {
            return Err(format!(
                "job `{job}` already reads data set `{dataset}` in an order its trainers gave (a sampler's plan): one order per job and data set; remove this file or stop the sampler"
            ));
        }
        self.epoch += 1;
        let fingerprint = listing.fingerprint(&files);
        // The previous epoch's plan goes first, and its buffer with it.
        if let Some(c) = self.current.get_mut(&key) {
            c.plan = None;
        }
        let (plan, _) = handle
            .job()
            .attach_plan(
                PlanKey {
                    rank: ORDER_RANK,
                    epoch: self.epoch,
                    run: 0,
                },
                fingerprint,
                ds,
                listing,
                files,
            )
            .map_err(|e| e.message)?;
        let length = plan.length;
        self.current.insert(
            key,
            Current {
                stamp,
                left: plan.length as usize,
                plan: Some(plan),
                _job: Some(handle),
                moved: Instant::now(),
                started: false,
            },
        );
        Ok(length)
    }

    /// The data set name a line gives, with the mount path it may start
    /// with taken off.
    fn relative<'a>(&self, prefixes: &[String], line: &'a str) -> &'a str {
        prefixes
            .iter()
            .find_map(|p| line.strip_prefix(p.as_str()))
            .unwrap_or(line)
    }

    /// What a line may start with to name a file by its mount path.
    fn prefixes(&self, job: &str, dataset: &str) -> Vec<String> {
        let mut out = Vec::new();
        for mount in &self.mounts {
            out.push(format!(
                "{}/",
                mount.join(format!("@{job}")).join(dataset).display()
            ));
            if job == self.default_job {
                out.push(format!("{}/", mount.join(dataset).display()));
            }
        }
        out
    }
}

/// Writes why an order file was refused beside it, at `path` (`shown`:
/// that path as the operator sees it, for the log); never through a link
/// put in the error file's place (that would write wherever it points).
fn write_error(path: &Path, shown: &Path, why: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path);
    match file {
        Ok(mut file) if file.metadata().is_ok_and(|m| m.is_file()) => {
            let _ = writeln!(file, "{why}");
        }
        Ok(_) => {}
        Err(e) => {
            warn!(file = %shown.display(), error = %e, "cannot write the order file's error file")
        }
    }
}

/// Who gave order `file`, for the `trainers:` rules: its owner, whom only
/// root can change. Not its group: a set-group-id orders directory, or
/// `chgrp` to any group the writer is in, gives it another than the
/// writer's own.
fn owner_of(file: &std::fs::File) -> Result<Peer, String> {
    use std::os::unix::fs::MetadataExt;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read it: {e}"))?;
    Ok(Peer::Owner { uid: meta.uid() })
}

/// Opens the order file at `path` for reading if it is a regular file:
/// neither a link (not followed) nor a FIFO or device, whose open or read
/// could block the scan of every job's orders or never end.
fn open_regular(path: &Path) -> Result<std::fs::File, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => "it is a symbolic link; write the order file itself".to_owned(),
            _ => format!("cannot read it: {e}"),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read it: {e}"))?;
    if !meta.is_file() {
        return Err("it is not a regular file".to_owned());
    }
    Ok(file)
}

/// `path` as the kernel reads it, without empty and `.` components and
/// with each `..` taking off the one before it: a path joined from a
/// directory given with a trailing slash (`glob` and `tf.io.gfile.glob`
/// keep the `//`) names the same file. (Every directory of a data set is
/// one through the mount, so `a/..` is where `a` is.)
fn lexical(path: &str) -> std::borrow::Cow<'_, str> {
    let plain = !path
        .split('/')
        .enumerate()
        .any(|(i, c)| (c.is_empty() && i > 0) || c == "." || c == "..");
    if plain {
        return path.into();
    }
    let mut kept: Vec<&str> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." if kept.last().is_some_and(|last| *last != "..") => {
                kept.pop();
            }
            c => kept.push(c),
        }
    }
    let joined = kept.join("/");
    if path.starts_with('/') {
        format!("/{joined}").into()
    } else {
        joined.into()
    }
}

/// `text` as an error message shows it: at most [`SHOWN`] characters.
fn shown(text: &str) -> String {
    match text.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::lexical;

    #[test]
    fn an_order_plan_is_read_until_delivered_or_left_unread() {
        use super::{Current, ORDER_IDLE};
        use std::time::{Duration, Instant, SystemTime};
        let start = Instant::now();
        let mut c = Current::passed_over((SystemTime::UNIX_EPOCH, 0, 0));
        (c.left, c.moved) = (100, start);
        // Before its first file is opened (a model loads), it waits long.
        assert!(c.still_read(Some(100), start + ORDER_IDLE * 2));
        assert!(!c.still_read(Some(100), start + super::ORDER_UNSTARTED));
        let mut c = Current::passed_over((SystemTime::UNIX_EPOCH, 0, 0));
        (c.left, c.moved) = (100, start);
        // Read slowly: each file opened counts.
        assert!(c.still_read(Some(99), start + ORDER_IDLE * 3 / 2));
        assert!(c.still_read(Some(99), start + ORDER_IDLE * 2));
        assert!(!c.still_read(
            Some(99),
            start + ORDER_IDLE * 5 / 2 + Duration::from_secs(1)
        ));
        // Every file delivered.
        let mut done = Current::passed_over((SystemTime::UNIX_EPOCH, 0, 0));
        assert!(!done.still_read(None, Instant::now()));
    }

    #[test]
    fn paths_are_read_as_the_kernel_reads_them() {
        assert_eq!(
            lexical("/mnt/@j/ds//shards/x.rec"),
            "/mnt/@j/ds/shards/x.rec"
        );
        assert_eq!(lexical("/mnt/./@j/ds/./a"), "/mnt/@j/ds/a");
        assert_eq!(lexical("./a//b"), "a/b");
        assert_eq!(lexical("a/b"), "a/b");
        assert_eq!(lexical("/mnt/@j/ds/sub/../x"), "/mnt/@j/ds/x");
        assert_eq!(lexical("../x"), "../x");
        assert_eq!(lexical("/mnt/@j/ds/"), "/mnt/@j/ds");
    }
}
