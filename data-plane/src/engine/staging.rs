//! Staging: loading a data set into the node cache before (or while) it is
//! read, when the controller asks (a `DatasetCache` policy's `preload`, or
//! `sluicectl stage`).
//!
//! A staging round is an ordinary job of the stage, `staging:<dataset>`
//! (labelled `sluice.dev/staging=<dataset>`), with one plan over the whole
//! listing in order and a consumer that drops what it is given: its reads
//! go through the same readers, limiter and cache as a trainer's, appear in
//! telemetry like any job's, and the controller allocates them from the
//! staging pool. Until the controller's settings for the job arrive its
//! rate is capped at the policy's staging rate (and never goes above it).
//! A round reads only the samples the cache lacks, in listing order, as
//! far as the data set's room in the cache goes; it ends `done` when that
//! was all of them and `full` when the cache keeps no more of the data set
//! (the rest stays on the source, which is the point of a stable subset),
//! or at the first sample read that the cache would not keep after all
//! (other jobs took the room meanwhile). A sample memory does not keep is written to the disk tier
//! before the round goes on (a trainer's reads only queue it, and the
//! queue drops what it has no room for).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use sluice_policy::{STAGING_LABEL, staging_job};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{JobHandle, PlanKey};
use crate::cache::Cache;
use crate::dataset::{Dataset, Listing};
use crate::metrics::CacheMetrics;
use crate::protocol::{Payload, Sample};
use crate::sync::lock;

/// Samples a staging round asks for at a time: its progress moves by as
/// many (a round held to a low rate, 64 samples of 100 KiB at 512 KiB/s,
/// showed no progress for 12 s at a time, and a round stopped before its
/// first batch showed none at all). The plan's readers read ahead of it
/// all the same.
const BATCH: usize = 8;

/// Where a staging round is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Running,
    /// Every sample was looked at.
    Done,
    /// The cache keeps no more of the data set.
    Full,
    Failed,
    /// Its `DatasetCache` policy went away while it ran.
    Stopped,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Done => "done",
            State::Full => "full",
            State::Failed => "failed",
            State::Stopped => "stopped",
        }
    }
}

/// How far the latest round of one data set got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    pub round: u64,
    pub state: State,
    pub samples_done: u64,
    pub samples_total: u64,
    pub source_bytes: u64,
    pub errors: u64,
    pub error: String,
}

/// A round to start: what it reads, into which cache, through which job.
pub struct Round {
    pub dataset: Arc<Dataset>,
    pub cache: Arc<Cache>,
    pub job: JobHandle,
    pub round: u64,
}

/// The stage's staging rounds, one (the latest) per data set.
#[derive(Debug, Default)]
pub struct Staging {
    progress: Arc<Mutex<HashMap<String, Progress>>>,
    /// Most bytes per second each data set's staging job may read.
    caps: Mutex<HashMap<String, u64>>,
    /// Stops the running round of each data set.
    stops: Mutex<HashMap<String, CancellationToken>>,
}

impl Staging {
    /// The latest round of `dataset`, if one ran.
    pub fn progress(&self, dataset: &str) -> Option<Progress> {
        lock(&self.progress).get(dataset).cloned()
    }

    /// The id and labels of the job that stages `dataset`.
    pub fn job(dataset: &str) -> (String, BTreeMap<String, String>) {
        let labels = BTreeMap::from([(STAGING_LABEL.to_owned(), dataset.to_owned())]);
        (staging_job(dataset), labels)
    }

    /// Whether a round `round` of `dataset` is new (none that high ran or
    /// runs); records the staging rate cap either way.
    pub fn wants(&self, dataset: &str, round: u64, cap: Option<u64>) -> bool {
        let mut caps = lock(&self.caps);
        match cap {
            Some(cap) => caps.insert(staging_job(dataset), cap),
            None => caps.remove(&staging_job(dataset)),
        };
        round > 0
            && lock(&self.progress)
                .get(dataset)
                .is_none_or(|p| p.round < round)
    }

