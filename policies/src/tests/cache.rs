//! `DatasetCache` documents: defaults, the canonical form, and every
//! error with its position.

use super::{POOL, errors, set};
use crate::{Kind, Pin, Policy, PolicySet, Preload, parse_documents};

/// A DatasetCache named `name` with `spec` (lines indented by two spaces);
/// its spec starts on line 6.
fn cache(name: &str, spec: &str) -> String {
    format!(
        "apiVersion: sluice.dev/v1\nkind: DatasetCache\nmetadata:\n  name: {name}\nspec:\n{spec}"
    )
}

#[test]
fn defaults_are_filled_in_and_the_canonical_form_reads_back() {
    let text = format!(
        "{POOL}---\n{}---\n{}",
        cache(
            "imagenet",
            "  dataset: imagenet\n  pin: all\n  preload: job-start\n  staging: {pool: shared}\n"
        ),
        cache(
            "c4",
            "  dataset: c4\n  tenant: text\n  tenantWeight: 2\n  weight: 5\n  pin: 20GiB\n"
        ),
    );
    let set = set(&text);
    let imagenet = set.dataset_cache("imagenet").unwrap().spec();
    assert_eq!(
        (
            imagenet.tenant.as_str(),
            imagenet.tenant_weight,
            imagenet.weight
        ),
        ("default", 1, 1)
    );
    assert_eq!(imagenet.pin, Some(Pin::All));
    assert_eq!(imagenet.preload, Preload::JobStart);
    let staging = imagenet.staging.as_ref().unwrap();
    assert_eq!(
        (staging.rate.bytes_per_second(), staging.weight),
        (100 << 20, 1)
    );
    let c4 = set.cache_for_dataset("c4").unwrap().spec();
    assert_eq!(c4.pin.unwrap().bytes(), 20 << 30);
    assert_eq!(c4.preload, Preload::Never);
    for doc in set.documents() {
        let again = parse_documents("canonical", &doc.canonical())
            .unwrap()
            .remove(0);
        assert_eq!(again, doc, "{}", doc.canonical());
    }
}

#[test]
fn document_errors_say_where_and_what_to_write() {
    let text = cache(
        "x",
        "  dataset: a/b\n  weight: 0\n  pin: lots\n  preload: job-start\n",
    );
    assert_eq!(
        errors(&text),
        [
            "t.yaml:6:12: spec.dataset: write the data set's name as the stages serve it (`--dataset NAME=...`): 1 to 128 bytes, no `/` and no spaces",
            "t.yaml:7:11: spec.weight must be from 1 to 10000, found 0: a tenant's part of a node's cache is split among its data sets by these weights",
            "t.yaml:8:8: spec.pin: `lots` is neither `all` nor a byte size: write `all` to keep the whole data set, or a size such as `20GiB`",
            "t.yaml:9:12: spec.preload: preloading is staging: add `staging: {pool: POOL}` to say which pool its reads are charged to",
        ]
    );
}

#[test]
fn set_errors_name_both_documents() {
    let text = format!(
        "{POOL}---\n{}---\n{}---\n{}",
        cache("one", "  dataset: imagenet\n  tenant: vision\n"),
        cache(
            "two",
            "  dataset: imagenet\n  tenant: vision\n  tenantWeight: 3\n"
        ),
        cache("three", "  dataset: c4\n  staging: {pool: sharde}\n"),
    );
    assert_eq!(
        errors(&text),
        [
            "t.yaml:23:12: data set `imagenet` already has DatasetCache `one` (t.yaml:15:12): one document steers one data set's cache; merge them or delete one",
            "t.yaml:25:17: tenant `vision` has tenantWeight 3 here but 1 in DatasetCache `one` (t.yaml:15:3): a tenant's share of a node's cache is one number; write the same in both",
            "t.yaml:33:19: pool `sharde` does not exist: did you mean `shared`? apply a StoragePool with this name or name one of `shared`",
        ]
    );
}

#[test]
fn a_pool_that_staging_uses_cannot_be_deleted() {
    let text = format!(
        "{POOL}---\n{}",
        cache(
            "imagenet",
            "  dataset: imagenet\n  staging: {pool: shared, rate: 20MiB/s}\n"
        )
    );
    let set: PolicySet = set(&text);
    let refused = set
        .delete(Kind::StoragePool, "shared")
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("the staging of DatasetCache `imagenet` (t.yaml:16:"),
        "{refused}"
    );
    let without = set.delete(Kind::DatasetCache, "imagenet").unwrap();
    assert!(without.delete(Kind::StoragePool, "shared").is_ok());
    assert!(matches!(
        set.documents().last(),
        Some(Policy::DatasetCache(_))
    ));
}
