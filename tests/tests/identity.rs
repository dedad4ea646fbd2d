//! Stage identity, end to end with the real binaries: a second stage that
//! says hello with a stage id already connected is refused with a sentence
//! it logs, the first keeps its session, labels and settings, and the
//! second takes over once the first dies.

mod support;

use std::path::Path;
use std::time::Duration;

use sluice_proto::AdminServiceClient;
use sluice_proto::v1::{GetStageRequest, Stage, StageState};
use support::{
    acked_above, admin, apply, controller_command, eventually, http, policy, stage_command, start,
    trainer,
};
use tonic::transport::Channel;

/// How long a test waits for what the daemons do on their own.
const WAIT: Duration = Duration::from_secs(30);

/// Returns stage `id` as the controller shows it.
async fn stage(client: &AdminServiceClient<Channel>, id: &str) -> Stage {
    let request = GetStageRequest { id: id.into() };
    client
        .clone()
        .get_stage(request)
        .await
        .unwrap()
        .into_inner()
}

/// Returns the lines of `log` that contain `text`.
fn lines_with(log: &Path, text: &str) -> Vec<String> {
    let log = std::fs::read_to_string(log).unwrap_or_default();
    log.lines()
        .filter(|l| l.contains(text))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_twin_stage_id_is_refused_until_the_first_stage_goes_away() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("c.db").display());
    let (_controller, ready) = start(controller_command(&url), &dir.path().join("c.log"));
    let grpc = ready["grpc"].as_str().unwrap().to_owned();
    let mut client = admin(&grpc).await;
    apply(&mut client, "p.yaml", &policy("100MB/s"))
        .await
        .unwrap();
    let controller = format!("http://{grpc}");

    let (mut command, socket) = stage_command(&dir.path().join("a"), "twin", &controller);
    command.arg("--label=copy=first");
    let (mut first, first_ready) = start(command, &dir.path().join("first.log"));
    let _trainer = trainer(&socket, "resnet");
    let version = acked_above(&client, "twin", 0).await;

    let (mut command, _) = stage_command(&dir.path().join("b"), "twin", &controller);
    command.arg("--label=copy=second");
    let second_log = dir.path().join("second.log");
    let (_second, second_ready) = start(command, &second_log);
    // Refused twice: the second keeps retrying, and the first has held its
    // session across both attempts.
    let refusals = eventually("two refusals in the second stage's log", WAIT, || async {
        let found = lines_with(&second_log, "is already connected from");
        (found.len() >= 2).then_some(found)
    })
    .await;
    assert!(
        refusals[0].contains("stage id `twin` is already connected from 127.0.0.1:")
            && refusals[0].contains(
                " (node twin); give each stage on a host its own --stage-id; retrying until that \
             session ends"
            ),
        "{refusals:?}"
    );
    let held = stage(&client, "twin").await;
    assert_eq!(held.state, StageState::Connected as i32);
    assert_eq!(held.labels.get("copy").map(String::as_str), Some("first"));
    // Still running what the controller publishes for it (the control
    // loop may have published since).
    assert!(
        held.acked_version == held.desired_version && held.acked_version >= version,
        "{held:?}"
    );
    let first_log = dir.path().join("first.log");
    assert!(
        lines_with(&first_log, "controller session ended").is_empty(),
        "the first stage lost its session"
    );
    let metrics = |ready: &serde_json::Value| {
        let addr = ready["metrics"].as_str().unwrap().to_owned();
        http(&addr, "GET", "/metrics", "")
    };
    assert!(metrics(&first_ready).contains("sluice_stage_controller_connected 1"));
    assert!(metrics(&second_ready).contains("sluice_stage_controller_connected 0"));

    // The first dies: the second's next attempt takes the id over.
    let _ = first.0.kill();
    let _ = first.0.wait();
    eventually("the second stage to take the id over", WAIT, || async {
        let s = stage(&client, "twin").await;
        (s.state == StageState::Connected as i32
            && s.labels.get("copy").map(String::as_str) == Some("second"))
        .then_some(())
    })
    .await;
    eventually("the second stage's session", WAIT, || async {
        metrics(&second_ready)
            .contains("sluice_stage_controller_connected 1")
            .then_some(())
    })
    .await;
}
