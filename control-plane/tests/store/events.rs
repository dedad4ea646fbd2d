//! Events (ordering, paging, a watcher racing writers) and the leader lease.

use std::time::{Duration, Instant};

use sluice_controller::store::{Store, StoreError};

use super::{Fixture, event};

pub(crate) async fn events_are_ordered_and_paged(f: &Fixture) {
    let store = f.open().await;
    assert_eq!(store.latest_event_seq().await.unwrap(), 0);
    assert!(store.events_since(0, 10).await.unwrap().is_empty());
    let mut seqs = Vec::new();
    for n in 0..5 {
        seqs.push(
            store
                .append_event(&event("policy.applied", n))
                .await
                .unwrap(),
        );
    }
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert_eq!(store.latest_event_seq().await.unwrap(), seqs[4]);

    let all = store.events_since(0, 100).await.unwrap();
    assert_eq!(all.iter().map(|e| e.seq).collect::<Vec<_>>(), seqs);
    assert_eq!(all[2].message, "event number 2");
    assert_eq!(
        (all[2].kind.as_str(), all[2].subject.as_str()),
        ("policy.applied", "stage/s2")
    );
    assert_eq!(all[2].unix_millis, 1_700_000_000_002);
    let page = store.events_since(seqs[1], 2).await.unwrap();
    assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), seqs[2..4]);
    assert!(store.events_since(seqs[4], 10).await.unwrap().is_empty());

    // The log keeps its newest events; seqs go on from the last.
    let forgotten = store.forget_unseen(0, 2).await.unwrap();
    assert_eq!(forgotten.events, 3);
    let kept = store.events_since(0, 100).await.unwrap();
    assert_eq!(kept.iter().map(|e| e.seq).collect::<Vec<_>>(), seqs[3..]);
    let next = store
        .append_event(&event("policy.applied", 5))
        .await
        .unwrap();
    assert!(next > seqs[4]);
    assert_eq!(store.forget_unseen(0, 100).await.unwrap().events, 0);
}

pub(crate) async fn concurrent_events_commit_in_seq_order(f: &Fixture) {
    let store = f.open().await;
    const WRITERS: i64 = 4;
    const EACH: i64 = 25;
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let store = store.clone();
            tokio::spawn(async move {
                for n in 0..EACH {
                    store
                        .append_event(&event("load", w * 1000 + n))
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    // A watcher following "seq > last" while writers run must see every
    // event exactly once, in seq order.
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.len() < (WRITERS * EACH) as usize {
        assert!(
            Instant::now() < deadline,
            "watcher saw {} events",
            seen.len()
        );
        let after = seen.last().copied().unwrap_or(0);
        let page = store.events_since(after, 7).await.unwrap();
        seen.extend(page.iter().map(|e| e.seq));
        if page.is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    for writer in writers {
        writer.await.unwrap();
    }
    assert!(seen.windows(2).all(|w| w[0] < w[1]));
    let stored: Vec<_> = store
        .events_since(0, 1000)
        .await
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seen, stored, "the watcher skipped an event");
}

pub(crate) async fn leadership_is_exclusive(f: &Fixture) {
    let store = f.open().await;
    let mut leader = store
        .try_acquire_leadership()
        .await
        .unwrap()
        .expect("the first leader");
    leader.check(Duration::from_secs(5)).await.unwrap();
    if store.backend_name() == "sqlite" {
        // One replica: a second store on the file is refused while the
        // first is open, and may open it once the first is closed.
        let err = Store::open(&f.url).await.unwrap_err();
        assert!(matches!(err, StoreError::InUse { .. }), "{err:?}");
        assert!(err.is_configuration(), "{err:?}");
        store.close().await;
        let other = f.open().await;
        assert!(other.try_acquire_leadership().await.unwrap().is_some());
        other.close().await;
        return;
    }
    let other = f.open().await;
    assert!(
        other.try_acquire_leadership().await.unwrap().is_none(),
        "two leaders"
    );
    leader.release().await.unwrap();
    let next = other
        .try_acquire_leadership()
        .await
        .unwrap()
        .expect("takeover after release");
    assert!(store.try_acquire_leadership().await.unwrap().is_none());
    // A leader that vanishes without releasing (its session closes) frees
    // the lease too, once the server sees the session end.
    drop(next);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if store.try_acquire_leadership().await.unwrap().is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lease outlived its dropped session"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    other.close().await;
    store.close().await;
}
