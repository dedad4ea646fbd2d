//! Data sets as operators see them (each stage's cache of one, and its
//! staging progress) and the staging command: a new staging round, which
//! the control loop puts in the settings of every stage serving the data
//! set (see `sluice_policy::coordination::cache_assignment`).

use std::collections::BTreeSet;
use std::time::Duration;

use serde::Serialize;
use sluice_proto::v1;

use crate::error::ApiError;
use crate::state::{Shared, lock, now_ms};

/// One data set.
#[derive(Debug, Clone, Serialize)]
pub struct DatasetView {
    pub name: String,
    /// The DatasetCache policy naming it; empty = none.
    pub policy: String,
    /// The staging round last asked for; 0 = none.
    pub staging_round: u64,
    /// Per stage serving it, by stage id.
    pub stages: Vec<DatasetOnStageView>,
}

/// A data set on one stage, from the stage's last report.
#[derive(Debug, Clone, Serialize)]
pub struct DatasetOnStageView {
    pub stage: String,
    /// `connected` or `lost`.
    pub state: &'static str,
    pub memory_capacity_bytes: u64,
    pub disk_capacity_bytes: u64,
    /// `None` when the stage has no cache (or has not reported yet).
    pub cache: Option<CacheUseView>,
}

/// What a stage's cache holds and did for one data set.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CacheUseView {
    pub memory_bytes: u64,
    pub disk_bytes: u64,
    pub entries: u64,
    pub share_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub hit_bytes: u64,
    pub evictions: u64,
    pub staging: Option<StagingView>,
}

/// The latest staging round on a stage.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StagingView {
    pub round: u64,
    pub state: String,
    pub samples_done: u64,
    pub samples_total: u64,
    pub source_bytes: u64,
    pub errors: u64,
    pub error: String,
}

/// Returns data set `name`: its policy and every stage's cache of it.
pub fn dataset(shared: &Shared, name: &str) -> Result<DatasetView, ApiError> {
    let policy = shared
        .read_policies()
        .cache_for_dataset(name)
        .map(|c| c.name().to_owned())
        .unwrap_or_default();
    let live = lock(&shared.live);
    let stages: Vec<DatasetOnStageView> = live
        .iter()
        .filter(|(_, l)| !l.stopped())
        .filter(|(_, l)| l.hello.datasets.iter().any(|d| d == name))
        .map(|(id, l)| {
            let cache = l.latest().and_then(|t| t.cache.as_ref());
            DatasetOnStageView {
                stage: id.clone(),
                state: if l.lost { "lost" } else { "connected" },
                memory_capacity_bytes: cache.map_or(0, |c| c.memory_capacity_bytes),
                disk_capacity_bytes: cache.map_or(0, |c| c.disk_capacity_bytes),
                cache: cache
                    .and_then(|c| c.datasets.iter().find(|d| d.dataset == name))
                    .map(use_view),
            }
        })
        .collect();
    if stages.is_empty() && policy.is_empty() {
        return Err(ApiError::NotFound(format!(
            "no stage serves data set `{name}` and no DatasetCache policy names it"
        )));
    }
    Ok(DatasetView {
        name: name.to_owned(),
        policy,
        staging_round: lock(&shared.staging_rounds).get(name).copied().unwrap_or(0),
        stages,
    })
}

/// Returns every data set a stage serves (or served, while it is kept
/// as lost) or a DatasetCache policy names, by name.
pub fn datasets(shared: &Shared) -> Vec<DatasetView> {
    let mut names: BTreeSet<String> = shared
        .read_policies()
        .cached_datasets()
        .map(str::to_owned)
        .collect();
    let served: Vec<String> = lock(&shared.live)
        .values()
        .filter(|l| !l.stopped())
        .flat_map(|l| l.hello.datasets.iter().cloned())
        .collect();
    names.extend(served);
    // A name that is neither since it was listed (its stage forgotten,
    // its policy deleted) is left out.
    names
        .iter()
        .filter_map(|name| dataset(shared, name).ok())
        .collect()
}

