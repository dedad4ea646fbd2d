//! Trainer connections: one task per connection reading request frames,
//! answering each, and ending only that connection on a malformed frame.
//! A local trainer speaking version 2 may take its samples in shared memory
//! ([`shared`]).

mod shared;

use std::collections::BTreeMap;
use std::io::{self, IoSlice};
use std::ops::ControlFlow;
use std::os::fd::{OwnedFd, RawFd};
use std::sync::Arc;

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::blocking;
use crate::dataset::{Dataset, Listing};
use crate::engine::{Engine, ORDER_RANK, PlanHandle, PlanKey, ShardOrder};
use crate::engine::{JobHandle, PlannedClaim, Presence, Reservation};
use crate::entry::check_name;
use crate::metrics::Metrics;
use crate::plan::{permutation, shard};
use crate::protocol::{
    self, ErrorCode, FEATURE_RUN_READS, FEATURE_RUNS, FEATURE_SHARED_MEMORY, FEATURE_TAKES,
    FrameReadError, MAX_LIST, MAX_NEXT, MAX_REQUEST_FRAME, PLAN_WITH_RUN, Part, Payload, PlanSpec,
    ProtocolError, Request, Response, SAMPLES_FRAME_BUDGET, Sample, TO_END,
};
use crate::source::{Pinned, changed};
use crate::storage::clamp_range;
use crate::trust::{Peer, TrainerAccess};
use shared::Shared;

/// Limits on what `HELLO` may carry.
use crate::protocol::MAX_JOB_BYTES;
const MAX_LABELS: usize = 64;

/// Serves one trainer connection until it says goodbye, breaks the protocol,
/// disconnects, or the stage shuts down. `unix` is the connection's socket
/// descriptor when it is a UNIX socket, over which a shared-memory region
/// can be passed.
pub async fn serve<S>(
    engine: Arc<Engine>,
    stage_id: Arc<str>,
    access: Arc<TrainerAccess>,
    stream: S,
    peer: Peer,
    unix: Option<RawFd>,
    cancel: CancellationToken,
) where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let metrics = Arc::clone(engine.metrics());
    metrics.connections.inc();
    let (rd, mut wr) = tokio::io::split(stream);
    // Buffered, so that the trainer's end can be watched while a request
    // is answered (see `trainer_left`) without losing what it sends next.
    let mut rd = tokio::io::BufReader::new(rd);
    let mut conn = Connection::new(engine, stage_id, access, peer, unix);
    let ending = loop {
        let next = next_request(&mut rd, &mut wr, &metrics, &cancel);
        let next = if conn.job.is_some() {
            next.await
        } else {
            // A peer that has not said who it is holds a connection (and a
            // descriptor) for nothing: it gets [`HELLO_WAIT`] per request.
            match tokio::time::timeout(HELLO_WAIT, next).await {
                Ok(next) => next,
                Err(_) => {
                    let message = format!(
                        "no HELLO within {} s: the stage closes connections that do not say HELLO first",
                        HELLO_WAIT.as_secs()
                    );
                    send_error(
                        &mut wr,
                        &metrics,
                        ProtocolError::new(ErrorCode::OutOfOrder, message),
                    )
                    .await;
                    break Ending::ByStage;
                }
            }
        };
        let ending = match next {
            Ok(request) => {
                let present = Arc::clone(&conn.trainer_present);
                let respond = conn.respond(request, &mut wr, &metrics);
                tokio::pin!(respond);
                tokio::select! {
                    biased;
                    ending = &mut respond => ending,
                    left = trainer_left(&mut rd) => {
                        if left {
                            // No longer the trainer's stall; a NEXT is
                            // given up (see `Connection::next`), any other
                            // request answered all the same.
                            present.leave();
                        }
                        respond.await
                    }
                }
            }
            Err(ending) => ControlFlow::Break(ending),
        };
        if let ControlFlow::Break(ending) = ending {
            break ending;
        }
    };
    conn.end(ending);
    let _ = wr.shutdown().await;
    metrics.connections.dec();
}

/// Waits until the trainer sends more or closes its end: true when it
/// closed it (or the connection broke), false when a request is waiting
/// in the buffer.
async fn trainer_left<R: AsyncBufRead + Unpin>(rd: &mut R) -> bool {
    rd.fill_buf()
        .await
        .map_or(true, |buffered| buffered.is_empty())
}

/// How long a connection may wait for its next request before it has said
/// `HELLO` (trainers say it as soon as they connect).
pub const HELLO_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a trainer may take to read an answer before its connection is
/// closed.
pub const ANSWER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// Which side ended a connection: it decides what becomes of the samples
/// its trainer holds in shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// The trainer said `BYE` or closed its end, so that reading or
    /// writing fails (its client let go of its samples first, or its
    /// process is gone).
    ByTrainer,
    /// The stage ended it (a malformed frame, a fatal error, shutdown):
    /// the trainer may still be reading its samples.
    ByStage,
}

