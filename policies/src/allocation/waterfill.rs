//! Weighted max-min water-filling with floors and ceilings: the one
//! algorithm every sharing decision in the engine is built on.
//!
//! Each claim gets `clamp(weight * level, floor, ceiling)`, and the water
//! `level` is the lowest at which the claims together take the whole
//! capacity (or every claim is at its ceiling, when they all fit). The
//! sum of the clamps is continuous and non-decreasing in the level and
//! piecewise linear between the breakpoints `floor / weight` and
//! `ceiling / weight`, so the level is found exactly by scanning those.

/// One claimant on a shared resource.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Claim {
    /// Relative share, > 0.
    pub weight: f64,
    /// What the claim gets whatever the level (a guarantee, a minimum).
    pub floor: f64,
    /// The most the claim can use (`f64::INFINITY` when greedy); >= floor.
    pub ceiling: f64,
}

/// The outcome of a fill: the level and each claim's share, in order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Fill {
    pub level: f64,
    pub shares: Vec<f64>,
}

/// Shares `capacity` among `claims`. The floors must fit in the capacity
/// (callers scale them first and report it); when they exactly fill it the
/// level is 0 and every claim gets its floor.
pub(crate) fn fill(claims: &[Claim], capacity: f64) -> Fill {
    let total = |level: f64| -> f64 { claims.iter().map(|c| share(c, level)).sum() };
    let ceilings: f64 = claims.iter().map(|c| c.ceiling).sum();
    if ceilings <= capacity {
        let shares = claims.iter().map(|c| c.ceiling).collect();
        return Fill {
            level: f64::INFINITY,
            shares,
        };
    }
    let floors: f64 = claims.iter().map(|c| c.floor).sum();
    let level = if floors >= capacity {
        0.0
    } else {
        let mut points: Vec<f64> = claims
            .iter()
            .flat_map(|c| [c.floor / c.weight, c.ceiling / c.weight])
            .filter(|p| p.is_finite() && *p > 0.0)
            .collect();
        points.sort_by(f64::total_cmp);
        points.dedup();
        let (mut lo, mut at_lo) = (0.0, floors);
        let mut found = None;
        for &hi in &points {
            let at_hi = total(hi);
            if at_hi >= capacity {
                // Linear between lo and hi, and at_lo < capacity <= at_hi.
                found = Some(lo + (capacity - at_lo) * (hi - lo) / (at_hi - at_lo));
                break;
            }
            (lo, at_lo) = (hi, at_hi);
        }
        found.unwrap_or_else(|| {
            // Past every breakpoint only the greedy claims still grow.
            let slope: f64 = claims
                .iter()
                .filter(|c| c.ceiling.is_infinite())
                .map(|c| c.weight)
                .sum();
            // No slope left only through rounding: everyone at the ceiling.
            if slope > 0.0 {
                lo + (capacity - at_lo) / slope
            } else {
                f64::INFINITY
            }
        })
    };
    let mut shares: Vec<f64> = claims.iter().map(|c| share(c, level)).collect();
    // Rounding may leave the sum a hair over; never hand out more than there is.
    let sum: f64 = shares.iter().sum();
    if sum > capacity && sum > 0.0 {
        let scale = capacity / sum;
        for s in &mut shares {
            *s *= scale;
        }
    }
    Fill { level, shares }
}

fn share(claim: &Claim, level: f64) -> f64 {
    (claim.weight * level).clamp(claim.floor, claim.ceiling)
}

/// Shares a budget of whole units (threads, bytes). Shares are rounded
/// down, then the units left over go one at a time to the claims with the
/// largest remainders that are still below their ceilings, so the result
/// sums to at most `budget` and respects every ceiling.
pub(crate) fn fill_units(claims: &[Claim], budget: u64) -> Vec<u64> {
    let exact = fill(claims, budget as f64).shares;
    let mut units: Vec<u64> = exact.iter().map(|s| s.floor() as u64).collect();
    // Unbounded claims (u64::MAX) must not overflow the sum.
    let used = units.iter().fold(0u64, |sum, &u| sum.saturating_add(u));
    let mut left = budget.saturating_sub(used);
    let mut order: Vec<usize> = (0..claims.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    for i in order {
        if left == 0 {
            break;
        }
        if (units[i].saturating_add(1) as f64) <= claims[i].ceiling && exact[i] > units[i] as f64 {
            units[i] += 1;
            left -= 1;
        }
    }
    units
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greedy(weight: f64) -> Claim {
        Claim {
            weight,
            floor: 0.0,
            ceiling: f64::INFINITY,
        }
    }

    #[test]
    fn greedy_claims_share_by_weight() {
        let claims: Vec<Claim> = [1.0, 2.0, 3.0, 4.0].map(greedy).to_vec();
        let fill = fill(&claims, 1000.0);
        for (s, want) in fill.shares.iter().zip([100.0, 200.0, 300.0, 400.0]) {
            assert!((s - want).abs() < 1e-9, "{s} != {want}");
        }
        assert!((fill.level - 100.0).abs() < 1e-9);
    }

    #[test]
    fn claims_that_fit_get_their_ceilings() {
        let claims = [Claim {
            weight: 1.0,
            floor: 0.0,
            ceiling: 10.0,
        }; 3];
        assert_eq!(fill(&claims, 100.0).shares, vec![10.0; 3]);
    }

    #[test]
    fn floors_that_fill_the_capacity_leave_level_zero() {
        let claims = [
            Claim {
                weight: 1.0,
                floor: 50.0,
                ceiling: f64::INFINITY,
            },
            greedy(1.0),
        ];
        let fill = fill(&claims, 50.0);
        assert_eq!(fill.level, 0.0);
        assert_eq!(fill.shares, vec![50.0, 0.0]);
    }

    #[test]
    fn units_never_exceed_budget_or_ceilings() {
        let claims = [
            Claim {
                weight: 1.0,
                floor: 1.0,
                ceiling: 3.0,
            },
            greedy(1.0),
            greedy(1.0),
        ];
        let units = fill_units(&claims, 10);
        assert_eq!(units.iter().sum::<u64>(), 10);
        assert_eq!(units[0], 3);
    }

    #[test]
    fn unbounded_budgets_and_ceilings_do_not_overflow() {
        let unbounded = Claim {
            weight: 1.0,
            floor: 0.0,
            ceiling: u64::MAX as f64,
        };
        let units = fill_units(&[unbounded; 2], u64::MAX);
        assert!(units.iter().all(|&u| u >= u64::MAX / 2 - 4096), "{units:?}");
    }
}
