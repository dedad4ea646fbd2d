//! Tests of one tick's decision.

use super::*;

const POLICIES: &str = "
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: shared}
spec: {capacity: {bandwidth: 1000B/s}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: light}
spec:
  selector: {matchLabels: {team: light}}
  pool: shared
  limit: {burst: 200ms}
  prefetch: {readers: {min: 1, max: 8}, buffer: {min: 1MiB, max: 64MiB}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: heavy}
spec:
  selector: {matchLabels: {team: heavy}}
  pool: shared
  weight: 3
";

fn set() -> PolicySet {
    PolicySet::from_documents(crate::parse_documents("t.yaml", POLICIES).unwrap()).unwrap()
}

type Labels = BTreeMap<String, String>;

fn labels(team: &str) -> Labels {
    Labels::from([("team".to_owned(), team.to_owned())])
}

fn stage<'a>(id: &'a str, jobs: Vec<(&'a str, &'a Labels)>) -> StageReport<'a> {
    StageReport {
        id,
        node: id,
        memory_budget: 32 << 20,
        reader_budget: 0,
        jobs: jobs
            .into_iter()
            .map(|(id, labels)| JobReport {
                id,
                labels,
                window: None,
            })
            .collect(),
    }
}

fn demand(bytes: f64) -> StageDemand {
    StageDemand {
        bytes_per_second: Some(bytes),
        wants_more: false,
        ..StageDemand::UNKNOWN
    }
}

#[test]
fn greedy_jobs_share_by_weight_and_split_over_their_stages() {
    let (light, heavy, other) = (labels("light"), labels("heavy"), labels("x"));
    let stages = [
        stage("s1", vec![("a", &light), ("b", &heavy), ("c", &other)]),
        stage("s2", vec![("a", &light), ("b", &heavy)]),
        stage("s3", vec![]),
    ];
    let c = assign(&set(), &stages, &BTreeMap::new());
    assert_eq!(c.assignments.keys().collect::<Vec<_>>(), ["s1", "s2", "s3"]);
    assert_eq!(
        c.assignments["s1"].jobs.keys().collect::<Vec<_>>(),
        ["a", "b"]
    );
    assert!(c.assignments["s3"].jobs.is_empty());
    let rate = |s: &str, j: &str| c.assignments[s].jobs[j].bytes_per_second;
    assert_eq!((rate("s1", "a"), rate("s2", "a")), (Some(125), Some(125)));
    assert_eq!((rate("s1", "b"), rate("s2", "b")), (Some(375), Some(375)));
    let a = &c.assignments["s1"].jobs["a"];
    assert_eq!(a.reason, "weighted-share");
    assert_eq!((a.policy.as_str(), a.pool.as_str()), ("light", "shared"));
    assert_eq!((a.min_readers, a.max_readers, a.burst_millis), (1, 8, 200));
    // The stage's 32 MiB budget, shared 1:3 with `b`.
    assert_eq!((a.min_buffer_bytes, a.max_buffer_bytes), (1 << 20, 8 << 20));
    assert_eq!(c.assignments["s1"].jobs["b"].max_buffer_bytes, 24 << 20);
    assert_eq!(c.shares.jobs["b"].bytes_per_second.round(), 750.0);
    assert_eq!(c.shares.jobs["b"].demand_bytes_per_second, None);
    assert!(!c.shares.jobs.contains_key("c"));
    assert_eq!(
        c.shares.pools["shared"].allocated_bytes_per_second.round(),
        1000.0
    );
}

#[test]
fn a_job_that_wants_little_leaves_the_rest_and_splits_by_demand() {
    let (light, heavy) = (labels("light"), labels("heavy"));
    let stages = [
        stage("s1", vec![("a", &light), ("b", &heavy)]),
        stage("s2", vec![("a", &light), ("b", &heavy)]),
    ];
    let demands = BTreeMap::from([(
        "a".to_owned(),
        BTreeMap::from([
            ("s1".to_owned(), demand(90.0)),
            ("s2".to_owned(), demand(10.0)),
        ]),
    )]);
    let c = assign(&set(), &stages, &demands);
    let a = &c.shares.jobs["a"];
    assert_eq!(
        (a.bytes_per_second.round(), a.reason.as_str()),
        (100.0, "demand-limited")
    );
    assert_eq!(a.demand_bytes_per_second, Some(100.0));
    assert_eq!(c.assignments["s1"].jobs["a"].bytes_per_second, Some(90));
    assert_eq!(c.assignments["s2"].jobs["a"].bytes_per_second, Some(10));
    assert_eq!(c.shares.jobs["b"].bytes_per_second.round(), 900.0);
    // The pool is fully allocated: nothing to lend.
    assert_eq!(c.shares.jobs["a"].enforced_bytes_per_second.round(), 100.0);
}

