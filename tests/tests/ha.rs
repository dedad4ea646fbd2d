//! Controller high availability on Postgres, end to end: a second
//! `sluice-controller` on the same database starts as a standby (healthy,
//! not ready, refusing stages and admin calls); when the leader is killed
//! it takes the lease, turns ready with the policies applied through the
//! old leader, and the stage, routed to it the way a Kubernetes Service
//! routes on readiness, reconnects and acknowledges its settings.
//!
//! Needs the Postgres server named by `SLUICE_TEST_POSTGRES_URL`
//! (`scripts/postgres` starts one); without it the test is skipped with a
//! note, except under `CI=true`, where it fails.

mod support;

use std::time::Duration;

use sluice_proto::StageServiceClient;
use sluice_proto::v1::{ListPoliciesRequest, ListStagesRequest};
use sluice_tests::postgres::TestDatabase;
use support::{
    Replica, acked_above, admin, apply, eventually, http, policy, replica, service, stage_command,
    trainer, until_ready,
};

/// Two replicas on a database of their own, `a` started first (it leads).
struct Pair {
    // The database is left behind: replica B may still use it when a test
    // ends, and the throwaway server goes anyway.
    _database: TestDatabase,
    dir: tempfile::TempDir,
    a: Replica,
    b: Replica,
}

/// Starts [`Pair`] on a new database named for `test`; `None` (skipped)
/// without a Postgres server outside CI.
async fn leader_and_standby(test: &str) -> Option<Pair> {
    let database = TestDatabase::create(test).await?;
    let dir = tempfile::tempdir().unwrap();
    let a = replica(database.url(), &dir.path().join("a.log"));
    let b = replica(database.url(), &dir.path().join("b.log"));
    assert_eq!(a.ready_line["role"], "leader");
    Some(Pair {
        _database: database,
        dir,
        a,
        b,
    })
}

