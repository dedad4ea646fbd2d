//! A validated set of pools and job policies, the rules that need the
//! whole set, and the precedence rule that picks one policy per job.
//!
//! # Precedence
//!
//! When several job policies select a job, the one that applies is the one
//! with the highest `spec.precedence` (default 0); among equal precedence,
//! the one whose selector has the most terms (`matchLabels` pairs plus
//! `matchExpressions` entries; identical entries count once). A set in
//! which two policies have equal precedence and equal specificity and can
//! select the same job is refused at validation, with both locations and an
//! example of the labels they both select, so the rule never has to guess
//! at run time. Whether two selectors can select a common job is decided
//! exactly (see `selector.rs`).

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{ErrorKind, Location, PolicyError, PolicyErrors, suggest};
use crate::model::{DatasetCache, JobPolicy, Kind, Policy, STAGING_LABEL, Sharing, StoragePool};
use crate::selector::Labels;

/// A consistent set of pools and job policies: every name is unique per
/// kind, every policy's pool exists, guarantees fit their pools, and no two
/// policies can claim a job with equal precedence and specificity. Built
/// only by [`PolicySet::apply`] (and [`PolicySet::from_documents`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicySet {
    pools: BTreeMap<String, StoragePool>,
    policies: BTreeMap<String, JobPolicy>,
    caches: BTreeMap<String, DatasetCache>,
}

/// What applying a document did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// No document of this kind and name existed.
    Created,
    /// One existed and differed.
    Updated,
    /// One existed and was the same once defaults are filled in: no new
    /// revision is needed.
    Unchanged,
}

/// One document of an apply and what happened to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The document's kind.
    pub kind: Kind,
    /// The document's name.
    pub name: String,
    /// Created, updated or unchanged.
    pub action: Action,
}

/// Why a document could not be deleted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeleteError {
    /// No document of this kind has this name.
    #[error("{kind} `{name}` does not exist")]
    NotFound { kind: Kind, name: String },
    /// Job policies still draw from the pool.
    #[error(
        "pool `{pool}` is still used by {}: delete those policies or point them at another pool first",
        .used_by.iter().map(|(n, at)| format!("{n} ({at})")).collect::<Vec<_>>().join(", ")
    )]
    PoolInUse {
        pool: String,
        used_by: Vec<(String, Location)>,
    },
}

impl PolicySet {
    /// Returns an empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Validates `documents` as one set (an offline `validate`).
    pub fn from_documents(documents: Vec<Policy>) -> Result<Self, PolicyErrors> {
        Self::new().apply(documents).map(|(set, _)| set)
    }

    /// Validates `documents` together with this set: documents replace the
    /// ones of the same kind and name, and the result must be consistent.
    /// Returns the new set and what happened to each document, or every
    /// error found; `self` is never changed.
    pub fn apply(&self, documents: Vec<Policy>) -> Result<(Self, Vec<Change>), PolicyErrors> {
        let mut errors = Vec::new();
        let mut seen: BTreeMap<(Kind, String), Location> = BTreeMap::new();
        let mut next = self.clone();
        let mut changes = Vec::new();
        for doc in documents {
            let (kind, name) = (doc.kind(), doc.name().to_owned());
            let at = doc.origin().at("metadata.name");
            if let Some(first) = seen.get(&(kind, name.clone())) {
                errors.push(PolicyError {
                    location: at,
                    kind: ErrorKind::DuplicateName {
                        kind: kind.as_str(),
                        name,
                        first: first.clone(),
                    },
                });
                continue;
            }
            seen.insert((kind, name.clone()), at);
            let action = match doc {
                Policy::StoragePool(p) => upsert(&mut next.pools, p),
                Policy::JobPolicy(p) => upsert(&mut next.policies, p),
                Policy::DatasetCache(p) => upsert(&mut next.caches, p),
            };
            changes.push(Change { kind, name, action });
        }
        let touched = changes
            .iter()
            .filter(|c| c.kind == Kind::JobPolicy)
            .map(|c| c.name.as_str())
            .collect();
        errors.extend(next.check(&touched));
        if errors.is_empty() {
            Ok((next, changes))
        } else {
            Err(PolicyErrors(errors).sorted())
        }
    }

