//! `sluice-slowfs`: a read-only pass-through FUSE file system that makes a
//! local directory behave like a network filer. Every `open` and every
//! `read` call waits `--latency` before it is served, and `--bandwidth`
//! caps the bytes it serves per second. The kernel here has no `netem`, so
//! the tests and benchmarks emulate slow storage with this instead of with
//! anything inside the stage's read path.
//!
//! ```text
//! sluice-slowfs SOURCE MOUNTPOINT [--latency 5ms] [--bandwidth 1GiB/s] [--threads 256]
//! ```
//!
//! Prints `{"mounted": MOUNTPOINT, ...}` on stdout once the mount is live,
//! serves until SIGTERM or SIGINT, then unmounts. Mounting needs root (or
//! `fusermount3`) and `/dev/fuse`. A call waits out its latency in a
//! queue, not on a thread: the latency is the same for every call, so
//! calls fall due in the order they come, and each of `--threads` threads
//! keeps a queue of its own (calls are dealt round robin), sleeps until its
//! first call is due and serves it. So the threads bound how many calls
//! are served at once (the source's I/O), not how many wait.
//!
//! The harness stands in for a filer on another machine, so it spends as
//! little of this machine's CPU as it can: files are read with `O_DIRECT`
//! (the disk writes into the reply buffer; no copy out of a page cache of
//! the source) into a buffer each pool thread keeps, and only the reply's
//! copy into the mount's pages remains. A source file system that refuses
//! `O_DIRECT` (tmpfs) is read through its page cache.

use std::cell::RefCell;
use std::collections::HashMap;
use std::collections::VecDeque;
use std::ffi::OsStr;
use std::fs::{File, Metadata, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, UNIX_EPOCH};

use clap::Parser;
use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, MountOption, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, Request,
};
use sluice_policy::ByteRate;
use sluice_tests::parse_duration;

/// How long the kernel may keep names and attributes.
const TTL: Duration = Duration::from_secs(1);

/// Offsets, lengths and buffer addresses of `O_DIRECT` reads are
/// multiples of this.
const ALIGN: u64 = 4096;

#[derive(Debug, Parser)]
#[command(
    name = "sluice-slowfs",
    about = "A read-only pass-through FUSE mount with added latency"
)]
struct Args {
    /// The directory to serve.
    source: PathBuf,
    /// Where to mount it (an existing empty directory).
    mountpoint: PathBuf,
    /// Added to every open and every read call, e.g. 5ms.
    #[arg(long, default_value = "0ms", value_parser = parse_duration)]
    latency: Duration,
    /// Bytes served per second at most, e.g. 500MiB/s (default: no cap).
    #[arg(long, value_parser = parse_rate)]
    bandwidth: Option<u64>,
    /// Threads serving calls: how many are served at once (calls wait
    /// out their latency in queues, not on threads).
    #[arg(long, default_value_t = 32)]
    threads: usize,
}

fn parse_rate(s: &str) -> Result<u64, String> {
    match s.parse::<ByteRate>() {
        Ok(ByteRate(0)) => Err("the bandwidth must be above 0".to_owned()),
        Ok(r) => Ok(r.0),
        Err(e) => Err(e.to_string()),
    }
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("sluice-slowfs: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), String> {
    let source = args
        .source
        .canonicalize()
        .map_err(|e| format!("source {}: {e}", args.source.display()))?;
    if !source.is_dir() {
        return Err(format!("source {} is not a directory", source.display()));
    }
    if args.threads == 0 {
        return Err("--threads must be at least 1".to_owned());
    }
    let fs = SlowFs::new(source, args.latency, args.bandwidth, args.threads);
    let options = [
        MountOption::RO,
        MountOption::FSName("sluice-slowfs".to_owned()),
        MountOption::AllowOther,
    ];
    let session = fuser::spawn_mount2(fs, &args.mountpoint, &options).map_err(|e| {
        format!(
            "cannot mount at {}: {e} (mounting needs root or fusermount3, and /dev/fuse)",
            args.mountpoint.display()
        )
    })?;
    println!(
        "{{\"mounted\": \"{}\", \"latency_ms\": {}, \"threads\": {}}}",
        args.mountpoint.display(),
        args.latency.as_secs_f64() * 1e3,
        args.threads
    );
    wait_for_signal();
    drop(session); // unmounts
    Ok(())
}

/// Blocks until SIGTERM or SIGINT.
fn wait_for_signal() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .expect("a runtime for signals");
    runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    });
}

/// Paths by inode number (1 is the root).
#[derive(Default)]
struct Inodes {
    paths: Vec<PathBuf>,
    numbers: HashMap<PathBuf, u64>,
}

impl Inodes {
    fn number(&mut self, relative: PathBuf) -> u64 {
        if let Some(&ino) = self.numbers.get(&relative) {
            return ino;
        }
        self.paths.push(relative.clone());
        let ino = self.paths.len() as u64;
        self.numbers.insert(relative, ino);
        ino
    }

