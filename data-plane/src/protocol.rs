//! The trainer protocol: length-prefixed binary frames, as specified in
//! `docs/protocol.md`. This module only parses and encodes; it does no I/O
//! beyond reading one frame from an async reader.

mod wire;

use std::collections::BTreeMap;

use tokio::io::{AsyncRead, AsyncReadExt};

pub use wire::{Decoder, Encoder};

use crate::chunk::Chunk;

/// The newest protocol version this stage speaks; it also speaks every
/// older one down to [`MIN_VERSION`].
pub const VERSION: u16 = 2;
/// The oldest protocol version this stage speaks.
pub const MIN_VERSION: u16 = 1;
/// `HELLO` feature bit (version 2): deliver samples in shared memory.
pub const FEATURE_SHARED_MEMORY: u32 = 1;
/// `HELLO` feature bit (version 2): `PLAN` may name the trainer's run,
/// which is part of the plan's identity.
pub const FEATURE_RUNS: u32 = 2;
/// `HELLO` feature bit (version 2): the connection may name its run with
/// `RUN`, and its reads by name then deliver only that run's plan entries.
pub const FEATURE_RUN_READS: u32 = 4;
/// `HELLO` feature bit (version 2, with shared memory): the process slots
/// are handed off to says it received them (`TAKE`); until then they are
/// in transit, and come back when never received.
pub const FEATURE_TAKES: u32 = 8;
/// Bit of `PLAN`'s kind byte: the plan is followed by the `u64` run it
/// belongs to.
pub const PLAN_WITH_RUN: u8 = 0x80;
/// The largest frame a trainer may send (type byte plus payload).
pub const MAX_REQUEST_FRAME: u32 = 16 << 20;
/// The largest frame the stage sends.
pub const MAX_RESPONSE_FRAME: u32 = 256 << 20;
/// Sample bytes packed into one `SAMPLES` frame before the stage stops adding.
pub const SAMPLES_FRAME_BUDGET: u64 = 32 << 20;
/// The most samples one `NEXT` may ask for.
pub const MAX_NEXT: u32 = 4096;
/// The most entries one `LIST` may ask for.
pub const MAX_LIST: u32 = 65536;
/// `READ` length meaning "to the end of the file".
pub const TO_END: u64 = u64::MAX;

/// Error codes carried by `ERROR` frames and failed samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    BadFrame = 1,
    FrameTooLarge = 2,
    UnsupportedVersion = 3,
    OutOfOrder = 4,
    InvalidArgument = 5,
    NoSuchDataset = 10,
    NoDataset = 11,
    NotFound = 12,
    ForbiddenPath = 13,
    IoError = 14,
    BadPlan = 15,
    PlanConflict = 16,
    NoPlan = 17,
    TooLarge = 18,
    Unavailable = 19,
    BadRelease = 20,
    ClaimRefused = 21,
}

impl ErrorCode {
    /// Every code, for exhaustive metric cleanup.
    pub const ALL: [Self; 17] = [
        Self::BadFrame,
        Self::FrameTooLarge,
        Self::UnsupportedVersion,
        Self::OutOfOrder,
        Self::InvalidArgument,
        Self::NoSuchDataset,
        Self::NoDataset,
        Self::NotFound,
        Self::ForbiddenPath,
        Self::IoError,
        Self::BadPlan,
        Self::PlanConflict,
        Self::NoPlan,
        Self::TooLarge,
        Self::Unavailable,
        Self::BadRelease,
        Self::ClaimRefused,
    ];

    /// Returns whether the stage closes the connection after this error.
    pub fn is_fatal(self) -> bool {
        matches!(
            self,
            Self::BadFrame
                | Self::FrameTooLarge
                | Self::UnsupportedVersion
                | Self::OutOfOrder
                | Self::BadRelease
                | Self::ClaimRefused
        )
    }