    /// Returns the set without the document `kind`/`name`, refusing to
    /// delete a pool that policies still use.
    pub fn delete(&self, kind: Kind, name: &str) -> Result<Self, DeleteError> {
        let mut next = self.clone();
        let found = match kind {
            Kind::StoragePool => next.pools.remove(name).is_some(),
            Kind::JobPolicy => next.policies.remove(name).is_some(),
            Kind::DatasetCache => next.caches.remove(name).is_some(),
        };
        if !found {
            return Err(DeleteError::NotFound {
                kind,
                name: name.to_owned(),
            });
        }
        let policies = next
            .policies
            .values()
            .filter(|p| kind == Kind::StoragePool && p.spec.pool == name)
            .map(|p| (format!("policy `{}`", p.name()), p.origin.at("spec.pool")));
        let caches = next
            .caches
            .values()
            .filter(|c| {
                kind == Kind::StoragePool && c.spec.staging.as_ref().is_some_and(|s| s.pool == name)
            })
            .map(|c| {
                let what = format!("the staging of DatasetCache `{}`", c.name());
                (what, c.origin.at("spec.staging.pool"))
            });
        let used_by: Vec<(String, Location)> = policies.chain(caches).collect();
        if !used_by.is_empty() {
            return Err(DeleteError::PoolInUse {
                pool: name.to_owned(),
                used_by,
            });
        }
        Ok(next)
    }

    /// Returns the pool named `name`.
    pub fn pool(&self, name: &str) -> Option<&StoragePool> {
        self.pools.get(name)
    }

    /// Returns the job policy named `name`.
    pub fn job_policy(&self, name: &str) -> Option<&JobPolicy> {
        self.policies.get(name)
    }

    /// Returns the pools, by name.
    pub fn pools(&self) -> impl Iterator<Item = &StoragePool> {
        self.pools.values()
    }

    /// Returns the job policies, by name.
    pub fn job_policies(&self) -> impl Iterator<Item = &JobPolicy> {
        self.policies.values()
    }

    /// Returns the data set caches, by name.
    pub fn dataset_caches(&self) -> impl Iterator<Item = &DatasetCache> {
        self.caches.values()
    }

    /// Returns the `DatasetCache` named `name`.
    pub fn dataset_cache(&self, name: &str) -> Option<&DatasetCache> {
        self.caches.get(name)
    }

    /// Returns the `DatasetCache` that steers data set `dataset` (at most
    /// one does).
    pub fn cache_for_dataset(&self, dataset: &str) -> Option<&DatasetCache> {
        self.caches.values().find(|c| c.spec.dataset == dataset)
    }

    /// Returns the data sets that `DatasetCache` documents name.
    pub fn cached_datasets(&self) -> impl Iterator<Item = &str> {
        self.caches.values().map(|c| c.spec.dataset.as_str())
    }

    /// Returns every document, pools first, each kind by name.
    pub fn documents(&self) -> Vec<Policy> {
        let pools = self.pools.values().cloned().map(Policy::StoragePool);
        pools
            .chain(self.policies.values().cloned().map(Policy::JobPolicy))
            .chain(self.caches.values().cloned().map(Policy::DatasetCache))
            .collect()
    }

