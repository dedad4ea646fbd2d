//! Work handed to the runtime's blocking threads, when the OS may refuse a
//! thread.
//!
//! A stage in a pod with a `pids` limit (or under `RLIMIT_NPROC`) can reach
//! it: every job's reader threads count against it. tokio's
//! `spawn_blocking` then panics ("OS can't spawn worker thread") when its
//! pool has no thread left alive to take the work later; on the mount's
//! FUSE thread that panic would end the mount for every reader. Here the
//! refusal is an answer instead: [`spawn`] gives the work back to the
//! caller, who cleans up, and [`run`] and [`spawn_or_reserve`] hand it to
//! threads the stage started for this at its start (slower, but
//! answered), with a warning that names the limit.

use std::cell::Cell;
use std::fmt;
use std::panic::{AssertUnwindSafe, PanicHookInfo};
use std::sync::{Arc, Mutex, Once, OnceLock, mpsc};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;

use crate::protocol::{ErrorCode, ProtocolError};
use crate::sync::lock;

/// The message tokio's panic starts with when the OS refuses a thread.
const REFUSED: &str = "OS can't spawn worker thread";

thread_local! {
    /// Set while this thread hands work over in [`spawn`], whose refusal
    /// is caught there and must not be reported as a panic.
    static HANDING_OVER: Cell<bool> = const { Cell::new(false) };
}

/// Blocking work that did not run to its end: it was cancelled (the stage
/// is stopping) or it panicked.
#[derive(Debug)]
pub struct Ended;

impl fmt::Display for Ended {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "its task ended before its work did (the stage is stopping, or the work failed)"
        )
    }
}

impl std::error::Error for Ended {}

impl Ended {
    /// The trainer's error for `what` (say, "reading `a.bin`").
    pub fn to_protocol(&self, what: &str) -> ProtocolError {
        ProtocolError::new(ErrorCode::IoError, format!("{what} failed: {self}"))
    }
}

/// Runs `work` on the current runtime's blocking threads and returns what
/// it returned; when the OS refuses the thread, on a reserve thread (see
/// [`spawn_or_reserve`]).
pub async fn run<T, F>(work: F) -> Result<T, Ended>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    spawn_or_reserve(&Handle::current(), move || {
        let _ = tx.send(work());
    });
    rx.await.map_err(|_| Ended)
}

/// What a reserve thread runs.
type Work = Box<dyn FnOnce() + Send>;

/// Where work the OS refused a blocking thread for goes: the reserve
/// threads' queue, once started.
static RESERVE: OnceLock<mpsc::Sender<Work>> = OnceLock::new();

/// Starts `threads` threads, in `runtime`'s context, that take the work
/// the OS refuses a blocking thread for. Started with the stage, they are
/// among its threads from the start, so that such work is never done on a
/// runtime worker (where an object store's read, which waits on the
/// runtime, cannot run at all, and two such waits would stop the stage) or
/// on the mount's thread (where every reader of the mount would wait).
pub fn start_reserve(runtime: &Handle, threads: usize) -> std::io::Result<()> {
    let (tx, rx) = mpsc::channel::<Work>();
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..threads {
        let (rx, runtime) = (Arc::clone(&rx), runtime.clone());
        std::thread::Builder::new()
            .name(format!("stage-reserve-{i}"))
            .spawn(move || {
                let _entered = runtime.enter();
                loop {
                    let work = lock(&rx).recv();
                    let Ok(work) = work else {
                        return;
                    };
                    // A failure is the work's own; the thread stays.
                    let _ = std::panic::catch_unwind(AssertUnwindSafe(work));
                }
            })?;
    }
    let _ = RESERVE.set(tx);
    Ok(())
}

/// Runs `work` on `runtime`'s blocking threads, or, when the OS refuses
/// the thread, on a reserve thread (one at a time there: slower, but
/// answered); here, on this thread, only where no reserve was started.
pub fn spawn_or_reserve(runtime: &Handle, work: impl FnOnce() + Send + 'static) {
    let Err((work, why)) = spawn(runtime, work) else {
        return;
    };
    refused(&why);
    match RESERVE.get() {
        Some(reserve) => {
            if let Err(mpsc::SendError(work)) = reserve.send(Box::new(work)) {
                work();
            }
        }
        None => work(),
    }
}

/// Runs `work` on a reserve thread (in turn with other work there);
/// `false`, leaving it undone, where no reserve was started.
pub fn on_reserve(work: impl FnOnce() + Send + 'static) -> bool {
    RESERVE
        .get()
        .is_some_and(|reserve| reserve.send(Box::new(work)).is_ok())
}

/// Logs a thread the OS refused, at most once every ten seconds (under a
/// thread limit, every request could meet one).
pub fn refused(why: &str) {
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    let mut last = lock(&LAST);
    if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
        *last = Some(Instant::now());
        tracing::warn!(error = %why, "the OS refused the stage a thread: it is at its process's or pod's thread limit (RLIMIT_NPROC, the pod's pids limit); work meant for other threads is done on the two it keeps for this, more slowly, until threads end");
    }
}

/// Runs `work` on `runtime`'s blocking threads, or gives it back with the
/// OS's reason when it refuses the thread needed (nothing of `work` has run
/// then). tokio queues the task before it asks for the thread, so a
/// refused task may still run later, when a thread does start: `work` sits
/// in a slot that whoever comes first takes.
pub fn spawn<F>(runtime: &Handle, work: F) -> Result<(), (F, String)>
where
    F: FnOnce() + Send + 'static,
{
    quiet_refusals();
    let slot = Arc::new(Mutex::new(Some(work)));
    let theirs = Arc::clone(&slot);
    HANDING_OVER.with(|h| h.set(true));
    let handed = std::panic::catch_unwind(AssertUnwindSafe(|| {
        drop(runtime.spawn_blocking(move || {
            let work = lock(&theirs).take();
            if let Some(work) = work {
                work();
            }
        }))
    }));
    HANDING_OVER.with(|h| h.set(false));
    let Err(panic) = handed else {
        return Ok(());
    };
    let why = panic
        .downcast_ref::<String>()
        .and_then(|m| m.strip_prefix(REFUSED))
        .map(|m| m.trim_start_matches(':').trim().to_owned());
    let Some(why) = why else {
        std::panic::resume_unwind(panic)
    };
    // A thread another hand-over started may have taken it meanwhile.
    let work = lock(&slot).take();
    work.map_or(Ok(()), |work| Err((work, why)))
}

/// Installs, once, a panic hook that leaves out the refusals [`spawn`]
/// catches (its callers log them) and reports every other panic as before.
fn quiet_refusals() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info: &PanicHookInfo<'_>| {
            let refused = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|m| m.starts_with(REFUSED));
            if !(refused && HANDING_OVER.with(Cell::get)) {
                before(info);
            }
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_handed_over_runs_once_and_returns_its_value() {
        assert_eq!(run(|| 6 * 7).await.unwrap(), 42);
        let (tx, rx) = std::sync::mpsc::channel();
        assert!(spawn(&Handle::current(), move || tx.send(1).unwrap()).is_ok());
        assert_eq!(rx.recv().unwrap(), 1);
        assert!(rx.recv().is_err(), "run once");
        let failed = run(|| -> u8 { panic!("the work failed") }).await;
        assert!(failed.is_err(), "{failed:?}");
    }
}