/// Returns the connected stages serving `name` whose last report shows a
/// node cache, or why there is none; `None` while none has one but some
/// have not reported yet.
fn stages_with_cache(shared: &Shared, name: &str) -> Result<Option<Vec<String>>, ApiError> {
    let live = lock(&shared.live);
    let serving: Vec<_> = live
        .iter()
        .filter(|(_, l)| !l.lost && l.session.is_some())
        .filter(|(_, l)| l.hello.datasets.iter().any(|d| d == name))
        .collect();
    if serving.is_empty() {
        return Err(ApiError::Conflict(format!(
            "no connected stage serves data set `{name}`: start one with `--dataset {name}=...`"
        )));
    }
    let cached: Vec<String> = serving
        .iter()
        .filter(|(_, l)| l.latest().is_some_and(|t| t.cache.is_some()))
        .map(|(id, _)| (*id).clone())
        .collect();
    if !cached.is_empty() {
        return Ok(Some(cached));
    }
    if serving.iter().any(|(_, l)| l.latest().is_none()) {
        return Ok(None);
    }
    Err(ApiError::Conflict(format!(
        "no stage serving `{name}` has a node cache (start it with --cache-memory or --cache-dir)"
    )))
}

fn use_view(d: &v1::DatasetCacheTelemetry) -> CacheUseView {
    CacheUseView {
        memory_bytes: d.memory_bytes,
        disk_bytes: d.disk_bytes,
        entries: d.entries,
        share_bytes: d.share_bytes,
        hits: d.hits,
        misses: d.misses,
        hit_bytes: d.hit_bytes,
        evictions: d.evictions,
        staging: d.staging.as_ref().map(|s| StagingView {
            round: s.round,
            state: s.state.clone(),
            samples_done: s.samples_done,
            samples_total: s.samples_total,
            source_bytes: s.source_bytes,
            errors: s.errors,
            error: s.error.clone(),
        }),
    }
}

/// How long staging waits for a serving stage's first report.
const FIRST_REPORT: Duration = Duration::from_secs(5);

/// Starts a staging round of `name` on every connected stage serving it
/// with a node cache; returns the round and those stages. Refused when no
/// DatasetCache with `spec.staging` names the data set (nothing would say
/// which pool pays), no connected stage serves it, or none of those has a
/// cache (its last report carries none): a stage without one never starts
/// the round, and `sluicectl stage` would wait for it forever.
pub async fn stage(shared: &Shared, name: &str) -> Result<(u64, Vec<String>), ApiError> {
    {
        let policies = shared.read_policies();
        match policies.cache_for_dataset(name) {
            None => {
                return Err(ApiError::Conflict(format!(
                    "no DatasetCache policy names data set `{name}`: apply one with `spec.dataset: {name}` and `spec.staging: {{pool: POOL}}` (the pool staging reads are charged to)"
                )));
            }
            Some(c) if c.spec().staging.is_none() => {
                return Err(ApiError::Conflict(format!(
                    "DatasetCache `{}` has no `spec.staging`: add `staging: {{pool: POOL}}` to say which pool staging reads of `{name}` are charged to",
                    c.name()
                )));
            }
            Some(_) => {}
        }
    }
    // A stage reports right after its hello: one that has not yet is
    // waited for a moment rather than refused.
    let started = tokio::time::Instant::now();
    let stages = loop {
        match stages_with_cache(shared, name)? {
            Some(stages) => break stages,
            None if started.elapsed() < FIRST_REPORT => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            None => {
                return Err(ApiError::Conflict(format!(
                    "no stage serving `{name}` has reported whether it has a node cache within \
                     {FIRST_REPORT:?} of connecting: try again once they have"
                )));
            }
        }
    };
    let round = {
        let mut rounds = lock(&shared.staging_rounds);
        let now = u64::try_from(now_ms()).unwrap_or(0);
        let last = rounds.get(name).copied().unwrap_or(0);
        // Rounds only grow, and stay above the preload round (1).
        let round = now.max(last + 1);
        rounds.insert(name.to_owned(), round);
        round
    };
    let message = format!(
        "staging round {round} of data set {name} asked of {}",
        stages.join(", ")
    );
    shared
        .event("dataset.staging", format!("dataset/{name}"), message)
        .await;
    shared.recompute.notify_one();
    Ok((round, stages))
}