    /// Returns the name used in docs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Self::BadFrame => "bad_frame",
            Self::FrameTooLarge => "frame_too_large",
            Self::UnsupportedVersion => "unsupported_version",
            Self::OutOfOrder => "out_of_order",
            Self::InvalidArgument => "invalid_argument",
            Self::NoSuchDataset => "no_such_dataset",
            Self::NoDataset => "no_dataset",
            Self::NotFound => "not_found",
            Self::ForbiddenPath => "forbidden_path",
            Self::IoError => "io_error",
            Self::BadPlan => "bad_plan",
            Self::PlanConflict => "plan_conflict",
            Self::NoPlan => "no_plan",
            Self::TooLarge => "too_large",
            Self::Unavailable => "unavailable",
            Self::BadRelease => "bad_release",
            Self::ClaimRefused => "claim_refused",
        }
    }
}

/// An error answer: a code and a sentence for the trainer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ProtocolError {
    pub code: ErrorCode,
    pub message: String,
    /// Sent as fatal whatever its code: the stage closes the connection
    /// after it (a refused connection, a stage shutting down).
    pub closing: bool,
}

impl ProtocolError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            closing: false,
        }
    }

    /// An error after which the stage closes the connection, whatever its
    /// code says of others.
    pub fn closing(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            closing: true,
            ..Self::new(code, message)
        }
    }

    /// Whether the stage closes the connection after this error.
    pub fn is_fatal(&self) -> bool {
        self.closing || self.code.is_fatal()
    }

    fn bad_frame(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadFrame, message)
    }
}

/// How a trainer describes an epoch's read order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanSpec {
    Indices(Vec<u32>),
    Names(Vec<String>),
    Shuffle {
        seed: u64,
        shuffle: bool,
        file_count: u32,
        digest: u64,
    },
}

/// A frame sent by a trainer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Hello {
        version: u16,
        job: String,
        labels: BTreeMap<String, String>,
        rank: u32,
        world_size: u32,
        /// Feature bits asked for (version 2; 0 in version 1).
        features: u32,
    },
    Open {
        dataset: String,
    },
    List {
        offset: u32,
        limit: u32,
    },
    Plan {
        epoch: u64,
        spec: PlanSpec,
        /// The trainer run the plan names (kind bit [`PLAN_WITH_RUN`],
        /// feature `RUNS`); `None` when it names none.
        run: Option<u64>,
    },
    Next {
        max_samples: u32,
    },
    Read {
        name: String,
        offset: u64,
        length: u64,
    },
    Bye,
    /// Version 2, shared memory: slots (by offset) the trainer is done
    /// with. A notification: it has no answer.
    Release {
        offsets: Vec<u64>,
    },
    /// Version 2: whole files by name, answered with one `SAMPLES`.
    Fetch {
        names: Vec<String>,
    },
    /// Version 2, shared memory: slots this connection holds that it gives
    /// to its job (another process of the job returns them). A
    /// notification: it has no answer.
    HandOff {
        offsets: Vec<u64>,
    },
    /// Version 2, feature `RUN_READS`: the trainer run this connection
    /// reads for (0: none). A notification: it has no answer.
    Run {
        run: u64,
    },
    /// Version 2, feature `TAKES`: slots another process of the job handed
    /// off that this connection's process received. A notification.
    Take {
        offsets: Vec<u64>,
    },
}

mod kind {
    pub const HELLO: u8 = 0x01;
    pub const OPEN: u8 = 0x02;
    pub const LIST: u8 = 0x03;
    pub const PLAN: u8 = 0x04;
    pub const NEXT: u8 = 0x05;
    pub const READ: u8 = 0x06;
    pub const BYE: u8 = 0x07;
    pub const RELEASE: u8 = 0x08;
    pub const FETCH: u8 = 0x09;
    pub const HAND_OFF: u8 = 0x0A;
    pub const RUN: u8 = 0x0B;
    pub const TAKE: u8 = 0x0C;
    pub const WELCOME: u8 = 0x81;
    pub const OPENED: u8 = 0x82;
    pub const FILES: u8 = 0x83;
    pub const PLANNED: u8 = 0x84;
    pub const SAMPLES: u8 = 0x85;
    pub const DATA: u8 = 0x86;
    pub const GOODBYE: u8 = 0x87;
    pub const ERROR: u8 = 0xEE;
}