    fn path(&self, ino: u64) -> Option<&Path> {
        let index = usize::try_from(ino.checked_sub(1)?).ok()?;
        self.paths.get(index).map(PathBuf::as_path)
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// What the delayed calls share with the pool's threads.
struct Shared {
    latency: Duration,
    /// Bytes per second, and when the link is next free.
    bandwidth: Option<(u64, Mutex<Instant>)>,
    open: Mutex<HashMap<u64, Arc<Source>>>,
}

impl Shared {
    /// Waits as long as serving `bytes` takes on the capped link.
    fn transfer(&self, bytes: usize) {
        let Some((rate, free_at)) = &self.bandwidth else {
            return;
        };
        let took = Duration::from_secs_f64(bytes as f64 / *rate as f64);
        let done = {
            let mut free_at = lock(free_at);
            let start = (*free_at).max(Instant::now());
            *free_at = start + took;
            *free_at
        };
        std::thread::sleep(done.saturating_duration_since(Instant::now()));
    }

    fn file(&self, fh: u64) -> Option<Arc<Source>> {
        lock(&self.open).get(&fh).cloned()
    }
}

struct SlowFs {
    source: PathBuf,
    inodes: Inodes,
    shared: Arc<Shared>,
    next_fh: AtomicU64,
    lanes: Vec<Arc<Lane>>,
    next_lane: AtomicUsize,
}

impl SlowFs {
    fn new(source: PathBuf, latency: Duration, bandwidth: Option<u64>, threads: usize) -> Self {
        let lanes: Vec<Arc<Lane>> = (0..threads).map(|_| Arc::default()).collect();
        for (i, lane) in lanes.iter().enumerate() {
            let lane = Arc::clone(lane);
            std::thread::Builder::new()
                .name(format!("slowfs-{i}"))
                .spawn(move || lane.serve())
                .expect("a pool thread");
        }
        let mut inodes = Inodes::default();
        inodes.number(PathBuf::new());
        Self {
            source,
            inodes,
            shared: Arc::new(Shared {
                latency,
                bandwidth: bandwidth.map(|r| (r, Mutex::new(Instant::now()))),
                open: Mutex::new(HashMap::new()),
            }),
            next_fh: AtomicU64::new(1),
            lanes,
            next_lane: AtomicUsize::new(0),
        }
    }

    fn full(&self, ino: u64) -> Option<PathBuf> {
        self.inodes.path(ino).map(|p| self.source.join(p))
    }

    fn attr(&self, ino: u64, meta: &Metadata) -> FileAttr {
        let time = |secs: i64, nanos: i64| {
            u64::try_from(secs)
                .ok()
                .map_or(UNIX_EPOCH, |s| UNIX_EPOCH + Duration::new(s, nanos as u32))
        };
        let mtime = time(meta.mtime(), meta.mtime_nsec());
        FileAttr {
            ino,
            size: meta.len(),
            blocks: meta.blocks(),
            atime: time(meta.atime(), meta.atime_nsec()),
            mtime,
            ctime: time(meta.ctime(), meta.ctime_nsec()),
            crtime: mtime,
            kind: kind(meta),
            perm: (meta.mode() & 0o7777) as u16 & !0o222,
            nlink: meta.nlink() as u32,
            uid: meta.uid(),
            gid: meta.gid(),
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    /// Runs `job` on the pool after the latency.
    fn delayed(&self, job: impl FnOnce(&Shared) + Send + 'static) {
        let shared = Arc::clone(&self.shared);
        let due = Instant::now() + shared.latency;
        let lane = self.next_lane.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
        self.lanes[lane].push(due, Box::new(move || job(&shared)));
    }
}

/// An open source file: with `O_DIRECT` where its file system takes it.
struct Source {
    file: File,
    direct: bool,
}

thread_local! {
    /// The buffer a pool thread reads into (it only grows).
    static BUFFER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl Source {
    fn open(path: &Path) -> std::io::Result<Self> {
        let direct = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path);
        match direct {
            Ok(file) => Ok(Self { file, direct: true }),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(Self {
                file: File::open(path)?,
                direct: false,
            }),
            Err(e) => Err(e),
        }
    }

    /// Reads up to `size` bytes at `offset` (fewer at the end of the
    /// file) into `buffer`, returning them. A direct read covers the
    /// aligned range around the bytes asked for.
    fn read<'b>(
        &self,
        buffer: &'b mut Vec<u8>,
        offset: u64,
        size: u32,
    ) -> std::io::Result<&'b [u8]> {
        let (start, skip, len) = if self.direct {
            let start = offset / ALIGN * ALIGN;
            let end = (offset + u64::from(size)).div_ceil(ALIGN) * ALIGN;
            (start, (offset - start) as usize, (end - start) as usize)
        } else {
            (offset, 0, size as usize)
        };
        // Room for `len` bytes from an aligned address in the buffer.
        if buffer.len() < len + ALIGN as usize {
            buffer.resize(len + ALIGN as usize, 0);
        }
        let base = buffer.as_ptr().align_offset(ALIGN as usize);
        let window = &mut buffer[base..base + len];
        let mut filled = 0;
        while filled < len {
            match self
                .file
                .read_at(&mut window[filled..], start + filled as u64)
            {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            if self.direct && filled % ALIGN as usize != 0 {
                break; // a short direct read ends at the end of the file
            }
        }
        let from = skip.min(filled);
        let to = (skip + size as usize).min(filled);
        Ok(&buffer[base + from..base + to])
    }
}

/// Locks `m`, taking it as it is if a panicking thread held it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One pool thread's calls, in the order they fall due.
#[derive(Default)]
struct Lane {
    calls: Mutex<VecDeque<(Instant, Job)>>,
    changed: Condvar,
}

impl Lane {
    fn push(&self, due: Instant, job: Job) {
        let mut calls = lock(&self.calls);
        calls.push_back((due, job));
        if calls.len() == 1 {
            // Its thread waits for a first call (with one it waits on time).
            self.changed.notify_one();
        }
    }

    /// Serves the calls as they fall due; never returns.
    fn serve(&self) {
        let mut calls = lock(&self.calls);
        loop {
            let Some(due) = calls.front().map(|(due, _)| *due) else {
                calls = self
                    .changed
                    .wait(calls)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            };
            let now = Instant::now();
            if due > now {
                calls = self
                    .changed
                    .wait_timeout(calls, due - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
                continue;
            }
            let (_, job) = calls.pop_front().expect("a call is queued");
            drop(calls);
            job();
            calls = lock(&self.calls);
        }
    }
}

fn kind(meta: &Metadata) -> FileType {
    let t = meta.file_type();
    if t.is_dir() {
        FileType::Directory
    } else if t.is_symlink() {
        FileType::Symlink
    } else {
        FileType::RegularFile
    }
}

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

impl Filesystem for SlowFs {
    fn init(&mut self, _req: &Request<'_>, config: &mut KernelConfig) -> Result<(), i32> {
        // Let many reads wait at once, as on a filer.
        let _ = config.set_max_background(512);
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let Some(dir) = self.inodes.path(parent) else {
            return reply.error(libc::ENOENT);
        };
        let relative = dir.join(name);
        match std::fs::symlink_metadata(self.source.join(&relative)) {
            Ok(meta) => {
                let ino = self.inodes.number(relative);
                reply.entry(&TTL, &self.attr(ino, &meta), 0);
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        let Some(path) = self.full(ino) else {
            return reply.error(libc::ENOENT);
        };
        match std::fs::symlink_metadata(path) {
            Ok(meta) => reply.attr(&TTL, &self.attr(ino, &meta)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readlink(&mut self, _req: &Request<'_>, ino: u64, reply: ReplyData) {
        let Some(path) = self.full(ino) else {
            return reply.error(libc::ENOENT);
        };
        match std::fs::read_link(path) {
            Ok(target) => reply.data(target.as_os_str().as_bytes()),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        if flags & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(libc::EROFS);
        }
        let Some(path) = self.full(ino) else {
            return reply.error(libc::ENOENT);
        };
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.delayed(move |shared| match Source::open(&path) {
            Ok(file) => {
                lock(&shared.open).insert(fh, Arc::new(file));
                // No FOPEN_KEEP_CACHE: every open reads through, as each
                // epoch of a filer that does not cache would.
                reply.opened(fh, 0);
            }
            Err(e) => reply.error(errno(&e)),
        });
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        let Ok(offset) = u64::try_from(offset) else {
            return reply.error(libc::EINVAL);
        };
        self.delayed(move |shared| {
            let Some(file) = shared.file(fh) else {
                return reply.error(libc::EBADF);
            };
            BUFFER.with_borrow_mut(|buffer| match file.read(buffer, offset, size) {
                Ok(bytes) => {
                    shared.transfer(bytes.len());
                    reply.data(bytes);
                }
                Err(e) => reply.error(errno(&e)),
            });
        });
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        lock(&self.shared.open).remove(&fh);
        reply.ok();
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        let Some(dir) = self.inodes.path(ino).map(Path::to_path_buf) else {
            return reply.error(libc::ENOENT);
        };
        let entries = match std::fs::read_dir(self.source.join(&dir)) {
            Ok(entries) => entries,
            Err(e) => return reply.error(errno(&e)),
        };
        let mut names: Vec<(std::ffi::OsString, FileType)> = entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                let meta = e.metadata().ok()?;
                Some((e.file_name(), kind(&meta)))
            })
            .collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        let skip = usize::try_from(offset).unwrap_or(0);
        for (i, (name, kind)) in names.into_iter().enumerate().skip(skip) {
            let child = self.inodes.number(dir.join(&name));
            if reply.add(child, (i + 1) as i64, kind, &name) {
                break;
            }
        }
        reply.ok();
    }
}
