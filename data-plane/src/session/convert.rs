//! Wire types of the session to and from the stage's domain types: the one
//! place that knows both.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sluice_proto::v1;

use crate::cache::Cache;
use crate::engine::{Engine, JobSnapshot, Staging};
use crate::settings::{DatasetCacheOverrides, JobOverrides, PushedSettings};

/// The stage's telemetry now.
pub fn telemetry(engine: &Engine) -> v1::Telemetry {
    v1::Telemetry {
        unix_millis: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64),
        settings_version: engine.settings_version(),
        memory_used_bytes: engine.memory().used(),
        jobs: engine.snapshot().into_iter().map(job_telemetry).collect(),
        cache: engine.cache().map(|c| cache_telemetry(c, engine.staging())),
    }
}

fn cache_telemetry(cache: &Cache, staging: &Staging) -> v1::CacheTelemetry {
    let report = cache.report();
    // One entry per data set name: data sets served from one source share
    // the numbers, each with its own staging round.
    let datasets = report
        .datasets
        .into_iter()
        .flat_map(|d| {
            d.names
                .clone()
                .into_iter()
                .map(move |name| (name, d.clone()))
        })
        .map(|(name, d)| {
            let staging = staging.progress(&name).map(|p| v1::StagingProgress {
                round: p.round,
                state: p.state.as_str().to_owned(),
                samples_done: p.samples_done,
                samples_total: p.samples_total,
                source_bytes: p.source_bytes,
                errors: p.errors,
                error: p.error,
            });
            v1::DatasetCacheTelemetry {
                dataset: name,
                memory_bytes: d.bytes,
                disk_bytes: d.disk_bytes,
                entries: d.entries + d.disk_entries,
                share_bytes: d.share_bytes,
                hits: d.hits,
                misses: d.misses,
                hit_bytes: d.hit_bytes,
                evictions: d.evictions,
                staging,
            }
        })
        .collect();
    v1::CacheTelemetry {
        memory_capacity_bytes: report.capacity_bytes,
        memory_used_bytes: report.used_bytes,
        disk_capacity_bytes: report.disk_capacity_bytes,
        disk_used_bytes: report.disk_used_bytes,
        datasets,
    }
}

fn job_telemetry(s: JobSnapshot) -> v1::JobTelemetry {
    v1::JobTelemetry {
        job: s.job,
        labels: s.labels.into_iter().collect(),
        delivered_bytes: s.delivered_bytes,
        delivered_samples: s.delivered_samples,
        storage_reads: s.storage_reads,
        storage_read_bytes: s.storage_read_bytes,
        cache_hit_bytes: s.cache_hit_bytes,
        read_seconds: s.read_seconds,
        stall_seconds: s.stall_seconds,
        throttled_seconds: s.throttled_seconds,
        errors: s.errors,
        buffer_used_bytes: s.buffer_used_bytes,
        buffer_capacity_bytes: s.buffer_capacity_bytes,
        readers: s.readers,
        active_readers: s.active_readers,
        connections: s.connections as u32,
        plans: s.plans as u32,
        bytes_per_second: s.bytes_per_second_limit,
        ops_per_second: s.ops_per_second_limit,
        read_latency: None,
    }
}

/// Converts a push; refuses fields that cannot be honoured as given.
pub fn settings(pushed: v1::Settings) -> Result<PushedSettings, String> {
    let mut jobs = std::collections::HashMap::new();
    for entry in pushed.jobs {
        let overrides = overrides(entry.settings.unwrap_or_default());
        if jobs.insert(entry.job.clone(), overrides).is_some() {
            return Err(format!("job `{}` appears twice", entry.job));
        }
    }
    let mut cache = std::collections::HashMap::new();
    for c in pushed.cache {
        let overrides = DatasetCacheOverrides {
            tenant: c.tenant,
            tenant_weight: c.tenant_weight,
            weight: c.weight,
            pin: c.pin_bytes,
            staging_round: c.staging_round,
            staging_bytes_per_s: (c.staging_bytes_per_second != 0)
                .then_some(c.staging_bytes_per_second),
        };
        if cache.insert(c.dataset.clone(), overrides).is_some() {
            return Err(format!("data set `{}` has cache settings twice", c.dataset));
        }
    }
    Ok(PushedSettings {
        version: pushed.version,
        defaults: pushed.defaults.map(overrides),
        jobs,
        unmanaged: pushed.unmanaged.into_iter().collect(),
        cache,
    })
}

/// Zero in a bound or the burst means "keep the stage's own value", each
/// on its own.
fn overrides(s: v1::JobSettings) -> JobOverrides {
    let set = |v: u64| (v != 0).then_some(v);
    JobOverrides {
        bytes_per_s: s.bytes_per_second,
        ops_per_s: s.ops_per_second,
        burst: set(u64::from(s.burst_millis)).map(Duration::from_millis),
        tuner: s.tuner,
        min_readers: (s.min_readers != 0).then_some(s.min_readers),
        max_readers: (s.max_readers != 0).then_some(s.max_readers),
        min_buffer: set(s.min_buffer_bytes),
        max_buffer: set(s.max_buffer_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushes_convert_and_duplicates_are_refused() {
        let job = |name: &str, bytes| v1::JobSettingsEntry {
            job: name.into(),
            settings: Some(v1::JobSettings {
                bytes_per_second: Some(bytes),
                min_readers: 2,
                max_readers: 8,
                ..Default::default()
            }),
        };
        let pushed = v1::Settings {
            version: 7,
            defaults: None,
            jobs: vec![job("a", 100)],
            unmanaged: vec!["x".into()],
            cache: vec![],
        };
        let s = settings(pushed).unwrap();
        assert_eq!(s.version, 7);
        assert!(s.names("a") && s.names("x") && !s.names("b"));
        assert_eq!(s.jobs["a"].bytes_per_s, Some(100));
        assert_eq!(
            (s.jobs["a"].min_readers, s.jobs["a"].max_readers),
            (Some(2), Some(8))
        );
        assert_eq!(
            (s.jobs["a"].min_buffer, s.jobs["a"].max_buffer),
            (None, None),
            "zero bounds keep the stage's"
        );
        let twice = v1::Settings {
            version: 8,
            defaults: None,
            jobs: vec![job("a", 1), job("a", 2)],
            unmanaged: vec![],
            cache: vec![],
        };
        assert!(settings(twice).unwrap_err().contains("twice"));
    }
}
