//! A fake controller for the CLI's end-to-end tests: a real tonic
//! `AdminService` on 127.0.0.1:0 answering with canned data, recording
//! what it was sent. It runs on a runtime of its own so that the tests can
//! stay plain `#[test]` functions that run the binary and block on it.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use sluice_proto::v1::{
    self, ApplyOutcome, ApplyPoliciesRequest, ApplyPoliciesResponse, DeletePolicyRequest,
    DeletePolicyResponse, Event, GetJobRequest, GetPoolRequest, GetStageRequest, Job,
    ListJobsRequest, ListJobsResponse, ListPoliciesRequest, ListPoliciesResponse, ListPoolsRequest,
    ListPoolsResponse, ListStagesRequest, ListStagesResponse, Pool, Stage, WatchEventsRequest,
};
use sluice_proto::{AdminService, AdminServiceServer};
use tokio::sync::oneshot;
use tokio_stream::Stream;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

/// The error lines the fake answers for a document with a misspelt field.
pub const INVALID_LINES: &str = "\
bad.yaml:8:3: unknown field `wieght`: write `weight`
bad.yaml:18:16: `800MiBps` is not a bandwidth: write for example `800MiB/s`";

/// What the fake has been sent.
#[derive(Debug, Default)]
pub struct Seen {
    pub applies: Vec<ApplyPoliciesRequest>,
    pub deletes: Vec<DeletePolicyRequest>,
    /// `GetDataset` calls for `flaky`, which fail at first.
    pub flaky_reads: u32,
}

/// A running fake controller; stops when dropped.
pub struct FakeController {
    /// `http://127.0.0.1:PORT`, for `--server`.
    pub url: String,
    seen: Arc<Mutex<Seen>>,
    stop: Option<oneshot::Sender<()>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl FakeController {
    /// Binds 127.0.0.1:0 and serves until dropped.
    pub fn start() -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (stop, stopped) = oneshot::channel::<()>();
        let service = Fake { seen: seen.clone() };
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        runtime.spawn(
            Server::builder()
                .add_service(AdminServiceServer::new(service))
                .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                    let _ = stopped.await;
                }),
        );
        Self {
            url,
            seen,
            stop: Some(stop),
            runtime: Some(runtime),
        }
    }

    /// Returns what the fake has been sent so far.
    pub fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap()
    }
}