    /// Returns the policy that applies to a job with `labels` (see the
    /// module docs for the precedence rule), or `None` when no policy
    /// selects it. A staging job (labelled [`STAGING_LABEL`]) runs under
    /// its data set's staging policy and no other.
    pub fn policy_for_job<L: Labels + ?Sized>(&self, labels: &L) -> Option<&JobPolicy> {
        if let Some(dataset) = labels.label(STAGING_LABEL) {
            return self
                .cache_for_dataset(dataset)
                .and_then(DatasetCache::staging_policy);
        }
        self.policies
            .values()
            .filter(|p| p.spec.selector.matches(labels))
            // Ties cannot survive validation; the name only makes the
            // choice deterministic should one ever appear.
            .max_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| b.name().cmp(a.name())))
    }

    /// Returns the policy and its pool for a job with `labels`.
    pub fn placement<L: Labels + ?Sized>(&self, labels: &L) -> Option<(&JobPolicy, &StoragePool)> {
        let policy = self.policy_for_job(labels)?;
        Some((policy, self.pools.get(&policy.spec.pool)?))
    }

    /// The rules that need the whole set; `touched` names the job
    /// policies of the current apply, where conflicts are reported.
    fn check(&self, touched: &BTreeSet<&str>) -> Vec<PolicyError> {
        let mut errors = Vec::new();
        for policy in self.policies.values() {
            errors.extend(self.check_pool_use(policy));
        }
        errors.extend(self.check_ambiguity(touched));
        errors.extend(self.check_caches());
        errors
    }

    /// Staging pools exist, one document per data set, one weight per
    /// tenant (reported at the later document in the source).
    fn check_caches(&self) -> Vec<PolicyError> {
        let mut errors = Vec::new();
        let mut by_dataset: BTreeMap<&str, &DatasetCache> = BTreeMap::new();
        let mut by_tenant: BTreeMap<&str, &DatasetCache> = BTreeMap::new();
        let mut caches: Vec<&DatasetCache> = self.caches.values().collect();
        caches.sort_by_key(|c| c.origin.at(""));
        for cache in caches {
            let spec = &cache.spec;
            if let Some(staging) = &spec.staging
                && !self.pools.contains_key(&staging.pool)
            {
                let known: Vec<String> = self.pools.keys().cloned().collect();
                errors.push(PolicyError {
                    location: cache.origin.at("spec.staging.pool"),
                    kind: ErrorKind::UnknownPool {
                        pool: staging.pool.clone(),
                        suggestion: suggest(&staging.pool, known.iter().map(String::as_str)),
                        known,
                    },
                });
            }
            if let Some(other) = by_dataset.insert(&spec.dataset, cache) {
                errors.push(PolicyError {
                    location: cache.origin.at("spec.dataset"),
                    kind: ErrorKind::DatasetCachedTwice {
                        dataset: spec.dataset.clone(),
                        other: other.name().to_owned(),
                        other_at: other.origin.at("spec.dataset"),
                    },
                });
            }
            match by_tenant.get(spec.tenant.as_str()) {
                Some(other) if other.spec.tenant_weight != spec.tenant_weight => {
                    errors.push(PolicyError {
                        location: cache.origin.at("spec.tenantWeight"),
                        kind: ErrorKind::TenantWeightDisagrees {
                            tenant: spec.tenant.clone(),
                            weight: spec.tenant_weight,
                            other: other.name().to_owned(),
                            other_weight: other.spec.tenant_weight,
                            other_at: other.origin.at("spec.tenantWeight"),
                        },
                    });
                }
                Some(_) => {}
                None => {
                    by_tenant.insert(&spec.tenant, cache);
                }
            }
        }
        errors
    }

    fn check_pool_use(&self, policy: &JobPolicy) -> Vec<PolicyError> {
        let spec = &policy.spec;
        let err = |path: &str, kind| PolicyError {
            location: policy.origin.at(path),
            kind,
        };
        let Some(pool) = self.pools.get(&spec.pool) else {
            let known: Vec<String> = self.pools.keys().cloned().collect();
            return vec![err(
                "spec.pool",
                ErrorKind::UnknownPool {
                    pool: spec.pool.clone(),
                    suggestion: suggest(&spec.pool, known.iter().map(String::as_str)),
                    known,
                },
            )];
        };
        let mut errors = Vec::new();
        let capacity = pool.spec.capacity;
        let pool_name = || pool.name().to_owned();
        if let Some(g) = spec.guarantee.bandwidth
            && g > capacity.bandwidth
        {
            errors.push(err(
                "spec.guarantee.bandwidth",
                ErrorKind::GuaranteeAboveCapacity {
                    resource: "bandwidth",
                    guarantee: g.to_string(),
                    pool: pool_name(),
                    capacity: capacity.bandwidth.to_string(),
                    pool_at: pool.origin.at("spec.capacity.bandwidth"),
                },
            ));
        }
        match (spec.guarantee.ops, capacity.ops) {
            (Some(g), Some(c)) if g > c => {
                errors.push(err(
                    "spec.guarantee.ops",
                    ErrorKind::GuaranteeAboveCapacity {
                        resource: "ops",
                        guarantee: g.to_string(),
                        pool: pool_name(),
                        capacity: c.to_string(),
                        pool_at: pool.origin.at("spec.capacity.ops"),
                    },
                ));
            }
            (Some(_), None) => errors.push(err(
                "spec.guarantee.ops",
                ErrorKind::GuaranteeWithoutCapacity {
                    pool: pool_name(),
                    pool_at: pool.origin.at("spec.capacity"),
                },
            )),
            _ => {}
        }
        if pool.spec.sharing == Sharing::Static {
            let pool_at = pool.origin.at("spec.sharing");
            if spec.limit.bandwidth.is_none() {
                errors.push(err(
                    "spec",
                    ErrorKind::StaticNeedsLimit {
                        pool: pool_name(),
                        pool_at: pool_at.clone(),
                    },
                ));
            }
            if spec.guarantee.bandwidth.is_some() || spec.guarantee.ops.is_some() {
                errors.push(err(
                    "spec.guarantee",
                    ErrorKind::StaticForbidsGuarantee {
                        pool: pool_name(),
                        pool_at,
                    },
                ));
            }
        }
        errors
    }

    /// Finds every pair of policies with equal (precedence, specificity)
    /// whose selectors can select a common job.
    fn check_ambiguity(&self, touched: &BTreeSet<&str>) -> Vec<PolicyError> {
        let mut by_rank: BTreeMap<(i32, usize), Vec<&JobPolicy>> = BTreeMap::new();
        for p in self.policies.values() {
            by_rank.entry(rank(p)).or_default().push(p);
        }
        let mut errors = Vec::new();
        for ((precedence, specificity), group) in by_rank {
            for (i, a) in group.iter().enumerate() {
                for b in &group[i + 1..] {
                    let Some(witness) = a.spec.selector.overlap(&b.spec.selector) else {
                        continue;
                    };
                    // Report at the one this apply wrote; between two
                    // of those, at the later in the source.
                    let (a_at, b_at) = (a.origin.at("spec.selector"), b.origin.at("spec.selector"));
                    let key =
                        |p: &JobPolicy, at: &Location| (touched.contains(p.name()), at.clone());
                    let ((here, here_at), (other, other_at)) = if key(a, &a_at) > key(b, &b_at) {
                        ((a, a_at), (b, b_at))
                    } else {
                        ((b, b_at), (a, a_at))
                    };
                    errors.push(PolicyError {
                        location: here_at.clone(),
                        kind: ErrorKind::Ambiguous {
                            policy: here.name().to_owned(),
                            policy_at: here_at,
                            other: other.name().to_owned(),
                            other_at,
                            labels: witness.to_string(),
                            precedence,
                            specificity,
                        },
                    });
                }
            }
        }
        errors
    }
}

