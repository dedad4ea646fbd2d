//! The controller end to end: the real `sluice-controller` and
//! `sluice-stage` binaries on ephemeral ports. Policies applied over gRPC
//! reach both stages and are acknowledged; a malformed policy is refused
//! with `file:line:column` and changes nothing; a killed stage is marked
//! lost; a restarted controller restores its state from the store and the
//! stages converge to the same versions.

mod support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sluice_proto::AdminServiceClient;
use sluice_proto::v1::{
    GetJobRequest, ListJobsRequest, ListPoliciesRequest, ListStagesRequest, Stage, StageState,
};
use sluice_stage::Request as Frame;
use support::{
    KillOnDrop, admin, apply, controller_command_at, eventually, http, stage_command, start,
    trainer,
};
use tonic::transport::Channel;

const POLICY: &str = "
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: shared}
spec: {capacity: {bandwidth: 1GB/s}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: vision}
spec:
  selector: {matchLabels: {team: vision}}
  pool: shared
  limit: {bandwidth: 100MB/s}
";

const MALFORMED: &str = "apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: broken}
spec:
  selector: {matchLabels: {team: vision}}
  pool: shared
  limitt: {bandwidth: 1MB/s}
";

struct RunningController {
    _process: KillOnDrop,
    grpc: String,
    http: String,
}

fn controller(db: &Path, grpc_addr: &str) -> RunningController {
    let url = format!("sqlite://{}", db.display());
    let log = db.with_extension("log");
    let (process, ready) = start(controller_command_at(&url, grpc_addr), &log);
    RunningController {
        _process: process,
        grpc: ready["grpc"].as_str().unwrap().to_owned(),
        http: ready["http"].as_str().unwrap().to_owned(),
    }
}

struct RunningStage {
    process: KillOnDrop,
    socket: PathBuf,
    metrics: String,
}

fn stage(dir: &Path, id: &str, grpc: &str) -> RunningStage {
    let (command, socket) = stage_command(dir, id, &format!("http://{grpc}"));
    let (process, ready) = start(command, &dir.join(format!("{id}.log")));
    let metrics = ready["metrics"].as_str().unwrap().to_owned();
    RunningStage {
        process,
        socket,
        metrics,
    }
}

/// Reads one whole file as a trainer of `job` would (HELLO, OPEN, READ).
fn read_file(socket: &Path, job: &str, name: &str) -> Vec<u8> {
    let mut s = trainer(socket, job);
    let mut answer = |frame: Frame| {
        s.write_all(&frame.encode()).unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut body).unwrap();
        body
    };
    assert_eq!(
        answer(Frame::Open {
            dataset: "train".into()
        })[0],
        0x82,
        "OPENED"
    );
    let data = answer(Frame::Read {
        name: name.into(),
        offset: 0,
        length: u64::MAX,
    });
    assert_eq!(data[0], 0x86, "DATA");
    data[5..].to_vec()
}

async fn stages(client: &mut AdminServiceClient<Channel>) -> Vec<Stage> {
    client
        .list_stages(ListStagesRequest {})
        .await
        .map(|r| r.into_inner().stages)
        .unwrap_or_default()
}

/// Waits until both stages are connected, report `job`, and run what the
/// controller wants (desired == acked, nonzero); returns their versions.
async fn converged(client: &mut AdminServiceClient<Channel>, job: &str) -> BTreeMap<String, u64> {
    eventually(
        "both stages to ack the settings",
        Duration::from_secs(30),
        || {
            let mut client = client.clone();
            async move {
                let list = stages(&mut client).await;
                if std::env::var_os("SLUICE_TEST_LOGS").is_some() {
                    eprintln!("{list:?}");
                }
                let ok = list.len() == 2
                    && list.iter().all(|s| {
                        s.state == StageState::Connected as i32
                            && s.jobs.iter().any(|j| j == job)
                            && s.desired_version > 0
                            && s.desired_version == s.acked_version
                    });
                ok.then(|| {
                    list.iter()
                        .map(|s| (s.id.clone(), s.acked_version))
                        .collect()
                })
            }
        },
    )
    .await
}

