//! Compares ways of reading many small whole files from a cold page cache:
//! a pool of threads doing blocking reads, buffered or `O_DIRECT` (what the
//! stage uses), against one thread driving io_uring, either for open, read
//! and close chained per file or for the reads only.
//!
//! ```text
//! cargo run --release -p sluice-stage --example read_engines -- DIR [FILES]
//! ```
//!
//! Environment: `ENGINES=threads,direct,io_uring,uring_reads` (which to run), `COUNTS=1,4,16`
//! (threads or queue depths), `SHUFFLE=1` (read in a pseudo-random order, as
//! an epoch plan does, instead of sorted by name).
//!
//! Every run first evicts the files from the page cache with
//! `posix_fadvise(DONTNEED)`, then reports files/s, MiB/s and the CPU time
//! the process used per file. docs/data-plane.md records the results.
// io_uring's submission API and posix_fadvise are unsafe by signature; this
// benchmark is the only place in the workspace that needs them.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use io_uring::{IoUring, opcode, types};

fn files(dir: &Path, limit: usize) -> Vec<(PathBuf, usize)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let e = e.expect("entry");
            let meta = e.metadata().expect("metadata");
            if meta.is_dir() {
                stack.push(e.path());
            } else if meta.is_file() {
                out.push((e.path(), meta.len() as usize));
            }
        }
    }
    out.sort();
    out.truncate(limit);
    if std::env::var_os("SHUFFLE").is_some() {
        // A fixed pseudo-random order (xorshift), like an epoch's plan.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for i in (1..out.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            out.swap(i, (x % (i as u64 + 1)) as usize);
        }
    }
    out
}

fn evict(files: &[(PathBuf, usize)]) {
    for (path, _) in files {
        let f = std::fs::File::open(path).expect("open");
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        // SAFETY: fd is open for the duration of the call.
        unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
}

fn cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct we pass.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Reads a whole file with O_DIRECT into a 4 KiB-aligned window of a
/// plain `Vec` (no page cache, no unsafe allocation).
fn read_direct(path: &PathBuf, size: usize) -> usize {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open");
    let rounded = size.div_ceil(4096) * 4096 + 4096;
    let mut buf = vec![0u8; rounded + 4096];
    let off = buf.as_ptr().align_offset(4096);
    let window = &mut buf[off..off + rounded];
    let mut got = 0;
    loop {
        let n = f.read(&mut window[got..]).expect("read");
        if n == 0 {
            break;
        }
        got += n;
    }
    got
}

fn threads(files: &[(PathBuf, usize)], n: usize) -> usize {
    threads_with(files, n, |p, _| std::fs::read(p).expect("read").len())
}

fn threads_direct(files: &[(PathBuf, usize)], n: usize) -> usize {
    threads_with(files, n, read_direct)
}

fn threads_with(
    files: &[(PathBuf, usize)],
    n: usize,
    read: impl Fn(&PathBuf, usize) -> usize + Sync,
) -> usize {
    let next = AtomicUsize::new(0);
    let bytes = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..n {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((path, size)) = files.get(i) else {
                        break;
                    };
                    bytes.fetch_add(read(path, *size), Ordering::Relaxed);
                }
            });
        }
    });
    bytes.into_inner()
}

fn uring(files: &[(PathBuf, usize)], depth: usize) -> usize {
    let mut ring = IoUring::new((depth * 2).next_power_of_two() as u32).expect("io_uring");
    let paths: Vec<CString> = files
        .iter()
        .map(|(p, _)| CString::new(p.as_os_str().as_bytes()).unwrap())
        .collect();
    let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); files.len()];
    let mut fds = vec![-1i32; files.len()];
    let (mut next, mut done, mut bytes) = (0usize, 0usize, 0usize);
    // user_data: file index * 4 + stage (0 open, 1 read, 2 close).
    let mut in_flight = 0;
    while done < files.len() {
        while in_flight < depth && next < files.len() {
            let open = opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), paths[next].as_ptr())
                .flags(libc::O_RDONLY | libc::O_CLOEXEC)
                .build()
                .user_data((next * 4) as u64);
            // SAFETY: the path outlives the submission.
            unsafe { ring.submission().push(&open).expect("sq full") };
            next += 1;
            in_flight += 1;
        }
        ring.submit_and_wait(1).expect("submit");
        let completions: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (data, result) in completions {
            let (i, stage) = ((data / 4) as usize, data % 4);
            assert!(
                result >= 0,
                "io_uring op {stage} on file {i} failed: {result}"
            );
            let sqe = match stage {
                0 => {
                    fds[i] = result;
                    bufs[i] = vec![0u8; files[i].1];
                    opcode::Read::new(types::Fd(fds[i]), bufs[i].as_mut_ptr(), files[i].1 as u32)
                        .build()
                        .user_data((i * 4 + 1) as u64)
                }
                1 => {
                    bytes += result as usize;
                    bufs[i] = Vec::new();
                    opcode::Close::new(types::Fd(fds[i]))
                        .build()
                        .user_data((i * 4 + 2) as u64)
                }
                _ => {
                    done += 1;
                    in_flight -= 1;
                    continue;
                }
            };
            // SAFETY: the buffer outlives the read (freed only after its completion).
            unsafe { ring.submission().push(&sqe).expect("sq full") };
        }
    }
    bytes
}