impl Request {
    /// Parses one frame body (type byte and payload).
    pub fn decode(body: &[u8]) -> Result<Self, ProtocolError> {
        let (&kind, payload) = body.split_first().ok_or_else(|| {
            ProtocolError::bad_frame("empty frame: a frame holds at least its type byte")
        })?;
        let mut d = Decoder::new(payload);
        let request = match kind {
            kind::HELLO => {
                let version = d.u16()?;
                // Before the rest, whose layout depends on the version: a
                // client of a newer version learns to step down.
                if !(MIN_VERSION..=VERSION).contains(&version) {
                    return Err(ProtocolError::new(
                        ErrorCode::UnsupportedVersion,
                        format!(
                            "protocol version {version} is not supported: this stage speaks versions {MIN_VERSION} to {VERSION}"
                        ),
                    ));
                }
                Self::Hello {
                    version,
                    job: d.str()?,
                    labels: d.map()?,
                    rank: d.u32()?,
                    world_size: d.u32()?,
                    features: if version >= 2 { d.u32()? } else { 0 },
                }
            }
            kind::OPEN => Self::Open { dataset: d.str()? },
            kind::LIST => Self::List {
                offset: d.u32()?,
                limit: d.u32()?,
            },
            kind::PLAN => {
                let epoch = d.u64()?;
                let kind = d.u8()?;
                let spec = PlanSpec::decode(kind & !PLAN_WITH_RUN, &mut d)?;
                let run = if kind & PLAN_WITH_RUN != 0 {
                    Some(d.u64()?)
                } else {
                    None
                };
                Self::Plan { epoch, spec, run }
            }
            kind::NEXT => Self::Next {
                max_samples: d.u32()?,
            },
            kind::READ => Self::Read {
                name: d.str()?,
                offset: d.u64()?,
                length: d.u64()?,
            },
            kind::BYE => Self::Bye,
            kind::RELEASE => Self::Release {
                offsets: offsets(&mut d)?,
            },
            kind::HAND_OFF => Self::HandOff {
                offsets: offsets(&mut d)?,
            },
            kind::RUN => Self::Run { run: d.u64()? },
            kind::TAKE => Self::Take {
                offsets: offsets(&mut d)?,
            },
            kind::FETCH => {
                let count = d.count(2)?;
                Self::Fetch {
                    names: (0..count).map(|_| d.str()).collect::<Result<_, _>>()?,
                }
            }
            other => {
                return Err(ProtocolError::bad_frame(format!(
                    "unknown request type 0x{other:02x}"
                )));
            }
        };
        d.finish()?;
        Ok(request)
    }