impl Drop for FakeController {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

struct Fake {
    seen: Arc<Mutex<Seen>>,
}

/// Two stages: one in sync, one lost that rejected version 4.
pub fn stages() -> Vec<Stage> {
    vec![
        Stage {
            id: "node-a-0".into(),
            node: "node-a".into(),
            labels: BTreeMap::from([("zone".into(), "eu-1".into())]),
            state: v1::StageState::Connected as i32,
            desired_version: 3,
            acked_version: 3,
            last_seen_unix_millis: 1_700_000_000_000,
            jobs: vec!["bert".into(), "resnet50".into()],
            software_version: "0.1.0".into(),
            capabilities: vec!["qos".into(), "tuner".into()],
            datasets: vec!["imagenet".into()],
            memory_budget_bytes: 8 << 30,
            memory_used_bytes: 3 << 30,
            ..Stage::default()
        },
        Stage {
            id: "node-b-0-with-a-rather-long-stage-identifier-from-k8s".into(),
            node: "node-b.cluster.example.internal".into(),
            state: v1::StageState::Lost as i32,
            desired_version: 4,
            acked_version: 3,
            last_nack: Some(v1::Nack {
                version: 4,
                reason: "buffer budget over memory".into(),
            }),
            jobs: vec!["resnet50".into()],
            ..Stage::default()
        },
    ]
}

/// Two jobs, one under a policy with a cap in force.
pub fn jobs() -> Vec<Job> {
    let capped = v1::JobSettings {
        bytes_per_second: Some(800 << 20),
        tuner: Some(true),
        min_readers: 2,
        max_readers: 16,
        max_buffer_bytes: 1 << 30,
        policy: "vision".into(),
        pool: "shared-nfs".into(),
        reason: "cap".into(),
        ..v1::JobSettings::default()
    };
    vec![
        Job {
            id: "bert".into(),
            labels: BTreeMap::from([("team".into(), "nlp".into())]),
            throughput_bytes_per_second: 50.0 * 1024.0 * 1024.0,
            stall_fraction: 0.25,
            stages: vec![v1::JobStage {
                stage_id: "node-a-0".into(),
                acked: true,
                ..v1::JobStage::default()
            }],
            ..Job::default()
        },
        Job {
            id: "resnet50".into(),
            labels: BTreeMap::from([("team".into(), "vision".into())]),
            policy: "vision".into(),
            pool: "shared-nfs".into(),
            settings: Some(capped.clone()),
            throughput_bytes_per_second: 812.0 * 1024.0 * 1024.0,
            throughput_samples_per_second: 1200.0,
            storage_bytes_per_second: 640.0 * 1024.0 * 1024.0,
            stall_fraction: 0.032,
            limits: Some(v1::JobLimits {
                limit_bytes_per_second: Some(800 << 20),
                weight: 3.0,
                ..v1::JobLimits::default()
            }),
            stages: vec![v1::JobStage {
                stage_id: "node-a-0".into(),
                settings: Some(capped),
                acked: true,
                throughput_bytes_per_second: 812.0 * 1024.0 * 1024.0,
                stall_fraction: 0.032,
            }],
            allocation: Some(v1::JobAllocation {
                bytes_per_second: 800.0 * 1024.0 * 1024.0,
                reason: "cap".into(),
                enforced_bytes_per_second: 800.0 * 1024.0 * 1024.0,
                ..v1::JobAllocation::default()
            }),
        },
    ]
}

/// One pool.
pub fn pools() -> Vec<Pool> {
    vec![Pool {
        name: "shared-nfs".into(),
        bandwidth_bytes_per_second: Some(2 << 30),
        ops_per_second: Some(20_000),
        sharing: "weighted".into(),
        allocated_bytes_per_second: 800 << 20,
        allocated_ops_per_second: 5_000,
        throughput_bytes_per_second: 862.0 * 1024.0 * 1024.0,
        jobs: vec!["resnet50".into()],
        problems: vec![
            "pool shared-nfs: bandwidth guarantees add up to 2560.0 MiB/s > capacity 2048.0 MiB/s; scaled by 0.8000".into(),
        ],
    }]
}

/// `(kind, name)` of each document in a source, found line by line: good
/// enough for the tests' own documents.
fn documents(yaml: &str) -> Vec<(String, String)> {
    yaml.split("\n---")
        .filter_map(|doc| {
            let field = |key: &str| {
                doc.lines()
                    .find_map(|l| l.trim().strip_prefix(key).map(|v| v.trim().to_owned()))
            };
            Some((field("kind:")?, field("name:")?))
        })
        .collect()
}

type Events = Pin<Box<dyn Stream<Item = Result<Event, Status>> + Send>>;

#[tonic::async_trait]
impl AdminService for Fake {
    async fn apply_policies(
        &self,
        request: Request<ApplyPoliciesRequest>,
    ) -> Result<Response<ApplyPoliciesResponse>, Status> {
        let request = request.into_inner();
        self.seen.lock().unwrap().applies.push(request.clone());
        if request.sources.iter().any(|s| s.yaml.contains("wieght")) {
            return Err(Status::invalid_argument(INVALID_LINES));
        }
        let changes = request
            .sources
            .iter()
            .flat_map(|s| {
                documents(&s.yaml)
                    .into_iter()
                    .map(|(kind, name)| v1::PolicyChange {
                        kind,
                        name,
                        revision: 1,
                        outcome: ApplyOutcome::Created as i32,
                        source: s.name.clone(),
                    })
            })
            .collect();
        Ok(Response::new(ApplyPoliciesResponse {
            changes,
            dry_run: request.dry_run,
        }))
    }

    async fn delete_policy(
        &self,
        request: Request<DeletePolicyRequest>,
    ) -> Result<Response<DeletePolicyResponse>, Status> {
        let request = request.into_inner();
        self.seen.lock().unwrap().deletes.push(request.clone());
        if request.name != "vision" && request.name != "shared-nfs" {
            return Err(Status::not_found(format!(
                "no policy named `{}`",
                request.name
            )));
        }
        // Says the kind only when the request named one, as a controller
        // from before the response carried it said none.
        Ok(Response::new(DeletePolicyResponse {
            revision: 2,
            kind: request.kind,
        }))
    }

