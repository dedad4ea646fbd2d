//! Settings the controller pushes: per-job overrides of the stage's own
//! configuration (QoS limits, tuner on/off, reader and buffer bounds), with a
//! version. A push is a complete snapshot: jobs it does not name get its
//! `defaults`, or the stage's configuration when it has none.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use crate::job_config::{JobConfig, MAX_BURST, MAX_READERS};
use crate::tuner::Bounds;

/// What the controller decided for one job (or for every unnamed job).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobOverrides {
    /// Storage bytes/s; `None` is unlimited.
    pub bytes_per_s: Option<u64>,
    /// Storage reads/s; `None` is unlimited.
    pub ops_per_s: Option<u64>,
    /// Limiter burst window; `None` keeps the stage's.
    pub burst: Option<Duration>,
    /// Tuner on or off; `None` keeps the stage's choice.
    pub tuner: Option<bool>,
    /// Fewest readers; `None` keeps the stage's.
    pub min_readers: Option<u32>,
    /// Most readers; `None` keeps the stage's.
    pub max_readers: Option<u32>,
    /// Smallest buffer in bytes; `None` keeps the stage's.
    pub min_buffer: Option<u64>,
    /// Largest buffer in bytes; `None` keeps the stage's.
    pub max_buffer: Option<u64>,
}

/// How the controller wants the node cache to keep one data set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DatasetCacheOverrides {
    /// The data set's tenant; the cache is split among tenants first.
    pub tenant: String,
    /// The tenant's share.
    pub tenant_weight: u32,
    /// The data set's share within its tenant.
    pub weight: u32,
    /// Bytes kept whatever other data sets want (`u64::MAX`: all).
    pub pin: u64,
    /// The staging round the stage should have run (0: none).
    pub staging_round: u64,
    /// Most bytes per second staging reads; `None` is not limited.
    pub staging_bytes_per_s: Option<u64>,
}

/// One versioned push from the controller.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PushedSettings {
    pub version: u64,
    pub defaults: Option<JobOverrides>,
    pub jobs: HashMap<String, JobOverrides>,
    /// Jobs the controller has seen here that no policy selects: they run
    /// on `defaults` like any job not in `jobs`.
    pub unmanaged: HashSet<String>,
    /// Per data set a cache policy steers.
    pub cache: HashMap<String, DatasetCacheOverrides>,
}

impl PushedSettings {
    /// Checks every override against what this stage can do; the reason
    /// names the job and the value, for the controller's Nack.
    pub fn validate(&self, base: JobConfig, memory_budget: u64) -> Result<(), String> {
        if let Some(defaults) = &self.defaults {
            defaults
                .validate(base, memory_budget)
                .map_err(|e| format!("defaults: {e}"))?;
        }
        let mut jobs: Vec<_> = self.jobs.iter().collect();
        jobs.sort_by_key(|(name, _)| name.as_str());
        for (job, overrides) in jobs {
            if job.is_empty() {
                return Err("a job entry has an empty job id".into());
            }
            overrides
                .validate(base, memory_budget)
                .map_err(|e| format!("job `{job}`: {e}"))?;
        }
        let mut caches: Vec<_> = self.cache.iter().collect();
        caches.sort_by_key(|(name, _)| name.as_str());
        for (dataset, cache) in caches {
            if cache.tenant_weight == 0 || cache.weight == 0 {
                return Err(format!(
                    "cache settings of data set `{dataset}`: weights must be at least 1 (tenant {}, data set {})",
                    cache.tenant_weight, cache.weight
                ));
            }
        }
        Ok(())
    }

    /// Whether the controller decided about `job` in this push (its
    /// settings, or that no policy selects it).
    pub fn names(&self, job: &str) -> bool {
        self.jobs.contains_key(job) || self.unmanaged.contains(job)
    }

    /// Returns the configuration job `job` runs with on top of `base`.
    pub fn resolve(&self, job: &str, base: JobConfig) -> JobConfig {
        match self.jobs.get(job).or(self.defaults.as_ref()) {
            Some(overrides) => overrides.apply_to(base),
            None => base,
        }
    }
}

impl JobOverrides {
    /// Checks the configuration these overrides give on top of `base`.
    fn validate(&self, base: JobConfig, memory_budget: u64) -> Result<(), String> {
        if self.bytes_per_s == Some(0) || self.ops_per_s == Some(0) {
            return Err("a limit of 0 would stop every read; leave it unset for unlimited".into());
        }
        if let Some(burst) = self.burst
            && (burst.is_zero() || burst > MAX_BURST)
        {
            return Err(format!("burst window {burst:?} is outside 1 ms to 60 s"));
        }
        let b = self.apply_to(base).bounds;
        if b.min_readers == 0 || b.min_readers > b.max_readers || b.max_readers > MAX_READERS {
            return Err(format!(
                "reader bounds {}..{} are impossible: need 1 <= min <= max <= {MAX_READERS}",
                b.min_readers, b.max_readers
            ));
        }
        if b.min_buffer > b.max_buffer {
            return Err(format!(
                "buffer bounds {}..{} bytes are impossible: min is above max",
                b.min_buffer, b.max_buffer
            ));
        }
        if b.max_buffer > memory_budget {
            return Err(format!(
                "buffer maximum of {} bytes exceeds this stage's memory budget of {memory_budget} bytes",
                b.max_buffer
            ));
        }
        Ok(())
    }