    /// Encodes this request as a whole frame (length prefix included).
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::frame();
        match self {
            Self::Hello {
                version,
                job,
                labels,
                rank,
                world_size,
                features,
            } => {
                e.u8(kind::HELLO)
                    .u16(*version)
                    .str(job)
                    .map(labels)
                    .u32(*rank)
                    .u32(*world_size);
                if *version >= 2 {
                    e.u32(*features);
                }
            }
            Self::Open { dataset } => {
                e.u8(kind::OPEN).str(dataset);
            }
            Self::List { offset, limit } => {
                e.u8(kind::LIST).u32(*offset).u32(*limit);
            }
            Self::Plan { epoch, spec, run } => {
                e.u8(kind::PLAN).u64(*epoch);
                spec.encode(&mut e, run.is_some());
                if let Some(run) = run {
                    e.u64(*run);
                }
            }
            Self::Next { max_samples } => {
                e.u8(kind::NEXT).u32(*max_samples);
            }
            Self::Read {
                name,
                offset,
                length,
            } => {
                e.u8(kind::READ).str(name).u64(*offset).u64(*length);
            }
            Self::Bye => {
                e.u8(kind::BYE);
            }
            Self::Release { offsets } => {
                e.u8(kind::RELEASE);
                encode_offsets(&mut e, offsets);
            }
            Self::HandOff { offsets } => {
                e.u8(kind::HAND_OFF);
                encode_offsets(&mut e, offsets);
            }
            Self::Run { run } => {
                e.u8(kind::RUN).u64(*run);
            }
            Self::Take { offsets } => {
                e.u8(kind::TAKE);
                encode_offsets(&mut e, offsets);
            }
            Self::Fetch { names } => {
                e.u8(kind::FETCH).u32(len32(names.len()));
                names.iter().for_each(|n| {
                    e.str(n);
                });
            }
        }
        e.finish_frame()
    }
}

impl PlanSpec {
    /// Parses the plan of `kind` (the kind byte without its
    /// [`PLAN_WITH_RUN`] bit) that follows the kind byte.
    fn decode(kind: u8, d: &mut Decoder<'_>) -> Result<Self, ProtocolError> {
        Ok(match kind {
            0 => {
                let count = d.count(4)?;
                Self::Indices((0..count).map(|_| d.u32()).collect::<Result<_, _>>()?)
            }
            1 => {
                let count = d.count(2)?;
                Self::Names((0..count).map(|_| d.str()).collect::<Result<_, _>>()?)
            }
            2 => Self::Shuffle {
                seed: d.u64()?,
                shuffle: match d.u8()? {
                    0 => false,
                    1 => true,
                    other => {
                        return Err(ProtocolError::new(
                            ErrorCode::InvalidArgument,
                            format!("PLAN shuffle flag is {other}: write 0 or 1"),
                        ));
                    }
                },
                file_count: d.u32()?,
                digest: d.u64()?,
            },
            other => {
                return Err(ProtocolError::new(
                    ErrorCode::BadPlan,
                    format!("unknown plan kind {other}: use 0 (indices), 1 (names) or 2 (shuffle)"),
                ));
            }
        })
    }

    /// Writes the plan kind byte and the plan.
    /// Encodes the kind byte (with [`PLAN_WITH_RUN`] when `with_run`) and
    /// the plan.
    fn encode(&self, e: &mut Encoder, with_run: bool) {
        let flag = if with_run { PLAN_WITH_RUN } else { 0 };
        match self {
            Self::Indices(indices) => {
                e.u8(flag).u32(len32(indices.len()));
                indices.iter().for_each(|i| {
                    e.u32(*i);
                });
            }
            Self::Names(names) => {
                e.u8(1 | flag).u32(len32(names.len()));
                names.iter().for_each(|n| {
                    e.str(n);
                });
            }
            Self::Shuffle {
                seed,
                shuffle,
                file_count,
                digest,
            } => {
                e.u8(2 | flag)
                    .u64(*seed)
                    .u8(u8::from(*shuffle))
                    .u32(*file_count)
                    .u64(*digest);
            }
        }
    }
}

/// Reads a `u32` count and that many `u64` slot offsets.
fn offsets(d: &mut Decoder<'_>) -> Result<Vec<u64>, ProtocolError> {
    let count = d.count(8)?;
    (0..count).map(|_| d.u64()).collect()
}

fn encode_offsets(e: &mut Encoder, offsets: &[u64]) {
    e.u32(len32(offsets.len()));
    for o in offsets {
        e.u64(*o);
    }
}

fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// One delivered plan entry: its bytes or why it could not be read.
#[derive(Debug)]
pub struct Sample {
    pub position: u32,
    pub name: String,
    pub data: Result<Payload, ProtocolError>,
}

