//! What a stage is told about its cache: per data set that a
//! `DatasetCache` steers, its tenant and weights, what is pinned, and
//! which staging round it should have run ([`cache_assignment`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{PolicySet, Preload};

/// How a stage should cache one data set (the domain twin of the wire
/// message `sluice.v1.DatasetCacheSettings`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetCacheAssignment {
    /// The DatasetCache document.
    pub policy: String,
    /// The data set's tenant.
    pub tenant: String,
    /// The tenant's share of the node's cache.
    pub tenant_weight: u32,
    /// The data set's share within its tenant.
    pub weight: u32,
    /// Bytes kept whatever other data sets want; 0 none, `u64::MAX` all.
    pub pin_bytes: u64,
    /// The staging round the stage should have run: when it is above the
    /// last round the stage ran, the stage stages the data set again. 0 =
    /// none asked.
    pub staging_round: u64,
    /// Most bytes per second staging reads (its pool may allow less).
    pub staging_bytes_per_second: u64,
}

/// The round `preload: job-start` asks for: the first, so a stage stages
/// once per start (later rounds come from operators' requests).
pub const PRELOAD_ROUND: u64 = 1;

/// Returns the cache settings of a stage serving `datasets`: one entry per
/// data set a `DatasetCache` steers. `reading` says whether trainers read
/// on the stage (then `preload: job-start` data sets are staged);
/// `requests` holds the staging round operators asked for, per data set.
pub fn cache_assignment(
    set: &PolicySet,
    datasets: &[String],
    reading: bool,
    requests: &BTreeMap<String, u64>,
) -> BTreeMap<String, DatasetCacheAssignment> {
    let mut out = BTreeMap::new();
    for dataset in datasets {
        let Some(cache) = set.cache_for_dataset(dataset) else {
            continue;
        };
        let spec = cache.spec();
        let staging = spec.staging.as_ref();
        let preload = (reading && spec.preload == Preload::JobStart).then_some(PRELOAD_ROUND);
        let requested = requests.get(dataset).copied();
        let staging_round = match staging {
            Some(_) => preload.max(requested).unwrap_or(0),
            None => 0,
        };
        out.insert(
            dataset.clone(),
            DatasetCacheAssignment {
                policy: cache.name().to_owned(),
                tenant: spec.tenant.clone(),
                tenant_weight: spec.tenant_weight,
                weight: spec.weight,
                pin_bytes: spec.pin.map_or(0, |p| p.bytes()),
                staging_round,
                staging_bytes_per_second: staging.map_or(0, |s| s.rate.bytes_per_second()),
            },
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_documents;

    const SET: &str = "
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: nfs}
spec: {capacity: {bandwidth: 1GiB/s}}
---
apiVersion: sluice.dev/v1
kind: DatasetCache
metadata: {name: imagenet}
spec:
  dataset: imagenet
  tenant: vision
  tenantWeight: 3
  weight: 2
  pin: all
  preload: job-start
  staging: {pool: nfs, rate: 50MiB/s}
---
apiVersion: sluice.dev/v1
kind: DatasetCache
metadata: {name: text}
spec: {dataset: c4, pin: 1GiB}
";

    fn set() -> PolicySet {
        PolicySet::from_documents(parse_documents("set.yaml", SET).unwrap()).unwrap()
    }

    #[test]
    fn each_steered_data_set_gets_its_weights_pin_and_round() {
        let set = set();
        let datasets = ["imagenet", "c4", "other"].map(str::to_owned);
        let idle = cache_assignment(&set, &datasets, false, &BTreeMap::new());
        assert_eq!(idle.len(), 2, "a data set no document names is left out");
        let imagenet = &idle["imagenet"];
        assert_eq!(
            (
                imagenet.tenant.as_str(),
                imagenet.tenant_weight,
                imagenet.weight
            ),
            ("vision", 3, 2)
        );
        assert_eq!(imagenet.pin_bytes, u64::MAX);
        assert_eq!(imagenet.staging_round, 0, "nobody reads: no preload yet");
        assert_eq!(imagenet.staging_bytes_per_second, 50 << 20);
        let c4 = &idle["c4"];
        assert_eq!((c4.tenant.as_str(), c4.pin_bytes), ("default", 1 << 30));

        let reading = cache_assignment(&set, &datasets, true, &BTreeMap::new());
        assert_eq!(reading["imagenet"].staging_round, PRELOAD_ROUND);
        assert_eq!(reading["c4"].staging_round, 0, "no preload asked");

        let asked = BTreeMap::from([("imagenet".to_owned(), 7), ("c4".to_owned(), 9)]);
        let asked = cache_assignment(&set, &datasets, true, &asked);
        assert_eq!(asked["imagenet"].staging_round, 7);
        assert_eq!(
            asked["c4"].staging_round, 0,
            "without spec.staging nothing stages"
        );
    }

    #[test]
    fn staging_jobs_run_under_their_data_sets_staging_policy() {
        let set = set();
        let staging = BTreeMap::from([(crate::STAGING_LABEL.to_owned(), "imagenet".to_owned())]);
        let (policy, pool) = set.placement(&staging).unwrap();
        assert_eq!((policy.name(), pool.name()), ("imagenet", "nfs"));
        assert_eq!(
            policy.spec().limit.bandwidth.unwrap().bytes_per_second(),
            50 << 20
        );
        let unstaged = BTreeMap::from([(crate::STAGING_LABEL.to_owned(), "c4".to_owned())]);
        assert!(set.placement(&unstaged).is_none());
    }
}
