//! The allocation's metrics: per pool its capacity, what is allocated and
//! what its jobs read; per job its allocation, reason, estimated demand
//! and measured throughput. Set every tick; series of jobs and pools that
//! are gone are removed, not left at their last value.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use prometheus::{GaugeVec, IntCounter, IntGauge, Opts, Registry};

use sluice_policy::coordination::Shares;

use crate::sync::lock;

/// Bytes per second each job read from storage, by job id.
pub type Throughput = BTreeMap<String, f64>;

/// A gauge vector whose series are replaced as a whole.
#[derive(Debug)]
struct Family {
    vec: GaugeVec,
    last: Mutex<BTreeSet<Vec<String>>>,
}

impl Family {
    fn new(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> Self {
        let vec = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
        registry
            .register(Box::new(vec.clone()))
            .expect("metric names are unique");
        Family {
            vec,
            last: Mutex::new(BTreeSet::new()),
        }
    }

    /// Sets these series and removes the ones set last time but not now.
    fn replace(&self, series: Vec<(Vec<String>, f64)>) {
        let mut last = lock(&self.last);
        let fresh: BTreeSet<Vec<String>> = series.iter().map(|(l, _)| l.clone()).collect();
        for gone in last.difference(&fresh) {
            let labels: Vec<&str> = gone.iter().map(String::as_str).collect();
            // Absent already is fine: the goal is that it is absent.
            let _ = self.vec.remove_label_values(&labels);
        }
        for (labels, value) in &series {
            let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
            self.vec.with_label_values(&labels).set(*value);
        }
        *last = fresh;
    }
}

/// The allocation's gauges.
#[derive(Debug)]
pub struct AllocationMetrics {
    pool_capacity: Family,
    pool_allocated: Family,
    pool_throughput: Family,
    job_allocated: Family,
    job_allocated_ops: Family,
    job_demand: Family,
    job_throughput: Family,
    job_reason: Family,
    problems: IntGauge,
    /// Job allocations that changed enough to be announced.
    pub changes: IntCounter,
    /// Connected stages not yet running their desired settings version.
    pub pending_stages: IntGauge,
}

impl AllocationMetrics {
    /// Returns the metrics, registered in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let pool = |name: &str, help: &str| Family::new(registry, name, help, &["pool"]);
        let job = |name: &str, help: &str| Family::new(registry, name, help, &["job", "pool"]);
        let register = |c: Box<dyn prometheus::core::Collector>| {
            registry.register(c).expect("metric names are unique");
        };
        let changes = IntCounter::new(
            "sluice_controller_allocation_changes_total",
            "Job allocations that changed by more than the announcement threshold",
        )
        .expect("valid metric");
        let problems = IntGauge::new(
            "sluice_controller_allocation_problems",
            "Things the last allocation could not do as the policies say",
        )
        .expect("valid metric");
        let pending_stages = IntGauge::new(
            "sluice_controller_settings_pending_stages",
            "Connected stages not yet running the settings version desired for them",
        )
        .expect("valid metric");
        register(Box::new(changes.clone()));
        register(Box::new(problems.clone()));
        register(Box::new(pending_stages.clone()));
        Self {
            pool_capacity: pool(
                "sluice_controller_pool_capacity_bytes_per_second",
                "Bandwidth a pool's policy declares",
            ),
            pool_allocated: pool(
                "sluice_controller_pool_allocated_bytes_per_second",
                "Bandwidth allocated to a pool's jobs, all together",
            ),
            pool_throughput: pool(
                "sluice_controller_pool_throughput_bytes_per_second",
                "Bytes per second a pool's jobs read from storage, as their stages report",
            ),
            job_allocated: job(
                "sluice_controller_job_allocated_bytes_per_second",
                "Bandwidth allocated to a job, all its stages together",
            ),
            job_allocated_ops: job(
                "sluice_controller_job_allocated_ops_per_second",
                "Storage operations per second allocated to a job (only when limited)",
            ),
            job_demand: job(
                "sluice_controller_job_demand_bytes_per_second",
                "A job's estimated demand (absent while it is greedy or unknown)",
            ),
            job_throughput: job(
                "sluice_controller_job_throughput_bytes_per_second",
                "Bytes per second a job read from storage, all its stages together",
            ),
            job_reason: Family::new(
                registry,
                "sluice_controller_job_allocation_reason",
                "1 for the reason a job's allocation is what it is",
                &["job", "pool", "reason"],
            ),
            problems,
            changes,
            pending_stages,
        }
    }

    /// Sets every gauge from the allocation in force and the measured
    /// throughput, and removes the series of jobs and pools that are gone.
    pub fn set(&self, shares: &Shares, throughput: &Throughput) {
        let (mut allocated, mut ops, mut demand, mut read, mut reason) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut pool_read: BTreeMap<&str, f64> = BTreeMap::new();
        for (job, share) in &shares.jobs {
            let labels = vec![job.clone(), share.pool.clone()];
            let bytes = throughput.get(job).copied().unwrap_or(0.0);
            *pool_read.entry(&share.pool).or_default() += bytes;
            allocated.push((labels.clone(), share.bytes_per_second));
            if let Some(o) = share.ops_per_second {
                ops.push((labels.clone(), o));
            }
            if let Some(d) = share.demand_bytes_per_second {
                demand.push((labels.clone(), d));
            }
            read.push((labels.clone(), bytes));
            let mut with_reason = labels;
            with_reason.push(share.reason.as_str().to_owned());
            reason.push((with_reason, 1.0));
        }
        self.job_allocated.replace(allocated);
        self.job_allocated_ops.replace(ops);
        self.job_demand.replace(demand);
        self.job_throughput.replace(read);
        self.job_reason.replace(reason);
        let pools = || shares.pools.iter().map(|(p, s)| (vec![p.clone()], s));
        self.pool_capacity.replace(
            pools()
                .map(|(l, s)| (l, s.capacity_bytes_per_second))
                .collect(),
        );
        self.pool_allocated.replace(
            pools()
                .map(|(l, s)| (l, s.allocated_bytes_per_second))
                .collect(),
        );
        let used = |l: &Vec<String>| pool_read.get(l[0].as_str()).copied().unwrap_or(0.0);
        self.pool_throughput
            .replace(pools().map(|(l, _)| (l.clone(), used(&l))).collect());
        self.problems.set(shares.problems.len() as i64);
    }

    /// Removes every series and zeroes the counts, as a controller that
    /// does not lead (a standby's) has them.
    pub fn clear(&self) {
        for family in [
            &self.pool_capacity,
            &self.pool_allocated,
            &self.pool_throughput,
            &self.job_allocated,
            &self.job_allocated_ops,
            &self.job_demand,
            &self.job_throughput,
            &self.job_reason,
        ] {
            family.replace(Vec::new());
        }
        self.problems.set(0);
        self.pending_stages.set(0);
    }
}
