//! Validation of a `DatasetCache` document: the data set's name, weights,
//! the pin, and staging (which a `preload` needs).

use std::collections::BTreeMap;

use crate::document::{RawDatasetCacheSpec, RawDocument, RawPrefetch, RawStaging};
use crate::model::{
    DatasetCache, DatasetCacheSpec, JobPolicy, JobPolicySpec, Limit, Metadata, Pin, Preload,
    STAGING_LABEL, Staging,
};
use crate::selector::Selector;
use crate::validate::prefetch::prefetch;
use crate::validate::{Check, MAX_WEIGHT, check_name, invalid, metadata, ranged};
use crate::{ByteRate, ByteSize};

/// Staging's rate when `spec.staging.rate` is absent.
pub const DEFAULT_STAGING_RATE: ByteRate = ByteRate(100 << 20);
/// The tenant of a data set whose document names none.
pub const DEFAULT_TENANT: &str = "default";
/// Longest data set name, as the stage allows.
const MAX_DATASET_BYTES: usize = 128;

pub(super) fn dataset_cache(
    check: &mut Check,
    doc: RawDocument<RawDatasetCacheSpec>,
) -> Option<DatasetCache> {
    let metadata = metadata(check, doc.metadata);
    let spec = doc.spec;
    dataset_name(check, &spec.dataset);
    let tenant = spec.tenant.unwrap_or_else(|| DEFAULT_TENANT.to_owned());
    check_name(check, "spec.tenant", &tenant);
    let mut weight = |path: &str, value: Option<i64>, hint: &str| {
        ranged(
            check,
            path,
            value.unwrap_or(1),
            1,
            i64::from(MAX_WEIGHT),
            hint,
        )
        .and_then(|w| u32::try_from(w).ok())
    };
    let tenant_weight = weight(
        "spec.tenantWeight",
        spec.tenant_weight,
        "a node's cache is split among tenants by these weights",
    );
    let data_set_weight = weight(
        "spec.weight",
        spec.weight,
        "a tenant's part of a node's cache is split among its data sets by these weights",
    );
    let pin = spec.pin.as_deref().and_then(|text| pin(check, text));
    let preload = spec.preload.unwrap_or_default();
    if preload == Preload::JobStart && spec.staging.is_none() {
        check.push(
            "spec.preload",
            invalid(
                "spec.preload",
                "preloading is staging: add `staging: {pool: POOL}` to say which pool its reads are charged to",
            ),
        );
    }
    let staging = spec.staging.and_then(|raw| staging(check, raw));
    let staging_policy = match &staging {
        Some(s) => Some(Box::new(staging_policy(
            check,
            &metadata.name,
            &spec.dataset,
            s,
        )?)),
        None => None,
    };
    Some(DatasetCache {
        metadata,
        spec: DatasetCacheSpec {
            dataset: spec.dataset,
            tenant,
            tenant_weight: tenant_weight?,
            weight: data_set_weight?,
            pin,
            preload,
            staging,
        },
        origin: check.origin.clone(),
        staging_policy,
    })
}

/// The job policy staging jobs of `dataset` run under: named as the
/// document, in the staging pool with its weight, capped at its rate,
/// with the default prefetch bounds.
fn staging_policy(
    check: &mut Check,
    name: &str,
    dataset: &str,
    staging: &Staging,
) -> Option<JobPolicy> {
    let selector = Selector {
        match_labels: BTreeMap::from([(STAGING_LABEL.to_owned(), dataset.to_owned())]),
        match_expressions: Vec::new(),
    };
    Some(JobPolicy {
        metadata: Metadata {
            name: name.to_owned(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
        },
        spec: JobPolicySpec {
            selector,
            pool: staging.pool.clone(),
            weight: staging.weight,
            priority: 0,
            precedence: 0,
            guarantee: Default::default(),
            limit: Limit {
                bandwidth: Some(staging.rate),
                ..Limit::default()
            },
            prefetch: prefetch(check, RawPrefetch::default())?,
        },
        origin: check.origin.clone(),
    })
}

fn dataset_name(check: &mut Check, name: &str) {
    let fine = !name.is_empty()
        && name.len() <= MAX_DATASET_BYTES
        && !name.contains('/')
        && !name.chars().any(|c| c.is_whitespace() || c.is_control());
    if !fine {
        check.push(
            "spec.dataset",
            invalid(
                "spec.dataset",
                "write the data set's name as the stages serve it (`--dataset NAME=...`): 1 to 128 bytes, no `/` and no spaces",
            ),
        );
    }
}

fn pin(check: &mut Check, text: &str) -> Option<Pin> {
    if text.trim() == "all" {
        return Some(Pin::All);
    }
    match ByteSize::parse(text) {
        Ok(size) if size.0 > 0 => Some(Pin::Bytes(size)),
        Ok(_) => {
            check.push(
                "spec.pin",
                invalid("spec.pin", "a pin of 0 keeps nothing: leave it out"),
            );
            None
        }
        Err(_) => {
            let message = format!(
                "`{}` is neither `all` nor a byte size: write `all` to keep the whole data set, or a size such as `20GiB`",
                text.trim()
            );
            check.push("spec.pin", invalid("spec.pin", &message));
            None
        }
    }
}

fn staging(check: &mut Check, raw: RawStaging) -> Option<Staging> {
    check_name(check, "spec.staging.pool", &raw.pool);
    let rate = raw.rate.unwrap_or(DEFAULT_STAGING_RATE);
    if rate.0 == 0 {
        check.push(
            "spec.staging.rate",
            invalid(
                "spec.staging.rate",
                "a rate of 0 would never stage anything: leave it out for 100MiB/s",
            ),
        );
    }
    let weight = ranged(
        check,
        "spec.staging.weight",
        raw.weight.unwrap_or(1),
        1,
        i64::from(MAX_WEIGHT),
        "staging reads share their pool with jobs by weight, like a job",
    )?;
    if rate.0 == 0 {
        return None;
    }
    Some(Staging {
        pool: raw.pool,
        rate,
        weight: u32::try_from(weight).ok()?,
    })
}
