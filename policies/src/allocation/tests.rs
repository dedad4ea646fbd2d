use proptest::prelude::*;

use super::*;

fn pool(capacity: f64, sharing: Sharing) -> PoolInput {
    PoolInput::new("p", capacity, sharing)
}

fn job(id: &str, weight: f64) -> JobInput {
    JobInput::new(id, "p", weight)
}

fn rates(a: &Allocation) -> Vec<f64> {
    a.jobs.iter().map(|j| j.bandwidth.rate).collect()
}

fn reasons(a: &Allocation) -> Vec<Reason> {
    a.jobs.iter().map(|j| j.bandwidth.reason).collect()
}

fn assert_close(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "{got:?} != {want:?}");
    }
}

fn run(capacity: f64, sharing: Sharing, jobs: Vec<JobInput>) -> Allocation {
    allocate(&Snapshot {
        pools: vec![pool(capacity, sharing)],
        jobs,
        nodes: vec![],
    })
}

fn stage(id: &str, demand: Option<f64>) -> StageInput {
    StageInput {
        stage: id.to_owned(),
        demand,
        wants_more: false,
        readers: Bounds { min: 1, max: 16 },
        buffer: Bounds { min: 4, max: 64 },
    }
}

#[test]
fn greedy_jobs_share_by_weight() {
    let jobs = [("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0)]
        .map(|(i, w)| job(i, w))
        .to_vec();
    let a = run(1000.0, Sharing::WeightedFair, jobs);
    assert_close(&rates(&a), &[100.0, 200.0, 300.0, 400.0]);
    assert!(reasons(&a).iter().all(|r| *r == Reason::WeightedShare));
    assert!(a.problems.is_empty());
}

#[test]
fn unused_share_is_redistributed_by_weight() {
    let mut jobs = [("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0)]
        .map(|(i, w)| job(i, w))
        .to_vec();
    jobs[0].demand.bandwidth = Some(10.0);
    let a = run(1000.0, Sharing::WeightedFair, jobs);
    assert_close(&rates(&a), &[10.0, 220.0, 330.0, 440.0]);
    assert_eq!(reasons(&a)[0], Reason::DemandLimited);
}

#[test]
fn a_guarantee_is_a_floor_not_a_bonus() {
    let mut low = job("low", 1.0);
    low.guarantee.bandwidth = Some(400.0);
    let a = run(
        1000.0,
        Sharing::WeightedFair,
        vec![low.clone(), job("high", 4.0)],
    );
    // Weighted alone: 200/800; the guarantee lifts `low` to 400.
    assert_close(&rates(&a), &[400.0, 600.0]);
    assert_eq!(reasons(&a), [Reason::Guarantee, Reason::WeightedShare]);
    // A guarantee below the weighted share changes nothing.
    low.guarantee.bandwidth = Some(100.0);
    let a = run(1000.0, Sharing::WeightedFair, vec![low, job("high", 4.0)]);
    assert_close(&rates(&a), &[200.0, 800.0]);
}

#[test]
fn a_cap_is_respected_and_the_rest_lent() {
    let mut capped = job("capped", 3.0);
    capped.limit.bandwidth = Some(150.0);
    let a = run(
        1000.0,
        Sharing::WeightedFair,
        vec![capped, job("other", 1.0)],
    );
    assert_close(&rates(&a), &[150.0, 850.0]);
    assert_eq!(reasons(&a), [Reason::Cap, Reason::WeightedShare]);
}

#[test]
fn demand_below_capacity_is_met_in_full() {
    let jobs: Vec<JobInput> = (0..3)
        .map(|i| {
            let mut j = job(&format!("j{i}"), 1.0 + f64::from(i));
            j.demand.bandwidth = Some(100.0);
            j
        })
        .collect();
    let a = run(1000.0, Sharing::WeightedFair, jobs);
    assert_close(&rates(&a), &[100.0; 3]);
}

#[test]
fn infeasible_guarantees_are_scaled_and_reported() {
    let jobs: Vec<JobInput> = [600.0, 900.0]
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let mut j = job(&format!("j{i}"), 1.0);
            j.guarantee.bandwidth = Some(*g);
            j
        })
        .collect();
    let a = run(1000.0, Sharing::WeightedFair, jobs);
    assert_close(&rates(&a), &[400.0, 600.0]);
    assert_eq!(reasons(&a), [Reason::Guarantee; 2]);
    assert!(matches!(
        a.problems[..],
        [Problem::GuaranteesInfeasible { resource: Resource::Bandwidth, guaranteed, scale, .. }]
            if guaranteed == 1500.0 && (scale - 2.0 / 3.0).abs() < 1e-12
    ));
}

/// `guaranteed` jobs guaranteed 15 each and one with none, in a
/// weighted-fair pool of 30.
fn beside_guarantees(guaranteed: usize) -> Allocation {
    let mut jobs: Vec<JobInput> = (0..guaranteed)
        .map(|i| {
            let mut j = job(&format!("g{i}"), 1.0);
            j.guarantee.bandwidth = Some(15.0);
            j
        })
        .collect();
    jobs.push(job("plain", 1.0));
    run(30.0, Sharing::WeightedFair, jobs)
}

#[test]
fn guarantees_that_fill_the_pool_leave_a_job_without_one_room_to_read() {
    let a = beside_guarantees(2);
    assert_close(&rates(&a), &[14.25, 14.25, 1.5]);
    assert_eq!(a.problems.len(), 1);
}

#[test]
fn infeasible_guarantees_leave_a_job_without_one_room_to_read() {
    let a = beside_guarantees(3);
    assert_close(&rates(&a), &[9.5, 9.5, 9.5, 1.5]);
    assert_eq!(reasons(&a)[3], Reason::WeightedShare);
    assert!(matches!(
        a.problems[..],
        [Problem::GuaranteesInfeasible { scale, .. }] if (scale - 28.5 / 45.0).abs() < 1e-12
    ));
}

#[test]
fn priority_classes_are_served_in_order() {
    let mut top = job("top", 1.0);
    top.priority = 10;
    top.demand.bandwidth = Some(300.0);
    let mut guaranteed = job("guaranteed", 1.0);
    guaranteed.priority = -5;
    guaranteed.guarantee.bandwidth = Some(100.0);
    let a = run(
        1000.0,
        Sharing::Priority,
        vec![top, job("q", 1.0), job("r", 3.0), guaranteed],
    );
    // Guarantees first (100), then class 10 (300), then class 0 the 600
    // left split 1:3, and class -5 keeps only its guarantee.
    assert_close(&rates(&a), &[300.0, 150.0, 450.0, 100.0]);
    assert_eq!(
        reasons(&a),
        [
            Reason::DemandLimited,
            Reason::Priority,
            Reason::Priority,
            Reason::Guarantee
        ]
    );
}

#[test]
fn a_satisfied_higher_class_leaves_the_rest_to_lower_ones() {
    let mut top = job("top", 1.0);
    top.priority = 1;
    top.demand.bandwidth = Some(100.0);
    let mut low = job("low", 1.0);
    low.demand.bandwidth = Some(200.0);
    let a = run(1000.0, Sharing::Priority, vec![top, low]);
    assert_close(&rates(&a), &[100.0, 200.0]);
}

#[test]
fn static_gives_limits_as_written_and_reports_overcommitment() {
    let mut a1 = job("a", 1.0);
    a1.limit.bandwidth = Some(700.0);
    a1.demand.bandwidth = Some(10.0);
    let mut b = job("b", 1.0);
    b.limit.bandwidth = Some(500.0);
    let a = run(1000.0, Sharing::Static, vec![a1, b, job("c", 1.0)]);
    assert_close(&rates(&a), &[700.0, 500.0, 0.0]);
    assert_eq!(reasons(&a), [Reason::Static; 3]);
    assert!(
        a.problems
            .iter()
            .any(|p| matches!(p, Problem::StaticOverCommitted { limits, .. } if *limits == 1200.0))
    );
    assert!(
        a.problems
            .iter()
            .any(|p| matches!(p, Problem::StaticWithoutLimit { job, .. } if job == "c"))
    );
}

#[test]
fn ops_are_shared_like_bandwidth_when_the_pool_limits_them() {
    let mut p = pool(1000.0, Sharing::WeightedFair);
    p.ops = Some(90.0);
    let mut capped = job("a", 1.0);
    capped.limit.ops = Some(500.0);
    let a = allocate(&Snapshot {
        pools: vec![p],
        jobs: vec![capped, job("b", 2.0)],
        nodes: vec![],
    });
    let ops: Vec<f64> = a.jobs.iter().map(|j| j.ops.unwrap().rate).collect();
    assert_close(&ops, &[30.0, 60.0]);
    // Without a pool ops capacity only the job's own limit applies.
    let mut capped = job("a", 1.0);
    capped.limit.ops = Some(500.0);
    let a = run(1000.0, Sharing::WeightedFair, vec![capped, job("b", 2.0)]);
    assert_eq!(
        a.jobs[0].ops,
        Some(Share {
            rate: 500.0,
            reason: Reason::Cap
        })
    );
    assert_eq!(a.jobs[1].ops, None);
}

#[test]
fn unknown_pools_and_bad_weights_are_reported() {
    let mut lost = job("lost", 1.0);
    lost.pool = "nowhere".to_owned();
    let a = run(
        100.0,
        Sharing::WeightedFair,
        vec![lost, job("nan", f64::NAN), job("ok", 1.0)],
    );
    assert_eq!(a.jobs.len(), 2);
    assert_close(&rates(&a), &[50.0, 50.0]);
    assert_eq!(a.problems.len(), 2);
}

#[test]
fn stages_split_by_measured_demand() {
    let held = |ds: &[Option<f64>]| ds.iter().map(|&d| (d, false)).collect::<Vec<_>>();
    assert_close(
        &split(900.0, &held(&[Some(100.0), Some(200.0)])),
        &[300.0, 600.0],
    );
    assert_close(&split(900.0, &held(&[None, None, None])), &[300.0; 3]);
    assert_close(&split(900.0, &held(&[Some(0.0), Some(0.0)])), &[450.0; 2]);
    // An idle stage keeps 5% of an even share (15 of 300) to grow from.
    assert_close(
        &split(900.0, &held(&[Some(1.0), None, Some(3.0)])),
        &[221.25, 15.0, 663.75],
    );
    assert!(split(900.0, &[]).is_empty());
}

#[test]
fn a_stage_held_back_by_its_trainers_gets_its_demand_before_stages_that_want_more() {
    // One rank reads as fast as it may (wants more, at 1.5x its 89), the
    // other's trainer computes and consumes 10 (11 with headroom): the
    // paced stage gets its 11, not 11/144 of the share (7.6, which would
    // stall it, make it want more and swing the split to 50/50).
    assert_close(
        &split(100.0, &[(Some(133.5), true), (Some(11.0), false)]),
        &[89.0, 11.0],
    );
    // Two stages that want more share what the held one leaves, by demand.
    assert_close(
        &split(
            100.0,
            &[(Some(30.0), true), (Some(10.0), false), (Some(60.0), true)],
        ),
        &[30.0, 10.0, 60.0],
    );
    // Too little for the held stages' demands: every part in proportion.
    assert_close(
        &split(100.0, &[(Some(100.0), true), (Some(300.0), false)]),
        &[25.0, 75.0],
    );
    // An unmeasured stage keeps its floor (5% of an even third) beside them.
    let floor = 100.0 / 3.0 * 0.05;
    assert_close(
        &split(
            100.0,
            &[(Some(200.0), true), (Some(10.0), false), (None, false)],
        ),
        &[90.0 - floor, 10.0, floor],
    );
}

#[test]
fn job_allocations_reach_their_stages() {
    let mut j = job("a", 1.0);
    j.stages = vec![stage("s1", Some(1.0)), stage("s2", Some(3.0))];
    let a = run(800.0, Sharing::WeightedFair, vec![j]);
    let parts: Vec<f64> = a.jobs[0].stages.iter().map(|s| s.bandwidth).collect();
    assert_close(&parts, &[200.0, 600.0]);
    // Neither stage is on a node: reported, bounds passed through.
    assert_eq!(a.problems.len(), 2);
    assert_eq!(a.jobs[0].stages[0].readers, Bounds { min: 1, max: 16 });
    assert_eq!(a.jobs[0].stages[0].buffer, 64);
}

#[test]
fn node_budgets_are_shared_by_weight_within_bounds() {
    let mut a1 = job("a", 1.0);
    a1.stages = vec![stage("s1", None)];
    let mut b = job("b", 3.0);
    b.stages = vec![stage("s1", None)];
    let mut c = job("c", 1.0);
    c.stages = vec![StageInput {
        readers: Bounds { min: 1, max: 2 },
        ..stage("s1", None)
    }];
    let node = NodeInput {
        name: "n1".to_owned(),
        stages: vec!["s1".to_owned()],
        readers: 18,
        buffer: 100,
    };
    let snapshot = Snapshot {
        pools: vec![pool(1000.0, Sharing::WeightedFair)],
        jobs: vec![a1, b, c],
        nodes: vec![node],
    };
    let a = allocate(&snapshot);
    let readers: Vec<u32> = a.jobs.iter().map(|j| j.stages[0].readers.max).collect();
    // c stops at its max of 2; the other 16 go 1:3.
    assert_eq!(readers, [4, 12, 2]);
    let buffers: Vec<u64> = a.jobs.iter().map(|j| j.stages[0].buffer).collect();
    // 100 bytes at weights 1:3:1, b capped at 64: 20/60/20.
    assert_eq!(buffers, [20, 60, 20]);
    assert_eq!(a.jobs[0].stages[0].node.as_deref(), Some("n1"));
    assert!(a.problems.is_empty());
}

#[test]
fn node_minimums_that_do_not_fit_are_reported() {
    let jobs: Vec<JobInput> = (0..3)
        .map(|i| {
            let mut j = job(&format!("j{i}"), 1.0);
            j.stages = vec![StageInput {
                readers: Bounds { min: 4, max: 8 },
                ..stage("s", None)
            }];
            j
        })
        .collect();
    let node = NodeInput {
        name: "n".to_owned(),
        stages: vec!["s".to_owned()],
        readers: 6,
        buffer: 1000,
    };
    let a = allocate(&Snapshot {
        pools: vec![pool(1.0, Sharing::WeightedFair)],
        jobs,
        nodes: vec![node],
    });
    let readers: u32 = a.jobs.iter().map(|j| j.stages[0].readers.max).sum();
    assert_eq!(readers, 6);
    assert!(matches!(
        a.problems[..],
        [Problem::NodeOverCommitted {
            resource: NodeResource::Readers,
            minimums: 12,
            budget: 6,
            ..
        }]
    ));
}

#[test]
fn allocations_serialise_with_kebab_case_reasons() {
    let a = run(10.0, Sharing::WeightedFair, vec![job("a", 1.0)]);
    let json = serde_json::to_string(&a).unwrap();
    assert!(json.contains("\"reason\":\"weighted-share\""), "{json}");
}

// ---- properties ----

const EPS: f64 = 1e-6;

fn close_le(a: f64, b: f64) -> bool {
    a <= b + EPS * b.abs().max(1.0)
}

fn approx(a: f64, b: f64) -> bool {
    (a - b).abs() <= EPS * a.abs().max(b.abs()).max(1.0)
}

prop_compose! {
    fn arb_job(index: usize, capacity: f64)(
        weight in 0.1f64..100.0,
        priority in 0i32..3,
        guarantee in proptest::option::weighted(0.3, 0.0..capacity),
        limit in proptest::option::weighted(0.3, 0.0..capacity * 1.5),
        demand in proptest::option::weighted(0.6, 0.0..capacity),
        stages in proptest::collection::vec(proptest::option::of(0.0f64..1000.0), 0..4),
        readers in (0u32..4, 0u32..16),
        buffer in (0u64..1000, 0u64..10_000),
    ) -> JobInput {
        let mut job = JobInput::new(&format!("j{index}"), "p", weight);
        job.priority = priority;
        job.guarantee.bandwidth = guarantee;
        job.limit.bandwidth = limit;
        job.demand.bandwidth = demand;
        job.stages = stages
            .into_iter()
            .enumerate()
            .map(|(s, demand)| StageInput {
                stage: format!("s{s}"),
                demand,
                wants_more: false,
                readers: Bounds { min: readers.0, max: readers.0 + readers.1 },
                buffer: Bounds { min: buffer.0, max: buffer.0 + buffer.1 },
            })
            .collect();
        job
    }
}

fn arb_snapshot(sharing: Sharing) -> impl Strategy<Value = Snapshot> {
    (1.0f64..1e6, 1usize..8, 0u32..40, 0u64..20_000)
        .prop_flat_map(move |(capacity, n, readers, buffer)| {
            let jobs: Vec<_> = (0..n).map(|i| arb_job(i, capacity)).collect();
            (Just(capacity), jobs, Just(readers), Just(buffer))
        })
        .prop_map(move |(capacity, jobs, readers, buffer)| Snapshot {
            pools: vec![pool(capacity, sharing)],
            jobs,
            // Two nodes: s0 and s2 on one, s1 on the other, s3 nowhere.
            nodes: vec![
                NodeInput {
                    name: "n0".into(),
                    stages: vec!["s0".into(), "s2".into()],
                    readers,
                    buffer,
                },
                NodeInput {
                    name: "n1".into(),
                    stages: vec!["s1".into()],
                    readers,
                    buffer,
                },
            ],
        })
}

fn ceiling(job: &JobInput) -> f64 {
    job.limit
        .bandwidth
        .unwrap_or(f64::INFINITY)
        .min(job.demand.bandwidth.unwrap_or(f64::INFINITY))
}

fn sharing() -> impl Strategy<Value = Sharing> {
    prop_oneof![Just(Sharing::WeightedFair), Just(Sharing::Priority)]
}

proptest! {
    #[test]
    fn never_more_than_capacity_caps_or_demand(s in sharing().prop_flat_map(arb_snapshot)) {
        let a = allocate(&s);
        let capacity = s.pools[0].bandwidth;
        prop_assert!(close_le(rates(&a).iter().sum(), capacity));
        for (job, alloc) in s.jobs.iter().zip(&a.jobs) {
            prop_assert!(alloc.bandwidth.rate >= 0.0);
            prop_assert!(close_le(alloc.bandwidth.rate, ceiling(job)), "{alloc:?} over {job:?}");
        }
    }

    #[test]
    fn feasible_guarantees_are_met_and_infeasible_ones_reported(s in sharing().prop_flat_map(arb_snapshot)) {
        let a = allocate(&s);
        let capacity = s.pools[0].bandwidth;
        let floors: Vec<f64> = s.jobs.iter().map(|j| j.guarantee.bandwidth.unwrap_or(0.0).min(ceiling(j))).collect();
        let total: f64 = floors.iter().sum();
        // Met in full when they fit, scaled by the same factor otherwise:
        // into the capacity, or in a weighted-fair pool where some job has
        // no guarantee, into all but the room left to it.
        let unguaranteed = floors.iter().zip(&s.jobs).any(|(&f, j)| f == 0.0 && ceiling(j) > 0.0);
        let room = match s.pools[0].sharing {
            Sharing::WeightedFair if unguaranteed => capacity * (1.0 - super::pool::UNGUARANTEED_ROOM),
            _ => capacity,
        };
        let reported = a.problems.iter().any(|p| matches!(p, Problem::GuaranteesInfeasible { .. }));
        prop_assert_eq!(reported, total > room);
        let scale = if total > room { room / total } else { 1.0 };
        for (floor, alloc) in floors.iter().zip(&a.jobs) {
            prop_assert!(close_le(floor * scale, alloc.bandwidth.rate), "{floor} * {scale} > {alloc:?}");
        }
    }

    #[test]
    fn work_conserving(s in sharing().prop_flat_map(arb_snapshot)) {
        let a = allocate(&s);
        let capacity = s.pools[0].bandwidth;
        let wanted: f64 = s.jobs.iter().map(ceiling).sum();
        if wanted >= capacity {
            prop_assert!(approx(rates(&a).iter().sum(), capacity));
        } else {
            for (job, alloc) in s.jobs.iter().zip(&a.jobs) {
                prop_assert!(approx(alloc.bandwidth.rate, ceiling(job)));
            }
        }
    }

    #[test]
    fn more_weight_never_means_less_share(
        s in sharing().prop_flat_map(arb_snapshot),
        pick in any::<prop::sample::Index>(),
        factor in 1.0f64..20.0,
    ) {
        let before = allocate(&s);
        let k = pick.index(s.jobs.len());
        let mut heavier = s.clone();
        heavier.jobs[k].weight *= factor;
        let after = allocate(&heavier);
        prop_assert!(close_le(before.jobs[k].bandwidth.rate, after.jobs[k].bandwidth.rate));
    }

    #[test]
    fn weighted_max_min_between_jobs_below_their_ceilings(s in arb_snapshot(Sharing::WeightedFair)) {
        // Two jobs both below their ceilings and above their guarantees
        // sit at the same level: rate / weight equal.
        let a = allocate(&s);
        let free: Vec<f64> = s.jobs.iter().zip(&a.jobs)
            .filter(|(_, x)| x.bandwidth.reason == Reason::WeightedShare)
            .map(|(j, x)| x.bandwidth.rate / j.weight)
            .collect();
        for pair in free.windows(2) {
            prop_assert!(approx(pair[0], pair[1]), "{free:?}");
        }
    }

    #[test]
    fn lower_classes_wait_for_higher_ones(s in arb_snapshot(Sharing::Priority)) {
        let a = allocate(&s);
        let capacity = s.pools[0].bandwidth;
        for (low, x) in s.jobs.iter().zip(&a.jobs) {
            let floor = low.guarantee.bandwidth.unwrap_or(0.0).min(ceiling(low));
            if x.bandwidth.rate > floor + EPS * capacity.max(1.0) {
                for (high, y) in s.jobs.iter().zip(&a.jobs) {
                    if high.priority > low.priority {
                        prop_assert!(approx(y.bandwidth.rate, ceiling(high)), "{y:?} starved by {x:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn stage_parts_sum_to_the_job(s in sharing().prop_flat_map(arb_snapshot)) {
        let a = allocate(&s);
        for alloc in &a.jobs {
            if !alloc.stages.is_empty() {
                let sum: f64 = alloc.stages.iter().map(|s| s.bandwidth).sum();
                prop_assert!(approx(sum, alloc.bandwidth.rate));
                prop_assert!(alloc.stages.iter().all(|s| s.bandwidth >= 0.0));
            }
        }
    }

    #[test]
    fn node_budgets_and_bounds_are_respected(s in sharing().prop_flat_map(arb_snapshot)) {
        let a = allocate(&s);
        for node in &s.nodes {
            let on: Vec<(&StageInput, &StageAllocation)> = s.jobs.iter().zip(&a.jobs)
                .flat_map(|(j, x)| j.stages.iter().zip(&x.stages))
                .filter(|(_, x)| x.node.as_deref() == Some(node.name.as_str()))
                .collect();
            let readers: u64 = on.iter().map(|(_, x)| u64::from(x.readers.max)).sum();
            let buffer: u64 = on.iter().map(|(_, x)| x.buffer).sum();
            prop_assert!(readers <= u64::from(node.readers));
            prop_assert!(buffer <= node.buffer);
            let fits = on.iter().map(|(w, _)| u64::from(w.readers.min)).sum::<u64>() <= u64::from(node.readers);
            for (wanted, x) in &on {
                prop_assert!(x.readers.max <= wanted.readers.max && x.buffer <= wanted.buffer.max);
                prop_assert!(x.readers.min <= x.readers.max);
                if fits {
                    prop_assert!(x.readers.max >= wanted.readers.min);
                }
            }
            let reported = a.problems.iter().any(|p| matches!(p,
                Problem::NodeOverCommitted { node: n, resource: NodeResource::Readers, .. } if *n == node.name));
            prop_assert_eq!(reported, !fits);
        }
    }

    #[test]
    fn static_pools_give_limits_as_written(s in arb_snapshot(Sharing::Static)) {
        let a = allocate(&s);
        for (job, x) in s.jobs.iter().zip(&a.jobs) {
            let want = job.limit.bandwidth.or(job.guarantee.bandwidth).unwrap_or(0.0);
            prop_assert_eq!(x.bandwidth.rate, want);
        }
        let total: f64 = rates(&a).iter().sum();
        let reported = a.problems.iter().any(|p| matches!(p, Problem::StaticOverCommitted { .. }));
        prop_assert_eq!(reported, total > s.pools[0].bandwidth * (1.0 + 1e-9));
    }
}

#[test]
fn bad_capacities_and_duplicate_pools_are_reported() {
    let snapshot = Snapshot {
        pools: vec![
            pool(f64::INFINITY, Sharing::WeightedFair),
            pool(5.0, Sharing::Static),
        ],
        jobs: vec![job("a", 1.0)],
        nodes: vec![],
    };
    let a = allocate(&snapshot);
    assert_eq!(rates(&a), [0.0]);
    assert!(matches!(
        a.problems[..],
        [
            Problem::InvalidCapacity { .. },
            Problem::DuplicatePool { .. }
        ]
    ));
}

#[test]
fn inputs_build_from_validated_policies() {
    let text = "
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: shared}
spec: {capacity: {bandwidth: 1000B/s, ops: 50}, sharing: priority}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: vision}
spec:
  selector: {matchLabels: {team: vision}}
  pool: shared
  weight: 3
  priority: 2
  guarantee: {bandwidth: 100B/s}
  limit: {bandwidth: 500B/s, ops: 20}
";
    let docs = crate::parse_documents("t.yaml", text).unwrap();
    let (crate::Policy::StoragePool(p), crate::Policy::JobPolicy(j)) = (&docs[0], &docs[1]) else {
        panic!("unexpected documents {docs:?}");
    };
    let pool = PoolInput::from_policy(p);
    assert_eq!(
        (pool.bandwidth, pool.ops, pool.sharing),
        (1000.0, Some(50.0), Sharing::Priority)
    );
    let job = JobInput::from_policy("job-1", j.spec());
    assert_eq!(
        (job.weight, job.priority, job.pool.as_str()),
        (3.0, 2, "shared")
    );
    assert_eq!(
        job.guarantee,
        Rates {
            bandwidth: Some(100.0),
            ops: None
        }
    );
    assert_eq!(
        job.limit,
        Rates {
            bandwidth: Some(500.0),
            ops: Some(20.0)
        }
    );
    assert_eq!(job.demand, Rates::default());
}