/// Where a delivered sample's bytes are.
#[derive(Debug)]
pub enum Payload {
    /// In the frame.
    Bytes(Chunk),
    /// In the connection's shared-memory region (version 2), lent to the
    /// trainer until it releases the slot at `offset`.
    Shared { offset: u64, len: u64 },
}

impl Payload {
    /// The sample's length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            Self::Bytes(chunk) => chunk.len() as u64,
            Self::Shared { len, .. } => *len,
        }
    }
}

/// Frames the stage sends. `Samples` and `Data` are written by
/// [`Response::encode_parts`] so sample bytes are never copied into a frame.
#[derive(Debug)]
pub enum Response {
    Welcome {
        version: u16,
        stage_id: String,
        /// Feature bits granted (version 2).
        features: u32,
        /// The shared-memory region's size, when granted (version 2).
        region_bytes: u64,
    },
    Opened {
        file_count: u32,
        total_bytes: u64,
        digest: u64,
    },
    Files {
        total: u32,
        entries: Vec<(String, u64)>,
    },
    Planned {
        length: u32,
        state: u8,
    },
    Samples {
        end: bool,
        samples: Vec<Sample>,
    },
    Data(Chunk),
    Goodbye,
    Error(ProtocolError),
}

impl Response {
    /// Encodes the frame as a list of buffers to write in order: small headers
    /// built here, and the sample data buffers as they are.
    pub fn encode_parts(&self) -> Vec<Part<'_>> {
        let mut parts = Vec::new();
        let mut e = Encoder::frame();
        match self {
            Self::Welcome {
                version,
                stage_id,
                features,
                region_bytes,
            } => {
                e.u8(kind::WELCOME)
                    .u16(*version)
                    .str(stage_id)
                    .u32(MAX_REQUEST_FRAME)
                    .u32(MAX_RESPONSE_FRAME);
                if *version >= 2 {
                    e.u32(*features).u64(*region_bytes);
                }
            }
            Self::Opened {
                file_count,
                total_bytes,
                digest,
            } => {
                e.u8(kind::OPENED)
                    .u32(*file_count)
                    .u64(*total_bytes)
                    .u64(*digest);
            }
            Self::Files { total, entries } => {
                e.u8(kind::FILES).u32(*total).u32(len32(entries.len()));
                for (name, size) in entries {
                    e.str(name).u64(*size);
                }
            }
            Self::Planned { length, state } => {
                e.u8(kind::PLANNED).u32(*length).u8(*state);
            }
            Self::Samples { end, samples } => {
                e.u8(kind::SAMPLES)
                    .u8(u8::from(*end))
                    .u32(len32(samples.len()));
                for sample in samples {
                    e.u32(sample.position).str(&sample.name);
                    match &sample.data {
                        Ok(Payload::Bytes(data)) => {
                            e.u8(0).u32(len32(data.len()));
                            parts.push(Part::Owned(e.take()));
                            parts.push(Part::Borrowed(data));
                        }
                        Ok(Payload::Shared { offset, len }) => {
                            e.u8(2).u64(*offset).u64(*len);
                        }
                        Err(err) => {
                            e.u8(1).u16(err.code as u16).str(&err.message);
                        }
                    }
                }
            }
            Self::Data(data) => {
                e.u8(kind::DATA).u32(len32(data.len()));
                parts.push(Part::Owned(e.take()));
                parts.push(Part::Borrowed(data));
            }
            Self::Goodbye => {
                e.u8(kind::GOODBYE);
            }
            Self::Error(err) => {
                e.u8(kind::ERROR)
                    .u16(err.code as u16)
                    .u8(u8::from(err.is_fatal()))
                    .str(&err.message);
            }
        }
        parts.push(Part::Owned(e.take()));
        let total: usize = parts.iter().map(|p| p.as_slice().len()).sum::<usize>() - 4;
        if let Some(Part::Owned(first)) = parts.first_mut() {
            first[..4].copy_from_slice(&len32(total).to_be_bytes());
        }
        parts.retain(|p| !p.as_slice().is_empty());
        parts
    }

    /// Encodes the frame into one buffer.
    pub fn encode(&self) -> Vec<u8> {
        self.encode_parts()
            .iter()
            .flat_map(|p| p.as_slice().iter().copied())
            .collect()
    }
}

