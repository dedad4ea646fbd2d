//! The controller library on ephemeral ports against a scripted stage (a
//! tonic client in the test): settings computed from policies and pushed,
//! nacks and acks recorded, desired settings re-pushed to a stage that
//! reconnects running an older version, dry runs, deletes, pools and the
//! event watch.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use sluice_controller::{Controller, ControllerConfig};
use sluice_proto::v1::{
    self as pb, ApplyOutcome, ApplyPoliciesRequest, DeletePolicyRequest, GetStageRequest,
    ListPoliciesRequest, ListPoolsRequest, PolicySource, StageMessage, WatchEventsRequest,
    controller_message, stage_message,
};
use sluice_proto::{AdminServiceClient, StageServiceClient};
use sluice_tests::eventually;
use sluice_tests::postgres::TestDatabase;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Streaming;
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
  limit: {bandwidth: 100MB/s, ops: 2k ops/s}
  prefetch: {readers: {min: 2, max: 8}, buffer: {min: 8MiB, max: 64MiB}}
";

/// How long a test waits for what the controller does on its own.
const WAIT: Duration = Duration::from_secs(10);

struct Running {
    grpc: String,
    http: String,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// A fresh SQLite store in `dir`.
fn sqlite_url(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("c.db").display())
}

async fn start(url: &str) -> Running {
    start_with(url, Duration::from_secs(1)).await
}

async fn start_with(url: &str, stage_timeout: Duration) -> Running {
    start_ticking(url, stage_timeout, ControllerConfig::for_tests(url).tick).await
}

async fn start_ticking(url: &str, stage_timeout: Duration, tick: Duration) -> Running {
    let mut config = ControllerConfig::for_tests(url);
    config.stage_timeout = stage_timeout;
    config.tick = tick;
    let controller = Controller::bind(config).await.unwrap();
    let addrs = controller.addresses().unwrap();
    let (grpc, http) = (addrs.grpc.to_string(), addrs.http.to_string());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(controller.run(cancel.clone()));
    Running {
        grpc,
        http,
        cancel,
        task,
    }
}

/// An admin client of the controller `c`.
async fn admin_of(c: &Running) -> AdminServiceClient<Channel> {
    AdminServiceClient::connect(format!("http://{}", c.grpc))
        .await
        .unwrap()
}

/// A scripted stage session.
struct Session {
    up: mpsc::Sender<StageMessage>,
    down: Streaming<pb::ControllerMessage>,
}

async fn session(grpc: &str, running_version: u64) -> Session {
    let hello = pb::Hello {
        stage_id: "stage-1".into(),
        node: "node-1".into(),
        settings_version: running_version,
        memory_budget_bytes: 1 << 30,
        ..Default::default()
    };
    session_with(grpc, hello).await
}

/// A session opened with `hello`, which has reported once.
async fn session_with(grpc: &str, hello: pb::Hello) -> Session {
    let mut client = StageServiceClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    let (up, rx) = mpsc::channel(8);
    up.send(message(stage_message::Kind::Hello(hello)))
        .await
        .unwrap();
    let down = client
        .session(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let s = Session { up, down };
    s.report().await;
    s
}

/// The settings a message from the controller carries.
fn settings_in(m: Result<Option<pb::ControllerMessage>, tonic::Status>) -> pb::Settings {
    let m = m.unwrap().expect("open");
    let Some(controller_message::Kind::Settings(s)) = m.kind else {
        panic!("not settings: {m:?}")
    };
    s
}

fn message(kind: stage_message::Kind) -> StageMessage {
    StageMessage { kind: Some(kind) }
}

impl Session {
    /// Sends one telemetry snapshot: job `train` with `team: vision`.
    async fn report(&self) {
        self.report_at(1).await;
    }

    /// A report stamped `unix_millis` (reports a window apart make the
    /// job's demand measured).
    async fn report_at(&self, unix_millis: i64) {
        let job = pb::JobTelemetry {
            job: "train".into(),
            labels: BTreeMap::from([("team".to_owned(), "vision".to_owned())]),
            connections: 1,
            ..Default::default()
        };
        let t = pb::Telemetry {
            unix_millis,
            jobs: vec![job],
            ..Default::default()
        };
        self.up
            .send(message(stage_message::Kind::Telemetry(t)))
            .await
            .unwrap();
    }

    async fn settings(&mut self) -> pb::Settings {
        let next = tokio::time::timeout(Duration::from_secs(10), self.down.message());
        settings_in(next.await.expect("settings in time"))
    }

    /// The next settings, reporting every 250 ms meanwhile as a stage
    /// does (twice a second): one silent past the stage timeout (1 s
    /// here) is marked lost and pushed nothing, and a policy applied
    /// within the controller's first stage timeout waits for its end.
    async fn settings_reporting(&mut self) -> pb::Settings {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match tokio::time::timeout(Duration::from_millis(250), self.down.message()).await {
                Ok(m) => return settings_in(m),
                Err(_) => {
                    assert!(tokio::time::Instant::now() < deadline, "settings in time");
                    self.report().await;
                }
            }
        }
    }

    async fn send(&self, kind: stage_message::Kind) {
        self.up.send(message(kind)).await.unwrap();
    }
}

async fn stage(admin: &mut AdminServiceClient<Channel>) -> pb::Stage {
    let request = GetStageRequest {
        id: "stage-1".into(),
    };
    admin.get_stage(request).await.unwrap().into_inner()
}