#[test]
fn capacity_nobody_wants_is_lent_by_weight_up_to_limits() {
    let (light, heavy) = (labels("light"), labels("heavy"));
    let stages = [stage("s1", vec![("a", &light), ("b", &heavy)])];
    let wants = |bytes| BTreeMap::from([("s1".to_owned(), demand(bytes))]);
    let demands = BTreeMap::from([
        ("a".to_owned(), wants(100.0)),
        ("b".to_owned(), wants(100.0)),
    ]);
    let c = assign(&set(), &stages, &demands);
    // 800 spare, lent 1:3.
    assert_eq!(c.shares.jobs["a"].bytes_per_second.round(), 100.0);
    assert_eq!(c.shares.jobs["a"].enforced_bytes_per_second.round(), 300.0);
    assert_eq!(c.shares.jobs["b"].enforced_bytes_per_second.round(), 700.0);
    assert_eq!(c.assignments["s1"].jobs["b"].bytes_per_second, Some(700));
    assert_eq!(c.assignments["s1"].jobs["b"].reason, "demand-limited");
}

/// A window of `mib` MiB/s read and delivered, throttled and stalled or
/// not, ending at `ends_at`.
fn window(mib: f64, pressed: bool, ends_at: i64) -> Option<Window> {
    let bytes = mib * 1024.0 * 1024.0;
    let pressure = if pressed { 1.0 } else { 0.0 };
    Some(Window {
        read_bytes_per_second: bytes,
        delivered_bytes_per_second: bytes,
        cache_hit_bytes_per_second: 0.0,
        delivered_samples_per_second: 0.0,
        throttled: pressure,
        stalled: pressure,
        ends_at,
    })
}

#[test]
fn the_coordinator_estimates_demand_from_windows_and_keeps_it() {
    let policies = PolicySet::from_documents(
        crate::parse_documents(
            "t.yaml",
            &POLICIES.replace("bandwidth: 1000B/s", "bandwidth: 100MiB/s"),
        )
        .unwrap(),
    )
    .unwrap();
    let (light, heavy) = (labels("light"), labels("heavy"));
    let mut coordinator = Coordinator::new();
    let mut decide = |a: Option<Window>, b: Option<Window>| {
        let mut s = stage("s1", vec![("a", &light), ("b", &heavy)]);
        s.jobs[0].window = a;
        s.jobs[1].window = b;
        coordinator.decide(&policies, &[s]).shares.jobs
    };
    let mib = |share: &JobShare| (share.bytes_per_second / (1024.0 * 1024.0)).round();
    // New jobs: unknown, so greedy: 25 and 75 MiB/s.
    let first = decide(None, None);
    assert_eq!(
        (mib(&first["a"]), first["a"].demand_bytes_per_second),
        (25.0, None)
    );
    // Their first window is a warm-up: still greedy.
    let warm = decide(window(5.0, false, 1), window(75.0, true, 1));
    assert_eq!(mib(&warm["a"]), 25.0);
    // Then `a` reads 10 MiB/s unthrottled: its demand is 11, and greedy
    // `b` gets the rest (89).
    let measured = decide(window(10.0, false, 2), window(75.0, true, 2));
    assert_eq!(mib(&measured["a"]), 11.0);
    assert_eq!(measured["a"].reason, Reason::DemandLimited);
    assert_eq!(mib(&measured["b"]), 89.0);
    // The same windows seen again change nothing.
    let again = decide(window(10.0, false, 2), window(75.0, true, 2));
    assert_eq!(again, measured);
}

#[test]
fn a_pool_names_what_the_allocation_could_not_do_in_it() {
    const STATIC: &str = "
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: fixed}
spec: {capacity: {bandwidth: 20MiB/s}, sharing: static}
---
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: other}
spec: {capacity: {bandwidth: 20MiB/s}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: research}
spec:
  selector: {matchLabels: {team: research}}
  pool: fixed
  limit: {bandwidth: 8MiB/s}
";
    let set = PolicySet::from_documents(crate::parse_documents("t.yaml", STATIC).unwrap()).unwrap();
    let research = labels("research");
    let two = [stage("s1", vec![("r1", &research), ("r2", &research)])];
    let c = assign(&set, &two, &BTreeMap::new());
    assert!(c.shares.pools["fixed"].problems.is_empty());
    let three = [stage(
        "s1",
        vec![("r1", &research), ("r2", &research), ("r3", &research)],
    )];
    let c = assign(&set, &three, &BTreeMap::new());
    assert_eq!(
        c.shares.pools["fixed"].problems,
        ["static pool fixed: bandwidth limits add up to 24.0 MiB/s > capacity 20.0 MiB/s"]
    );
    assert_eq!(c.shares.problems, c.shares.pools["fixed"].problems);
    assert!(c.shares.pools["other"].problems.is_empty());
}
