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

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use sluice_proto::v1::{ListPoliciesRequest, ListStagesRequest};
use sluice_proto::{AdminServiceClient, StageServiceClient};
use sqlx::{Connection, PgConnection};
use support::{
    KillOnDrop, acked_above, apply, controller_command, eventually, http, policy, stage_command,
    trainer,
};
use tonic::transport::Channel;

/// A database of its own on the test server, or `None` (skip) when no
/// server is configured outside CI.
async fn postgres_database(test: &str) -> Option<String> {
    let Ok(server) = std::env::var("SLUICE_TEST_POSTGRES_URL") else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "SLUICE_TEST_POSTGRES_URL is not set but CI=true: the HA tests must run in CI \
             (scripts/test starts a server with scripts/postgres)"
        );
        // Straight to stderr: eprintln! would be captured and hidden.
        let _ = writeln!(
            std::io::stderr(),
            "note: skipping {test}: SLUICE_TEST_POSTGRES_URL is not set \
             (scripts/postgres starts a throwaway server and prints the URL to use)"
        );
        return None;
    };
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut name = format!("sluice_ha_{}_{stamp}_{test}", std::process::id());
    name.truncate(63);
    let mut admin = PgConnection::connect(&server)
        .await
        .expect("connecting to the test server");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
        .execute(&mut admin)
        .await
        .expect("creating the test database");
    admin.close().await.ok();
    let (base, _) = server.rsplit_once('/').expect("a URL with a database");
    Some(format!("{base}/{name}"))
}

struct Replica {
    process: KillOnDrop,
    ready_line: serde_json::Value,
    grpc: String,
    http: String,
}

fn replica(database_url: &str, log: &std::path::Path) -> Replica {
    let (process, ready_line) = support::start(controller_command(database_url), log);
    Replica {
        process,
        grpc: ready_line["grpc"].as_str().unwrap().to_owned(),
        http: ready_line["http"].as_str().unwrap().to_owned(),
        ready_line,
    }
}

/// Stands in for a Kubernetes Service in front of the replicas: each new
/// connection goes to the first backend whose `/readyz` answers 200 (gRPC,
/// HTTP address pairs); with none ready it is closed at once.
fn service(backends: Vec<(String, String)>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let ready = backends.iter().find(|(_, http_addr)| {
                TcpStream::connect(http_addr).is_ok()
                    && http(http_addr, "GET", "/readyz", "").starts_with("HTTP/1.1 200")
            });
            let Some(server) = ready.and_then(|(grpc, _)| TcpStream::connect(grpc).ok()) else {
                continue;
            };
            for (mut from, mut to) in [
                (client.try_clone().unwrap(), server.try_clone().unwrap()),
                (server, client),
            ] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(std::net::Shutdown::Both);
                    let _ = from.shutdown(std::net::Shutdown::Both);
                });
            }
        }
    });
    addr
}

async fn admin(grpc: &str) -> AdminServiceClient<Channel> {
    AdminServiceClient::connect(format!("http://{grpc}"))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_when_the_leader_dies_and_the_stage_follows() {
    let Some(url) = postgres_database("standby_takes_over").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut a = replica(&url, &dir.path().join("a.log"));
    let b = replica(&url, &dir.path().join("b.log"));
    assert_eq!(a.ready_line["role"], "leader");
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
    let (command, socket) = stage_command(dir.path(), "stage-1", &format!("http://{front}"));
    let _stage = support::start(command, &dir.path().join("stage.log"));
    let _trainer = trainer(&socket, "resnet");
    let mut leader = admin(&a.grpc).await;
    apply(&mut leader, policy("100MB/s")).await;
    let from_a = acked_above(&leader, "stage-1", 0).await;

    // A dies without releasing anything: B takes over within seconds.
    a.process.0.kill().unwrap();
    a.process.0.wait().unwrap();
    eventually("the standby to turn ready", Duration::from_secs(10), || {
        let ready = http(&b.http, "GET", "/readyz", "").starts_with("HTTP/1.1 200");
        async move { ready.then_some(()) }
    })
    .await;
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
    apply(&mut leader, policy("200MB/s")).await;
    acked_above(&leader, "stage-1", resumed).await;
}
