//! `sluice.v1.AdminService` (what `sluicectl` calls): a thin gRPC edge over
//! [`crate::policies`] and [`crate::views`], converting to and from
//! protobuf here and nowhere else.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use sluice_proto::AdminService;
use sluice_proto::v1::{self as pb};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::datasets::{self, CacheUseView, DatasetView};
use crate::policies::{self, ChangeView, Source};
use crate::sessions::job_to_proto;
use crate::state::Shared;
use crate::views::{self, JobView, PolicyView, PoolView, StageView};

/// Events read from the store per query while catching up.
const EVENT_PAGE: u32 = 256;

/// The AdminService implementation.
#[derive(Debug, Clone)]
pub struct Admin {
    shared: Arc<Shared>,
}

impl Admin {
    /// Returns the service over the shared state.
    pub fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::Event, Status>> + Send>>;

#[tonic::async_trait]
impl AdminService for Admin {
    async fn apply_policies(
        &self,
        request: Request<pb::ApplyPoliciesRequest>,
    ) -> Result<Response<pb::ApplyPoliciesResponse>, Status> {
        let r = request.into_inner();
        let sources = r
            .sources
            .into_iter()
            .map(|s| Source {
                name: s.name,
                yaml: s.yaml,
            })
            .collect();
        let changes = policies::apply(&self.shared, sources, r.dry_run).await?;
        Ok(Response::new(pb::ApplyPoliciesResponse {
            changes: changes.into_iter().map(change).collect(),
            dry_run: r.dry_run,
        }))
    }

    async fn delete_policy(
        &self,
        request: Request<pb::DeletePolicyRequest>,
    ) -> Result<Response<pb::DeletePolicyResponse>, Status> {
        let r = request.into_inner();
        let (kind, revision) = policies::delete(&self.shared, &r.kind, &r.name).await?;
        Ok(Response::new(pb::DeletePolicyResponse {
            revision,
            kind: kind.as_str().to_owned(),
        }))
    }

    async fn list_policies(
        &self,
        request: Request<pb::ListPoliciesRequest>,
    ) -> Result<Response<pb::ListPoliciesResponse>, Status> {
        let history = request.into_inner().include_history;
        let list = views::policies(&self.shared, history).await?;
        Ok(Response::new(pb::ListPoliciesResponse {
            policies: list.into_iter().map(policy).collect(),
        }))
    }

    async fn list_stages(
        &self,
        _request: Request<pb::ListStagesRequest>,
    ) -> Result<Response<pb::ListStagesResponse>, Status> {
        let list = views::stages(&self.shared).await?;
        Ok(Response::new(pb::ListStagesResponse {
            stages: list.into_iter().map(stage).collect(),
        }))
    }

    async fn get_stage(
        &self,
        request: Request<pb::GetStageRequest>,
    ) -> Result<Response<pb::Stage>, Status> {
        let view = views::stage(&self.shared, &request.into_inner().id).await?;
        Ok(Response::new(stage(view)))
    }