    async fn list_policies(
        &self,
        _: Request<ListPoliciesRequest>,
    ) -> Result<Response<ListPoliciesResponse>, Status> {
        let policy = |kind: &str, name: &str, revision| v1::Policy {
            kind: kind.into(),
            name: name.into(),
            revision,
            yaml: format!("kind: {kind}\n"),
            json: format!(r#"{{"kind":"{kind}","metadata":{{"name":"{name}"}}}}"#),
            created_unix_millis: 1_700_000_000_000,
            deleted: false,
        };
        Ok(Response::new(ListPoliciesResponse {
            policies: vec![
                policy("JobPolicy", "vision", 3),
                policy("StoragePool", "shared-nfs", 1),
            ],
        }))
    }

    async fn list_stages(
        &self,
        _: Request<ListStagesRequest>,
    ) -> Result<Response<ListStagesResponse>, Status> {
        Ok(Response::new(ListStagesResponse { stages: stages() }))
    }

    async fn get_stage(
        &self,
        request: Request<GetStageRequest>,
    ) -> Result<Response<Stage>, Status> {
        let id = request.into_inner().id;
        stages()
            .into_iter()
            .find(|s| s.id == id)
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no stage `{id}`")))
    }

    async fn list_jobs(
        &self,
        _: Request<ListJobsRequest>,
    ) -> Result<Response<ListJobsResponse>, Status> {
        Ok(Response::new(ListJobsResponse { jobs: jobs() }))
    }

    async fn get_job(&self, request: Request<GetJobRequest>) -> Result<Response<Job>, Status> {
        let id = request.into_inner().id;
        jobs()
            .into_iter()
            .find(|j| j.id == id)
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no job `{id}`")))
    }

    async fn list_pools(
        &self,
        _: Request<ListPoolsRequest>,
    ) -> Result<Response<ListPoolsResponse>, Status> {
        Ok(Response::new(ListPoolsResponse { pools: pools() }))
    }

    async fn get_pool(&self, request: Request<GetPoolRequest>) -> Result<Response<Pool>, Status> {
        let name = request.into_inner().name;
        pools()
            .into_iter()
            .find(|p| p.name == name)
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no pool `{name}`")))
    }

    async fn get_dataset(
        &self,
        request: Request<v1::GetDatasetRequest>,
    ) -> Result<Response<v1::Dataset>, Status> {
        let name = request.into_inner().name;
        // `flaky` is out of reach, then answered by a standby, then
        // staged: a controller restarting while `sluicectl stage` waits.
        if name == "flaky" {
            let reads = {
                let mut seen = self.seen.lock().unwrap();
                seen.flaky_reads += 1;
                seen.flaky_reads
            };
            return match reads {
                1 => Err(Status::unavailable("")),
                2 => Err(Status::unavailable(
                    "this controller is a standby; the leader is elsewhere",
                )),
                _ => Ok(Response::new(v1::Dataset { name, ..imagenet() })),
            };
        }
        if name != "imagenet" {
            return Err(Status::not_found(format!(
                "no stage serves data set `{name}` and no DatasetCache policy names it"
            )));
        }
        Ok(Response::new(imagenet()))
    }

    async fn list_datasets(
        &self,
        _: Request<v1::ListDatasetsRequest>,
    ) -> Result<Response<v1::ListDatasetsResponse>, Status> {
        Ok(Response::new(v1::ListDatasetsResponse {
            datasets: vec![imagenet()],
        }))
    }

    async fn stage_dataset(
        &self,
        request: Request<v1::StageDatasetRequest>,
    ) -> Result<Response<v1::StageDatasetResponse>, Status> {
        let name = request.into_inner().name;
        if name != "imagenet" && name != "flaky" {
            return Err(Status::failed_precondition(format!(
                "no DatasetCache policy names data set `{name}`: apply one"
            )));
        }
        Ok(Response::new(v1::StageDatasetResponse {
            round: 42,
            stages: vec!["node-a-0".into()],
        }))
    }

    type WatchEventsStream = Events;

    async fn watch_events(
        &self,
        _: Request<WatchEventsRequest>,
    ) -> Result<Response<Events>, Status> {
        Ok(Response::new(Box::pin(tokio_stream::empty())))
    }
}

/// The one data set the fake controller knows.
fn imagenet() -> v1::Dataset {
    let staging = v1::StagingProgress {
        round: 42,
        state: "done".into(),
        samples_done: 1000,
        samples_total: 1000,
        source_bytes: 100 << 20,
        errors: 0,
        error: String::new(),
    };
    let cache = v1::DatasetCacheTelemetry {
        dataset: String::new(),
        memory_bytes: 100 << 20,
        disk_bytes: 0,
        entries: 1000,
        share_bytes: 512 << 20,
        hits: 3000,
        misses: 1000,
        hit_bytes: 300 << 20,
        evictions: 0,
        staging: Some(staging),
    };
    v1::Dataset {
        name: "imagenet".into(),
        policy: "imagenet-cache".into(),
        staging_round: 42,
        stages: vec![v1::DatasetOnStage {
            stage: "node-a-0".into(),
            state: v1::StageState::Connected.into(),
            cache: Some(cache),
            memory_capacity_bytes: 1 << 30,
            disk_capacity_bytes: 0,
        }],
    }
}
