//! Faults, end to end, against the real binaries:
//!
//! - the leader controller killed (SIGKILL) while policies are being
//!   applied, with a standby on the same Postgres: no acknowledged apply is
//!   lost and the stage runs the newest settings through the new leader
//!   within 5 s;
//! - Postgres stopped as a crash would stop it (a private server, so the
//!   other tests' server is untouched): the controller keeps running and
//!   keeps its stage session, the stage keeps serving, `/readyz` says why,
//!   applies are refused with that sentence, and all recovers once the
//!   server is back;
//! - a stage cut off from the controller by a network namespace whose link
//!   goes down: it keeps serving, the controller marks it lost, and once
//!   the link is back it reconnects and runs what was applied meanwhile.
//!
//! Each scenario writes one `chaos: ...` line with its recovery times on
//! stderr, and appends it as JSON to `$SLUICE_CHAOS_REPORT` when set
//! (`scripts/chaos` runs the long forms and prints a summary). The outage
//! and partition last `SLUICE_CHAOS_OUTAGE_S` and `SLUICE_CHAOS_PARTITION_S`
//! seconds (5 by default, the CI form). The Postgres scenarios need
//! `SLUICE_TEST_POSTGRES_URL` (scripts/postgres), the partition needs root
//! and `ip`; without them they are skipped with a note, except under
//! `CI=true`, where they fail.

mod support;

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_proto::v1::{ListPoliciesRequest, ListStagesRequest, StageState};
use sluice_tests::postgres::TestDatabase;
use support::{
    acked_above, admin, apply, controller_command, controller_command_at, eventually, http, policy,
    read_sample, replica, service, stage_command, start, trainer, until_ready,
};

fn seconds(var: &str, default: u64) -> Duration {
    let value = std::env::var(var).ok().and_then(|v| v.parse().ok());
    Duration::from_secs(value.unwrap_or(default))
}

/// Writes a scenario's outcome where `scripts/chaos` and a person running
/// the tests see it.
fn report(scenario: &str, figures: serde_json::Value) {
    let line = format!("chaos: {scenario}: {figures}");
    // Straight to stderr: eprintln! is captured for passing tests.
    let _ = writeln!(std::io::stderr(), "{line}");
    if let Ok(path) = std::env::var("SLUICE_CHAOS_REPORT") {
        let entry = serde_json::json!({"scenario": scenario, "figures": figures});
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("opening the chaos report");
        writeln!(file, "{entry}").unwrap();
    }
}

/// Skips a test whose prerequisite is missing, or fails it under `CI=true`.
fn missing(test: &str, what: &str) {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test}: {what}, but CI=true: the fault tests must run in CI"
    );
    let _ = writeln!(std::io::stderr(), "note: skipping {test}: {what}");
}

fn readyz(http_addr: &str) -> String {
    http(http_addr, "GET", "/readyz", "")
}

