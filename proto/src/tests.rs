//! Wire round trips of every top-level message, and a real tonic session
//! over loopback TCP (proves the generated server and client and the
//! transport features fit together).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::Duration;

use prost::Message;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

use crate::v1::{
    Ack, ApplyOutcome, ApplyPoliciesRequest, ApplyPoliciesResponse, CacheTelemetry,
    ControllerMessage, DatasetCacheSettings, DatasetCacheTelemetry, DeletePolicyRequest,
    DeletePolicyResponse, Event, GetJobRequest, GetPoolRequest, GetStageRequest, Hello, Job,
    JobLimits, JobSettings, JobSettingsEntry, JobStage, JobTelemetry, LatencyHistogram,
    ListJobsRequest, ListJobsResponse, ListPoliciesRequest, ListPoliciesResponse, ListPoolsRequest,
    ListPoolsResponse, ListStagesRequest, ListStagesResponse, Nack, Policy, PolicyChange,
    PolicySource, Pool, Settings, Stage, StageMessage, StageState, StagingProgress, Telemetry,
    WatchEventsRequest, controller_message, stage_message,
};
use crate::{StageService, StageServiceClient, StageServiceServer};

/// Encodes `msg`, decodes it back and checks nothing was lost.
fn roundtrip<M: Message + Default + PartialEq + Debug>(msg: M) {
    let bytes = msg.encode_to_vec();
    let back = M::decode(bytes.as_slice()).expect("decoding what was just encoded");
    assert_eq!(back, msg);
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn hello() -> Hello {
    Hello {
        stage_id: "node-a-0".into(),
        node: "node-a".into(),
        labels: labels(&[("zone", "eu-1"), ("rack", "r7")]),
        capabilities: vec!["qos".into(), "tuner".into()],
        settings_version: 0,
        datasets: vec!["imagenet".into()],
        memory_budget_bytes: 8 << 30,
        reader_budget: 64,
        software_version: "0.1.0".into(),
    }
}

fn job_settings() -> JobSettings {
    JobSettings {
        bytes_per_second: Some(800 << 20),
        // Some(0) ("stopped") must stay distinct from None ("unlimited").
        ops_per_second: Some(0),
        burst_millis: 250,
        tuner: Some(true),
        min_readers: 2,
        max_readers: 16,
        min_buffer_bytes: 64 << 20,
        max_buffer_bytes: 1 << 30,
        policy: "training".into(),
        pool: "nfs".into(),
        reason: "weighted-share".into(),
    }
}

fn settings(version: u64) -> Settings {
    Settings {
        version,
        defaults: Some(JobSettings {
            reason: "static".into(),
            ..JobSettings::default()
        }),
        jobs: vec![JobSettingsEntry {
            job: "resnet50".into(),
            settings: Some(job_settings()),
        }],
        unmanaged: vec!["notebook".into()],
        cache: vec![DatasetCacheSettings {
            dataset: "imagenet".into(),
            policy: "imagenet".into(),
            tenant: "vision".into(),
            tenant_weight: 2,
            weight: 3,
            pin_bytes: u64::MAX,
            staging_round: 7,
            staging_bytes_per_second: 100 << 20,
        }],
    }
}

fn telemetry() -> Telemetry {
    Telemetry {
        unix_millis: 1_700_000_000_123,
        settings_version: 3,
        memory_used_bytes: 512 << 20,
        jobs: vec![JobTelemetry {
            job: "resnet50".into(),
            labels: labels(&[("team", "vision")]),
            delivered_bytes: 10 << 30,
            delivered_samples: 90_000,
            storage_reads: 90_100,
            storage_read_bytes: 10 << 30,
            cache_hit_bytes: 1 << 30,
            read_seconds: 123.5,
            stall_seconds: 1.25,
            throttled_seconds: 0.5,
            errors: 2,
            buffer_used_bytes: 100 << 20,
            buffer_capacity_bytes: 256 << 20,
            readers: 8,
            active_readers: 5,
            connections: 4,
            plans: 1,
            bytes_per_second: Some(800 << 20),
            ops_per_second: None,
            read_latency: Some(LatencyHistogram {
                upper_bounds_seconds: vec![0.001, 0.01, 0.1],
                cumulative_counts: vec![10, 80, 99],
                count: 100,
                sum_seconds: 0.9,
            }),
        }],
        cache: Some(CacheTelemetry {
            memory_capacity_bytes: 1 << 30,
            memory_used_bytes: 512 << 20,
            disk_capacity_bytes: 0,
            disk_used_bytes: 0,
            datasets: vec![DatasetCacheTelemetry {
                dataset: "imagenet".into(),
                memory_bytes: 512 << 20,
                disk_bytes: 0,
                entries: 5000,
                share_bytes: 1 << 30,
                hits: 10_000,
                misses: 5000,
                hit_bytes: 1 << 30,
                evictions: 3,
                staging: Some(StagingProgress {
                    round: 7,
                    state: "running".into(),
                    samples_done: 4000,
                    samples_total: 5000,
                    source_bytes: 400 << 20,
                    errors: 1,
                    error: String::new(),
                }),
            }],
        }),
    }
}

#[test]
fn stage_session_messages_roundtrip() {
    let kinds = [
        stage_message::Kind::Hello(hello()),
        stage_message::Kind::Telemetry(telemetry()),
        stage_message::Kind::Ack(Ack { version: 3 }),
        stage_message::Kind::Nack(Nack {
            version: 4,
            reason: "max_readers 16 exceeds the stage's reader budget of 8".into(),
        }),
    ];
    for kind in kinds {
        roundtrip(StageMessage { kind: Some(kind) });
    }
    roundtrip(ControllerMessage {
        kind: Some(controller_message::Kind::Settings(settings(4))),
    });
    roundtrip(StageMessage::default());
}

#[test]
fn admin_policy_messages_roundtrip() {
    roundtrip(ApplyPoliciesRequest {
        sources: vec![PolicySource {
            name: "policies/training.yaml".into(),
            yaml: "apiVersion: sluice.dev/v1\nkind: StoragePool\n".into(),
        }],
        dry_run: true,
    });
    roundtrip(ApplyPoliciesResponse {
        changes: vec![PolicyChange {
            kind: "StoragePool".into(),
            name: "nfs".into(),
            revision: 2,
            outcome: ApplyOutcome::Updated.into(),
            source: "policies/training.yaml".into(),
        }],
        dry_run: true,
    });
    roundtrip(DeletePolicyRequest {
        kind: "JobPolicy".into(),
        name: "training".into(),
    });
    roundtrip(DeletePolicyResponse {
        revision: 3,
        kind: "JobPolicy".into(),
    });
    roundtrip(ListPoliciesRequest {
        include_history: true,
    });
    roundtrip(ListPoliciesResponse {
        policies: vec![Policy {
            kind: "JobPolicy".into(),
            name: "training".into(),
            revision: 3,
            yaml: String::new(),
            json: String::new(),
            created_unix_millis: 1_700_000_000_000,
            deleted: true,
        }],
    });
}

#[test]
fn admin_view_messages_roundtrip() {
    roundtrip(ListStagesRequest {});
    roundtrip(GetStageRequest {
        id: "node-a-0".into(),
    });
    roundtrip(ListStagesResponse {
        stages: vec![Stage {
            id: "node-a-0".into(),
            node: "node-a".into(),
            labels: labels(&[("zone", "eu-1")]),
            state: StageState::Lost.into(),
            desired_version: 5,
            acked_version: 3,
            last_nack: Some(Nack {
                version: 4,
                reason: "no".into(),
            }),
            last_seen_unix_millis: 1_700_000_000_000,
            jobs: vec!["resnet50".into()],
            software_version: "0.1.0".into(),
            capabilities: vec!["qos".into()],
            datasets: vec!["imagenet".into()],
            memory_budget_bytes: 8 << 30,
            memory_used_bytes: 1 << 30,
        }],
    });
    roundtrip(ListJobsRequest {});
    roundtrip(GetJobRequest {
        id: "resnet50".into(),
    });
    roundtrip(ListJobsResponse {
        jobs: vec![Job {
            id: "resnet50".into(),
            labels: labels(&[("team", "vision")]),
            policy: "training".into(),
            pool: "nfs".into(),
            stages: vec![JobStage {
                stage_id: "node-a-0".into(),
                settings: Some(job_settings()),
                acked: true,
                throughput_bytes_per_second: 7.5e8,
                stall_fraction: 0.02,
            }],
            settings: Some(job_settings()),
            throughput_bytes_per_second: 7.5e8,
            throughput_samples_per_second: 6800.0,
            storage_bytes_per_second: 5.0e8,
            stall_fraction: 0.02,
            limits: Some(JobLimits {
                guarantee_bytes_per_second: Some(200 << 20),
                limit_bytes_per_second: None,
                guarantee_ops_per_second: None,
                limit_ops_per_second: Some(20_000),
                weight: 2.0,
                priority: -1,
            }),
            allocation: Some(crate::v1::JobAllocation {
                bytes_per_second: 7.5e8,
                ops_per_second: None,
                reason: "weighted-share".into(),
                demand_bytes_per_second: None,
                enforced_bytes_per_second: 8.0e8,
            }),
        }],
    });
    roundtrip(ListPoolsRequest {});
    roundtrip(GetPoolRequest { name: "nfs".into() });
    roundtrip(ListPoolsResponse {
        pools: vec![Pool {
            name: "nfs".into(),
            bandwidth_bytes_per_second: Some(2 << 30),
            ops_per_second: None,
            sharing: "weighted-fair".into(),
            allocated_bytes_per_second: 2 << 30,
            allocated_ops_per_second: 0,
            throughput_bytes_per_second: 1.5e9,
            jobs: vec!["resnet50".into()],
            problems: vec!["static pool nfs: bandwidth limits add up to 3.0 GiB/s".into()],
        }],
    });
    roundtrip(WatchEventsRequest { since_seq: 41 });
    roundtrip(Event {
        seq: 42,
        unix_millis: 1_700_000_000_000,
        kind: "settings.acked".into(),
        subject: "stage/node-a-0".into(),
        message: "stage node-a-0 applied settings version 5".into(),
    });
}

/// A controller stand-in: answers a `Hello` with `Settings` version 1 and
/// ends the session once that version is acknowledged.
struct EchoController;

#[tonic::async_trait]
impl StageService for EchoController {
    type SessionStream = ReceiverStream<Result<ControllerMessage, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<StageMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            while let Ok(Some(msg)) = inbound.message().await {
                match msg.kind {
                    Some(stage_message::Kind::Hello(_)) => {
                        let reply = ControllerMessage {
                            kind: Some(controller_message::Kind::Settings(settings(1))),
                        };
                        if tx.send(Ok(reply)).await.is_err() {
                            return;
                        }
                    }
                    // Dropping `tx` ends the response stream.
                    Some(stage_message::Kind::Ack(Ack { version: 1 })) => return,
                    other => {
                        let status = Status::invalid_argument(format!("unexpected {other:?}"));
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[tokio::test]
async fn session_roundtrip_over_tcp() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("binding a loopback port");
    let addr = listener.local_addr().expect("reading the bound address");
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder()
            .add_service(StageServiceServer::new(EchoController))
            .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                let _ = stopped.await;
            }),
    );

    let session = async {
        let mut client = StageServiceClient::connect(format!("http://{addr}"))
            .await
            .expect("connecting to the in-process server");
        let (to_controller, outbound) = mpsc::channel(4);
        let hello = StageMessage {
            kind: Some(stage_message::Kind::Hello(hello())),
        };
        to_controller.send(hello).await.expect("queueing hello");
        let mut inbound = client
            .session(ReceiverStream::new(outbound))
            .await
            .expect("opening the session")
            .into_inner();

        let first = inbound.message().await.expect("reading settings");
        let Some(ControllerMessage {
            kind: Some(controller_message::Kind::Settings(got)),
        }) = first
        else {
            panic!("expected settings, got {first:?}");
        };
        assert_eq!(got, settings(1));

        let ack = StageMessage {
            kind: Some(stage_message::Kind::Ack(Ack {
                version: got.version,
            })),
        };
        to_controller.send(ack).await.expect("queueing ack");
        let end = inbound.message().await.expect("reading the end of stream");
        assert_eq!(end, None, "the controller ends the session after the ack");
    };
    tokio::time::timeout(Duration::from_secs(20), session)
        .await
        .expect("session finished in time");

    stop.send(()).expect("server still running");
    server
        .await
        .expect("server task joined")
        .expect("server shut down cleanly");
}