    /// Lays these overrides over `base`. Limits are replaced outright (an
    /// unset limit means unlimited: a push is a complete decision).
    pub fn apply_to(&self, base: JobConfig) -> JobConfig {
        let mut s = base;
        s.limits.bytes_per_s = self.bytes_per_s;
        s.limits.ops_per_s = self.ops_per_s;
        if let Some(burst) = self.burst {
            s.limits.burst = burst;
        }
        if let Some(tuner) = self.tuner {
            s.tuner = tuner;
        }
        s.bounds = Bounds {
            min_readers: self.min_readers.unwrap_or(base.bounds.min_readers),
            max_readers: self.max_readers.unwrap_or(base.bounds.max_readers),
            min_buffer: self.min_buffer.unwrap_or(base.bounds.min_buffer),
            max_buffer: self.max_buffer.unwrap_or(base.bounds.max_buffer),
        };
        s.initial_readers = s.bounds.clamp_readers(base.initial_readers);
        s.initial_buffer = s.bounds.clamp_buffer(base.initial_buffer);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token_bucket::Limits;

    const MIB: u64 = 1 << 20;

    fn base() -> JobConfig {
        JobConfig {
            bounds: Bounds {
                min_readers: 1,
                max_readers: 64,
                min_buffer: 4 * MIB,
                max_buffer: 1024 * MIB,
            },
            initial_readers: 16,
            initial_buffer: 64 * MIB,
            tuner: true,
            limits: Limits {
                bytes_per_s: Some(500 * MIB),
                ..Limits::default()
            },
        }
    }

    #[test]
    fn named_jobs_then_defaults_then_the_stage_config() {
        let mut settings = PushedSettings {
            version: 3,
            ..Default::default()
        };
        assert_eq!(settings.resolve("a", base()), base());
        settings.defaults = Some(JobOverrides {
            ops_per_s: Some(100),
            ..Default::default()
        });
        settings.jobs.insert(
            "a".into(),
            JobOverrides {
                bytes_per_s: Some(200 * MIB),
                tuner: Some(false),
                min_readers: Some(2),
                max_readers: Some(8),
                ..Default::default()
            },
        );
        let a = settings.resolve("a", base());
        assert_eq!(
            (a.limits.bytes_per_s, a.limits.ops_per_s),
            (Some(200 * MIB), None)
        );
        assert!(!a.tuner);
        assert_eq!(
            (
                a.bounds.min_readers,
                a.bounds.max_readers,
                a.initial_readers
            ),
            (2, 8, 8)
        );
        let b = settings.resolve("b", base());
        assert_eq!(
            (b.limits.bytes_per_s, b.limits.ops_per_s),
            (None, Some(100)),
            "a push replaces limits"
        );
        assert_eq!(b.bounds, base().bounds);
    }

    #[test]
    fn impossible_overrides_are_refused_with_the_job_named() {
        let bad = |o: JobOverrides| {
            let mut s = PushedSettings::default();
            s.jobs.insert("train".into(), o);
            s.validate(base(), 256 * MIB).unwrap_err()
        };
        assert!(
            bad(JobOverrides {
                min_readers: Some(9),
                max_readers: Some(2),
                ..Default::default()
            })
            .contains("job `train`: reader bounds 9..2")
        );
        assert!(
            bad(JobOverrides {
                max_buffer: Some(512 * MIB),
                ..Default::default()
            })
            .contains("memory budget")
        );
        assert!(
            bad(JobOverrides {
                ops_per_s: Some(0),
                ..Default::default()
            })
            .contains("limit of 0")
        );
        assert!(
            bad(JobOverrides {
                burst: Some(Duration::ZERO),
                ..Default::default()
            })
            .contains("burst")
        );
        let ok = PushedSettings {
            defaults: Some(JobOverrides::default()),
            ..Default::default()
        };
        assert!(ok.validate(base(), 1024 * MIB).is_ok());
        // One bound alone is laid over the stage's own other bound.
        let mut one = PushedSettings::default();
        one.jobs.insert(
            "j".into(),
            JobOverrides {
                min_buffer: Some(4 * MIB),
                ..Default::default()
            },
        );
        assert!(one.validate(base(), 1024 * MIB).is_ok());
        one.jobs.insert(
            "j".into(),
            JobOverrides {
                min_readers: Some(100),
                ..Default::default()
            },
        );
        assert!(
            one.validate(base(), 1024 * MIB)
                .unwrap_err()
                .contains("100..64")
        );
    }
}