/// Reads and decodes the next request. Returns how the connection ended
/// when it ends first: the trainer left, its frame was malformed (answered
/// with an error), the connection broke, or the stage is shutting down
/// (answered with `UNAVAILABLE`).
async fn next_request<R, W>(
    rd: &mut R,
    wr: &mut W,
    metrics: &Metrics,
    cancel: &CancellationToken,
) -> Result<Result<Request, ProtocolError>, Ending>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let frame = tokio::select! {
        () = cancel.cancelled() => {
            let _ = send(wr, &Response::Error(ProtocolError::closing(ErrorCode::Unavailable, "the stage is shutting down"))).await;
            return Err(Ending::ByStage);
        }
        frame = protocol::read_frame(rd, MAX_REQUEST_FRAME) => frame,
    };
    match frame {
        Ok(Some(body)) => Ok(Request::decode(&body)),
        Ok(None) => Err(Ending::ByTrainer),
        Err(FrameReadError::Malformed(err)) => {
            send_error(wr, metrics, err).await;
            Err(Ending::ByStage)
        }
        Err(e) => {
            debug!(error = %e, "connection ended");
            Err(Ending::ByTrainer)
        }
    }
}

/// Counts an error answer and sends it.
async fn send_error<W: AsyncWrite + Unpin>(w: &mut W, metrics: &Metrics, err: ProtocolError) {
    metrics
        .protocol_errors
        .with_label_values(&[err.code.name()])
        .inc();
    let _ = send(w, &Response::Error(err)).await;
}

async fn send<W: AsyncWrite + Unpin>(w: &mut W, response: &Response) -> io::Result<()> {
    write_parts(w, &response.encode_parts()).await
}

/// Sends a response with a descriptor attached to its first byte (the
/// `WELCOME` that grants shared memory).
async fn send_with_fd<W: AsyncWrite + Unpin>(
    w: &mut W,
    socket: RawFd,
    response: &Response,
    fd: &OwnedFd,
) -> io::Result<()> {
    let frame: Vec<u8> = response
        .encode_parts()
        .iter()
        .flat_map(|p| p.as_slice().iter().copied())
        .collect();
    let sent = shared::send_with_descriptor(socket, &frame, fd).await?;
    w.write_all(&frame[sent..]).await?;
    w.flush().await
}

