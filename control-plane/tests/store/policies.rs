//! Policy revisions: identical re-apply, history, tombstones, atomic
//! multi-document applies, concurrent appliers, input checks.

use std::collections::BTreeSet;

use sluice_controller::store::{ApplyOutcome, PolicyDocument, StoreError};

use super::{Fixture, JOB, POOL, hello};

pub(crate) async fn identical_reapply_creates_no_revision(f: &Fixture) {
    let store = f.open().await;
    assert_eq!(
        store.apply_policy(POOL, "shared", "{a}").await.unwrap(),
        (1, ApplyOutcome::Created)
    );
    assert_eq!(
        store.apply_policy(POOL, "shared", "{a}").await.unwrap(),
        (1, ApplyOutcome::Unchanged)
    );
    assert_eq!(
        store.apply_policy(POOL, "shared", "{b}").await.unwrap(),
        (2, ApplyOutcome::Updated)
    );
    assert_eq!(
        store.apply_policy(POOL, "shared", "{b}").await.unwrap(),
        (2, ApplyOutcome::Unchanged)
    );
    // Going back to an older text is a change like any other.
    assert_eq!(
        store.apply_policy(POOL, "shared", "{a}").await.unwrap(),
        (3, ApplyOutcome::Updated)
    );
    assert_eq!(store.policy_history(POOL, "shared").await.unwrap().len(), 3);
    // Same name, other kind: another policy.
    assert_eq!(
        store.apply_policy(JOB, "shared", "{a}").await.unwrap(),
        (1, ApplyOutcome::Created)
    );
}

pub(crate) async fn history_keeps_every_revision_in_order(f: &Fixture) {
    let store = f.open().await;
    for text in ["one", "two", "three"] {
        store.apply_policy(JOB, "vision", text).await.unwrap();
    }
    let history = store.policy_history(JOB, "vision").await.unwrap();
    let seen: Vec<_> = history
        .iter()
        .map(|r| (r.revision, r.canonical.as_deref()))
        .collect();
    assert_eq!(
        seen,
        [(1, Some("one")), (2, Some("two")), (3, Some("three"))]
    );
    assert!(
        history
            .iter()
            .all(|r| r.kind == JOB && r.name == "vision" && r.created_ms > 0)
    );
    assert!(
        history
            .windows(2)
            .all(|w| w[0].created_ms <= w[1].created_ms)
    );
    assert!(store.policy_history(JOB, "never").await.unwrap().is_empty());
}

pub(crate) async fn delete_records_a_tombstone(f: &Fixture) {
    let store = f.open().await;
    store.apply_policy(JOB, "vision", "v1").await.unwrap();
    assert_eq!(store.delete_policy(JOB, "vision").await.unwrap(), 2);
    assert!(store.current_policies().await.unwrap().is_empty());
    let history = store.policy_history(JOB, "vision").await.unwrap();
    assert_eq!(history.len(), 2);
    assert!(history[1].is_tombstone() && history[1].revision == 2);

    let again = store.delete_policy(JOB, "vision").await.unwrap_err();
    assert!(
        matches!(&again, StoreError::PolicyNotFound { kind, name } if kind == JOB && name == "vision")
    );
    assert_eq!(again.to_string(), "JobPolicy `vision` does not exist");
    let never = store.delete_policy(POOL, "vision").await.unwrap_err();
    assert!(
        matches!(never, StoreError::PolicyNotFound { .. }),
        "{never:?}"
    );

    // Applying the deleted text again re-creates the policy, as a new revision.
    assert_eq!(
        store.apply_policy(JOB, "vision", "v1").await.unwrap(),
        (3, ApplyOutcome::Created)
    );
    assert_eq!(store.current_policies().await.unwrap()[0].revision, 3);
}

