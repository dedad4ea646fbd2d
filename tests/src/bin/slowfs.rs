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
//! `fusermount3`) and `/dev/fuse`. Requests wait on a pool of `--threads`
//! threads, so at most that many are delayed at once: the harness serves
//! at most `threads / latency` calls per second.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{File, Metadata};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
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
    /// Calls served (and delayed) at once.
    #[arg(long, default_value_t = 256)]
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
    open: Mutex<HashMap<u64, Arc<File>>>,
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

    fn file(&self, fh: u64) -> Option<Arc<File>> {
        lock(&self.open).get(&fh).cloned()
    }
}

struct SlowFs {
    source: PathBuf,
    inodes: Inodes,
    shared: Arc<Shared>,
    next_fh: AtomicU64,
    jobs: Sender<Job>,
}

impl SlowFs {
    fn new(source: PathBuf, latency: Duration, bandwidth: Option<u64>, threads: usize) -> Self {
        let (jobs, queue) = channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        for i in 0..threads {
            let queue = Arc::clone(&queue);
            std::thread::Builder::new()
                .name(format!("slowfs-{i}"))
                .spawn(move || serve(&queue))
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
            jobs,
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
        let job: Job = Box::new(move || {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            job(&shared);
        });
        // The pool outlives the session: a send cannot fail.
        let _ = self.jobs.send(job);
    }
}

/// Locks `m`, taking it as it is if a panicking thread held it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn serve(queue: &Mutex<Receiver<Job>>) {
    loop {
        let job = {
            let queue = lock(queue);
            queue.recv()
        };
        match job {
            Ok(job) => job(),
            Err(_) => return,
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
        self.delayed(move |shared| match File::open(&path) {
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
            let mut buf = vec![0u8; size as usize];
            let mut filled = 0;
            while filled < buf.len() {
                match file.read_at(&mut buf[filled..], offset + filled as u64) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return reply.error(errno(&e)),
                }
            }
            shared.transfer(filled);
            reply.data(&buf[..filled]);
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
