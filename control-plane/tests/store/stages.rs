//! Stages, settings versions, acks and nacks, jobs, and state surviving a
//! reopen of the store.

use sluice_controller::store::{ApplyOutcome, JobSighting, Labels, StageState, StoreError};

use super::{Fixture, JOB, event, hello, labels};

pub(crate) async fn stage_hello_creates_then_updates(f: &Fixture) {
    let store = f.open().await;
    let first = store
        .stage_hello(&hello("s1", "node-1", 0), 1_000)
        .await
        .unwrap();
    assert_eq!(
        (first.id.as_str(), first.node.as_str(), first.state),
        ("s1", "node-1", StageState::Connected)
    );
    assert_eq!(first.labels, labels(&[("zone", "a")]));
    assert_eq!((first.first_seen_ms, first.last_seen_ms), (1_000, 1_000));
    assert_eq!(
        (first.desired, first.acked_version, first.last_nack),
        (None, None, None)
    );

    let version = store
        .set_desired_settings("s1", "{\"readers\":4}")
        .await
        .unwrap();
    store.record_ack("s1", version).await.unwrap();
    store.mark_stage_lost("s1").await.unwrap();

    // The stage comes back on another node with new labels, running `version`.
    let mut again = hello("s1", "node-2", version);
    again.labels = labels(&[("zone", "b"), ("rack", "7")]);
    let back = store.stage_hello(&again, 2_000).await.unwrap();
    assert_eq!(
        (back.node.as_str(), back.state),
        ("node-2", StageState::Connected)
    );
    assert_eq!(back.labels, again.labels);
    assert_eq!((back.first_seen_ms, back.last_seen_ms), (1_000, 2_000));
    assert_eq!(back.desired_version(), Some(version));
    assert_eq!(back.desired.unwrap().document, "{\"readers\":4}");
    assert_eq!(back.acked_version, Some(version));
    assert_eq!(
        store.stage("s1").await.unwrap().unwrap().labels,
        again.labels
    );

    store
        .stage_hello(&hello("s0", "node-0", 0), 3_000)
        .await
        .unwrap();
    let ids: Vec<_> = store
        .stages()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(ids, ["s0", "s1"]);
    assert!(store.stage("nope").await.unwrap().is_none());
}

pub(crate) async fn stage_state_and_acks(f: &Fixture) {
    let store = f.open().await;
    store
        .stage_hello(&hello("s1", "n", 0), 1_000)
        .await
        .unwrap();
    store.mark_stage_lost("s1").await.unwrap();
    let lost = store.stage("s1").await.unwrap().unwrap();
    assert_eq!((lost.state, lost.last_seen_ms), (StageState::Lost, 1_000));
    store.mark_stage_seen("s1", 5_000).await.unwrap();
    let seen = store.stage("s1").await.unwrap().unwrap();
    assert_eq!(
        (seen.state, seen.last_seen_ms),
        (StageState::Connected, 5_000)
    );

    let v1 = store.set_desired_settings("s1", "a").await.unwrap();
    store.record_ack("s1", v1).await.unwrap();
    let v2 = store.set_desired_settings("s1", "b").await.unwrap();
    store
        .record_nack("s1", v2, "buffer budget above the node's memory")
        .await
        .unwrap();
    let stage = store.stage("s1").await.unwrap().unwrap();
    assert_eq!(stage.acked_version, Some(v1));
    let nack = stage.last_nack.unwrap();
    assert_eq!(
        (nack.version, nack.reason.as_str()),
        (v2, "buffer budget above the node's memory")
    );

    // An ack of an older version leaves the newer nack; acking it clears it.
    store.record_ack("s1", v1).await.unwrap();
    assert!(
        store
            .stage("s1")
            .await
            .unwrap()
            .unwrap()
            .last_nack
            .is_some()
    );
    let v3 = store.set_desired_settings("s1", "c").await.unwrap();
    store.record_ack("s1", v3).await.unwrap();
    let stage = store.stage("s1").await.unwrap().unwrap();
    assert_eq!(
        (stage.acked_version, stage.desired_version()),
        (Some(v3), Some(v3))
    );
    assert_eq!(stage.last_nack, None);
}

pub(crate) async fn unknown_stages_are_refused(f: &Fixture) {
    let store = f.open().await;
    let is_unknown = |r: Result<_, StoreError>| matches!(r, Err(StoreError::StageNotFound { id }) if id == "ghost");
    assert!(is_unknown(
        store.next_settings_version("ghost").await.map(drop)
    ));
    assert!(is_unknown(
        store.set_desired_settings("ghost", "x").await.map(drop)
    ));
    assert!(is_unknown(store.record_ack("ghost", 1).await));
    assert!(is_unknown(store.record_nack("ghost", 1, "no").await));
    assert!(is_unknown(store.mark_stage_seen("ghost", 1).await));
    assert!(is_unknown(store.mark_stage_lost("ghost").await));
    let sighting = JobSighting {
        job: "j".into(),
        labels: Labels::new(),
        stage: "ghost".into(),
    };
    assert!(is_unknown(store.upsert_job(&sighting, 1).await));
    // The failed sighting left no half-written job behind.
    assert!(store.jobs().await.unwrap().is_empty());
}