/// A stage `stage-1` reaching its controller at `controller`, a trainer of
/// job `resnet` on it, and the policies applied through the leader at
/// `leader`; returns the stage and the trainer (to keep them) and the
/// settings version the stage acknowledged.
async fn serving_a_job(
    dir: &std::path::Path,
    controller: &str,
    leader: &str,
) -> (
    (support::KillOnDrop, serde_json::Value),
    std::os::unix::net::UnixStream,
    u64,
) {
    let (command, socket) = stage_command(dir, "stage-1", &format!("http://{controller}"));
    let stage = support::start(command, &dir.join("stage.log"));
    let trainer = trainer(&socket, "resnet");
    let mut leader = admin(leader).await;
    apply(&mut leader, "policy.yaml", &policy("100MB/s"))
        .await
        .unwrap();
    let acked = acked_above(&leader, "stage-1", 0).await;
    (stage, trainer, acked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_when_the_leader_dies_and_the_stage_follows() {
    let Some(Pair {
        _database,
        dir,
        mut a,
        b,
    }) = leader_and_standby("standby_takes_over").await
    else {
        return;
    };
    assert_eq!(b.ready_line["role"], "standby");

    // B is up and healthy, but not ready, and refuses stages and sluicectl.
    assert!(http(&b.http, "GET", "/healthz", "").starts_with("HTTP/1.1 200"));
    let readyz = http(&b.http, "GET", "/readyz", "");
    assert!(readyz.starts_with("HTTP/1.1 503"), "{readyz}");
    assert!(readyz.contains("standby"), "{readyz}");
    let api = http(&b.http, "GET", "/api/v1/policies", "");
    assert!(api.starts_with("HTTP/1.1 503"), "{api}");
    assert!(http(&b.http, "GET", "/metrics", "").contains("sluice_controller_leader 0"));
    assert!(http(&a.http, "GET", "/metrics", "").contains("sluice_controller_leader 1"));
    let refused = admin(&b.grpc)
        .await
        .list_stages(ListStagesRequest {})
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("standby"), "{refused:?}");
    let (up, rx) = tokio::sync::mpsc::channel(1);
    drop(up);
    let refused = StageServiceClient::connect(format!("http://{}", b.grpc))
        .await
        .unwrap()
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");

    // A stage behind the "Service" runs settings from A.
    let front = service(vec![
        (a.grpc.clone(), a.http.clone()),
        (b.grpc.clone(), b.http.clone()),
    ]);
    let (_stage, _trainer, from_a) = serving_a_job(dir.path(), &front, &a.grpc).await;

    // A dies without releasing anything: B takes over within seconds.
    a.process.0.kill().unwrap();
    a.process.0.wait().unwrap();
    until_ready(&b.http, Duration::from_secs(10)).await;
    assert!(http(&b.http, "GET", "/metrics", "").contains("sluice_controller_leader 1"));
    let mut leader = admin(&b.grpc).await;
    let names: Vec<String> = leader
        .list_policies(ListPoliciesRequest {
            include_history: false,
        })
        .await
        .unwrap()
        .into_inner()
        .policies
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert_eq!(names, ["vision", "shared"], "policies applied through A");

    // The stage reconnects to B and acks what B pushes; versions keep
    // increasing across leaders.
    let resumed = acked_above(&leader, "stage-1", 0).await;
    assert!(resumed >= from_a, "{resumed} < {from_a}");
    apply(&mut leader, "policy.yaml", &policy("200MB/s"))
        .await
        .unwrap();
    acked_above(&leader, "stage-1", resumed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_loses_the_lease_and_stands_by_when_it_wakes() {
    let Some(Pair {
        _database,
        dir,
        a,
        b,
    }) = leader_and_standby("frozen_leader").await
    else {
        return;
    };
    // The leader serves a stage and a job, so its gauges have figures.
    let (_stage, _trainer, _) = serving_a_job(dir.path(), &a.grpc, &a.grpc).await;
    eventually(
        "the leader to export the job's allocation",
        Duration::from_secs(30),
        || {
            let shown = http(&a.http, "GET", "/metrics", "")
                .contains("sluice_controller_job_allocated_bytes_per_second{");
            async move { shown.then_some(()) }
        },
    )
    .await;
    let signal = |name: &str| {
        let pid = a.process.0.id().to_string();
        let sent = std::process::Command::new("kill")
            .args([name, pid.as_str()])
            .status();
        assert!(sent.unwrap().success());
    };
    // Paused, its connections stay open (its kernel answers for them): the
    // server ends the lease session once it has sat idle too long.
    signal("-STOP");
    // The standby takes the lease.
    until_ready(&b.http, Duration::from_secs(30)).await;
    signal("-CONT");
    eventually(
        "the old leader to stand by",
        Duration::from_secs(30),
        || {
            let standing_by =
                http(&a.http, "GET", "/metrics", "").contains("sluice_controller_leader 0");
            async move { standing_by.then_some(()) }
        },
    )
    .await;
    assert!(http(&b.http, "GET", "/metrics", "").contains("sluice_controller_leader 1"));
    // Standing by, it exports no figures of the leader's any more: kept,
    // they stayed at their last values, and dashboards and alerts taking
    // the max across replicas showed them for good.
    let metrics = http(&a.http, "GET", "/metrics", "");
    for gone in [
        "sluice_controller_job_allocated_bytes_per_second{",
        "sluice_controller_job_throughput_bytes_per_second{",
        "sluice_controller_pool_capacity_bytes_per_second{",
    ] {
        assert!(!metrics.contains(gone), "{gone} in\n{metrics}");
    }
    for zero in [
        "sluice_controller_jobs 0",
        "sluice_controller_policies 0",
        "sluice_controller_stages{state=\"connected\"} 0",
        "sluice_controller_settings_pending_stages 0",
        "sluice_controller_allocation_problems 0",
    ] {
        assert!(metrics.contains(zero), "{zero} not in\n{metrics}");
    }
}

/// A stage stopped (SIGTERM) just before its leader dies left: the
/// standby that takes over forgets it once the stage timeout has run from
/// when it stopped, and never counts it lost (a lost-stage alert and a
/// ghost for an hour, on every rollout that restarts both together).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_stopped_just_before_a_failover_left_and_was_not_lost() {
    let Some(Pair {
        _database,
        dir,
        mut a,
        b,
    }) = leader_and_standby("stopped_before_failover").await
    else {
        return;
    };
    let (command, _socket) = stage_command(dir.path(), "stage-1", &format!("http://{}", a.grpc));
    let (mut stage, _) = support::start(command, &dir.path().join("stage.log"));
    let leader = admin(&a.grpc).await;
    eventually("the stage to connect", Duration::from_secs(10), || {
        let mut leader = leader.clone();
        async move {
            let stages = leader.list_stages(ListStagesRequest {}).await.ok()?;
            (stages.into_inner().stages.len() == 1).then_some(())
        }
    })
    .await;

    let pid = stage.0.id().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", pid.as_str()])
        .status();
    assert!(sent.unwrap().success());
    assert!(stage.0.wait().unwrap().success());
    // Well within the stage timeout (2 s): the leader has seen the stage
    // end its session, not yet that it stayed away.
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.process.0.kill().unwrap();
    a.process.0.wait().unwrap();
    until_ready(&b.http, Duration::from_secs(10)).await;
    let leader = admin(&b.grpc).await;
    eventually("the stage to be forgotten", Duration::from_secs(10), || {
        let mut leader = leader.clone();
        async move {
            let stages = leader.list_stages(ListStagesRequest {}).await.ok()?;
            stages.into_inner().stages.is_empty().then_some(())
        }
    })
    .await;
    let log = std::fs::read_to_string(dir.path().join("b.log")).unwrap();
    assert!(!log.contains("marked lost"), "{log}");
    assert!(log.contains("did not come back: forgotten"), "{log}");
}