/// One thread: opens each file itself (O_DIRECT), submits only the read to
/// io_uring, keeps `depth` reads in flight, closes on completion.
fn uring_reads(files: &[(PathBuf, usize)], depth: usize) -> usize {
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::os::unix::fs::OpenOptionsExt;
    let mut ring = IoUring::new((depth * 2).next_power_of_two() as u32).expect("io_uring");
    let mut slots: Vec<Option<(OwnedFd, Vec<u8>)>> = (0..files.len()).map(|_| None).collect();
    let (mut next, mut done, mut bytes, mut in_flight) = (0usize, 0usize, 0usize, 0usize);
    while done < files.len() {
        while in_flight < depth && next < files.len() {
            let (path, size) = &files[next];
            let file = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .expect("open");
            let len = size.div_ceil(4096) * 4096 + 4096;
            let mut buf = vec![0u8; len + 4096];
            let off = buf.as_ptr().align_offset(4096);
            let read = opcode::Read::new(
                types::Fd(file.as_raw_fd()),
                buf[off..].as_mut_ptr(),
                len as u32,
            )
            .build()
            .user_data(next as u64);
            slots[next] = Some((file.into(), buf));
            // SAFETY: the buffer and fd live in `slots` until the completion.
            unsafe { ring.submission().push(&read).expect("sq full") };
            next += 1;
            in_flight += 1;
        }
        ring.submit_and_wait(1).expect("submit");
        let completions: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (i, result) in completions {
            assert!(result >= 0, "read of file {i} failed: {result}");
            bytes += result as usize;
            slots[i as usize] = None;
            done += 1;
            in_flight -= 1;
        }
    }
    bytes
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().expect("usage: read_engines DIR [FILES]"));
    let limit = args
        .next()
        .map_or(usize::MAX, |n| n.parse().expect("FILES is a number"));
    let files = files(&dir, limit);
    println!(
        "{} files, {:.1} MiB",
        files.len(),
        files.iter().map(|f| f.1).sum::<usize>() as f64 / 1048576.0
    );
    println!(
        "{:<16} {:>10} {:>10} {:>14}",
        "engine", "files/s", "MiB/s", "cpu us/file"
    );
    let counts: Vec<usize> = std::env::var("COUNTS")
        .map(|c| {
            c.split(',')
                .map(|n| n.parse().expect("COUNTS is a list of numbers"))
                .collect()
        })
        .unwrap_or_else(|_| vec![1, 4, 8, 16, 32, 64]);
    let engines = std::env::var("ENGINES").unwrap_or_else(|_| "threads,direct,io_uring".into());
    let configs: Vec<(&str, usize)> = engines
        .split(',')
        .flat_map(|e| {
            let engine = match e {
                "threads" => "threads",
                "direct" => "direct",
                "uring_reads" => "uring_reads",
                _ => "io_uring",
            };
            counts.iter().map(move |&n| (engine, n))
        })
        .collect();
    for (engine, n) in configs {
        evict(&files);
        let (t0, c0) = (Instant::now(), cpu_seconds());
        let bytes = match engine {
            "threads" => threads(&files, n),
            "direct" => threads_direct(&files, n),
            "uring_reads" => uring_reads(&files, n),
            _ => uring(&files, n),
        };
        let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        println!(
            "{:<16} {:>10.0} {:>10.1} {:>14.1}",
            format!("{engine} x{n}"),
            files.len() as f64 / wall,
            bytes as f64 / 1048576.0 / wall,
            cpu / files.len() as f64 * 1e6
        );
    }
}