/// Bytes per second pushed for `job` on each stage, by stage id (empty
/// while the controller does not know the job yet).
async fn job_limits(
    client: &mut AdminServiceClient<Channel>,
    job: &str,
) -> BTreeMap<String, Option<u64>> {
    let Ok(job) = client.get_job(GetJobRequest { id: job.into() }).await else {
        return BTreeMap::new();
    };
    job.into_inner()
        .stages
        .into_iter()
        .map(|s| (s.stage_id, s.settings.and_then(|s| s.bytes_per_second)))
        .collect()
}

/// Waits until the idle job `resnet` is held at its (small) demand, with
/// the capacity nobody wants lent up to its 100 MB/s limit: its settings
/// are then stable. (Until its first telemetry window it counts as greedy.)
async fn held_at_demand(http_addr: &str) {
    eventually(
        "the idle job held at its demand",
        Duration::from_secs(10),
        || {
            let response = http(http_addr, "GET", "/api/v1/jobs", "");
            let held = response.contains(r#""reason":"demand-limited""#)
                && response.contains(r#""enforced_bytes_per_second":100000000"#);
            async move { held.then_some(()) }
        },
    )
    .await;
}

/// Waits until each of the two stages runs `per_stage` bytes/s for `job`.
async fn limits_become(client: &AdminServiceClient<Channel>, job: &str, per_stage: u64) {
    eventually(
        "the job's limit on both stages",
        Duration::from_secs(10),
        || {
            let mut client = client.clone();
            async move {
                let l = job_limits(&mut client, job).await;
                (l.len() == 2 && l.values().all(|v| *v == Some(per_stage))).then_some(())
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_reach_both_stages_bad_ones_change_nothing_and_lost_stages_show() {
    let dir = tempfile::tempdir().unwrap();
    let c = controller(&dir.path().join("c.db"), "127.0.0.1:0");
    let a = stage(dir.path(), "stage-a", &c.grpc);
    let mut b = stage(dir.path(), "stage-b", &c.grpc);
    let _ta = trainer(&a.socket, "resnet");
    let _tb = trainer(&b.socket, "resnet");
    let mut client = admin(&c.grpc).await;

    apply(&mut client, "policy.yaml", POLICY).await.unwrap();
    held_at_demand(&c.http).await;
    let versions = converged(&mut client, "resnet").await;
    limits_become(&client, "resnet", 50_000_000).await;

    // A malformed policy: refused with file:line:column, nothing changes.
    let before = client
        .list_policies(ListPoliciesRequest {
            include_history: true,
        })
        .await
        .unwrap()
        .into_inner();
    let refused = apply(&mut client, "bad.yaml", MALFORMED).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().starts_with("bad.yaml:7:3: "),
        "{}",
        refused.message()
    );
    let after = client
        .list_policies(ListPoliciesRequest {
            include_history: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(before, after);
    assert_eq!(after.policies.len(), 2);
    assert_eq!(converged(&mut client, "resnet").await, versions);

    // The same over HTTP, plus the read-only views and metrics.
    let response = http(
        &c.http,
        "POST",
        "/api/v1/policies?source=web.yaml",
        MALFORMED,
    );
    assert!(response.starts_with("HTTP/1.1 400"), "{response}");
    assert!(response.contains("web.yaml:7:3: "), "{response}");
    let response = http(&c.http, "GET", "/api/v1/stages", "");
    assert!(
        response.contains(r#""id":"stage-a""#) && response.contains(r#""state":"connected""#),
        "{response}"
    );
    let response = http(&c.http, "GET", "/metrics", "");
    assert!(
        response.contains("sluice_controller_stages{state=\"connected\"} 2"),
        "{response}"
    );
    assert!(
        response.contains("sluice_controller_settings_acks_total"),
        "{response}"
    );
    assert!(http(&c.http, "GET", "/readyz", "").starts_with("HTTP/1.1 200"));

    // The allocation: the idle job is held at its (small) demand, and the
    // capacity nobody wants is lent up to its 100 MB/s limit.
    held_at_demand(&c.http).await;
    let response = http(&c.http, "GET", "/metrics", "");
    for series in [
        r#"sluice_controller_pool_capacity_bytes_per_second{pool="shared"} 1000000000"#,
        r#"sluice_controller_job_allocated_bytes_per_second{job="resnet",pool="shared"}"#,
        r#"sluice_controller_job_allocation_reason{job="resnet",pool="shared",reason="demand-limited"} 1"#,
        "sluice_controller_settings_pending_stages 0",
    ] {
        assert!(
            response.contains(series),
            "{series} missing from\n{response}"
        );
    }

    // A job new on a stage under a controller reads once the controller's
    // settings name it, not unlimited before.
    let starts = |how: &str| {
        let metrics = http(&a.metrics, "GET", "/metrics", "");
        let series = format!("sluice_stage_job_starts_total{{how=\"{how}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str())?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let (cleared, timed_out) = (starts("settings"), starts("timeout"));
    assert_eq!(read_file(&a.socket, "second", "a.bin"), b"abc");
    eventually(
        "the second job cleared by settings",
        Duration::from_secs(10),
        || {
            let now = starts("settings");
            async move { (now == cleared + 1).then_some(()) }
        },
    )
    .await;
    assert_eq!(starts("timeout"), timed_out);

    // A stage killed: marked lost within the timeout, and the job's whole
    // limit goes to the stage that still serves it.
    b.process.0.kill().unwrap();
    b.process.0.wait().unwrap();
    eventually("stage-b to be marked lost", Duration::from_secs(6), || {
        let mut client = client.clone();
        async move {
            let list = stages(&mut client).await;
            list.iter()
                .any(|s| s.id == "stage-b" && s.state == StageState::Lost as i32)
                .then_some(())
        }
    })
    .await;
    eventually(
        "stage-a to get the whole limit",
        Duration::from_secs(10),
        || {
            let mut client = client.clone();
            async move {
                let l = job_limits(&mut client, "resnet").await;
                (l.get("stage-a") == Some(&Some(100_000_000))).then_some(())
            }
        },
    )
    .await;
    // The lost stage no longer counts toward the job: its last settings
    // and rates would show the job over its cap.
    let job = client
        .get_job(GetJobRequest {
            id: "resnet".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let serving: Vec<&str> = job.stages.iter().map(|s| s.stage_id.as_str()).collect();
    assert_eq!(serving, ["stage-a"]);
    // Nor does the stage view list jobs of its last report.
    let lost = stages(&mut client).await;
    let lost = lost.iter().find(|s| s.id == "stage-b").unwrap();
    assert!(lost.jobs.is_empty(), "{:?}", lost.jobs);
    assert_eq!(
        job.settings.and_then(|s| s.bytes_per_second),
        Some(100_000_000)
    );
    // Jobs running: `resnet`; `second` read a file and left.
    let metrics = http(&c.http, "GET", "/metrics", "");
    assert!(
        metrics.contains("\nsluice_controller_jobs 1\n"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_controller_restores_state_and_stages_converge_to_the_same_versions() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    let first = controller(&db, "127.0.0.1:0");
    let grpc = first.grpc.clone();
    let a = stage(dir.path(), "stage-a", &grpc);
    let b = stage(dir.path(), "stage-b", &grpc);
    let _ta = trainer(&a.socket, "resnet");
    let _tb = trainer(&b.socket, "resnet");
    let mut client = admin(&grpc).await;
    apply(&mut client, "policy.yaml", POLICY).await.unwrap();
    limits_become(&client, "resnet", 50_000_000).await;
    held_at_demand(&first.http).await;
    let versions = converged(&mut client, "resnet").await;

    // The controller dies: the stages keep their settings and serve.
    drop(first);
    for s in [&a, &b] {
        assert_eq!(read_file(&s.socket, "resnet", "a.bin"), b"abc");
        let jobs = http(&s.metrics, "GET", "/api/v1/jobs", "");
        assert!(
            jobs.contains(r#""bytes_per_second_limit":50000000"#),
            "{jobs}"
        );
    }
    let second = controller(&db, &grpc);
    let mut client = admin(&second.grpc).await;
    let policies = client
        .list_policies(ListPoliciesRequest {
            include_history: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(policies.policies.len(), 2);
    assert_eq!(converged(&mut client, "resnet").await, versions);
    limits_become(&client, "resnet", 50_000_000).await;
    assert_eq!(converged(&mut client, "resnet").await, versions);
}

/// Runs `sluicectl --server http://GRPC ARGS...` and returns (exit code,
/// stdout, stderr).
fn sluicectl(grpc: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(sluice_tests::binary("sluicectl"))
        .arg(format!("--server=http://{grpc}"))
        .args(args)
        .output()
        .expect("sluicectl runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// What an operator does: `sluicectl apply`, then `sluicectl get stages -o
/// json` until both stages acknowledged the new version; a malformed file
/// exits 1 with its location and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluicectl_apply_reaches_both_stages_and_a_bad_file_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let c = controller(&dir.path().join("c.db"), "127.0.0.1:0");
    // The HTTP port given for the gRPC one, an easy slip: said so (it was
    // tonic's "invalid compression flag" on the 404 page).
    let (code, out, err) = sluicectl(&c.http, &["get", "stages"]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert!(
        err.contains("does not speak gRPC (it answered HTTP 404 Not Found); give the controller's gRPC address"),
        "{err}"
    );
    let a = stage(dir.path(), "stage-a", &c.grpc);
    let b = stage(dir.path(), "stage-b", &c.grpc);
    let _ta = trainer(&a.socket, "resnet");
    let _tb = trainer(&b.socket, "resnet");
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let grpc = c.grpc.clone();
    let stages_json = move || {
        let (code, out, err) = sluicectl(&grpc, &["get", "stages", "-o", "json"]);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<Vec<serde_json::Value>>(&out).expect("a JSON array")
    };
    // Both stages have reported the job before the policy arrives.
    let client = admin(&c.grpc).await;
    eventually(
        "both stages to report the job",
        Duration::from_secs(15),
        || {
            let mut client = client.clone();
            async move {
                let jobs = client
                    .list_jobs(ListJobsRequest {})
                    .await
                    .ok()?
                    .into_inner()
                    .jobs;
                jobs.iter()
                    .any(|j| j.id == "resnet" && j.stages.len() == 2)
                    .then_some(())
            }
        },
    )
    .await;
    for round in 1..=3u64 {
        let rate = 100 + round;
        std::fs::write(&policy, POLICY.replace("100MB/s", &format!("{rate}MB/s"))).unwrap();
        let (code, out, err) = sluicectl(&c.grpc, &["apply", "-f", policy.to_str().unwrap()]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("jobpolicy/vision"), "{out}");
        limits_become(&client, "resnet", rate * 1_000_000 / 2).await;
        // What the operator sees: every stage runs the version the
        // controller wants.
        eventually(
            "every stage to run the version the controller wants",
            Duration::from_secs(10),
            || {
                let stages = stages_json();
                let in_sync = stages.len() == 2
                    && stages.iter().all(|s| {
                        s["state"] == "connected"
                            && s["acked_version"].as_u64().unwrap_or(0) >= 1
                            && s["acked_version"] == s["desired_version"]
                    });
                async move { in_sync.then_some(()) }
            },
        )
        .await;
    }
    let (_, before, _) = sluicectl(&c.grpc, &["get", "policies", "-o", "json"]);
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, MALFORMED).unwrap();
    let (code, out, err) = sluicectl(&c.grpc, &["apply", "-f", bad.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("bad.yaml:") && err.lines().all(|l| l.contains(':')),
        "{err}"
    );
    let (_, after, _) = sluicectl(&c.grpc, &["get", "policies", "-o", "json"]);
    assert_eq!(before, after, "a refused apply changes nothing");
    // Deleting the policy a running job is under says which jobs lose it.
    let (code, out, err) = sluicectl(&c.grpc, &["delete", "jobpolicy", "vision"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("jobpolicy/vision deleted"), "{out}");
    assert!(
        err.starts_with("sluicectl: note: running jobs were under jobpolicy/vision: resnet;"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_flags_exit_64_and_sigterm_shuts_down_cleanly() {
    let bin = sluice_tests::binary("sluice-controller");
    let status = Command::new(&bin)
        .args(["--tick", "soon"])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(64));

    // With a stage session and an event watch open: both are endless
    // streams, and shutdown must still finish.
    let dir = tempfile::tempdir().unwrap();
    let c = controller(&dir.path().join("c.db"), "127.0.0.1:0");
    let _stage = stage(dir.path(), "stage-a", &c.grpc);
    let mut client = admin(&c.grpc).await;
    eventually("the stage to connect", Duration::from_secs(10), || {
        let mut client = client.clone();
        async move { (stages(&mut client).await.len() == 1).then_some(()) }
    })
    .await;
    let _watch = client
        .watch_events(sluice_proto::v1::WatchEventsRequest { since_seq: 0 })
        .await
        .unwrap();
    let mut process = c._process;
    let pid = process.0.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let started = Instant::now();
    let status = eventually(
        "the controller to stop on SIGTERM",
        Duration::from_secs(10),
        || {
            let done = process.0.try_wait().unwrap();
            async move { done }
        },
    )
    .await;
    assert_eq!(status.code(), Some(0));
    // Drained, not cut off by the drain timeout.
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
}

/// A JobPolicy and a StoragePool may share a name: `delete policy NAME`
/// then says which commands delete each, and `delete jobpolicy NAME`
/// deletes the policy and leaves the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluicectl_deletes_one_of_two_policies_sharing_a_name_by_kind() {
    let dir = tempfile::tempdir().unwrap();
    let c = controller(&dir.path().join("c.db"), "127.0.0.1:0");
    let file = dir.path().join("dup.yaml");
    std::fs::write(
        &file,
        "apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: dup}
spec: {capacity: {bandwidth: 1GiB/s}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: dup}
spec:
  selector: {matchLabels: {x: dup}}
  pool: dup
",
    )
    .unwrap();
    let (code, _, err) = sluicectl(&c.grpc, &["apply", "-f", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");

    let (code, out, err) = sluicectl(&c.grpc, &["delete", "policy", "dup"]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(
        err,
        "sluicectl: a JobPolicy and a StoragePool are named `dup`: say which with \
         `sluicectl delete jobpolicy dup` or `sluicectl delete pool dup`\n"
    );
    let (code, out, err) = sluicectl(&c.grpc, &["delete", "jobpolicy", "dup"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "jobpolicy/dup deleted (revision 2)\n");
    let (_, json, _) = sluicectl(&c.grpc, &["get", "policies", "-o", "json"]);
    let policies: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    let left: Vec<(&str, &str)> = policies
        .iter()
        .map(|p| (p["kind"].as_str().unwrap(), p["name"].as_str().unwrap()))
        .collect();
    assert_eq!(left, [("StoragePool", "dup")]);
    // With one kind left, `delete policy` finds it and says which it deleted.
    let (code, out, err) = sluicectl(&c.grpc, &["delete", "policy", "dup"]);
    assert_eq!(
        (code, out.as_str()),
        (0, "pool/dup deleted (revision 2)\n"),
        "{err}"
    );
    // Into a pipe its reader closed (`| head` done early): a quiet end.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(sluice_tests::binary("sluicectl"))
        .arg(format!("--server=http://{}", c.grpc))
        .args(["get", "policies"])
        .stdout(writer)
        .output()
        .expect("sluicectl runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!((out.status.code(), err.as_ref()), (Some(0), ""));
}

/// `sluicectl apply -f -` with nothing on standard input (a generator that
/// failed upstream in a pipe) is refused like any invalid apply: exit 1
/// and one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluicectl_apply_of_empty_input_fails() {
    let dir = tempfile::tempdir().unwrap();
    let c = controller(&dir.path().join("c.db"), "127.0.0.1:0");
    for input in ["", "# only a comment\n", "---\n"] {
        let mut child = Command::new(sluice_tests::binary("sluicectl"))
            .arg(format!("--server=http://{}", c.grpc))
            .args(["apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{input:?}: {err}");
        assert!(out.stdout.is_empty(), "{input:?}");
        assert!(
            err.starts_with("no policies in standard input: ") && err.lines().count() == 1,
            "{input:?}: {err}"
        );
    }
}

/// Runs the controller with `--database-url URL` until it exits (or 10 s
/// pass); returns its exit code and standard error.
fn controller_exit(url: &str) -> (Option<i32>, String) {
    controller_exit_with(url, &[])
}

/// [`controller_exit`] with more flags.
fn controller_exit_with(url: &str, flags: &[&std::ffi::OsStr]) -> (Option<i32>, String) {
    let out = Command::new("timeout")
        .arg("10")
        .arg(sluice_tests::binary("sluice-controller"))
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(["--database-url", url])
        .args(flags)
        .stdout(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// SQLite means one replica: a second controller on the same file (by
/// its name, a symlink or a hard link) is refused at start (exit 64, one
/// line naming the holder where it can) while the first
/// keeps leading; once the first is gone the file opens again. A URL that
/// names no file, or a read-only store, is refused the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_store_serves_one_controller_and_must_be_a_writable_file() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    let first = controller(&db, "127.0.0.1:0");
    let pid = first._process.0.id();
    let url = format!("sqlite://{}", db.display());
    let (code, err) = controller_exit(&url);
    assert_eq!(code, Some(64), "{err}");
    let expected = format!(
        "sluice-controller: --database-url: the store {} is in use by another controller \
         (pid {pid}): ",
        db.display()
    );
    assert!(err.lines().any(|l| l.starts_with(&expected)), "{err}");
    // A hard link names another lock file, but the same database.
    let link = dir.path().join("linked.db");
    std::fs::hard_link(&db, &link).unwrap();
    let (code, err) = controller_exit(&format!("sqlite://{}", link.display()));
    assert_eq!(code, Some(64), "{err}");
    let expected = format!(
        "sluice-controller: --database-url: the store {} is in use by another controller: ",
        link.display()
    );
    assert!(err.lines().any(|l| l.starts_with(&expected)), "{err}");
    assert!(
        http(&first.http, "GET", "/readyz", "").starts_with("HTTP/1.1 200"),
        "the first controller leads on"
    );
    drop(first);
    let again = controller(&db, "127.0.0.1:0");
    assert!(http(&again.http, "GET", "/readyz", "").starts_with("HTTP/1.1 200"));
    drop(again);

    let (code, err) = controller_exit("sqlite://");
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("--database-url: `sqlite://` names no database file: write sqlite://PATH"),
        "{err}"
    );
    assert!(!err.contains("no such table"), "{err}");

    let (code, err) = controller_exit(&format!("{url}?mode=ro"));
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("is read-only"), "{err}");

    let missing = dir.path().join("no-such-dir").join("c.db");
    let (code, err) = controller_exit(&format!("sqlite://{}", missing.display()));
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("no-such-dir"), "{err}");

    // A directory: refused before a lock file is made beside it.
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    for url in [
        format!("sqlite://{}", sub.display()),
        format!("sqlite://{}/", sub.display()),
    ] {
        let (code, err) = controller_exit(&url);
        assert_eq!(code, Some(64), "{err}");
        assert!(
            err.contains("names a directory, not a database file"),
            "{err}"
        );
    }
    assert!(!dir.path().join("sub.lock").exists());
    assert_eq!(std::fs::read_dir(&sub).unwrap().count(), 0);
}

/// `--policies` with a document that is not valid is an invalid
/// configuration (exit 64), found before the store is opened: no new
/// database is left behind.
#[test]
fn invalid_policies_stop_the_start_before_the_store_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let policies = dir.path().join("zero.yaml");
    std::fs::write(
        &policies,
        "apiVersion: sluice.dev/v1\nkind: StoragePool\nmetadata:\n  name: p1\nspec:\n  capacity:\n    bandwidth: 0B/s\n",
    )
    .unwrap();
    let db = dir.path().join("new.db");
    let (code, err) = controller_exit_with(
        &format!("sqlite://{}", db.display()),
        &["--policies".as_ref(), policies.as_os_str()],
    );
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("--policies") && err.contains("zero.yaml:7:") && err.contains("bandwidth"),
        "{err}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["zero.yaml"], "{err}");
}

/// A Postgres server that refuses connections is named as such at start,
/// not hidden behind a pool's timeout.
#[test]
fn an_unreachable_postgres_says_why() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let (code, err) = controller_exit(&format!("postgres://u:secret@127.0.0.1:{port}/db"));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("onnection refused"), "{err}");
    assert!(!err.contains("pool timed out"), "{err}");
    assert!(!err.contains("secret"), "{err}");
}

/// `--policies` naming nothing is a usage error (exit 64), found before
/// any store is opened.
#[test]
fn policies_that_do_not_exist_are_a_usage_error() {
    let (code, err) = controller_exit_with(
        "sqlite::memory:",
        &["--policies".as_ref(), "/no/such/policies".as_ref()],
    );
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("--policies") && err.contains("/no/such/policies"),
        "{err}"
    );
}

/// Every file in `policies/examples/` is a complete configuration that a
/// controller accepts through `sluicectl apply` (each on its own: they are
/// alternatives), and applying it twice creates no revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_example_policy_applies() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&examples)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    for file in files {
        let dir = tempfile::tempdir().unwrap();
        let c = controller(&dir.path().join("c.db"), "127.0.0.1:0");
        let (code, out, err) = sluicectl(&c.grpc, &["apply", "-f", file.to_str().unwrap()]);
        assert_eq!(code, 0, "{}: {err}", file.display());
        let documents = out.lines().filter(|l| l.contains("created")).count();
        assert!(documents >= 2, "{}: {out}", file.display());
        let (code, again, err) = sluicectl(&c.grpc, &["apply", "-f", file.to_str().unwrap()]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(
            again.lines().filter(|l| l.contains("unchanged")).count(),
            documents,
            "{again}"
        );
        let (_, json, _) = sluicectl(&c.grpc, &["get", "policies", "-o", "json"]);
        let policies: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
        assert_eq!(policies.len(), documents);
        assert!(policies.iter().all(|p| p["revision"] == 1), "{json}");
    }
}

/// A stage stopped with SIGTERM ends its session: once the stage timeout
/// has run it left and is forgotten, and it is never counted lost on the
/// way (its last report came before its session ended, so its silence
/// passed the timeout first: a lost-stage alert for every clean stop).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_that_stops_left_and_was_never_lost() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    let c = controller(&db, "127.0.0.1:0");
    let mut s = stage(dir.path(), "stage-1", &c.grpc);
    let _trainer = trainer(&s.socket, "resnet");
    let client = admin(&c.grpc).await;
    eventually("the stage to connect", Duration::from_secs(10), || {
        let mut client = client.clone();
        async move { (stages(&mut client).await.len() == 1).then_some(()) }
    })
    .await;
    // Reports come twice a second; stop between two.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let pid = s.process.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    assert!(s.process.0.wait().unwrap().success());
    eventually("the stage to be forgotten", Duration::from_secs(10), || {
        let mut client = client.clone();
        async move { stages(&mut client).await.is_empty().then_some(()) }
    })
    .await;
    let log = std::fs::read_to_string(db.with_extension("log")).unwrap();
    assert!(!log.contains("marked lost"), "{log}");
    assert!(log.contains("did not come back: forgotten"), "{log}");
}