    /// The data set no longer has a `DatasetCache`: a round that runs stops
    /// at once (reads already waiting for its rate cap finish at it; the
    /// cap goes with the next settings once no round runs).
    pub fn unwanted(&self, dataset: &str) {
        let mut all = lock(&self.progress);
        if let Some(p) = all.get_mut(dataset).filter(|p| p.state == State::Running) {
            p.state = State::Stopped;
            p.error = "its DatasetCache was deleted".to_owned();
            info!(
                dataset,
                round = p.round,
                "staging stops: its DatasetCache was deleted"
            );
            if let Some(stop) = lock(&self.stops).get(dataset) {
                stop.cancel();
            }
            return;
        }
        drop(all);
        lock(&self.caps).remove(&staging_job(dataset));
    }

    /// The rate cap of job `job`, when it is a staging job with one.
    pub fn cap(&self, job: &str) -> Option<u64> {
        lock(&self.caps).get(job).copied()
    }

    /// Starts `round` on the current Tokio runtime (a newer round of the
    /// same data set makes the older one stop at its next batch).
    pub fn start(&self, round: Round, metrics: CacheMetrics) {
        let name = round.dataset.name.clone();
        lock(&self.progress).insert(
            name.clone(),
            Progress {
                round: round.round,
                state: State::Running,
                samples_done: 0,
                samples_total: 0,
                source_bytes: 0,
                errors: 0,
                error: String::new(),
            },
        );
        let progress = Arc::clone(&self.progress);
        let stop = CancellationToken::new();
        if let Some(older) = lock(&self.stops).insert(name.clone(), stop.clone()) {
            older.cancel();
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            warn!(dataset = %name, "no runtime to stage on: the staging round is dropped");
            return;
        };
        runtime.spawn(async move {
            let number = round.round;
            info!(dataset = %name, round = number, "staging starts");
            let outcome = run(round, &progress, &metrics, &stop).await;
            let mut all = lock(&progress);
            let Some(p) = all
                .get_mut(&name)
                .filter(|p| p.round == number && p.state == State::Running)
            else {
                return;
            };
            match outcome {
                Ok(state) => p.state = state,
                Err(error) => {
                    warn!(dataset = %name, round = number, %error, "staging failed");
                    p.state = State::Failed;
                    p.error = error;
                }
            }
            info!(
                dataset = %name,
                round = number,
                state = p.state.as_str(),
                samples = p.samples_done,
                source_bytes = p.source_bytes,
                "staging ends"
            );
        });
    }
}