    async fn list_jobs(
        &self,
        _request: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsResponse>, Status> {
        let list = views::jobs(&self.shared).await?;
        Ok(Response::new(pb::ListJobsResponse {
            jobs: list.into_iter().map(job).collect(),
        }))
    }

    async fn get_job(
        &self,
        request: Request<pb::GetJobRequest>,
    ) -> Result<Response<pb::Job>, Status> {
        let view = views::job(&self.shared, &request.into_inner().id).await?;
        Ok(Response::new(job(view)))
    }

    async fn list_pools(
        &self,
        _request: Request<pb::ListPoolsRequest>,
    ) -> Result<Response<pb::ListPoolsResponse>, Status> {
        let list = views::pools(&self.shared).await?;
        Ok(Response::new(pb::ListPoolsResponse {
            pools: list.into_iter().map(pool).collect(),
        }))
    }

    async fn get_pool(
        &self,
        request: Request<pb::GetPoolRequest>,
    ) -> Result<Response<pb::Pool>, Status> {
        let view = views::pool(&self.shared, &request.into_inner().name).await?;
        Ok(Response::new(pool(view)))
    }

    async fn get_dataset(
        &self,
        request: Request<pb::GetDatasetRequest>,
    ) -> Result<Response<pb::Dataset>, Status> {
        let view = datasets::dataset(&self.shared, &request.into_inner().name)?;
        Ok(Response::new(dataset(view)))
    }

    async fn list_datasets(
        &self,
        _request: Request<pb::ListDatasetsRequest>,
    ) -> Result<Response<pb::ListDatasetsResponse>, Status> {
        let list = datasets::datasets(&self.shared);
        Ok(Response::new(pb::ListDatasetsResponse {
            datasets: list.into_iter().map(dataset).collect(),
        }))
    }

    async fn stage_dataset(
        &self,
        request: Request<pb::StageDatasetRequest>,
    ) -> Result<Response<pb::StageDatasetResponse>, Status> {
        let (round, stages) = datasets::stage(&self.shared, &request.into_inner().name).await?;
        Ok(Response::new(pb::StageDatasetResponse { round, stages }))
    }

    type WatchEventsStream = EventStream;

    async fn watch_events(
        &self,
        request: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        let mut after = request.into_inner().since_seq;
        let shared = self.shared.clone();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                // Register before reading so an event appended in between
                // still wakes this watcher.
                let woken = shared.events.notified();
                let page = match shared.store.events_since(after, EVENT_PAGE).await {
                    Ok(page) => page,
                    Err(e) => {
                        let _ = tx.send(Err(crate::error::status(e))).await;
                        return;
                    }
                };
                let full = page.len() == EVENT_PAGE as usize;
                for e in page {
                    after = e.seq;
                    let event = pb::Event {
                        seq: e.seq,
                        unix_millis: e.unix_millis,
                        kind: e.kind,
                        subject: e.subject,
                        message: e.message,
                    };
                    if tx.send(Ok(event)).await.is_err() {
                        return;
                    }
                }
                if !full {
                    tokio::select! {
                        () = woken => {}
                        () = tx.closed() => return,
                        () = shared.shutdown.cancelled() => return,
                        // Events appended by another replica wake no one here.
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

fn change(c: ChangeView) -> pb::PolicyChange {
    let outcome = match c.outcome.as_str() {
        "created" => pb::ApplyOutcome::Created,
        "updated" => pb::ApplyOutcome::Updated,
        _ => pb::ApplyOutcome::Unchanged,
    };
    pb::PolicyChange {
        kind: c.kind,
        name: c.name,
        revision: c.revision,
        outcome: outcome.into(),
        source: c.source,
    }
}

fn policy(p: PolicyView) -> pb::Policy {
    pb::Policy {
        kind: p.kind,
        name: p.name,
        revision: p.revision,
        yaml: p.yaml,
        json: p.json,
        created_unix_millis: p.created_unix_millis,
        deleted: p.deleted,
    }
}

fn stage_state(state: &str) -> pb::StageState {
    match state {
        "lost" => pb::StageState::Lost,
        "stopped" => pb::StageState::Stopped,
        _ => pb::StageState::Connected,
    }
}

fn stage(s: StageView) -> pb::Stage {
    pb::Stage {
        id: s.id,
        node: s.node,
        labels: s.labels,
        state: stage_state(s.state).into(),
        desired_version: s.desired_version,
        acked_version: s.acked_version,
        last_nack: s.last_nack.map(|n| pb::Nack {
            version: n.version,
            reason: n.reason,
        }),
        last_seen_unix_millis: s.last_seen_unix_millis,
        jobs: s.jobs,
        software_version: s.software_version,
        capabilities: s.capabilities,
        datasets: s.datasets,
        memory_budget_bytes: s.memory_budget_bytes,
        memory_used_bytes: s.memory_used_bytes,
    }
}

fn job(j: JobView) -> pb::Job {
    // The job as a whole: rates summed over its stages, the rest as pushed.
    let mut total: Option<pb::JobSettings> = None;
    for s in j.stages.iter().filter_map(|s| s.settings.as_ref()) {
        let p = job_to_proto(s);
        total = Some(match total {
            None => p,
            Some(mut t) => {
                t.bytes_per_second = sum(t.bytes_per_second, p.bytes_per_second);
                t.ops_per_second = sum(t.ops_per_second, p.ops_per_second);
                t
            }
        });
    }
    pb::Job {
        id: j.id,
        labels: j.labels,
        policy: j.policy,
        pool: j.pool,
        stages: j
            .stages
            .into_iter()
            .map(|s| pb::JobStage {
                stage_id: s.stage_id,
                settings: s.settings.as_ref().map(job_to_proto),
                acked: s.acked,
                throughput_bytes_per_second: s.throughput_bytes_per_second,
                stall_fraction: s.stall_fraction,
            })
            .collect(),
        settings: total,
        throughput_bytes_per_second: j.throughput_bytes_per_second,
        throughput_samples_per_second: j.throughput_samples_per_second,
        storage_bytes_per_second: j.storage_bytes_per_second,
        stall_fraction: j.stall_fraction,
        limits: j.limits.map(|l| pb::JobLimits {
            guarantee_bytes_per_second: l.guarantee_bytes_per_second,
            limit_bytes_per_second: l.limit_bytes_per_second,
            guarantee_ops_per_second: l.guarantee_ops_per_second,
            limit_ops_per_second: l.limit_ops_per_second,
            weight: f64::from(l.weight),
            priority: l.priority,
        }),
        allocation: j.allocation.map(|a| pb::JobAllocation {
            bytes_per_second: a.bytes_per_second,
            ops_per_second: a.ops_per_second,
            reason: a.reason.as_str().to_owned(),
            demand_bytes_per_second: a.demand_bytes_per_second,
            enforced_bytes_per_second: a.enforced_bytes_per_second,
        }),
    }
}

/// Adds two optional rates; unlimited (`None`) on any stage is unlimited.
fn sum(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    Some(a?.saturating_add(b?))
}

fn pool(p: PoolView) -> pb::Pool {
    pb::Pool {
        name: p.name,
        bandwidth_bytes_per_second: p.bandwidth_bytes_per_second,
        ops_per_second: p.ops_per_second,
        sharing: p.sharing,
        allocated_bytes_per_second: p.allocated_bytes_per_second,
        allocated_ops_per_second: p.allocated_ops_per_second,
        throughput_bytes_per_second: p.throughput_bytes_per_second,
        jobs: p.jobs,
        problems: p.problems,
    }
}

fn dataset(d: DatasetView) -> pb::Dataset {
    let stages = d
        .stages
        .into_iter()
        .map(|s| pb::DatasetOnStage {
            stage: s.stage,
            state: stage_state(s.state).into(),
            cache: s.cache.map(cache_use),
            memory_capacity_bytes: s.memory_capacity_bytes,
            disk_capacity_bytes: s.disk_capacity_bytes,
        })
        .collect();
    pb::Dataset {
        name: d.name,
        policy: d.policy,
        staging_round: d.staging_round,
        stages,
    }
}

fn cache_use(c: CacheUseView) -> pb::DatasetCacheTelemetry {
    pb::DatasetCacheTelemetry {
        dataset: String::new(),
        memory_bytes: c.memory_bytes,
        disk_bytes: c.disk_bytes,
        entries: c.entries,
        share_bytes: c.share_bytes,
        hits: c.hits,
        misses: c.misses,
        hit_bytes: c.hit_bytes,
        evictions: c.evictions,
        staging: c.staging.map(|s| pb::StagingProgress {
            round: s.round,
            state: s.state,
            samples_done: s.samples_done,
            samples_total: s.samples_total,
            source_bytes: s.source_bytes,
            errors: s.errors,
            error: s.error,
        }),
    }
}