/// What the precedence rule compares: precedence, then specificity.
fn rank(p: &JobPolicy) -> (i32, usize) {
    (p.spec.precedence, p.spec.selector.specificity())
}

/// Inserts or replaces a document and says which it was.
fn upsert<T: PartialEq + NamedDoc>(map: &mut BTreeMap<String, T>, doc: T) -> Action {
    let action = match map.get(doc.doc_name()) {
        None => Action::Created,
        Some(old) if *old == doc => Action::Unchanged,
        Some(_) => Action::Updated,
    };
    map.insert(doc.doc_name().to_owned(), doc);
    action
}

trait NamedDoc {
    fn doc_name(&self) -> &str;
}

impl NamedDoc for StoragePool {
    fn doc_name(&self) -> &str {
        self.name()
    }
}

impl NamedDoc for JobPolicy {
    fn doc_name(&self) -> &str {
        self.name()
    }
}

impl NamedDoc for DatasetCache {
    fn doc_name(&self) -> &str {
        self.name()
    }
}

/// Returns the policy that applies to a job with `labels` in `set`: the
/// highest precedence, then the most specific selector (see the module
/// docs). The same as [`PolicySet::policy_for_job`].
pub fn policy_for_job<'a, L: Labels + ?Sized>(
    set: &'a PolicySet,
    labels: &L,
) -> Option<&'a JobPolicy> {
    set.policy_for_job(labels)
}