/// A piece of an encoded response frame.
#[derive(Debug)]
pub enum Part<'a> {
    Owned(Vec<u8>),
    Borrowed(&'a [u8]),
}

impl Part<'_> {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Self::Owned(v) => v,
            Self::Borrowed(s) => s,
        }
    }
}

/// Reads one frame body from `reader`. Returns `Ok(None)` on a clean end of
/// stream before a frame starts. A length over `max` is refused before any of
/// the body is read, and a body that does not come within
/// [`FRAME_BODY_TIMEOUT`] is an error.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    max: u32,
) -> Result<Option<Vec<u8>>, FrameReadError> {
    read_frame_within(reader, max, FRAME_BODY_TIMEOUT).await
}

/// [`read_frame`], with the body given `body_timeout`.
async fn read_frame_within<R: AsyncRead + Unpin>(
    reader: &mut R,
    max: u32,
    body_timeout: std::time::Duration,
) -> Result<Option<Vec<u8>>, FrameReadError> {
    let mut prefix = [0u8; 4];
    let mut filled = 0;
    while filled < 4 {
        match reader.read(&mut prefix[filled..]).await? {
            0 if filled == 0 => return Ok(None),
            0 => return Err(FrameReadError::Truncated),
            n => filled += n,
        }
    }
    let length = u32::from_be_bytes(prefix);
    if length == 0 {
        return Err(FrameReadError::Malformed(ProtocolError::bad_frame(
            "frame length is 0: a frame holds at least its type byte",
        )));
    }
    if length > max {
        return Err(FrameReadError::Malformed(ProtocolError::new(
            ErrorCode::FrameTooLarge,
            format!("frame of {length} bytes is over the limit of {max} bytes"),
        )));
    }
    // Grown as the bytes come (a peer that announces 16 MiB and sends one
    // byte holds 64 KiB, not 16 MiB), and within a time limit once the
    // frame has begun (idle between frames is fine; stalled inside one
    // is not).
    let mut body = Vec::with_capacity((length as usize).min(FRAME_FIRST_ALLOC));
    let mut rest = reader.take(u64::from(length));
    let read = rest.read_to_end(&mut body);
    match tokio::time::timeout(body_timeout, read).await {
        Ok(Ok(n)) if n == length as usize => Ok(Some(body)),
        Ok(Ok(_)) => Err(FrameReadError::Truncated),
        Ok(Err(e)) => Err(FrameReadError::Io(e)),
        Err(_) => Err(FrameReadError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the rest of a {length}-byte frame did not come within {body_timeout:?}"),
        ))),
    }
}

/// What a frame's body is given before its bytes come.
const FRAME_FIRST_ALLOC: usize = 64 << 10;