pub(crate) async fn multi_apply_is_all_or_nothing(f: &Fixture) {
    let store = f.open().await;
    store.apply_policy(POOL, "shared", "old").await.unwrap();
    let batch = [
        PolicyDocument::new(POOL, "shared", "new"),
        PolicyDocument::new(JOB, "vision", "v"),
        PolicyDocument::new(JOB, "", "no name"),
    ];
    let err = store.apply_policies(&batch).await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Invalid {
                field: "policy name",
                ..
            }
        ),
        "{err:?}"
    );
    // The two documents before the bad one were written, then rolled back.
    let current = store.current_policies().await.unwrap();
    assert_eq!(current.len(), 1);
    assert_eq!(
        (current[0].revision, current[0].canonical.as_deref()),
        (1, Some("old"))
    );
    assert!(
        store
            .policy_history(JOB, "vision")
            .await
            .unwrap()
            .is_empty()
    );

    let applied = store.apply_policies(&batch[..2]).await.unwrap();
    let got: Vec<_> = applied
        .iter()
        .map(|a| (a.kind.as_str(), a.name.as_str(), a.revision, a.outcome))
        .collect();
    assert_eq!(
        got,
        [
            (POOL, "shared", 2, ApplyOutcome::Updated),
            (JOB, "vision", 1, ApplyOutcome::Created)
        ]
    );
    // A document repeated in one batch sees the earlier one's write.
    let twice = [
        PolicyDocument::new(JOB, "nlp", "x"),
        PolicyDocument::new(JOB, "nlp", "x"),
    ];
    let applied = store.apply_policies(&twice).await.unwrap();
    assert_eq!(applied[1].outcome, ApplyOutcome::Unchanged);
    assert!(store.apply_policies(&[]).await.unwrap().is_empty());
}

pub(crate) async fn current_policies_are_the_live_heads(f: &Fixture) {
    let store = f.open().await;
    store.apply_policy(POOL, "b-pool", "1").await.unwrap();
    store.apply_policy(JOB, "z-job", "1").await.unwrap();
    store.apply_policy(JOB, "a-job", "1").await.unwrap();
    store.apply_policy(JOB, "a-job", "2").await.unwrap();
    store.apply_policy(JOB, "gone", "1").await.unwrap();
    store.delete_policy(JOB, "gone").await.unwrap();
    let current = store.current_policies().await.unwrap();
    let got: Vec<_> = current
        .iter()
        .map(|p| (p.kind.as_str(), p.name.as_str(), p.revision))
        .collect();
    assert_eq!(
        got,
        [(JOB, "a-job", 2), (JOB, "z-job", 1), (POOL, "b-pool", 1)]
    );
    assert_eq!(current[0].canonical.as_deref(), Some("2"));
}

pub(crate) async fn concurrent_appliers_never_duplicate_revisions(f: &Fixture) {
    let store = f.open().await;
    const N: usize = 12;
    // N different texts for one policy: N revisions, each number once.
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.apply_policy(JOB, "busy", &format!("text {i}")).await })
        })
        .collect();
    let mut revisions = BTreeSet::new();
    for task in tasks {
        let (revision, _) = task.await.unwrap().expect("a concurrent apply failed");
        assert!(
            revisions.insert(revision),
            "revision {revision} handed out twice"
        );
    }
    assert_eq!(revisions, (1..=N as u64).collect());
    assert_eq!(store.policy_history(JOB, "busy").await.unwrap().len(), N);

    // N identical texts for a new policy: one revision, one creator.
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let batch = [
                    PolicyDocument::new(JOB, "same", "text"),
                    PolicyDocument::new(POOL, "p", "t"),
                ];
                store.apply_policies(&batch).await
            })
        })
        .collect();
    let mut created = 0;
    for task in tasks {
        let applied = task.await.unwrap().expect("a concurrent apply failed");
        assert!(applied.iter().all(|a| a.revision == 1));
        created += usize::from(applied[0].outcome == ApplyOutcome::Created);
    }
    assert_eq!(created, 1);
    assert_eq!(store.policy_history(JOB, "same").await.unwrap().len(), 1);
}

pub(crate) async fn bad_names_are_refused(f: &Fixture) {
    let store = f.open().await;
    let long = "x".repeat(300);
    for (kind, name, text) in [
        ("", "n", "t"),
        (JOB, "", "t"),
        (JOB, long.as_str(), "t"),
        (JOB, "n", " "),
    ] {
        let err = store.apply_policy(kind, name, text).await.unwrap_err();
        assert!(matches!(err, StoreError::Invalid { .. }), "{err:?}");
    }
    let err = store.stage_hello(&hello("", "n", 0), 1).await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Invalid {
                field: "stage id",
                ..
            }
        ),
        "{err:?}"
    );
    let err = store.record_ack("s", u64::MAX).await.unwrap_err();
    assert!(matches!(err, StoreError::Invalid { .. }), "{err:?}");
    assert!(store.current_policies().await.unwrap().is_empty());
}
