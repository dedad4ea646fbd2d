//! Loans: capacity of a `weighted-fair` or `priority` pool that no job
//! wants (every job in it is held at its demand) is lent to the jobs held
//! at their demand, by weight and up to their limits. A job whose demand
//! grows then reads more at once, its measured demand rises, and the next
//! tick allocates it; the loan shrinks as soon as another job wants the
//! capacity. Loans are not allocations: a pool's allocated figure and the
//! jobs' reasons leave them out.

use crate::Sharing;
use crate::allocation::{Allocation, Reason, Snapshot};

/// Returns each job's enforced bandwidth, in allocation order: its
/// allocation plus its loan.
pub fn lend_spare(snapshot: &Snapshot, allocation: &Allocation) -> Vec<f64> {
    let mut enforced: Vec<f64> = allocation.jobs.iter().map(|j| j.bandwidth.rate).collect();
    for pool in &snapshot.pools {
        if pool.sharing == Sharing::Static {
            continue;
        }
        let members = || {
            allocation
                .jobs
                .iter()
                .enumerate()
                .filter(|(_, j)| j.pool == pool.name)
        };
        let allocated: f64 = members().map(|(_, j)| j.bandwidth.rate).sum();
        let takers: Vec<Taker> = members()
            .filter(|(_, j)| j.bandwidth.reason == Reason::DemandLimited)
            .filter_map(|(index, j)| {
                let job = snapshot.jobs.iter().find(|input| input.id == j.job)?;
                let limit = job.limit.bandwidth.unwrap_or(f64::INFINITY);
                Some(Taker {
                    index,
                    weight: job.weight,
                    room: limit - j.bandwidth.rate,
                })
            })
            .filter(|t| t.room > 0.0)
            .collect();
        share_out(pool.bandwidth - allocated, takers, &mut enforced);
    }
    enforced
}

/// A job that may borrow: where it is, its weight, and how much more it
/// may take under its limit.
struct Taker {
    index: usize,
    weight: f64,
    room: f64,
}

/// Gives `spare` to `takers` in weighted shares, each capped by its room;
/// the capped drop out and the rest share again.
fn share_out(mut spare: f64, mut takers: Vec<Taker>, enforced: &mut [f64]) {
    while spare > 1.0 && !takers.is_empty() {
        let weights: f64 = takers.iter().map(|t| t.weight).sum();
        let mut given = 0.0;
        for t in &mut takers {
            let part = (spare * t.weight / weights).min(t.room);
            enforced[t.index] += part;
            t.room -= part;
            given += part;
        }
        spare -= given;
        takers.retain(|t| t.room > 1e-9);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocation::{JobInput, PoolInput, Rates, allocate};

    fn job(id: &str, weight: f64, demand: Option<f64>, limit: Option<f64>) -> JobInput {
        JobInput {
            demand: Rates {
                bandwidth: demand,
                ops: None,
            },
            limit: Rates {
                bandwidth: limit,
                ops: None,
            },
            ..JobInput::new(id, "p", weight)
        }
    }

    fn enforced(sharing: Sharing, jobs: Vec<JobInput>) -> Vec<f64> {
        let snapshot = Snapshot {
            pools: vec![PoolInput::new("p", 1000.0, sharing)],
            jobs,
            nodes: vec![],
        };
        lend_spare(&snapshot, &allocate(&snapshot))
            .into_iter()
            .map(f64::round)
            .collect()
    }

    #[test]
    fn spare_capacity_is_lent_by_weight_up_to_limits() {
        // 800 spare, lent 1:3.
        let jobs = vec![
            job("a", 1.0, Some(100.0), None),
            job("b", 3.0, Some(100.0), None),
        ];
        assert_eq!(enforced(Sharing::WeightedFair, jobs), [300.0, 700.0]);
        // `a` may take only 50 more: the rest goes to `b`.
        let jobs = vec![
            job("a", 1.0, Some(100.0), Some(150.0)),
            job("b", 3.0, Some(100.0), None),
        ];
        assert_eq!(enforced(Sharing::WeightedFair, jobs), [150.0, 850.0]);
    }

    #[test]
    fn nothing_is_lent_from_a_full_or_static_pool() {
        let jobs = vec![job("a", 1.0, Some(100.0), None), job("b", 1.0, None, None)];
        assert_eq!(enforced(Sharing::WeightedFair, jobs), [100.0, 900.0]);
        let jobs = vec![job("a", 1.0, Some(100.0), Some(200.0))];
        assert_eq!(enforced(Sharing::Static, jobs), [200.0]);
    }
}