/// Writes every part with vectored writes, so sample data goes from the
/// buffer to the socket without being copied into a frame first.
async fn write_parts<W: AsyncWrite + Unpin>(w: &mut W, parts: &[Part<'_>]) -> io::Result<()> {
    let (mut index, mut offset) = (0, 0);
    while index < parts.len() {
        let slices: Vec<IoSlice<'_>> = std::iter::once(&parts[index].as_slice()[offset..])
            .chain(parts[index + 1..].iter().take(63).map(Part::as_slice))
            .map(IoSlice::new)
            .collect();
        let mut n = w.write_vectored(&slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let left = parts[index].as_slice().len() - offset;
            if n >= left {
                n -= left;
                index += 1;
                offset = 0;
            } else {
                offset += n;
                n = 0;
            }
        }
    }
    w.flush().await
}

/// An answer and the buffer bytes its samples hold until it is written.
type Answer = Result<(Response, Vec<Reservation>), ProtocolError>;

struct Connection {
    engine: Arc<Engine>,
    stage_id: Arc<str>,
    /// The socket's descriptor on a UNIX socket (shared memory possible).
    unix: Option<RawFd>,
    /// Who is connected, and what they may claim in `HELLO`.
    peer: Peer,
    access: Arc<TrainerAccess>,
    job: Option<JobHandle>,
    rank: u32,
    world_size: u32,
    dataset: Option<(Arc<Dataset>, Arc<Listing>)>,
    plan: Option<PlanHandle>,
    /// Shared-memory delivery, when negotiated.
    shared: Option<Shared>,
    /// The region's descriptor, sent with the next answer (`WELCOME`).
    descriptor: Option<OwnedFd>,
    /// Whether `HELLO` was granted `RUNS` (a `PLAN` may name a run).
    runs: bool,
    /// Whether `HELLO` was granted `RUN_READS` (the connection may say
    /// `RUN`).
    run_reads: bool,
    /// The run whose plan entries this connection's reads by name deliver
    /// (0: plans that name none), once it said `RUN`; before, any plan's.
    reads_for: Option<u64>,
    /// Cleared once the trainer has gone while a request is answered.
    trainer_present: Arc<Presence>,
    /// Set when a `NEXT` was given up because the trainer left before it
    /// took its samples: the connection ends without an answer.
    given_up: bool,
    /// The file this connection is reading in ranges, while it has more.
    ranged: Option<RangedRead>,
}

/// A file a trainer reads in ranges (a file too large for one answer): a
/// `READ` that starts where the last one of the same file ended reads the
/// version the first range read, as a reader holding the file open would,
/// so ranges of two versions are never joined into one file's bytes.
struct RangedRead {
    dataset: Arc<str>,
    name: String,
    next: u64,
    pin: Pinned,
}

fn invalid(message: String) -> ProtocolError {
    ProtocolError::new(ErrorCode::InvalidArgument, message)
}

fn reply(response: Response) -> Answer {
    Ok((response, Vec::new()))
}

impl Connection {
    fn new(
        engine: Arc<Engine>,
        stage_id: Arc<str>,
        access: Arc<TrainerAccess>,
        peer: Peer,
        unix: Option<RawFd>,
    ) -> Self {
        Self {
            engine,
            stage_id,
            unix,
            peer,
            access,
            job: None,
            rank: 0,
            world_size: 1,
            dataset: None,
            plan: None,
            shared: None,
            descriptor: None,
            runs: false,
            run_reads: false,
            reads_for: None,
            trainer_present: Arc::default(),
            given_up: false,
            ranged: None,
        }
    }

    /// Answers one request and writes the answer. Breaks when the
    /// connection should end: after `BYE`, a fatal error, or a failed write.
    async fn respond<W: AsyncWrite + Unpin>(
        &mut self,
        request: Result<Request, ProtocolError>,
        wr: &mut W,
        metrics: &Metrics,
    ) -> ControlFlow<Ending> {
        if matches!(request, Ok(Request::Bye)) {
            let _ = send(wr, &Response::Goodbye).await;
            return ControlFlow::Break(Ending::ByTrainer);
        }
        // RELEASE and HAND_OFF have no answer: only a failure is sent (and
        // is fatal).
        let request = match request {
            Ok(Request::Release { offsets }) => match self.release(&offsets) {
                Ok(()) => return ControlFlow::Continue(()),
                Err(e) => Err(e),
            },
            Ok(Request::HandOff { offsets }) => match self.hand_off(&offsets) {
                Ok(()) => return ControlFlow::Continue(()),
                Err(e) => Err(e),
            },
            Ok(Request::Run { run }) => match self.run(run) {
                Ok(()) => return ControlFlow::Continue(()),
                Err(e) => Err(e),
            },
            Ok(Request::Take { offsets }) => match self.take(&offsets) {
                Ok(()) => return ControlFlow::Continue(()),
                Err(e) => Err(e),
            },
            other => other,
        };
        let claims = matches!(request, Ok(Request::Next { .. }));
        let answer = match request {
            Ok(request) => self.handle(request).await,
            Err(e) => Err(e),
        };
        if std::mem::take(&mut self.given_up) {
            return ControlFlow::Break(Ending::ByTrainer);
        }
        let (response, reservation) = match answer {
            Ok(ok) => ok,
            Err(err) => {
                let fatal = err.is_fatal();
                send_error(wr, metrics, err).await;
                return if fatal {
                    ControlFlow::Break(Ending::ByStage)
                } else {
                    ControlFlow::Continue(())
                };
            }
        };
        let descriptor = self.descriptor.take();
        let writing = async {
            match (descriptor, self.unix) {
                (Some(fd), Some(socket)) => send_with_fd(wr, socket, &response, &fd).await,
                _ => send(wr, &response).await,
            }
        };
        // The answer holds the memory of the samples it carries until it is
        // written: a trainer that stopped reading (hung, stopped) must not
        // hold it, and with it the node's other jobs, for good.
        let written = tokio::time::timeout(ANSWER_PATIENCE, writing).await;
        let failed = match written {
            Ok(Ok(())) => None,
            Ok(Err(e)) => {
                debug!(error = %e, "writing to the trainer failed");
                Some(Ending::ByTrainer)
            }
            Err(_) => {
                warn!(
                    "a trainer did not take its answer within {} s: its connection is closed",
                    ANSWER_PATIENCE.as_secs()
                );
                Some(Ending::ByStage)
            }
        };
        drop(reservation);
        let Some(ending) = failed else {
            return ControlFlow::Continue(());
        };
        // The entries of a NEXT's answer that never got through are the
        // job's next trainer's.
        if let (true, Response::Samples { samples, .. }, Some(plan)) =
            (claims, &response, &self.plan)
        {
            let positions: Vec<u32> = samples.iter().map(|s| s.position).collect();
            self.job().reopen(plan, &positions);
        }
        ControlFlow::Break(ending)
    }

    /// Ends the connection: what its trainer holds in shared memory goes
    /// back at once when the trainer ended it, or stays the job's when the
    /// stage did (the trainer may still read it), before the connection
    /// leaves the job.
    fn end(mut self, ending: Ending) {
        if let Some(shared) = self.shared.take() {
            shared.end(ending == Ending::ByStage);
        }
    }

    async fn handle(&mut self, request: Request) -> Answer {
        if let Request::Hello {
            version,
            job,
            labels,
            rank,
            world_size,
            features,
        } = request
        {
            return self.hello(version, &job, labels, (rank, world_size), features);
        }
        if self.job.is_none() {
            return Err(ProtocolError::new(
                ErrorCode::OutOfOrder,
                "the first frame of a connection must be HELLO",
            ));
        }
        match request {
            Request::Hello { .. }
            | Request::Bye
            | Request::Release { .. }
            | Request::HandOff { .. }
            | Request::Run { .. }
            | Request::Take { .. } => unreachable!("handled above"),
            Request::Fetch { names } => self.fetch(names).await,
            Request::Open { dataset } => self.open(&dataset).await,
            Request::List { offset, limit } => self.list(offset, limit),
            Request::Plan { epoch, spec, run } => self.plan(epoch, spec, run),
            Request::Next { max_samples } => self.next(max_samples).await,
            Request::Read {
                name,
                offset,
                length,
            } => self.read(name, offset, length).await,
        }
    }

    fn hello(
        &mut self,
        version: u16,
        job: &str,
        labels: BTreeMap<String, String>,
        (rank, world_size): (u32, u32),
        features: u32,
    ) -> Answer {
        if self.job.is_some() {
            return Err(ProtocolError::new(
                ErrorCode::OutOfOrder,
                "HELLO may be sent only once per connection",
            ));
        }
        if !(protocol::MIN_VERSION..=protocol::VERSION).contains(&version) {
            return Err(ProtocolError::new(
                ErrorCode::UnsupportedVersion,
                format!(
                    "protocol version {version} is not supported: this stage speaks versions {} to {}",
                    protocol::MIN_VERSION,
                    protocol::VERSION
                ),
            ));
        }
        if !crate::protocol::valid_job_id(job) {
            return Err(invalid(format!(
                "job id `{job}` is invalid: use 1 to {MAX_JOB_BYTES} characters of letters, digits, `.`, `_` and `-`"
            )));
        }
        if labels.len() > MAX_LABELS {
            return Err(invalid(format!(
                "{} labels is too many: at most {MAX_LABELS}",
                labels.len()
            )));
        }
        // The labels operators' policies can select on, and no others: the
        // controller takes no other from stages, so a job labelled otherwise
        // would run under no policy at all.
        if let Some(why) = labels
            .iter()
            .find_map(|(k, v)| sluice_policy::check_label(k, v).err())
        {
            return Err(invalid(why));
        }
        if world_size == 0 || rank >= world_size {
            return Err(invalid(format!(
                "rank {rank} of world size {world_size} is impossible: world size is at least 1 and rank is below it"
            )));
        }
        // A HELLO without labels joins the job as it runs (its labels are
        // kept: another connection of the job must not clear them).
        let claimed = (!labels.is_empty()).then_some(labels);
        let handle = self.engine.claim(&self.access, &self.peer, job, claimed)?;
        self.rank = rank;
        self.world_size = world_size;
        #[cfg(debug_assertions)]
        crate::fault::panic_job_if_asked(handle.job());
        self.job = Some(handle);
        let mut granted = features & (FEATURE_RUNS | FEATURE_RUN_READS);
        self.runs = granted & FEATURE_RUNS != 0;
        self.run_reads = granted & FEATURE_RUN_READS != 0;
        if features & FEATURE_SHARED_MEMORY != 0 {
            granted |= self.grant_shared_memory();
            if granted & FEATURE_SHARED_MEMORY != 0
                && features & FEATURE_TAKES != 0
                && let Some(shared) = &mut self.shared
            {
                shared.take_receipts();
                granted |= FEATURE_TAKES;
            }
        }
        reply(Response::Welcome {
            version,
            stage_id: self.stage_id.to_string(),
            features: granted,
            region_bytes: self.shared.as_ref().map_or(0, Shared::region_bytes),
        })
    }

    /// Grants shared-memory delivery when the connection is a UNIX socket
    /// and the job's buffers live in a region; returns the feature bits
    /// granted. The region's descriptor goes out with `WELCOME`.
    fn grant_shared_memory(&mut self) -> u32 {
        let Some(region) = self.job().region().cloned() else {
            return 0;
        };
        if self.unix.is_none() {
            return 0;
        }
        let shared = Shared::new(Arc::clone(self.job()), region);
        match shared.descriptor() {
            Ok(fd) => {
                self.descriptor = Some(fd);
                self.shared = Some(shared);
                FEATURE_SHARED_MEMORY
            }
            Err(e) => {
                debug!(error = %e, "no read-only descriptor of the region: delivering in frames");
                0
            }
        }
    }

    /// Takes back slots the job's trainers are done with.
    fn release(&self, offsets: &[u64]) -> Result<(), ProtocolError> {
        self.shared()?.release(offsets)
    }

    /// Names the run this connection reads for: its whole-file reads by
    /// name deliver only entries of that run's plans, so that another run
    /// of the job (an evaluation pass, a restarted trainer) reading the
    /// same files does not take them from a running epoch.
    fn run(&mut self, run: u64) -> Result<(), ProtocolError> {
        if !self.run_reads {
            return Err(ProtocolError::new(
                ErrorCode::OutOfOrder,
                "RUN on a connection not granted RUN_READS: ask for it in HELLO",
            ));
        }
        self.reads_for = Some(run);
        if let Some(shared) = &mut self.shared {
            shared.name_run(run);
        }
        Ok(())
    }

    /// Hands this connection's slots to its job.
    fn hand_off(&self, offsets: &[u64]) -> Result<(), ProtocolError> {
        self.shared()?.hand_off(offsets);
        Ok(())
    }

    /// Takes the slots another process of the job handed off and this
    /// connection's process received.
    fn take(&self, offsets: &[u64]) -> Result<(), ProtocolError> {
        let shared = self.shared()?;
        if !shared.receipts() {
            return Err(ProtocolError::new(
                ErrorCode::OutOfOrder,
                "TAKE on a connection not granted TAKES: ask for it in HELLO, with shared memory",
            ));
        }
        shared.receive(offsets);
        Ok(())
    }

    fn shared(&self) -> Result<&Shared, ProtocolError> {
        self.shared.as_ref().ok_or_else(|| {
            ProtocolError::new(
                ErrorCode::BadRelease,
                "RELEASE or HAND_OFF on a connection without shared memory: negotiate it in HELLO",
            )
        })
    }

    fn job(&self) -> &Arc<crate::engine::Job> {
        self.job.as_ref().expect("checked by handle").job()
    }

    fn opened(&self) -> Result<&(Arc<Dataset>, Arc<Listing>), ProtocolError> {
        self.dataset.as_ref().ok_or_else(|| {
            ProtocolError::new(ErrorCode::NoDataset, "no dataset is open: send OPEN first")
        })
    }

    async fn open(&mut self, name: &str) -> Answer {
        let Some(dataset) = self.engine.dataset(name) else {
            return Err(ProtocolError::new(
                ErrorCode::NoSuchDataset,
                format!(
                    "this stage serves no dataset `{name}`; it serves: {}",
                    self.engine.dataset_names().join(", ")
                ),
            ));
        };
        let ds = Arc::clone(&dataset);
        let listing = blocking::run(move || ds.listing())
            .await
            .map_err(|e| e.to_protocol(&format!("listing dataset `{name}`")))?
            .map_err(|e| {
                ProtocolError::new(
                    ErrorCode::IoError,
                    format!("listing dataset `{name}` failed: {e}"),
                )
            })?;
        self.plan = None;
        let response = Response::Opened {
            file_count: listing.len(),
            total_bytes: listing.total_bytes,
            digest: listing.digest,
        };
        self.dataset = Some((dataset, listing));
        reply(response)
    }

    fn list(&self, offset: u32, limit: u32) -> Answer {
        let (_, listing) = self.opened()?;
        if limit == 0 || limit > MAX_LIST {
            return Err(invalid(format!(
                "LIST limit {limit} is out of range: ask for 1 to {MAX_LIST} entries"
            )));
        }
        let entries = listing
            .files
            .iter()
            .skip(offset as usize)
            .take(limit as usize)
            .map(|f| (f.name.clone(), f.size))
            .collect();
        reply(Response::Files {
            total: listing.len(),
            entries,
        })
    }

    fn plan(&mut self, epoch: u64, spec: PlanSpec, run: Option<u64>) -> Answer {
        if run.is_some() && !self.runs {
            // As a stage without the feature answers the flagged kind.
            return Err(ProtocolError::new(
                ErrorCode::BadPlan,
                format!(
                    "PLAN names a run (kind bit 0x{PLAN_WITH_RUN:02x}) on a connection not granted the RUNS feature: ask for it in a version-2 HELLO"
                ),
            ));
        }
        let (dataset, listing) = self.opened()?.clone();
        let order = match spec {
            PlanSpec::Shuffle { seed, shuffle, .. } => Some(ShardOrder {
                seed,
                shuffle,
                world_size: self.world_size,
            }),
            _ => None,
        };
        let files = self.plan_files(epoch, spec, &dataset, &listing)?;
        let fingerprint = listing.fingerprint(&files);
        let key = PlanKey {
            rank: self.rank,
            epoch,
            run: run.unwrap_or(0),
        };
        self.plan = None;
        let name = dataset.name.clone();
        // An order file gives this job's order over the data set: a second
        // order would read every file again, and the mount's opens would
        // deliver entries of either plan.
        if self.job().plans_of(&name, ORDER_RANK) {
            return Err(ProtocolError::new(
                ErrorCode::PlanConflict,
                format!(
                    "job `{}` reads data set `{name}` in the order of an order file (see docs/mount.md): one order per job and data set; remove the order file, or read under another job name",
                    self.job().id()
                ),
            ));
        }
        let (handle, state) = self
            .job()
            .attach_plan(key, fingerprint, dataset, listing, files)?;
        if let Some(order) = order
            && let Some((rank, theirs)) = self.job().note_order(&handle, order)
        {
            // Not refused: a rank restarted with another world size meets
            // the old plan its predecessor's workers hold until they exit.
            warn!(
                "job `{}`: rank {} plans epoch {epoch} of data set `{name}` with {order}, but rank {rank} reads that epoch with {theirs}: their shares overlap and leave samples out; every rank of a job must use the same seed, shuffle and world size",
                self.job().id(),
                self.rank,
            );
        }
        let length = handle.length;
        self.plan = Some(handle);
        reply(Response::Planned {
            length,
            state: state as u8,
        })
    }

    /// Returns the file indices of this rank's plan, refusing indices and
    /// names the listing lacks and a shuffle made for another listing.
    fn plan_files(
        &self,
        epoch: u64,
        spec: PlanSpec,
        dataset: &Dataset,
        listing: &Listing,
    ) -> Result<Vec<u32>, ProtocolError> {
        let n = listing.len();
        let bad = |message: String| ProtocolError::new(ErrorCode::BadPlan, message);
        Ok(match spec {
            PlanSpec::Indices(indices) => {
                if let Some(i) = indices.iter().find(|&&i| i >= n) {
                    return Err(bad(format!(
                        "index {i} is out of range: dataset `{}` has {n} files",
                        dataset.name
                    )));
                }
                indices
            }
            PlanSpec::Names(names) => names
                .iter()
                .map(|name| {
                    check_name(name)?;
                    listing.position(name).ok_or_else(|| {
                        bad(format!(
                            "`{name}` is not in the listing of dataset `{}`",
                            dataset.name
                        ))
                    })
                })
                .collect::<Result<_, _>>()?,
            PlanSpec::Shuffle {
                seed,
                shuffle,
                file_count,
                digest,
            } => {
                if file_count != n || digest != listing.digest {
                    return Err(bad(format!(
                        "the listing of dataset `{}` is not the one the plan was made for (the stage has {n} files, digest {:#x}; the plan names {file_count}, {digest:#x}): OPEN it again and resubmit",
                        dataset.name, listing.digest
                    )));
                }
                shard(
                    &permutation(n, seed, epoch, shuffle),
                    self.rank,
                    self.world_size,
                )
            }
        })
    }

    async fn next(&mut self, max_samples: u32) -> Answer {
        if max_samples == 0 || max_samples > MAX_NEXT {
            return Err(invalid(format!(
                "NEXT of {max_samples} samples is out of range: ask for 1 to {MAX_NEXT}"
            )));
        }
        self.opened()?;
        let handle = self.plan.as_ref().ok_or_else(|| {
            ProtocolError::new(
                ErrorCode::NoPlan,
                "no plan is active on this connection: send PLAN first",
            )
        })?;
        let job = Arc::clone(self.job());
        let Some(mut batch) = job
            .next(handle, max_samples as usize, Some(&self.trainer_present))
            .await
        else {
            // The trainer left: nobody reads an answer (see `respond`).
            self.given_up = true;
            return Err(ProtocolError::new(
                ErrorCode::Unavailable,
                "the trainer left before its samples were taken",
            ));
        };
        let mut held = vec![batch.reservation];
        if let Some(shared) = &self.shared {
            shared.lend(&mut batch.samples, &mut held, |_| Some(0));
        }
        Ok((
            Response::Samples {
                end: batch.end,
                samples: batch.samples,
            },
            held,
        ))
    }

    /// Answers `FETCH`: every named file whole, read concurrently, in one
    /// `SAMPLES` (positions are the names' places in the request). A name
    /// that is an undelivered entry of one of the job's plans delivers it,
    /// as a whole-file `READ` does.
    async fn fetch(&mut self, names: Vec<String>) -> Answer {
        if names.is_empty() || names.len() > MAX_NEXT as usize {
            return Err(invalid(format!(
                "FETCH of {} names is out of range: ask for 1 to {MAX_NEXT}",
                names.len()
            )));
        }
        let (dataset, listing) = self.opened()?.clone();
        // One answer carries at most the frame budget in its frame (or one
        // file): the client splits its batches by the listed sizes.
        let listed: u64 = names.iter().filter_map(|n| listing.size_of(n)).sum();
        if names.len() > 1 && listed > SAMPLES_FRAME_BUDGET {
            return Err(invalid(format!(
                "FETCH of {} files holding {listed} bytes is more than one answer carries \
                 ({SAMPLES_FRAME_BUDGET} bytes, or a single file): split it",
                names.len()
            )));
        }
        let job = Arc::clone(self.job());
        let run = self.reads_for;
        if let Some(run) = run
            && job.plans_over_another_listing(&dataset.name, run, listing.digest)
        {
            return Err(ProtocolError::new(
                ErrorCode::BadPlan,
                format!(
                    "dataset `{}` was listed again since this connection opened it, and its trainer plans over the new listing (digest {:#x} here): OPEN it again",
                    dataset.name, listing.digest
                ),
            ));
        }
        // Counted before anything is read, so that waiting holds nothing;
        // but planned entries a reader has started (before or while this
        // waits) are the plan's bytes, counted already: they are taken
        // and wait for no room (waiting, they kept the buffer full, and
        // the read that held the room waited 2 s for it to empty).
        let mut buffered: Vec<Option<PlannedClaim>> = names.iter().map(|_| None).collect();
        let unbuffered = || {
            let mut bytes = 0;
            for (name, claim) in names.iter().zip(&mut buffered) {
                if claim.is_none() && check_name(name).is_ok() {
                    *claim = job.claim_buffered(&dataset.name, name, run);
                }
                if claim.is_none() {
                    bytes += listing.size_of(name).unwrap_or(0);
                }
            }
            bytes
        };
        let held = job.hold_answer(unbuffered).await;
        // No room came: the entries taken meanwhile are delivered all the
        // same (dropped, their plan would stay an entry short), the other
        // names answered with why.
        let (mut untaken, refused) = match held {
            Ok(untaken) => (Some(untaken), None),
            Err(e) if buffered.iter().all(Option::is_none) => return Err(e),
            Err(e) => (None, Some(e)),
        };
        let mut reads = tokio::task::JoinSet::new();
        for (position, name) in names.into_iter().enumerate() {
            let (job, dataset) = (Arc::clone(&job), Arc::clone(&dataset));
            let claim = buffered[position].take();
            let refused = refused.clone();
            reads.spawn(async move {
                let answer = match (claim, refused) {
                    (Some(claim), _) => deliver_whole(&job, dataset, Some(claim), name).await,
                    (None, Some(e)) => {
                        let data = Err(e);
                        (
                            Sample {
                                position: 0,
                                name,
                                data,
                            },
                            None,
                        )
                    }
                    (None, None) => read_whole_file(job, dataset, name, run).await,
                };
                (position, answer)
            });
        }
        let mut answers: Vec<(usize, Sample, Option<Reservation>)> = Vec::new();
        while let Some(done) = reads.join_next().await {
            let (position, (sample, reservation)) = done.map_err(|e| {
                ProtocolError::new(ErrorCode::IoError, format!("fetch task failed: {e}"))
            })?;
            answers.push((position, sample, reservation));
        }
        answers.sort_by_key(|(position, ..)| *position);
        // Sample i's bytes are held by held[holder[i]], if by any.
        let (mut samples, mut held, mut holder) = (Vec::new(), Vec::new(), Vec::new());
        for (position, mut sample, reservation) in answers {
            // The name's place in the request, whatever position the plan
            // or the direct read gave it.
            sample.position = position as u32;
            samples.push(sample);
            holder.push(reservation.map(|mut r| {
                if let Some(untaken) = untaken.take() {
                    r.keep_untaken(untaken);
                }
                held.push(r);
                held.len() - 1
            }));
        }
        if let Some(shared) = &self.shared {
            shared.lend(&mut samples, &mut held, |i| holder[i]);
        }
        Ok((
            Response::Samples {
                end: false,
                samples,
            },
            held,
        ))
    }

    async fn read(&mut self, name: String, offset: u64, length: u64) -> Answer {
        let (dataset, listing) = self.opened()?.clone();
        let job = Arc::clone(self.job());
        check_name(&name).inspect_err(|e| job.count_refused(&dataset.name, e))?;
        let (whole, run) = (offset == 0 && length == TO_END, self.reads_for);
        // Counted before anything is read, so that waiting holds nothing;
        // but a planned entry a reader has started (before or while this
        // waits) is the plan's bytes, counted already: it waits for no
        // room (as in `fetch`).
        let (_, listed) = clamp_range(listing.size_of(&name).unwrap_or(0), offset, length);
        let mut buffered = None;
        let unbuffered = || {
            if whole && buffered.is_none() {
                buffered = job.claim_buffered(&dataset.name, &name, run);
            }
            if buffered.is_some() { 0 } else { listed }
        };
        let untaken = job.hold_answer(unbuffered).await?;
        if let Some(claim) = buffered {
            let (sample, reservation) = deliver_whole(&job, dataset, Some(claim), name).await;
            let held = reservation.into_iter().collect();
            return data(sample).map(|data| (Response::Data(data), held));
        }
        if whole
            && let Some((sample, mut reservation)) =
                job.read_planned(&dataset.name, &name, run).await
        {
            reservation.keep_untaken(untaken);
            return data(sample).map(|data| (Response::Data(data), vec![reservation]));
        }
        let resumed = self.ranged.take().filter(|r| {
            offset > 0 && r.next == offset && r.name == name && *r.dataset == *dataset.name
        });
        let dataset_name: Arc<str> = Arc::from(dataset.name.as_str());
        let metrics = job.metrics_for(&dataset.name);
        let (sample, pinned) = read_range_now(
            &job,
            dataset,
            name.clone(),
            offset,
            length,
            resumed.map(|r| r.pin),
            &metrics,
        )
        .await;
        job.delivered(&metrics, &sample);
        let chunk = data(sample)?;
        if let Some(pin) = pinned {
            let (start, want) = clamp_range(pin.size, offset, length);
            let end = start + chunk.len() as u64;
            if end < start + want {
                // Shrunk in place since the first range was read: what is
                // left is not the rest of what that range began.
                return Err(changed(&name));
            }
            if end < pin.size {
                self.ranged = Some(RangedRead {
                    dataset: dataset_name,
                    name,
                    next: end,
                    pin,
                });
            }
        }
        // Its bytes count in the budget until written.
        let mut reservation = job.hold_read(chunk.len() as u64);
        reservation.keep_untaken(untaken);
        Ok((Response::Data(chunk), vec![reservation]))
    }
}

/// The bytes of a sample read for `READ` (always in the frame).
fn data(sample: Sample) -> Result<crate::chunk::Chunk, ProtocolError> {
    match sample.data? {
        Payload::Bytes(chunk) => Ok(chunk),
        Payload::Shared { .. } => unreachable!("only connections lend samples"),
    }
}

/// Reads a byte range of `name` now (not from a plan), off the async
/// runtime, of the version `pin` holds when given; the caller counts what
/// it delivers of it. Returns the version read with the sample.
pub(crate) async fn read_range_now(
    job: &Arc<crate::engine::Job>,
    dataset: Arc<Dataset>,
    name: String,
    offset: u64,
    length: u64,
    pin: Option<Pinned>,
    metrics: &crate::metrics::DatasetMetrics,
) -> (Sample, Option<Pinned>) {
    let task_job = Arc::clone(job);
    let task_name = name.clone();
    let task_metrics = metrics.clone();
    let read = blocking::run(move || {
        let pin = pin.as_ref();
        task_job.read_now(&dataset, &task_name, offset, length, pin, &task_metrics)
    })
    .await
    .unwrap_or_else(|e| Err(e.to_protocol(&format!("reading `{name}`"))));
    let (data, pinned) = match read {
        Ok((chunk, pinned)) => (Ok(Payload::Bytes(chunk)), Some(pinned)),
        Err(e) => (Err(e), None),
    };
    let sample = Sample {
        position: 0,
        name,
        data,
    };
    (sample, pinned)
}

/// Reads file `name` whole for `FETCH`: the plan entry it is when one of the
/// job's plans (of run `run`, when given) has it undelivered, else straight
/// from storage.
async fn read_whole_file(
    job: Arc<crate::engine::Job>,
    dataset: Arc<Dataset>,
    name: String,
    run: Option<u64>,
) -> (Sample, Option<Reservation>) {
    if let Err(e) = check_name(&name) {
        job.count_refused(&dataset.name, &e);
        let sample = Sample {
            position: 0,
            name,
            data: Err(e),
        };
        return (sample, None);
    }
    let claim = job.claim_planned(&dataset.name, &name, run);
    deliver_whole(&job, dataset, claim, name).await
}

/// File `name` whole: its planned entry `claim` when there is one, else
/// (or when its plan was abandoned meanwhile) read now.
async fn deliver_whole(
    job: &Arc<crate::engine::Job>,
    dataset: Arc<Dataset>,
    claim: Option<PlannedClaim>,
    name: String,
) -> (Sample, Option<Reservation>) {
    if let Some(claim) = claim
        && let Some((sample, reservation)) = job.deliver_claimed(claim, &name).await
    {
        return (sample, Some(reservation));
    }
    let metrics = job.metrics_for(&dataset.name);
    let (sample, reservation) = job.read_whole_now(dataset, &name, 0, &metrics).await;
    job.delivered(&metrics, &sample);
    (sample, Some(reservation))
}