fn apply_request(yaml: &str, dry_run: bool) -> ApplyPoliciesRequest {
    ApplyPoliciesRequest {
        sources: vec![PolicySource {
            name: "p.yaml".into(),
            yaml: yaml.into(),
        }],
        dry_run,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_flow_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    settings_flow(&sqlite_url(dir.path())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_flow_on_postgres() {
    let Some(database) = TestDatabase::create("settings_flow").await else {
        return;
    };
    settings_flow(database.url()).await;
    database.remove().await;
}

/// Settings flow from policy to stage, with nacks, acks and re-push.
async fn settings_flow(url: &str) {
    let c = start(url).await;
    let mut admin = admin_of(&c).await;
    let applied = admin
        .apply_policies(apply_request(POLICY, false))
        .await
        .unwrap();
    let outcomes: Vec<i32> = applied
        .into_inner()
        .changes
        .iter()
        .map(|c| c.outcome)
        .collect();
    assert_eq!(outcomes, [ApplyOutcome::Created as i32; 2]);

    let mut s = session(&c.grpc, 0).await;
    let pushed = s.settings().await;
    let job = pushed.jobs[0].settings.clone().unwrap();
    assert_eq!(pushed.jobs[0].job, "train");
    assert_eq!(
        (job.bytes_per_second, job.ops_per_second),
        (Some(100_000_000), Some(2000))
    );
    assert_eq!((job.min_readers, job.max_readers), (2, 8));
    assert_eq!(
        (job.min_buffer_bytes, job.max_buffer_bytes),
        (8 << 20, 64 << 20)
    );
    assert_eq!(
        (job.policy.as_str(), job.pool.as_str()),
        ("vision", "shared")
    );

    // A nack is recorded and shown; a later ack clears it.
    let nack = pb::Nack {
        version: pushed.version,
        reason: "no thanks".into(),
    };
    s.send(stage_message::Kind::Nack(nack)).await;
    let shown = eventually("the nack", WAIT, || {
        let mut admin = admin.clone();
        async move { stage(&mut admin).await.last_nack }
    })
    .await;
    assert_eq!(
        (shown.version, shown.reason.as_str()),
        (pushed.version, "no thanks")
    );
    let view = http(&c.http, "GET", "/api/v1/stages", "").await;
    assert!(view.contains(r#""in_sync":false"#), "{view}");
    s.send(stage_message::Kind::Ack(pb::Ack {
        version: pushed.version,
    }))
    .await;
    eventually("the ack", WAIT, || {
        let mut admin = admin.clone();
        async move {
            let st = stage(&mut admin).await;
            (st.acked_version == pushed.version && st.last_nack.is_none()).then_some(())
        }
    })
    .await;
    assert_eq!(stage(&mut admin).await.desired_version, pushed.version);
    let view = http(&c.http, "GET", "/api/v1/stages", "").await;
    assert!(view.contains(r#""in_sync":true"#), "{view}");
    // An ack of a version never published, and a late one of an older
    // version, change nothing.
    for version in [pushed.version + 100, 0] {
        s.send(stage_message::Kind::Ack(pb::Ack { version })).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stage(&mut admin).await.acked_version, pushed.version);

    // Reconnecting with an older version gets the desired one at once.
    drop(s);
    let mut s = session(&c.grpc, 0).await;
    let again = s.settings().await;
    assert_eq!(
        (again.version, again.jobs.clone()),
        (pushed.version, pushed.jobs.clone())
    );
    s.send(stage_message::Kind::Ack(pb::Ack {
        version: again.version,
    }))
    .await;

    // A restarted controller on the same store: the stage comes back
    // running the desired version, and nothing new is published for it.
    drop(s);
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
    let c = start(url).await;
    let mut admin = admin_of(&c).await;
    let mut s = session(&c.grpc, pushed.version).await;
    let quiet = tokio::time::timeout(Duration::from_millis(1500), s.down.message()).await;
    assert!(quiet.is_err(), "pushed again after a restart: {quiet:?}");
    let st = stage(&mut admin).await;
    assert_eq!(
        (st.desired_version, st.acked_version),
        (pushed.version, pushed.version)
    );

    // A dry run stores nothing.
    let changed = POLICY.replace("100MB/s", "200MB/s");
    let dry = admin
        .apply_policies(apply_request(&changed, true))
        .await
        .unwrap()
        .into_inner();
    assert!(dry.dry_run);
    let vision = dry.changes.iter().find(|c| c.name == "vision").unwrap();
    assert_eq!(
        (vision.revision, vision.outcome),
        (2, ApplyOutcome::Updated as i32)
    );
    let list = admin
        .list_policies(ListPoliciesRequest {
            include_history: true,
        })
        .await;
    assert!(
        list.unwrap()
            .into_inner()
            .policies
            .iter()
            .all(|p| p.revision == 1)
    );

    // Pools list their jobs; a pool in use cannot go; deleting the policy
    // pushes settings without the job.
    // (The stage reports again first: silent past the timeout it is lost,
    // and a lost stage's jobs hold no allocation.)
    s.report().await;
    let pools = eventually("the job's whole limit in its pool", WAIT, || {
        let mut admin = admin.clone();
        async move {
            let pools = admin
                .list_pools(ListPoolsRequest {})
                .await
                .unwrap()
                .into_inner()
                .pools;
            // Its first window not measured yet, the job counts as greedy
            // and gets its whole limit.
            (pools[0].allocated_bytes_per_second == 100_000_000).then_some(pools)
        }
    })
    .await;
    assert_eq!(pools[0].jobs, ["train"]);
    assert!(pools[0].problems.is_empty(), "{:?}", pools[0].problems);
    let in_use = DeletePolicyRequest {
        kind: "pool".into(),
        name: "shared".into(),
    };
    let refused = admin.delete_policy(in_use).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    let delete = DeletePolicyRequest {
        kind: String::new(),
        name: "vision".into(),
    };
    let revision = admin
        .delete_policy(delete)
        .await
        .unwrap()
        .into_inner()
        .revision;
    assert_eq!(revision, 2);
    let emptied = s.settings().await;
    assert!(
        emptied.version > pushed.version && emptied.jobs.is_empty(),
        "{emptied:?}"
    );

    // The watch replays stored events, in order.
    let mut events = admin
        .watch_events(WatchEventsRequest { since_seq: 0 })
        .await
        .unwrap()
        .into_inner();
    let mut kinds = Vec::new();
    while !kinds.contains(&"policy.deleted".to_owned()) {
        let e = tokio::time::timeout(Duration::from_secs(10), events.message()).await;
        kinds.push(e.expect("events in time").unwrap().unwrap().kind);
    }
    for kind in [
        "policy.applied",
        "stage.connected",
        "settings.pushed",
        "settings.nacked",
    ] {
        assert!(
            kinds.iter().any(|k| k == kind),
            "{kind} missing from {kinds:?}"
        );
    }

    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_policies_are_refused_with_locations_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(&sqlite_url(dir.path())).await;
    let mut admin = admin_of(&c).await;
    let bad = POLICY.replace("pool: shared", "pool: missing");
    let refused = admin
        .apply_policies(apply_request(&bad, false))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().starts_with("p.yaml:"),
        "{}",
        refused.message()
    );
    let list = admin
        .list_policies(ListPoliciesRequest {
            include_history: true,
        })
        .await;
    assert!(list.unwrap().into_inner().policies.is_empty());
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

/// One HTTP/1.1 request; returns the whole response.
async fn http(addr: &str, method: &str, path: &str, body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    // A refused oversized body may close the connection early.
    let _ = s.write_all(body.as_bytes()).await;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_view_applies_lists_and_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(&sqlite_url(dir.path())).await;
    let ok = http(&c.http, "POST", "/api/v1/policies?source=web.yaml", POLICY).await;
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(ok.contains(r#""outcome":"created""#), "{ok}");
    let bad = POLICY.replace("100MB/s", "100 parsecs");
    let refused = http(&c.http, "POST", "/api/v1/policies", &bad).await;
    assert!(refused.starts_with("HTTP/1.1 400"), "{refused}");
    assert!(
        refused.contains("text/plain") && refused.contains("\r\n\r\nbody:"),
        "{refused}"
    );
    let huge = "#".repeat(5 << 20);
    let too_big = http(&c.http, "POST", "/api/v1/policies", &huge).await;
    assert!(
        too_big.starts_with("HTTP/1.1 413") && too_big.contains("at most 4 MiB"),
        "{}",
        &too_big[..too_big.len().min(400)]
    );
    // A body declared too large is refused at its head, not waited for.
    let declared = tokio::time::timeout(Duration::from_secs(5), async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(&c.http).await.unwrap();
        let head = "POST /api/v1/policies HTTP/1.1\r\nHost: x\r\nContent-Length: 10485760\r\n\r\n";
        s.write_all(head.as_bytes()).await.unwrap();
        let mut out = vec![0; 4096];
        let n = s.read(&mut out).await.unwrap();
        String::from_utf8_lossy(&out[..n]).into_owned()
    })
    .await
    .expect("the controller waited for a body its head declared too large");
    assert!(
        declared.starts_with("HTTP/1.1 413") && declared.contains("the body is 10485760 bytes"),
        "{declared}"
    );

    let policies = http(&c.http, "GET", "/api/v1/policies?history=true", "").await;
    assert!(policies.contains(r#""name":"vision""#), "{policies}");
    let pools = http(&c.http, "GET", "/api/v1/pools", "").await;
    assert!(
        pools.contains(r#""name":"shared""#) && pools.contains(r#""sharing":"weighted-fair""#),
        "{pools}"
    );
    assert!(
        http(&c.http, "GET", "/api/v1/jobs", "")
            .await
            .ends_with("[]")
    );
    assert!(
        http(&c.http, "GET", "/api/v1/stages", "")
            .await
            .ends_with("[]")
    );
    let metrics = http(&c.http, "GET", "/metrics", "").await;
    assert!(
        metrics.contains("sluice_controller_policy_revisions_total 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("sluice_controller_policies 2"),
        "{metrics}"
    );
    assert!(
        http(&c.http, "GET", "/healthz", "")
            .await
            .starts_with("HTTP/1.1 200")
    );
    assert!(
        http(&c.http, "GET", "/readyz", "")
            .await
            .starts_with("HTTP/1.1 200")
    );
    // A path or method it does not serve is refused with a sentence, not
    // an empty body.
    let slash = http(&c.http, "GET", "/api/v1/datasets/", "").await;
    assert!(slash.starts_with("HTTP/1.1 404"), "{slash}");
    assert!(
        slash.contains("did you mean `/api/v1/datasets`") && slash.contains("GET /api/v1/stages"),
        "{slash}"
    );
    // No hint of a path that is not served either.
    for path in ["/api/v1/", "/api/v1/stages/../"] {
        let bare = http(&c.http, "GET", path, "").await;
        assert!(
            bare.starts_with("HTTP/1.1 404") && !bare.contains("did you mean"),
            "{bare}"
        );
    }
    let unknown = http(&c.http, "GET", "/api/v1/stage", "").await;
    assert!(
        unknown.starts_with("HTTP/1.1 404") && unknown.contains("no endpoint at `/api/v1/stage`:"),
        "{unknown}"
    );
    let method = http(&c.http, "DELETE", "/api/v1/policies", "").await;
    assert!(method.starts_with("HTTP/1.1 405"), "{method}");
    assert!(
        method.contains("takes GET and POST, not DELETE")
            && method.contains("allow: GET,HEAD,POST"),
        "{method}"
    );
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

/// An apply that holds no document (empty, comments only, `---` only) is a
/// mistake upstream and is refused over gRPC and REST alike, changing
/// nothing; `--policies` naming such a file still starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apply_of_no_documents_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.yaml");
    std::fs::write(&empty, "# nothing yet\n").unwrap();
    let mut config = ControllerConfig::for_tests(sqlite_url(dir.path()));
    config.policies = Some(empty);
    let controller = Controller::bind(config).await.unwrap();
    let addrs = controller.addresses().unwrap();
    let cancel = CancellationToken::new();
    let task = tokio::spawn(controller.run(cancel.clone()));
    let mut admin = AdminServiceClient::connect(format!("http://{}", addrs.grpc))
        .await
        .unwrap();
    for yaml in ["", "\n  \n", "# a comment\n", "---\n", "---\n# x\n---\n"] {
        let refused = admin
            .apply_policies(apply_request(yaml, false))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{yaml:?}");
        assert!(
            refused.message().starts_with("no policies in p.yaml: "),
            "{yaml:?}: {}",
            refused.message()
        );
    }
    let stdin = ApplyPoliciesRequest {
        sources: vec![PolicySource {
            name: "-".into(),
            yaml: String::new(),
        }],
        dry_run: true,
    };
    let refused = admin.apply_policies(stdin).await.unwrap_err();
    assert!(
        refused
            .message()
            .starts_with("no policies in standard input: "),
        "{}",
        refused.message()
    );
    let http_addr = addrs.http.to_string();
    let refused = http(&http_addr, "POST", "/api/v1/policies", "").await;
    assert!(refused.starts_with("HTTP/1.1 400"), "{refused}");
    assert!(
        refused.contains("\r\n\r\nno policies in body: "),
        "{refused}"
    );
    let listed = admin
        .list_policies(ListPoliciesRequest {
            include_history: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(listed.policies.is_empty(), "{listed:?}");
    cancel.cancel();
    task.await.unwrap().unwrap();
}

/// `dry_run` is read strictly over REST: `1` is a dry run, a value that is
/// not a boolean or a misspelled parameter is refused with 400, and none of
/// them stores anything. Query values are percent-decoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_apply_reads_its_query_strictly_and_a_bad_query_stores_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(&sqlite_url(dir.path())).await;
    let dry = http(&c.http, "POST", "/api/v1/policies?dry_run=1", POLICY).await;
    assert!(dry.starts_with("HTTP/1.1 200"), "{dry}");
    assert!(dry.contains(r#""outcome":"created""#), "{dry}");
    for (query, says) in [
        (
            "dry_run=yes",
            "query parameter dry_run=yes is not a boolean",
        ),
        (
            "dry_run=TRUE",
            "query parameter dry_run=TRUE is not a boolean",
        ),
        (
            "dryrun=true",
            "unknown query parameter `dryrun` (did you mean `dry_run`?)",
        ),
        ("dry_run=true&force=1", "unknown query parameter `force`"),
        // Shown later in operators' terminals: no escape sequences.
        (
            "source=%1b%5b2Jx.yaml",
            r"the source name `\u{1b}[2Jx.yaml` is refused",
        ),
    ] {
        let path = format!("/api/v1/policies?{query}");
        let refused = http(&c.http, "POST", &path, POLICY).await;
        assert!(refused.starts_with("HTTP/1.1 400"), "{query}: {refused}");
        assert!(refused.contains(says), "{query}: {refused}");
    }
    let listed = http(&c.http, "GET", "/api/v1/policies", "").await;
    assert!(
        listed.ends_with("[]"),
        "a refused or dry apply stored: {listed}"
    );
    for path in ["/api/v1/stages?state=lost", "/api/v1/policies?histroy=true"] {
        let refused = http(&c.http, "GET", path, "").await;
        assert!(refused.starts_with("HTTP/1.1 400"), "{path}: {refused}");
    }

    let bad = POLICY.replace("100MB/s", "100 parsecs");
    let named = http(
        &c.http,
        "POST",
        "/api/v1/policies?source=team%2Fa+b.yaml",
        &bad,
    )
    .await;
    assert!(named.contains("\r\n\r\nteam/a b.yaml:"), "{named}");
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_controller_on_one_postgres_stands_by_until_the_lease_is_free() {
    let Some(database) = TestDatabase::create("second_controller").await else {
        return;
    };
    let c = start(database.url()).await;
    let standby = Controller::bind(ControllerConfig::for_tests(database.url()))
        .await
        .unwrap();
    assert!(!standby.is_leader());
    let standby_http = standby.addresses().unwrap().http.to_string();
    let cancel = CancellationToken::new();
    let task = tokio::spawn(standby.run(cancel.clone()));
    let readyz = http(&standby_http, "GET", "/readyz", "").await;
    assert!(readyz.starts_with("HTTP/1.1 503"), "{readyz}");
    assert!(readyz.contains("standby"), "{readyz}");
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
    // Released at shutdown: the standby takes the lease and turns ready.
    eventually("the standby to turn ready", WAIT, || async {
        let readyz = http(&standby_http, "GET", "/readyz", "").await;
        readyz.starts_with("HTTP/1.1 200").then_some(())
    })
    .await;
    cancel.cancel();
    task.await.unwrap().unwrap();
    database.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_given_at_start_are_applied_once_and_reloaded() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let file = dir.path().join("static.yaml");
    std::fs::write(&file, POLICY).unwrap();
    for _ in 0..2 {
        let mut config = ControllerConfig::for_tests(url.as_str());
        config.policies = Some(file.clone());
        let controller = Controller::bind(config).await.unwrap();
        let grpc = controller.addresses().unwrap().grpc;
        let cancel = CancellationToken::new();
        let task = tokio::spawn(controller.run(cancel.clone()));
        let mut admin = AdminServiceClient::connect(format!("http://{grpc}"))
            .await
            .unwrap();
        let list = admin
            .list_policies(ListPoliciesRequest {
                include_history: true,
            })
            .await
            .unwrap()
            .into_inner()
            .policies;
        // The second start applies an identical file: no new revision.
        let names: Vec<(String, u64)> = list.into_iter().map(|p| (p.name, p.revision)).collect();
        assert_eq!(names, [("vision".to_owned(), 1), ("shared".to_owned(), 1)]);
        cancel.cancel();
        task.await.unwrap().unwrap();
    }
    // A broken file stops the start with its location.
    std::fs::write(&file, "kind: [").unwrap();
    let mut config = ControllerConfig::for_tests(url.as_str());
    config.policies = Some(file.clone());
    let e = Controller::bind(config).await.unwrap_err();
    assert!(format!("{e:#}").contains("static.yaml:2:1: "), "{e:#}");
}

/// `--policies` never rolls back what was changed through the API since
/// the files were applied: a restart (or a standby taking over) with the
/// same files keeps the newer stored revisions, even where the files no
/// longer fit them; a file changed since is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_given_at_start_keep_what_was_changed_since() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let file = dir.path().join("static.yaml");
    std::fs::write(&file, POLICY).unwrap();
    let start_with_files = || async {
        let mut config = ControllerConfig::for_tests(url.as_str());
        config.policies = Some(file.clone());
        let controller = Controller::bind(config).await.unwrap();
        let grpc = controller.addresses().unwrap().grpc;
        let cancel = CancellationToken::new();
        let task = tokio::spawn(controller.run(cancel.clone()));
        let admin = AdminServiceClient::connect(format!("http://{grpc}"))
            .await
            .unwrap();
        (admin, cancel, task)
    };
    let current = |mut admin: AdminServiceClient<Channel>| async move {
        let list = admin
            .list_policies(ListPoliciesRequest {
                include_history: false,
            })
            .await
            .unwrap()
            .into_inner()
            .policies;
        let mut out: Vec<(String, u64, String)> = list
            .into_iter()
            .map(|p| (p.name, p.revision, p.yaml))
            .collect();
        out.sort();
        out
    };
    let (mut admin, cancel, task) = start_with_files().await;
    // Through the API: a larger pool, and a guarantee only it can give.
    let grown = POLICY.replace("bandwidth: 1GB/s", "bandwidth: 4GB/s")
        + "---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: big}
spec:
  selector: {matchLabels: {team: big}}
  pool: shared
  guarantee: {bandwidth: 3GB/s}
";
    admin
        .apply_policies(apply_request(&grown, false))
        .await
        .unwrap();
    cancel.cancel();
    task.await.unwrap().unwrap();

    let (admin, cancel, task) = start_with_files().await;
    let kept = current(admin).await;
    let revisions: Vec<(&str, u64)> = kept.iter().map(|(n, r, _)| (n.as_str(), *r)).collect();
    assert_eq!(revisions, [("big", 1), ("shared", 2), ("vision", 1)]);
    assert!(kept[1].2.contains("4GB/s"), "{}", kept[1].2);
    cancel.cancel();
    task.await.unwrap().unwrap();

    // The file changed since: applied.
    std::fs::write(
        &file,
        POLICY.replace("bandwidth: 1GB/s", "bandwidth: 8GB/s"),
    )
    .unwrap();
    let (admin, cancel, task) = start_with_files().await;
    let changed = current(admin).await;
    assert_eq!((changed[1].0.as_str(), changed[1].1), ("shared", 3));
    assert!(changed[1].2.contains("8GB/s"), "{}", changed[1].2);
    cancel.cancel();
    task.await.unwrap().unwrap();
}

/// A hello naming an id or node the store cannot keep is refused before
/// anything is recorded: no stage is listed, and none is later counted
/// lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_hello_leaves_no_stage_behind() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(&sqlite_url(dir.path())).await;
    for (id, node) in [
        ("x".repeat(300), "node-1".to_owned()),
        ("evil\nstage".to_owned(), "node-1".to_owned()),
        ("stage-1".to_owned(), "n\u{1b}[31mred".to_owned()),
    ] {
        let mut client = StageServiceClient::connect(format!("http://{}", c.grpc))
            .await
            .unwrap();
        let (up, rx) = mpsc::channel(8);
        let hello = pb::Hello {
            stage_id: id,
            node,
            ..Default::default()
        };
        up.send(message(stage_message::Kind::Hello(hello)))
            .await
            .unwrap();
        let refused = client.session(ReceiverStream::new(rx)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().len() < 300, "{}", refused.message());
    }
    // Past the stage timeout (1 s) and a few ticks: still nothing.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let metrics = http(&c.http, "GET", "/metrics", "").await;
    assert!(
        metrics.contains(r#"sluice_controller_stages{state="lost"} 0"#),
        "{metrics}"
    );
    let stages = http(&c.http, "GET", "/api/v1/stages", "").await;
    assert!(stages.ends_with("\r\n\r\n[]"), "{stages}");
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

/// A stage that ends its session itself (it stops: a sidecar whose
/// training finished) and does not come back within the stage timeout
/// left: it is forgotten, not counted lost. One that comes back in time
/// (a restart) is the same stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_that_ends_its_session_and_stays_away_is_forgotten_not_lost() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(&sqlite_url(dir.path())).await;
    let listed = |c: &Running| {
        let http_addr = c.http.clone();
        async move { http(&http_addr, "GET", "/api/v1/stages", "").await }
    };
    // Ended and back within the timeout (1 s): still there, connected.
    let Session { up, down } = session(&c.grpc, 0).await;
    drop(up);
    drop(down);
    let again = session(&c.grpc, 0).await;
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        again.report().await;
    }
    assert!(listed(&c).await.contains(r#""state":"connected""#));
    // Ended for good.
    let Session { up, down } = again;
    drop(up);
    drop(down);
    eventually("the stage forgotten", WAIT, || async {
        listed(&c).await.ends_with("\r\n\r\n[]").then_some(())
    })
    .await;
    let metrics = http(&c.http, "GET", "/metrics", "").await;
    assert!(
        metrics.contains(r#"sluice_controller_stages{state="lost"} 0"#),
        "{metrics}"
    );
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misbehaving_stage_does_not_hold_up_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(&sqlite_url(dir.path())).await;
    let url = format!("http://{}", c.grpc);

    // A session that does not open with a hello is refused.
    let mut client = StageServiceClient::connect(url.clone()).await.unwrap();
    let (up, rx) = mpsc::channel(1);
    let t = pb::Telemetry::default();
    up.send(message(stage_message::Kind::Telemetry(t)))
        .await
        .unwrap();
    let refused = client.session(ReceiverStream::new(rx)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);

    // A stage that never reads its pushes, next to one that does.
    let mut stuck_client = StageServiceClient::connect(url).await.unwrap();
    let (stuck_up, rx) = mpsc::channel(8);
    let hello = pb::Hello {
        stage_id: "stuck".into(),
        memory_budget_bytes: 1 << 30,
        ..Default::default()
    };
    stuck_up
        .send(message(stage_message::Kind::Hello(hello)))
        .await
        .unwrap();
    let _stuck_down = stuck_client.session(ReceiverStream::new(rx)).await.unwrap();
    let mut good = session(&c.grpc, 0).await;
    let mut admin = admin_of(&c).await;
    // Many jobs with long ids make each push to the stuck stage ~35 KB, so
    // 120 of them overflow HTTP/2 flow control and the session's queue.
    let jobs: Vec<pb::JobTelemetry> = std::iter::once("train".to_owned())
        .chain((0..200).map(|n| format!("{n:0>128}")))
        .map(|job| pb::JobTelemetry {
            job,
            labels: BTreeMap::from([("team".to_owned(), "vision".to_owned())]),
            ..Default::default()
        })
        .collect();
    // Reported once: the stuck stage is soon marked lost, but its session
    // stays open and keeps being pushed to.
    let t = pb::Telemetry {
        jobs,
        ..Default::default()
    };
    stuck_up
        .send(message(stage_message::Kind::Telemetry(t)))
        .await
        .unwrap();
    for i in 1..=120u64 {
        good.report().await;
        let rate = (100 + i) * 1_000_000;
        let yaml = POLICY.replace("100MB/s", &format!("{}MB/s", 100 + i));
        admin
            .apply_policies(apply_request(&yaml, false))
            .await
            .unwrap();
        // The good stage gets every change: the whole limit, or half of it
        // while the stuck stage still counts as serving the job.
        loop {
            let s = good.settings_reporting().await;
            // Pushed before the first policy: the job unmanaged.
            let Some(job) = s.jobs.first() else {
                continue;
            };
            let got = job.settings.as_ref().unwrap().bytes_per_second;
            if got == Some(rate) || got == Some(rate / 2) {
                break;
            }
        }
    }
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

/// What a stage of this release never sends is not kept or shown: job
/// ids no trainer could claim are dropped from its reports (the rest
/// kept), a refusal's reason is shown as one bounded line, and a message
/// over the limit ends the session with a status that says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_no_stage_sends_is_dropped_bounded_or_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(&sqlite_url(dir.path())).await;
    let mut s = session(&c.grpc, 0).await;
    let mut admin = admin_of(&c).await;
    let job = |id: &str| pb::JobTelemetry {
        job: id.into(),
        connections: 1,
        ..Default::default()
    };
    let t = pb::Telemetry {
        unix_millis: 2,
        jobs: vec![
            job("train"),
            job("\u{1b}[2Jzzred"),
            job(""),
            job("line1\nline2"),
            job(&"x".repeat(300)),
        ],
        ..Default::default()
    };
    s.send(stage_message::Kind::Telemetry(t)).await;
    let nack = pb::Nack {
        version: 1,
        reason: format!("\u{1b}[2J{}", "y".repeat(100_000)),
    };
    s.send(stage_message::Kind::Nack(nack)).await;
    let shown = eventually("the nack", WAIT, || {
        let mut admin = admin.clone();
        async move { stage(&mut admin).await.last_nack }
    })
    .await;
    assert!(
        !shown.reason.contains('\u{1b}'),
        "{:?}",
        &shown.reason[..40]
    );
    assert!(shown.reason.len() <= 1100, "{}", shown.reason.len());
    assert_eq!(stage(&mut admin).await.jobs, ["train"]);
    let listed = http(&c.http, "GET", "/api/v1/jobs", "").await;
    assert!(
        !listed.contains("zzred") && !listed.contains("line1"),
        "{listed}"
    );

    // 20 MiB in one report: the session ends, saying why.
    let big = pb::JobTelemetry {
        labels: BTreeMap::from([("a".to_owned(), "x".repeat(20 << 20))]),
        ..job("train")
    };
    let t = pb::Telemetry {
        jobs: vec![big],
        ..Default::default()
    };
    s.send(stage_message::Kind::Telemetry(t)).await;
    let ended = loop {
        match tokio::time::timeout(WAIT, s.down.message()).await {
            Ok(Ok(Some(_))) => continue,
            Ok(ended) => break ended,
            Err(_) => panic!("the session did not end"),
        }
    };
    let status = ended.unwrap_err();
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    assert!(status.message().contains("16777216"), "{status:?}");
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

/// A stage that ends its session (SIGTERM) shows as stopped, in the REST
/// view, the admin API and the stage count, until it comes back or the
/// stage timeout forgets it: not as connected, which it was shown as while
/// nothing served its jobs any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_that_ends_its_session_shows_stopped_until_it_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    // A tick longer than the waits: the stage gauges follow sessions
    // starting and ending at once, not at the next tick.
    let (timeout, tick) = (Duration::from_secs(60), Duration::from_secs(30));
    let c = start_ticking(&sqlite_url(dir.path()), timeout, tick).await;
    let mut admin = admin_of(&c).await;
    let shown = |c: &Running| {
        let http_addr = c.http.clone();
        async move {
            let stages = http(&http_addr, "GET", "/api/v1/stages", "").await;
            let metrics = http(&http_addr, "GET", "/metrics", "").await;
            (stages, metrics)
        }
    };
    let s = session(&c.grpc, 0).await;
    s.report().await;
    eventually("the stage connected", WAIT, || async {
        let (stages, metrics) = shown(&c).await;
        (stages.contains(r#""state":"connected""#)
            && metrics.contains(r#"sluice_controller_stages{state="connected"} 1"#))
        .then_some(())
    })
    .await;
    let stopped_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let Session { up, down } = s;
    drop(up);
    drop(down);
    eventually("the stage shown stopped", WAIT, || async {
        let (stages, metrics) = shown(&c).await;
        (stages.contains(r#""state":"stopped""#)
            && metrics.contains(r#"sluice_controller_stages{state="stopped"} 1"#)
            && metrics.contains(r#"sluice_controller_stages{state="connected"} 0"#))
        .then_some(())
    })
    .await;
    let stage = admin
        .get_stage(pb::GetStageRequest {
            id: "stage-1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stage.state, pb::StageState::Stopped as i32);
    // A controller that starts over shows it stopped, last seen when it
    // stopped (the store's sighting of it is written every few seconds
    // only: it showed the stage seen that much earlier).
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
    let c = start_ticking(&sqlite_url(dir.path()), timeout, tick).await;
    let mut admin = admin_of(&c).await;
    let stage = admin
        .get_stage(pb::GetStageRequest {
            id: "stage-1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stage.state, pb::StageState::Stopped as i32);
    assert!(
        stage.last_seen_unix_millis >= stopped_at,
        "last seen {} ms before it stopped",
        stopped_at - stage.last_seen_unix_millis
    );
    // Back (a restart): connected again.
    let again = session(&c.grpc, 0).await;
    again.report().await;
    eventually("the stage connected again", WAIT, || async {
        let (stages, metrics) = shown(&c).await;
        (stages.contains(r#""state":"connected""#)
            && metrics.contains(r#"sluice_controller_stages{state="stopped"} 0"#))
        .then_some(())
    })
    .await;
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

/// The limit `settings` give job `train`, if they name it.
fn train_limit(settings: &pb::Settings) -> Option<u64> {
    let job = settings.jobs.iter().find(|j| j.job == "train")?;
    job.settings.as_ref()?.bytes_per_second
}

/// Reads settings off `s` (reporting meanwhile, as a stage does) until
/// `train`'s limit is `want`; panics after `within`.
async fn until_limit(s: &mut Session, want: u64, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        s.report_at(now.unwrap().as_millis() as i64).await;
        let next = tokio::time::timeout(Duration::from_millis(300), s.down.message()).await;
        if let Ok(Ok(Some(m))) = next
            && let Some(controller_message::Kind::Settings(settings)) = m.kind
            && train_limit(&settings) == Some(want)
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "train's limit never became {want} within {within:?}"
        );
    }
}

/// A stage that stops (ends its session) reads for nobody: the share of a
/// job it had goes to the stages that remain at once, not when the stage
/// timeout forgets it (before, the remaining stage kept half the limit
/// for the whole timeout while the stage showed as stopped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_stages_share_goes_to_the_stages_that_remain_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let c = start_with(&sqlite_url(dir.path()), Duration::from_secs(60)).await;
    let mut admin = admin_of(&c).await;
    admin
        .apply_policies(apply_request(POLICY, false))
        .await
        .unwrap();
    let hello = |id: &str| pb::Hello {
        stage_id: id.into(),
        node: format!("node-{id}"),
        memory_budget_bytes: 1 << 30,
        ..Default::default()
    };
    let mut a = session_with(&c.grpc, hello("a")).await;
    let mut b = session_with(&c.grpc, hello("b")).await;
    // Both serve the job: the limit is split between them.
    let split = async {
        until_limit(&mut a, 50_000_000, WAIT).await;
    };
    let other = async {
        until_limit(&mut b, 50_000_000, WAIT).await;
    };
    tokio::join!(split, other);
    let Session { up, down } = b;
    drop((up, down));
    until_limit(&mut a, 100_000_000, Duration::from_secs(5)).await;
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

/// A stage restarted with a smaller budget (or with part of it given to
/// its cache) is not sent the settings decided for the larger one, which
/// it would refuse (a refusal an operator's alert fires on): the next
/// decision, made for its new budget, goes instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_back_with_a_smaller_budget_is_sent_settings_that_fit_it() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(&sqlite_url(dir.path())).await;
    let mut admin = admin_of(&c).await;
    admin
        .apply_policies(apply_request(POLICY, false))
        .await
        .unwrap();
    let mut s = session(&c.grpc, 0).await;
    let first = s.settings().await;
    let buffer = |settings: &pb::Settings| {
        settings.jobs[0]
            .settings
            .as_ref()
            .map(|j| j.max_buffer_bytes)
    };
    assert_eq!(buffer(&first), Some(64 << 20));
    drop(s);
    // Back at once, running nothing yet, with 32 MiB.
    let hello = pb::Hello {
        stage_id: "stage-1".into(),
        node: "node-1".into(),
        memory_budget_bytes: 32 << 20,
        ..Default::default()
    };
    let mut back = session_with(&c.grpc, hello).await;
    let sent = back.settings().await;
    let max = buffer(&sent).unwrap_or(0);
    assert!(
        max <= 32 << 20,
        "sent a {max}-byte buffer to a 32 MiB stage: {sent:?}"
    );
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

/// A job that starts as its stage does, before the stage has reported for
/// long enough to measure anything, gets its settings at once: its stage
/// holds it for at most half a second, then lets it read unlimited. (The
/// controller, which waits at its start for every stage's first measured
/// window, waited for this stage's too, and the job read past its limit.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_starts_with_its_stage_gets_its_settings_within_the_gate() {
    let dir = tempfile::tempdir().unwrap();
    let c = start_with(&sqlite_url(dir.path()), Duration::from_secs(5)).await;
    let mut admin = admin_of(&c).await;
    admin
        .apply_policies(apply_request(POLICY, false))
        .await
        .unwrap();
    // One report, naming job `train`: no window yet.
    let mut s = session(&c.grpc, 0).await;
    let settings = tokio::time::timeout(Duration::from_millis(500), s.settings())
        .await
        .expect("settings within the stage's gate");
    assert!(
        settings.jobs.iter().any(|j| j.job == "train"),
        "{settings:?}"
    );
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

/// `StageDataset` asks only stages that have a node cache: a stage that
/// serves the data set without one would never start the round, so with no
/// cached stage the round is refused, and once the stage reports a cache it
/// is asked. The round asked outlives a restart of the controller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_asks_stages_with_a_cache_and_outlives_a_controller_restart() {
    const CACHE: &str = "
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: p}
spec: {capacity: {bandwidth: 100MiB/s}}
---
apiVersion: sluice.dev/v1
kind: DatasetCache
metadata: {name: demo}
spec: {dataset: demo, staging: {pool: p}}
";
    let dir = tempfile::tempdir().unwrap();
    let c = start(&sqlite_url(dir.path())).await;
    let mut admin = admin_of(&c).await;
    admin
        .apply_policies(apply_request(CACHE, false))
        .await
        .unwrap();
    let mut client = StageServiceClient::connect(format!("http://{}", c.grpc))
        .await
        .unwrap();
    let (up, rx) = mpsc::channel(8);
    let hello = pb::Hello {
        stage_id: "nc".into(),
        node: "node-1".into(),
        datasets: vec!["demo".into()],
        memory_budget_bytes: 1 << 30,
        ..Default::default()
    };
    up.send(message(stage_message::Kind::Hello(hello)))
        .await
        .unwrap();
    let mut down = client
        .session(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let report = |cache: Option<pb::CacheTelemetry>| {
        message(stage_message::Kind::Telemetry(pb::Telemetry {
            unix_millis: 1,
            cache,
            ..Default::default()
        }))
    };
    up.send(report(None)).await.unwrap();
    let ask = || {
        let mut admin = admin.clone();
        async move {
            let request = pb::StageDatasetRequest {
                name: "demo".into(),
            };
            admin.stage_dataset(request).await.map(|r| r.into_inner())
        }
    };
    let refused = eventually("the report without a cache", WAIT, || async {
        ask()
            .await
            .err()
            .filter(|e| e.message().contains("has a node cache ("))
    })
    .await;
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert_eq!(
        refused.message(),
        "no stage serving `demo` has a node cache (start it with --cache-memory or --cache-dir)"
    );
    let cache = pb::CacheTelemetry {
        memory_capacity_bytes: 1 << 20,
        ..Default::default()
    };
    up.send(report(Some(cache))).await.unwrap();
    let asked = eventually("the report with a cache", WAIT, || async {
        ask().await.ok()
    })
    .await;
    assert_eq!(asked.stages, ["nc"]);
    // The stage is sent the round.
    let staged = |settings: &pb::Settings| {
        settings
            .cache
            .iter()
            .any(|c| c.dataset == "demo" && c.staging_round == asked.round)
    };
    loop {
        let next = tokio::time::timeout(WAIT, down.message()).await;
        let m = next.expect("settings in time").unwrap().expect("open");
        if let Some(controller_message::Kind::Settings(settings)) = m.kind
            && staged(&settings)
        {
            break;
        }
    }
    // A controller that starts over on the same store knows the round it
    // asked: it shows it, and sends it to a stage that connects.
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
    drop((up, down));
    let c = start(&sqlite_url(dir.path())).await;
    let mut admin = admin_of(&c).await;
    let shown = admin
        .get_dataset(pb::GetDatasetRequest {
            name: "demo".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(shown.staging_round, asked.round, "{shown:?}");
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

/// A job no policy selects is held to the stage's own limit
/// (`--rate-limit`): the views show that limit, as the stage reports it,
/// not "unlimited".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_no_policy_selects_shows_the_limit_its_stage_enforces() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(&sqlite_url(dir.path())).await;
    let s = session(&c.grpc, 0).await;
    let job = pb::JobTelemetry {
        job: "free".into(),
        connections: 1,
        bytes_per_second: Some(5 << 20),
        ..Default::default()
    };
    s.send(stage_message::Kind::Telemetry(pb::Telemetry {
        unix_millis: 2,
        jobs: vec![job],
        ..Default::default()
    }))
    .await;
    let admin = admin_of(&c).await;
    let shown = eventually("the job shown", WAIT, || {
        let mut admin = admin.clone();
        async move {
            let jobs = admin
                .list_jobs(pb::ListJobsRequest::default())
                .await
                .ok()?
                .into_inner()
                .jobs;
            jobs.into_iter()
                .find(|j| j.id == "free" && !j.stages.is_empty())
        }
    })
    .await;
    let settings = shown.settings.clone().expect("the limit in force");
    assert_eq!(settings.bytes_per_second, Some(5 << 20), "{shown:?}");
    assert_eq!(settings.ops_per_second, None, "{shown:?}");
    let view = http(&c.http, "GET", "/api/v1/jobs", "").await;
    assert!(view.contains(r#""reason":"stage""#), "{view}");
    drop(s);
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}

/// A stage lost before the controller restarts is still counted lost by
/// the stage gauges after it (they counted it nowhere, and the lost-stage
/// alert cleared and started over), as the views show it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_stage_is_counted_lost_across_a_controller_restart() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(&sqlite_url(dir.path())).await;
    let lost = r#"sluice_controller_stages{state="lost"} 1"#;
    // The session stays open and says nothing: lost after the timeout (1 s).
    let s = session(&c.grpc, 0).await;
    eventually("the stage lost", WAIT, || async {
        http(&c.http, "GET", "/metrics", "")
            .await
            .contains(lost)
            .then_some(())
    })
    .await;
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
    drop(s);
    // A timeout longer than the wait: lost as stored, not lost again.
    let c = start_with(&sqlite_url(dir.path()), Duration::from_secs(60)).await;
    eventually("the stage lost after the restart", WAIT, || async {
        let stages = http(&c.http, "GET", "/api/v1/stages", "").await;
        let metrics = http(&c.http, "GET", "/metrics", "").await;
        (stages.contains(r#""state":"lost""#) && metrics.contains(lost)).then_some(())
    })
    .await;
    c.cancel.cancel();
    c.task.await.unwrap().unwrap();
}
