//! Sharing one resource of one pool (bandwidth or operations) among its
//! jobs, by the pool's [`Sharing`] mode.

use super::waterfill::{Claim, fill};
use super::{Problem, Reason, Resource, Share};
use crate::Sharing;

/// Slack for comparing shares with the bounds they were clamped to.
const EPS: f64 = 1e-9;

/// What one job asks of one resource.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Ask {
    pub weight: f64,
    pub priority: i32,
    pub guarantee: Option<f64>,
    pub limit: Option<f64>,
    /// `None`: unknown, treated as greedy.
    pub demand: Option<f64>,
}

impl Ask {
    /// The most the job can use: its limit or its demand, whichever is less.
    fn ceiling(&self) -> f64 {
        let limit = self.limit.unwrap_or(f64::INFINITY);
        limit.min(self.demand.unwrap_or(f64::INFINITY)).max(0.0)
    }

    /// Why the job stopped at its ceiling.
    fn ceiling_reason(&self) -> Reason {
        match (self.limit, self.demand) {
            (Some(l), Some(d)) if d < l => Reason::DemandLimited,
            (Some(_), _) => Reason::Cap,
            _ => Reason::DemandLimited,
        }
    }
}

/// The pool being shared, for problem reports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pool<'a> {
    pub name: &'a str,
    pub resource: Resource,
    pub capacity: f64,
    pub sharing: Sharing,
}

/// Returns each job's share, in order, and adds what went wrong to
/// `problems`.
pub(crate) fn share(pool: Pool<'_>, asks: &[Ask], problems: &mut Vec<Problem>) -> Vec<Share> {
    match pool.sharing {
        Sharing::Static => fixed(pool, asks, problems),
        Sharing::WeightedFair => {
            let floors = guarantees(pool, asks, problems);
            let all: Vec<usize> = (0..asks.len()).collect();
            let mut shares = vec![Share::default(); asks.len()];
            class(asks, &floors, &all, pool.capacity, false, &mut shares);
            shares
        }
        Sharing::Priority => by_priority(pool, asks, problems),
    }
}

/// Of a `weighted-fair` pool where some job has no guarantee, the part of
/// its capacity the guarantees leave to such jobs: together they take at
/// most the rest (scaled down, and reported, past it). A job given nothing
/// stalls its trainers outright (two jobs guaranteed 15 MiB/s each in a
/// pool of 30, or three, left another job 0 B/s).
pub(crate) const UNGUARANTEED_ROOM: f64 = 0.05;

/// Every job's effective guarantee, `min(guarantee, limit, demand)`, scaled
/// down in proportion (and reported) when together they take more than
/// the pool has for them: its capacity, or in a `weighted-fair` pool where
/// some job has none, all but [`UNGUARANTEED_ROOM`] of it.
fn guarantees(pool: Pool<'_>, asks: &[Ask], problems: &mut Vec<Problem>) -> Vec<f64> {
    let mut floors: Vec<f64> = asks
        .iter()
        .map(|a| a.guarantee.unwrap_or(0.0).max(0.0).min(a.ceiling()))
        .collect();
    let total: f64 = floors.iter().sum();
    let unguaranteed = floors
        .iter()
        .zip(asks)
        .any(|(&f, a)| f == 0.0 && a.ceiling() > 0.0);
    let room = if pool.sharing == Sharing::WeightedFair && unguaranteed {
        pool.capacity * (1.0 - UNGUARANTEED_ROOM)
    } else {
        pool.capacity
    };
    if total > room {
        let scale = if total > 0.0 { room / total } else { 0.0 };
        for f in &mut floors {
            *f *= scale;
        }
        problems.push(Problem::GuaranteesInfeasible {
            pool: pool.name.to_owned(),
            resource: pool.resource,
            guaranteed: total,
            capacity: pool.capacity,
            scale,
        });
    }
    floors
}

/// Water-fills `capacity` among the jobs `members` (floors included in it)
/// and writes their shares. `outranked`: a higher class took capacity
/// beyond its guarantees, so a job held below its ceiling is held there by
/// priority rather than by its weighted share alone.
fn class(
    asks: &[Ask],
    floors: &[f64],
    members: &[usize],
    capacity: f64,
    outranked: bool,
    out: &mut [Share],
) {
    let claims: Vec<Claim> = members
        .iter()
        .map(|&i| Claim {
            weight: asks[i].weight,
            floor: floors[i],
            ceiling: asks[i].ceiling(),
        })
        .collect();
    let result = fill(&claims, capacity);
    for ((&i, claim), rate) in members.iter().zip(&claims).zip(result.shares) {
        let reason = if rate >= claim.ceiling - EPS * claim.ceiling.max(1.0) {
            asks[i].ceiling_reason()
        } else if claim.floor > 0.0 && claim.floor >= claim.weight * result.level - EPS {
            Reason::Guarantee
        } else if outranked {
            Reason::Priority
        } else {
            Reason::WeightedShare
        };
        out[i] = Share { rate, reason };
    }
}

/// Strict priority: every guarantee first, then the classes from the
/// highest `priority` down, each water-filling what the classes above left
/// (plus its own guarantees).
fn by_priority(pool: Pool<'_>, asks: &[Ask], problems: &mut Vec<Problem>) -> Vec<Share> {
    let floors = guarantees(pool, asks, problems);
    let mut remaining = pool.capacity - floors.iter().sum::<f64>();
    let mut classes: Vec<i32> = asks.iter().map(|a| a.priority).collect();
    classes.sort_unstable_by(|a, b| b.cmp(a));
    classes.dedup();
    let mut shares = vec![Share::default(); asks.len()];
    let mut outranked = false;
    for priority in classes {
        let members: Vec<usize> = (0..asks.len())
            .filter(|&i| asks[i].priority == priority)
            .collect();
        let guaranteed: f64 = members.iter().map(|&i| floors[i]).sum();
        class(
            asks,
            &floors,
            &members,
            remaining.max(0.0) + guaranteed,
            outranked,
            &mut shares,
        );
        let taken: f64 = members.iter().map(|&i| shares[i].rate).sum::<f64>() - guaranteed;
        remaining -= taken;
        outranked |= taken > EPS * pool.capacity.max(1.0);
    }
    shares
}

/// Static: every job runs at its limit as written (its guarantee when it
/// has no limit), whatever the others do; over-commitment is reported,
/// not corrected.
fn fixed(pool: Pool<'_>, asks: &[Ask], problems: &mut Vec<Problem>) -> Vec<Share> {
    let shares: Vec<Share> = asks
        .iter()
        .map(|a| Share {
            rate: a.limit.or(a.guarantee).unwrap_or(0.0).max(0.0),
            reason: Reason::Static,
        })
        .collect();
    let total: f64 = shares.iter().map(|s| s.rate).sum();
    if total > pool.capacity * (1.0 + EPS) {
        problems.push(Problem::StaticOverCommitted {
            pool: pool.name.to_owned(),
            resource: pool.resource,
            limits: total,
            capacity: pool.capacity,
        });
    }
    shares
}