/// How long the rest of a frame may take once its length has come.
pub const FRAME_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameReadError {
    #[error("connection closed in the middle of a frame")]
    Truncated,
    #[error("{0}")]
    Malformed(ProtocolError),
    #[error("reading from the connection: {0}")]
    Io(#[from] std::io::Error),
}

pub use sluice_policy::{MAX_JOB_ID_BYTES as MAX_JOB_BYTES, valid_job_id};

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn body(frame: &[u8]) -> &[u8] {
        let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - 4, "length prefix counts the body");
        &frame[4..]
    }

    fn requests() -> Vec<Request> {
        vec![
            Request::Hello {
                version: 1,
                job: "resnet-a".into(),
                labels: [("team".to_string(), "vision".to_string())].into(),
                rank: 1,
                world_size: 4,
                features: 0,
            },
            Request::Hello {
                version: 2,
                job: "resnet-a".into(),
                labels: BTreeMap::new(),
                rank: 0,
                world_size: 1,
                features: FEATURE_SHARED_MEMORY,
            },
            Request::Open {
                dataset: "imagenet".into(),
            },
            Request::List {
                offset: 10,
                limit: 100,
            },
            Request::Plan {
                epoch: 3,
                spec: PlanSpec::Indices(vec![3, 1, 2]),
                run: None,
            },
            Request::Plan {
                epoch: 3,
                spec: PlanSpec::Indices(vec![3, 1, 2]),
                run: Some(0x5eed_0000_0000_0001),
            },
            Request::Plan {
                epoch: 3,
                spec: PlanSpec::Names(vec!["a/b".into(), "c".into()]),
                run: Some(0),
            },
            Request::Plan {
                epoch: 0,
                spec: PlanSpec::Shuffle {
                    seed: 42,
                    shuffle: true,
                    file_count: 10,
                    digest: 7,
                },
                run: Some(u64::MAX),
            },
            Request::Next { max_samples: 32 },
            Request::Read {
                name: "x/y.bin".into(),
                offset: 5,
                length: TO_END,
            },
            Request::Bye,
            Request::Release {
                offsets: vec![0, 4096, 1 << 40],
            },
            Request::HandOff {
                offsets: vec![8192],
            },
            Request::Run { run: u64::MAX },
            Request::Take {
                offsets: vec![0, 1 << 40],
            },
            Request::Fetch {
                names: vec!["a/b.jpg".into(), "c".into()],
            },
        ]
    }

    #[test]
    fn requests_round_trip() {
        for request in requests() {
            let frame = request.encode();
            assert_eq!(Request::decode(body(&frame)).unwrap(), request);
        }
    }

    #[test]
    fn every_truncation_is_refused() {
        for request in requests() {
            let frame = request.encode();
            let full = body(&frame);
            for cut in 0..full.len() {
                if full[..cut].is_empty() {
                    continue;
                }
                let err = Request::decode(&full[..cut]);
                assert!(err.is_err(), "{request:?} cut at {cut} parsed");
            }
        }
    }

    #[test]
    fn leftover_bytes_and_unknown_types_are_refused() {
        let mut frame = Request::Next { max_samples: 1 }.encode();
        frame.push(0);
        let err = Request::decode(&frame[4..]).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadFrame);
        assert!(err.message.contains("left over"), "{}", err.message);
        let err = Request::decode(&[0x42]).unwrap_err();
        assert!(err.message.contains("0x42"));
        assert!(Request::decode(&[]).is_err());
    }

    #[test]
    fn invalid_utf8_is_refused() {
        let err = Request::decode(&[kind::OPEN, 0, 2, 0xff, 0xfe]).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadFrame);
        assert!(err.message.contains("UTF-8"));
    }

    #[test]
    fn counts_larger_than_the_frame_are_refused_without_allocating() {
        // An INDICES plan claiming 4 billion entries in a 14-byte payload.
        let mut payload = vec![kind::PLAN];
        payload.extend(0u64.to_be_bytes());
        payload.push(0);
        payload.extend(u32::MAX.to_be_bytes());
        let err = Request::decode(&payload).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadFrame);
    }

    #[tokio::test]
    async fn oversized_and_truncated_frames() {
        let mut huge: &[u8] = &[0xff, 0xff, 0xff, 0xff, 1];
        let err = read_frame(&mut huge, MAX_REQUEST_FRAME).await.unwrap_err();
        assert!(matches!(
            err,
            FrameReadError::Malformed(ProtocolError {
                code: ErrorCode::FrameTooLarge,
                ..
            })
        ));
        let mut cut: &[u8] = &[0, 0, 0, 10, 1, 2];
        assert!(matches!(
            read_frame(&mut cut, MAX_REQUEST_FRAME).await,
            Err(FrameReadError::Truncated)
        ));
        let mut half_prefix: &[u8] = &[0, 0];
        assert!(matches!(
            read_frame(&mut half_prefix, MAX_REQUEST_FRAME).await,
            Err(FrameReadError::Truncated)
        ));
        let mut empty: &[u8] = &[];
        assert!(
            read_frame(&mut empty, MAX_REQUEST_FRAME)
                .await
                .unwrap()
                .is_none()
        );
        let mut zero: &[u8] = &[0, 0, 0, 0];
        assert!(read_frame(&mut zero, MAX_REQUEST_FRAME).await.is_err());
    }

    #[tokio::test]
    async fn a_frame_whose_body_stops_coming_is_given_up() {
        use tokio::io::AsyncWriteExt;
        let (mut peer, mut stage) = tokio::io::duplex(1 << 20);
        // 16 MiB announced, one byte sent, the connection kept open.
        peer.write_all(&(16u32 << 20).to_be_bytes()).await.unwrap();
        peer.write_all(&[1]).await.unwrap();
        let limit = std::time::Duration::from_millis(100);
        let read = read_frame_within(&mut stage, MAX_REQUEST_FRAME, limit).await;
        let Err(FrameReadError::Io(e)) = read else {
            panic!("{read:?}");
        };
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        drop(peer);
        // One that comes whole in time is read.
        let (mut peer, mut stage) = tokio::io::duplex(64);
        let writer = tokio::spawn(async move {
            peer.write_all(&[0, 0, 0, 3, 7, 8, 9]).await.unwrap();
            peer
        });
        let body = read_frame_within(&mut stage, MAX_REQUEST_FRAME, limit).await;
        assert_eq!(body.unwrap(), Some(vec![7, 8, 9]));
        drop(writer.await);
    }

    #[test]
    fn samples_frame_layout() {
        let response = Response::Samples {
            end: true,
            samples: vec![
                Sample {
                    position: 0,
                    name: "a".into(),
                    data: Ok(Payload::Bytes(Chunk::from_vec(vec![1, 2, 3]))),
                },
                Sample {
                    position: 1,
                    name: "b".into(),
                    data: Err(ProtocolError::new(ErrorCode::NotFound, "gone")),
                },
                Sample {
                    position: 2,
                    name: "c".into(),
                    data: Ok(Payload::Shared {
                        offset: 8192,
                        len: 5,
                    }),
                },
            ],
        };
        let frame = response.encode();
        let mut d = Decoder::new(body(&frame));
        assert_eq!(d.u8().unwrap(), kind::SAMPLES);
        assert_eq!(d.u8().unwrap(), 1);
        assert_eq!(d.u32().unwrap(), 3);
        assert_eq!(
            (d.u32().unwrap(), d.str().unwrap(), d.u8().unwrap()),
            (0, "a".into(), 0)
        );
        assert_eq!(d.bytes().unwrap(), &[1, 2, 3]);
        assert_eq!(
            (d.u32().unwrap(), d.str().unwrap(), d.u8().unwrap()),
            (1, "b".into(), 1)
        );
        assert_eq!(
            (d.u16().unwrap(), d.str().unwrap()),
            (ErrorCode::NotFound as u16, "gone".into())
        );
        assert_eq!(
            (d.u32().unwrap(), d.str().unwrap(), d.u8().unwrap()),
            (2, "c".into(), 2)
        );
        assert_eq!((d.u64().unwrap(), d.u64().unwrap()), (8192, 5));
        d.finish().unwrap();
    }

    proptest! {
        #[test]
        fn arbitrary_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Request::decode(&body);
        }

        #[test]
        fn arbitrary_payloads_after_a_valid_type_never_panic(
            kind in 1u8..11,
            payload in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut body = vec![kind];
            body.extend(payload);
            let _ = Request::decode(&body);
        }
    }
}