/// Runs one round to its end; returns how it ended, or why it failed.
async fn run(
    round: Round,
    progress: &Mutex<HashMap<String, Progress>>,
    metrics: &CacheMetrics,
    stop: &CancellationToken,
) -> Result<State, String> {
    let Round {
        dataset,
        cache,
        job: handle,
        round: number,
    } = round;
    let name = dataset.name.clone();
    let listing = {
        let dataset = Arc::clone(&dataset);
        crate::blocking::run(move || dataset.listing())
            .await
            .map_err(|e| format!("listing data set `{name}` failed: {e}"))?
            .map_err(|e| format!("cannot list data set `{name}`: {e}"))?
    };
    let total = listing.len();
    let update = |f: &mut dyn FnMut(&mut Progress)| -> bool {
        let mut all = lock(progress);
        match all
            .get_mut(&name)
            .filter(|p| p.round == number && p.state == State::Running)
        {
            Some(p) => {
                f(p);
                true
            }
            // A newer round replaced this one, or it was stopped.
            None => false,
        }
    };
    update(&mut |p| p.samples_total = u64::from(total));
    metrics
        .staging_samples
        .with_label_values(&[&name, "total"])
        .set(i64::from(total));
    let done_gauge = metrics.staging_samples.with_label_values(&[&name, "done"]);
    done_gauge.set(0);
    let bytes_counter = metrics.staging_bytes.with_label_values(&[&name]);
    let job = Arc::clone(handle.job());
    let key = PlanKey {
        rank: 0,
        epoch: number,
        run: 0,
    };
    // Only what the cache lacks and has room for is read: a data set
    // larger than its room is read as far as the room goes, not whole.
    let (files, held, short) = {
        let (cache, listing, dataset) = (
            Arc::clone(&cache),
            Arc::clone(&listing),
            Arc::clone(&dataset),
        );
        crate::blocking::run(move || {
            let keys =
                (listing.files.iter().enumerate()).map(|(i, f)| (i as u32, dataset.key_of(f)));
            cache.to_stage(&dataset.identity, &dataset.name, keys)
        })
        .await
        .map_err(|e| format!("staging data set `{name}` failed: {e}"))?
    };
    let ended = if short { State::Full } else { State::Done };
    update(&mut |p| p.samples_done = u64::from(held));
    done_gauge.set(i64::from(held));
    if files.is_empty() {
        return Ok(ended);
    }
    // Before the plan exists: its readers start at once.
    let read_before = job.snapshot().storage_read_bytes;
    let (plan, _) = job
        .attach_plan(
            key,
            listing.digest ^ number,
            Arc::clone(&dataset),
            Arc::clone(&listing),
            files,
        )
        .map_err(|e| e.message)?;
    // What the round has read of the source, counted as it goes.
    let mut counted = 0;
    let mut count_read = || {
        let read = job.snapshot().storage_read_bytes - read_before;
        bytes_counter.inc_by(read - counted);
        counted = read;
        read
    };
    loop {
        let mut batch = tokio::select! {
            batch = job.next(&plan, BATCH, None) => {
                batch.expect("a NEXT with no trainer to leave is never given up")
            }
            // Stopped, or a newer round began: its plan goes with it, and
            // what it read of the source is counted.
            () = stop.cancelled() => {
                let read = count_read();
                // Stopped from outside: the round is no longer running.
                if let Some(p) = lock(progress).get_mut(&name).filter(|p| p.round == number) {
                    p.source_bytes = read;
                }
                return Ok(State::Stopped);
            }
        };
        let errors = batch.samples.iter().filter(|s| s.data.is_err()).count() as u64;
        let looked = batch.samples.len() as u64;
        let samples = std::mem::take(&mut batch.samples);
        let kept = {
            let (cache, listing, dataset) = (
                Arc::clone(&cache),
                Arc::clone(&listing),
                Arc::clone(&dataset),
            );
            crate::blocking::run(move || keep_all(&cache, &dataset, &listing, samples))
                .await
                .map_err(|e| format!("staging data set `{name}` failed: {e}"))?
                .map_err(|e| format!("the disk cache cannot write: {e}"))?
        };
        let end = batch.end;
        drop(batch);
        let read = count_read();
        done_gauge.add(looked as i64);
        let current = update(&mut |p| {
            p.samples_done += looked;
            p.errors += errors;
            p.source_bytes = read;
        });
        if !current {
            return Ok(State::Running);
        }
        if !kept {
            return Ok(State::Full);
        }
        if end {
            return Ok(ended);
        }
    }
}

/// Makes sure the cache keeps each sample read (see [`Cache::keep`]);
/// returns false at the first it would not keep, and the error of a disk
/// tier that cannot write (a full or failing file system is no "full"
/// share). Blocking.
fn keep_all(
    cache: &Cache,
    dataset: &Dataset,
    listing: &Listing,
    samples: Vec<Sample>,
) -> std::io::Result<bool> {
    for sample in samples {
        let Ok(Payload::Bytes(bytes)) = &sample.data else {
            // A failed read is counted as an error, not as room.
            continue;
        };
        let Some(entry) = listing
            .position(&sample.name)
            .map(|i| &listing.files[i as usize])
        else {
            continue;
        };
        if !cache.keep(&dataset.key_of(entry), bytes)? {
            return Ok(false);
        }
    }
    Ok(true)
}