pub(crate) async fn versions_and_state_survive_a_reopen(f: &Fixture) {
    let store = f.open().await;
    store.stage_hello(&hello("s1", "n", 0), 1).await.unwrap();
    assert_eq!(store.next_settings_version("s1").await.unwrap(), 1);
    assert_eq!(store.next_settings_version("s1").await.unwrap(), 2);
    assert_eq!(store.set_desired_settings("s1", "doc").await.unwrap(), 3);
    store.apply_policy(JOB, "vision", "v1").await.unwrap();
    store.apply_policy(JOB, "vision", "v2").await.unwrap();
    let sighting = JobSighting {
        job: "train".into(),
        labels: labels(&[("team", "vision")]),
        stage: "s1".into(),
    };
    store.upsert_job(&sighting, 10).await.unwrap();
    let seq = store.append_event(&event("stage.hello", 1)).await.unwrap();
    store.close().await;

    let store = f.open().await;
    assert_eq!(store.next_settings_version("s1").await.unwrap(), 4);
    let stage = store.stage("s1").await.unwrap().unwrap();
    assert_eq!(stage.desired.unwrap().document, "doc");
    assert_eq!(store.current_policies().await.unwrap()[0].revision, 2);
    assert_eq!(
        store.apply_policy(JOB, "vision", "v2").await.unwrap(),
        (2, ApplyOutcome::Unchanged)
    );
    assert_eq!(store.job("train").await.unwrap().unwrap().stages, ["s1"]);
    assert!(store.append_event(&event("stage.lost", 2)).await.unwrap() > seq);

    // A stage running a version from elsewhere raises the counter above it;
    // one running an older version never lowers it.
    store.stage_hello(&hello("s1", "n", 40), 2).await.unwrap();
    assert_eq!(store.next_settings_version("s1").await.unwrap(), 41);
    store.stage_hello(&hello("s1", "n", 3), 3).await.unwrap();
    assert_eq!(store.set_desired_settings("s1", "doc2").await.unwrap(), 42);
    store.close().await;
    assert_eq!(
        f.open().await.next_settings_version("s1").await.unwrap(),
        43
    );
}

pub(crate) async fn jobs_collect_their_stages(f: &Fixture) {
    let store = f.open().await;
    for stage in ["s1", "s2"] {
        store.stage_hello(&hello(stage, "n", 0), 1).await.unwrap();
    }
    let mut sighting = JobSighting {
        job: "train".into(),
        labels: labels(&[("team", "a")]),
        stage: "s2".into(),
    };
    store.upsert_job(&sighting, 100).await.unwrap();
    sighting.stage = "s1".into();
    sighting.labels = labels(&[("team", "b")]);
    store.upsert_job(&sighting, 200).await.unwrap();
    store.upsert_job(&sighting, 300).await.unwrap();
    let other = JobSighting {
        job: "eval".into(),
        labels: Labels::new(),
        stage: "s1".into(),
    };
    store.upsert_job(&other, 250).await.unwrap();

    let job = store.job("train").await.unwrap().unwrap();
    assert_eq!(job.labels, labels(&[("team", "b")]));
    assert_eq!((job.first_seen_ms, job.last_seen_ms), (100, 300));
    assert_eq!(job.stages, ["s1", "s2"]);
    let jobs = store.jobs().await.unwrap();
    let got: Vec<_> = jobs
        .iter()
        .map(|j| (j.id.as_str(), j.stages.len()))
        .collect();
    assert_eq!(got, [("eval", 1), ("train", 2)]);
    assert!(store.job("nope").await.unwrap().is_none());
}

pub(crate) async fn stages_and_jobs_not_seen_for_long_are_forgotten(f: &Fixture) {
    let store = f.open().await;
    // s1 lost long ago, s2 lost recently, s3 connected (seen long ago: a
    // connected stage is forgotten only once lost); s4 leaves.
    for (stage, seen) in [("s1", 100), ("s2", 5_000), ("s3", 100), ("s4", 5_000)] {
        store
            .stage_hello(&hello(stage, "n", 0), seen)
            .await
            .unwrap();
    }
    store.mark_stage_lost("s1").await.unwrap();
    store.mark_stage_lost("s2").await.unwrap();
    for (job, stage, seen) in [
        ("old", "s1", 200),
        ("recent", "s2", 5_000),
        ("gone", "s4", 150),
    ] {
        let sighting = JobSighting {
            job: job.into(),
            labels: Labels::new(),
            stage: stage.into(),
        };
        store.upsert_job(&sighting, seen).await.unwrap();
    }
    store.forget_stage("s4").await.unwrap();
    let ids = |stages: Vec<sluice_controller::store::StageRecord>| {
        stages.into_iter().map(|s| s.id).collect::<Vec<_>>()
    };
    assert_eq!(ids(store.stages().await.unwrap()), ["s1", "s2", "s3"]);
    assert!(store.job("gone").await.unwrap().unwrap().stages.is_empty());

    let forgotten = store.forget_unseen(1_000, 100).await.unwrap();
    assert_eq!(forgotten.stages, ["s1"]);
    assert_eq!(forgotten.jobs, ["gone", "old"]);
    assert_eq!(ids(store.stages().await.unwrap()), ["s2", "s3"]);
    let jobs: Vec<String> = store
        .jobs()
        .await
        .unwrap()
        .into_iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(jobs, ["recent"]);
    // Nothing more to forget.
    assert_eq!(
        store.forget_unseen(1_000, 100).await.unwrap(),
        Default::default()
    );
}