fn limit(i: u64) -> String {
    format!("{}MB/s", 100 + i)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_mid_apply_loses_no_acknowledged_apply() {
    let Some(database) = TestDatabase::create("leader_killed_mid_apply").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut a = replica(database.url(), &dir.path().join("a.log"));
    let b = replica(database.url(), &dir.path().join("b.log"));
    assert_eq!(a.ready_line["role"], "leader");
    let front = service(vec![
        (a.grpc.clone(), a.http.clone()),
        (b.grpc.clone(), b.http.clone()),
    ]);
    let (command, socket) = stage_command(dir.path(), "stage-1", &format!("http://{front}"));
    let _stage = start(command, &dir.path().join("stage.log"));
    let _trainer = trainer(&socket, "resnet");
    apply(&mut admin(&a.grpc).await, "policy.yaml", &policy(&limit(0)))
        .await
        .unwrap();
    acked_above(&admin(&a.grpc).await, "stage-1", 0).await;

    // An operator applies a new limit every 50 ms through the Service,
    // reconnecting after each failure; the applies the controller
    // acknowledged are kept.
    let acknowledged = Arc::new(Mutex::new(Vec::new()));
    let stop = tokio_util::sync::CancellationToken::new();
    let operator = tokio::spawn({
        let (acknowledged, stop, front) = (acknowledged.clone(), stop.clone(), front.clone());
        async move {
            let mut i = 1;
            while !stop.is_cancelled() {
                let endpoint = format!("http://{front}");
                if let Ok(mut client) = sluice_proto::AdminServiceClient::connect(endpoint).await
                    && apply(&mut client, "policy.yaml", &policy(&limit(i)))
                        .await
                        .is_ok()
                {
                    acknowledged.lock().unwrap().push((i, Instant::now()));
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    a.process.0.kill().unwrap();
    let killed = Instant::now();
    a.process.0.wait().unwrap();
    until_ready(&b.http, Duration::from_secs(10)).await;
    let ready = killed.elapsed();
    // What the old leader last stored for the stage, as the new one loaded
    // it: converged means acknowledging a newer version, from the new one.
    let (_, inherited, _) = stage_state(&b.grpc).await.unwrap();
    let version = acked_above(&admin(&b.grpc).await, "stage-1", inherited).await;
    let converged = killed.elapsed();
    assert!(
        converged <= Duration::from_secs(5),
        "the stage converged on the new leader {converged:?} after the kill"
    );
    // Applies go on through the new leader for a while.
    eventually(
        "three applies through the new leader",
        Duration::from_secs(10),
        || {
            let after = acknowledged
                .lock()
                .unwrap()
                .iter()
                .filter(|(_, at)| *at > killed + ready)
                .count();
            async move { (after >= 3).then_some(()) }
        },
    )
    .await;
    stop.cancel();
    operator.await.unwrap();

    // Every acknowledged limit is in the new leader's history, and the one
    // in force is the last acknowledged.
    let mut leader = admin(&b.grpc).await;
    let history = leader
        .list_policies(ListPoliciesRequest {
            include_history: true,
        })
        .await
        .unwrap()
        .into_inner()
        .policies;
    let limits: Vec<String> = history
        .iter()
        .filter(|p| p.name == "vision")
        .map(|p| p.yaml.clone())
        .collect();
    let acknowledged = acknowledged.lock().unwrap().clone();
    let before_kill = acknowledged.iter().filter(|(_, at)| *at < killed).count();
    assert!(before_kill > 0, "no apply went through before the kill");
    for (i, _) in &acknowledged {
        let wanted = format!("{}", (100 + i) * 1_000_000);
        let text = limit(*i);
        assert!(
            limits
                .iter()
                .any(|y| y.contains(&wanted) || y.contains(&text)),
            "acknowledged apply {i} ({text}) is not in the history: {limits:#?}"
        );
    }
    let (last, _) = acknowledged.last().copied().unwrap();
    let current = limits.last().unwrap();
    assert!(
        current.contains(&format!("{}", (100 + last) * 1_000_000))
            || current.contains(&limit(last)),
        "the limit in force is not the last acknowledged ({}): {current}",
        limit(last)
    );

    // The stage ends up running the newest settings.
    let newest = acked_above(&admin(&b.grpc).await, "stage-1", version - 1).await;
    report(
        "leader killed mid-apply",
        serde_json::json!({
            "standby_ready_s": ready.as_secs_f64(),
            "stage_converged_s": converged.as_secs_f64(),
            "applies_acknowledged": acknowledged.len(),
            "applies_acknowledged_before_kill": before_kill,
            "acknowledged_lost": 0,
            "stage_version": newest,
        }),
    );
    drop(b);
    database.remove().await;
}

/// A Postgres server of the test's own (the other tests' server stays up),
/// on a free port, stopped and deleted when dropped.
struct PrivatePostgres {
    port: u16,
    dir: PathBuf,
    _parent: tempfile::TempDir,
}

impl PrivatePostgres {
    fn start(test: &str) -> Option<Self> {
        if std::env::var("SLUICE_TEST_POSTGRES_URL").is_err() {
            missing(
                test,
                "SLUICE_TEST_POSTGRES_URL is not set (scripts/postgres)",
            );
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let parent = tempfile::tempdir().unwrap();
        let server = Self {
            port,
            dir: parent.path().join("pg"),
            _parent: parent,
        };
        server.script("start");
        Some(server)
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn script(&self, verb: &str) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/postgres");
        let done = Command::new(script)
            .arg(verb)
            .env("SLUICE_PG_PORT", self.port.to_string())
            .env("SLUICE_PG_DIR", &self.dir)
            .output()
            .unwrap();
        assert!(
            done.status.success(),
            "scripts/postgres {verb}: {}",
            String::from_utf8_lossy(&done.stderr)
        );
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.script("stop");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_is_ridden_out() {
    let Some(postgres) = PrivatePostgres::start("a_postgres_outage_is_ridden_out") else {
        return;
    };
    let outage = seconds("SLUICE_CHAOS_OUTAGE_S", 5);
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, ready) = start(
        controller_command(&postgres.url()),
        &dir.path().join("controller.log"),
    );
    let grpc = ready["grpc"].as_str().unwrap().to_owned();
    let http_addr = ready["http"].as_str().unwrap().to_owned();
    let (command, socket) = stage_command(dir.path(), "stage-1", &format!("http://{grpc}"));
    let (_stage, stage_ready) = start(command, &dir.path().join("stage.log"));
    let stage_metrics = stage_ready["metrics"].as_str().unwrap().to_owned();
    let mut reader = trainer(&socket, "resnet");
    apply(&mut admin(&grpc).await, "policy.yaml", &policy("100MB/s"))
        .await
        .unwrap();
    let before = acked_above(&admin(&grpc).await, "stage-1", 0).await;

    postgres.script("pause");
    let down = Instant::now();
    let why = eventually(
        "/readyz to report the outage",
        Duration::from_secs(10),
        || {
            let answer = readyz(&http_addr);
            async move { answer.starts_with("HTTP/1.1 503").then_some(answer) }
        },
    )
    .await;
    let detected = down.elapsed();
    assert!(why.contains("store unavailable"), "{why}");
    let refused = apply(&mut admin(&grpc).await, "policy.yaml", &policy("300MB/s"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains("store unavailable"),
        "{refused:?}"
    );
    let api = http(&http_addr, "GET", "/api/v1/stages", "");
    assert!(api.starts_with("HTTP/1.1 503"), "{api}");
    // A job new during the outage: the controller's session handler waits
    // on its sighting's store write until the store answers.
    let mut newcomer = trainer(&socket, "bert");
    assert_eq!(read_sample(&mut newcomer), b"abc");
    assert!(http(&http_addr, "GET", "/metrics", "").contains("sluice_controller_store_up 0"));
    // Throughout the outage the controller runs, the stage keeps its
    // session and its trainers are served; a new trainer is welcome.
    while down.elapsed() < outage {
        assert!(
            controller.0.try_wait().unwrap().is_none(),
            "the controller exited during the outage"
        );
        assert_eq!(read_sample(&mut reader), b"abc");
        let metrics = http(&stage_metrics, "GET", "/metrics", "");
        assert!(
            metrics.contains("sluice_stage_controller_connected 1"),
            "the stage lost its session"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(read_sample(&mut trainer(&socket, "resnet")), b"abc");

    postgres.script("start");
    let back = Instant::now();
    until_ready(&http_addr, Duration::from_secs(30)).await;
    let ready_after = back.elapsed();
    assert!(http(&http_addr, "GET", "/metrics", "").contains("sluice_controller_store_up 1"));
    let mut client = admin(&grpc).await;
    apply(&mut client, "policy.yaml", &policy("200MB/s"))
        .await
        .unwrap();
    let after = acked_above(&client, "stage-1", before).await;
    let converged = back.elapsed();
    // The stage kept its session and reported throughout: it was never
    // lost (a stage timeout past the return, to be sure).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = std::fs::read_to_string(dir.path().join("controller.log")).unwrap();
    assert!(!log.contains("marked lost"), "{log}");
    report(
        "postgres outage",
        serde_json::json!({
            "outage_s": outage.as_secs_f64(),
            "detected_s": detected.as_secs_f64(),
            "ready_after_return_s": ready_after.as_secs_f64(),
            "apply_acked_after_return_s": converged.as_secs_f64(),
            "stage_version": after,
        }),
    );
}

/// A network namespace joined to this one by a veth pair: the stage runs
/// inside, the controller listens on the host end; taking the host end
/// down partitions them.
struct Partition {
    name: String,
    host_if: String,
    host_ip: String,
}

fn ip(args: &[&str]) {
    let done = Command::new("ip").args(args).output().unwrap();
    assert!(
        done.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&done.stderr)
    );
}

impl Partition {
    fn create(test: &str) -> Option<Self> {
        // /proc/self belongs to the process's effective user.
        let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
        let has_ip = Command::new("ip").arg("-V").output().is_ok();
        if !root || !has_ip {
            missing(test, "network namespaces need root and `ip` (iproute2)");
            return None;
        }
        let id = std::process::id();
        let octet = 16 + id % 200;
        let p = Self {
            name: format!("sluice-chaos-{id}"),
            host_if: format!("slc{id}h"),
            host_ip: format!("10.251.{octet}.1"),
        };
        let inner_if = format!("slc{id}n");
        ip(&["netns", "add", &p.name]);
        ip(&[
            "link", "add", &p.host_if, "type", "veth", "peer", "name", &inner_if,
        ]);
        ip(&["link", "set", &inner_if, "netns", &p.name]);
        ip(&[
            "addr",
            "add",
            &format!("{}/30", p.host_ip),
            "dev",
            &p.host_if,
        ]);
        ip(&["link", "set", &p.host_if, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &p.name, "ip"];
            all.extend_from_slice(args);
            ip(&all);
        };
        inside(&[
            "addr",
            "add",
            &format!("10.251.{octet}.2/30"),
            "dev",
            &inner_if,
        ]);
        inside(&["link", "set", &inner_if, "up"]);
        inside(&["link", "set", "lo", "up"]);
        Some(p)
    }

    /// `program` run inside the namespace.
    fn command(&self, program: &Command) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name])
            .arg(program.get_program())
            .args(program.get_args());
        c
    }

    fn cut(&self) {
        ip(&["link", "set", &self.host_if, "down"]);
    }

    fn heal(&self) {
        ip(&["link", "set", &self.host_if, "up"]);
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        // Deleting the namespace deletes the veth pair with it.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
    }
}

async fn stage_state(grpc: &str) -> Option<(i32, u64, u64)> {
    let stages = admin(grpc)
        .await
        .list_stages(ListStagesRequest {})
        .await
        .ok()?;
    let s = stages.into_inner().stages.into_iter().next()?;
    Some((s.state, s.desired_version, s.acked_version))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_stage_keeps_serving_and_reconverges() {
    let Some(net) = Partition::create("a_partitioned_stage_keeps_serving_and_reconverges") else {
        return;
    };
    let span = seconds("SLUICE_CHAOS_PARTITION_S", 5);
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite://{}", dir.path().join("sluice.db").display());
    // On the host end of the link: not loopback, so admin access is opened
    // explicitly (a test controller, nothing else reaches this link).
    let mut controller = controller_command_at(&database, &format!("{}:0", net.host_ip));
    controller.arg("--insecure-admin");
    let (_controller, ready) = start(controller, &dir.path().join("controller.log"));
    let grpc = ready["grpc"].as_str().unwrap().to_owned();
    let (stage, socket) = stage_command(dir.path(), "stage-1", &format!("http://{grpc}"));
    let _stage = start(net.command(&stage), &dir.path().join("stage.log"));
    let mut reader = trainer(&socket, "resnet");
    apply(&mut admin(&grpc).await, "policy.yaml", &policy("100MB/s"))
        .await
        .unwrap();
    let before = acked_above(&admin(&grpc).await, "stage-1", 0).await;

    net.cut();
    let cut = Instant::now();
    eventually(
        "the stage to be marked lost",
        Duration::from_secs(15),
        || {
            let grpc = grpc.clone();
            async move {
                let (state, ..) = stage_state(&grpc).await?;
                (state == StageState::Lost as i32).then_some(())
            }
        },
    )
    .await;
    let lost_after = cut.elapsed();
    // A change made meanwhile waits for the stage.
    apply(&mut admin(&grpc).await, "policy.yaml", &policy("200MB/s"))
        .await
        .unwrap();
    while cut.elapsed() < span {
        assert_eq!(read_sample(&mut reader), b"abc");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(read_sample(&mut trainer(&socket, "resnet")), b"abc");

    net.heal();
    let healed = Instant::now();
    let after = acked_above(&admin(&grpc).await, "stage-1", before).await;
    let converged = healed.elapsed();
    report(
        "stage partitioned",
        serde_json::json!({
            "partition_s": span.as_secs_f64(),
            "marked_lost_s": lost_after.as_secs_f64(),
            "reconverged_after_heal_s": converged.as_secs_f64(),
            "stage_version": after,
        }),
    );
}
