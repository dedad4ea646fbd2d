//! Tests across modules: the examples, one test per error kind with its
//! exact position and message, the precedence rule, applying against an
//! existing set, and property tests of the validator.

use std::collections::BTreeMap;

use super::*;

mod cache;
mod errors;
mod properties;

const POOL: &str = "apiVersion: sluice.dev/v1
kind: StoragePool
metadata:
  name: shared
spec:
  capacity:
    bandwidth: 2GiB/s
    ops: 10k ops/s
";

/// A JobPolicy named `name` with `spec` (lines indented by two spaces);
/// `metadata.name` is on line 4 of the document and the spec starts on
/// line 6.
fn job(name: &str, spec: &str) -> String {
    format!("apiVersion: sluice.dev/v1\nkind: JobPolicy\nmetadata:\n  name: {name}\nspec:\n{spec}")
}

/// [`POOL`], then the job after `---`: the job's spec starts on line 15.
fn with_pool(name: &str, spec: &str) -> String {
    format!("{POOL}---\n{}", job(name, spec))
}

fn set(text: &str) -> PolicySet {
    parse_documents("t.yaml", text)
        .and_then(PolicySet::from_documents)
        .unwrap_or_else(|e| panic!("{e}\nin:\n{text}"))
}

fn errors(text: &str) -> Vec<String> {
    match parse_documents("t.yaml", text).and_then(PolicySet::from_documents) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e.errors().iter().map(ToString::to_string).collect(),
    }
}

fn error(text: &str) -> String {
    let mut all = errors(text);
    assert_eq!(all.len(), 1, "{all:#?}");
    all.remove(0)
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[test]
fn every_example_parses_and_validates() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.display().to_string();
        let docs = parse_documents(&name, &text).unwrap_or_else(|e| panic!("{e}"));
        let set = PolicySet::from_documents(docs.clone()).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            set.pools().count() >= 1 && set.job_policies().count() >= 2,
            "{name}"
        );
        // Every document round-trips through its canonical form.
        for doc in docs {
            let again = parse_documents("canonical", &doc.canonical())
                .unwrap()
                .remove(0);
            assert_eq!(again, doc);
        }
        seen += 1;
    }
    assert!(seen >= 3, "only {seen} examples");
}

#[test]
fn the_reference_examples_are_valid() {
    let doc = include_str!("../../docs/policies.md");
    let blocks: Vec<&str> = doc
        .split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .filter(|b| b.starts_with("apiVersion:") && !b.contains("..."))
        .collect();
    assert!(blocks.len() >= 2, "{blocks:?}");
    let set = set(&blocks.join("---\n"));
    assert_eq!(set.job_policy("vision-prod").unwrap().spec().weight, 3);
    assert_eq!(set.cache_for_dataset("imagenet").unwrap().spec().weight, 3);
}

#[test]
fn examples_mean_what_their_comments_say() {
    let text = include_str!("../examples/shared-weighted.yaml");
    let set = set(text);
    let name = |l: &[(&str, &str)]| set.policy_for_job(&labels(l)).map(|p| p.name().to_owned());
    assert_eq!(
        name(&[("team", "vision"), ("stage", "prod")]).as_deref(),
        Some("vision-prod")
    );
    assert_eq!(
        name(&[("team", "vision"), ("stage", "dev")]).as_deref(),
        Some("vision-default")
    );
    assert_eq!(name(&[("team", "nlp")]).as_deref(), Some("interactive"));
    assert_eq!(name(&[("team", "nlp"), ("kind", "batch")]), None);
    let prod = set.job_policy("vision-prod").unwrap().spec();
    assert_eq!(prod.guarantee.bandwidth, Some(ByteRate(400 << 20)));
    assert_eq!(prod.prefetch.buffer.max, Some(ByteSize(1 << 30)));

    let set = self::set(include_str!("../examples/priority-classes.yaml"));
    let pick = |l: &[(&str, &str)]| set.policy_for_job(&labels(l)).unwrap().name().to_owned();
    assert_eq!(pick(&[("class", "hotfix")]), "release-critical");
    assert_eq!(pick(&[("class", "other")]), "best-effort");
    assert_eq!(
        pick(&[("class", "release"), ("sluice.dev/pause", "true")]),
        "paused"
    );
    let (_, pool) = set.placement(&labels(&[])).unwrap();
    assert_eq!(pool.spec().sharing, Sharing::Priority);
    assert_eq!(pool.spec().capacity.bandwidth, ByteRate(6_000_000_000));

    let set = self::set(include_str!("../examples/static-split.yaml"));
    let bench = set.job_policy("benchmarks").unwrap().spec();
    assert!(!bench.prefetch.tuner);
    assert_eq!(bench.prefetch.readers.initial, Some(8));
}

#[test]
fn defaults_are_filled_in() {
    let set = set(&with_pool("train", "  selector: {}\n  pool: shared\n"));
    let spec = set.job_policy("train").unwrap().spec();
    assert_eq!((spec.weight, spec.priority, spec.precedence), (1, 0, 0));
    assert!(spec.prefetch.tuner);
    assert_eq!(
        (spec.prefetch.readers.min, spec.prefetch.readers.max),
        (1, 64)
    );
    assert_eq!(spec.prefetch.buffer.min, ByteSize(4 << 20));
    assert_eq!(spec.prefetch.buffer.max, None);
    assert_eq!(
        set.pool("shared").unwrap().spec().sharing,
        Sharing::WeightedFair
    );
    // An omitted bound moves to the written one rather than contradict it.
    let set = self::set(&with_pool(
        "train",
        "  selector: {}\n  pool: shared\n  prefetch:\n    readers: {min: 100}\n    buffer: {max: 1MiB}\n",
    ));
    let p = set.job_policy("train").unwrap().spec().prefetch;
    assert_eq!((p.readers.min, p.readers.max), (100, 100));
    assert_eq!(
        (p.buffer.min, p.buffer.max),
        (ByteSize(1 << 20), Some(ByteSize(1 << 20)))
    );
}

// ---- precedence ----

#[test]
fn equal_rank_overlap_is_ambiguous() {
    let text = format!(
        "{POOL}---\n{}---\n{}",
        job(
            "a",
            "  selector: {matchLabels: {team: x}}\n  pool: shared\n"
        ),
        job(
            "b",
            "  selector: {matchLabels: {gpu: a100}}\n  pool: shared\n"
        )
    );
    assert_eq!(
        error(&text),
        "t.yaml:23:13: policies `b` (t.yaml:23:13) and `a` (t.yaml:15:13) both select jobs with labels {gpu=a100, team=x} with equal precedence (0) and specificity (1): add a label requirement to one selector or set spec.precedence on one of them"
    );
    // Two catch-alls.
    let text = format!(
        "{POOL}---\n{}---\n{}",
        job("a", "  selector: {}\n  pool: shared\n"),
        job("b", "  selector: {}\n  pool: shared\n")
    );
    assert!(error(&text).contains("both select jobs with labels {} (every job)"));
}

#[test]
fn precedence_then_specificity_decides() {
    let text = format!(
        "{POOL}---\n{}---\n{}---\n{}---\n{}",
        job("all", "  selector: {}\n  pool: shared\n"),
        job(
            "team-x",
            "  selector: {matchLabels: {team: x}}\n  pool: shared\n"
        ),
        job(
            "team-x-gpu",
            "  selector:\n    matchLabels: {team: x}\n    matchExpressions:\n      - {key: gpu, operator: Exists}\n  pool: shared\n"
        ),
        job(
            "override",
            "  selector: {matchLabels: {urgent: \"true\"}}\n  pool: shared\n  precedence: 1\n"
        ),
    );
    let set = set(&text);
    let pick = |l: &[(&str, &str)]| policy_for_job(&set, &labels(l)).map(|p| p.name().to_owned());
    assert_eq!(pick(&[]).as_deref(), Some("all"));
    assert_eq!(pick(&[("team", "y")]).as_deref(), Some("all"));
    assert_eq!(pick(&[("team", "x")]).as_deref(), Some("team-x"));
    assert_eq!(
        pick(&[("team", "x"), ("gpu", "h100")]).as_deref(),
        Some("team-x-gpu")
    );
    // Precedence beats specificity.
    assert_eq!(
        pick(&[("team", "x"), ("gpu", "h100"), ("urgent", "true")]).as_deref(),
        Some("override")
    );
    // Disjoint selectors may share a rank.
    let text = format!(
        "{POOL}---\n{}---\n{}",
        job(
            "x",
            "  selector: {matchLabels: {team: x}}\n  pool: shared\n"
        ),
        job(
            "y",
            "  selector: {matchExpressions: [{key: team, operator: In, values: [y, z]}]}\n  pool: shared\n"
        ),
    );
    let set = self::set(&text);
    assert!(set.policy_for_job(&labels(&[("team", "w")])).is_none());
    let mut hash = std::collections::HashMap::new();
    hash.insert("team".to_owned(), "z".to_owned());
    assert_eq!(set.policy_for_job(&hash).unwrap().name(), "y");
}

// ---- applying against what exists ----

#[test]
fn apply_validates_against_the_existing_set() {
    let existing = set(&format!(
        "{POOL}---\n{}",
        job(
            "a",
            "  selector: {matchLabels: {team: x}}\n  pool: shared\n"
        )
    ));
    // A policy in a later apply may use a pool applied before.
    let docs = parse_documents(
        "b.yaml",
        &job(
            "b",
            "  selector: {matchLabels: {team: y}}\n  pool: shared\n",
        ),
    )
    .unwrap();
    let (next, changes) = existing.apply(docs).unwrap();
    assert_eq!(
        changes,
        [Change {
            kind: Kind::JobPolicy,
            name: "b".into(),
            action: Action::Created
        }]
    );
    assert_eq!(next.job_policies().count(), 2);
    // A conflict with a stored policy names both sources.
    let docs = parse_documents(
        "c.yaml",
        &job(
            "c",
            "  selector: {matchLabels: {gpu: a100}}\n  pool: shared\n",
        ),
    )
    .unwrap();
    let e = next.apply(docs).unwrap_err().to_string();
    assert_eq!(
        e,
        "c.yaml:6:13: policies `c` (c.yaml:6:13) and `a` (t.yaml:15:13) both select jobs with labels {gpu=a100, team=x} with equal precedence (0) and specificity (1): add a label requirement to one selector or set spec.precedence on one of them\n\
         c.yaml:6:13: policies `c` (c.yaml:6:13) and `b` (b.yaml:6:13) both select jobs with labels {gpu=a100, team=y} with equal precedence (0) and specificity (1): add a label requirement to one selector or set spec.precedence on one of them"
    );
    // Re-applying the same meaning is no change; a new meaning is an update.
    let same = parse_documents(
        "b2.yaml",
        &job(
            "b",
            "  selector: {matchLabels: {team: y}}\n  pool: shared\n  weight: 1\n",
        ),
    )
    .unwrap();
    assert_eq!(next.apply(same).unwrap().1[0].action, Action::Unchanged);
    let other = parse_documents(
        "b3.yaml",
        &job(
            "b",
            "  selector: {matchLabels: {team: y}}\n  pool: shared\n  weight: 2\n",
        ),
    )
    .unwrap();
    assert_eq!(next.apply(other).unwrap().1[0].action, Action::Updated);
    // Shrinking a pool below a stored guarantee is refused at the policy,
    // naming the pool's new location.
    let with_guarantee = set(&with_pool(
        "g",
        "  selector: {}\n  pool: shared\n  guarantee: {bandwidth: 1GiB/s}\n",
    ));
    let smaller = parse_documents("pool.yaml", &POOL.replace("2GiB/s", "512MiB/s")).unwrap();
    assert_eq!(
        with_guarantee.apply(smaller).unwrap_err().to_string(),
        "t.yaml:17:26: spec.guarantee.bandwidth (1GiB/s) is above the capacity of pool `shared` (512MiB/s, pool.yaml:7:16): lower the guarantee or raise the pool's spec.capacity.bandwidth"
    );
}

#[test]
fn deleting_a_pool_in_use_is_refused() {
    let s = set(&with_pool("a", "  selector: {}\n  pool: shared\n"));
    assert_eq!(
        s.delete(Kind::StoragePool, "shared")
            .unwrap_err()
            .to_string(),
        "pool `shared` is still used by policy `a` (t.yaml:16:9): delete those policies or point them at another pool first"
    );
    assert!(matches!(
        s.delete(Kind::JobPolicy, "zz"),
        Err(DeleteError::NotFound { .. })
    ));
    let s = s
        .delete(Kind::JobPolicy, "a")
        .unwrap()
        .delete(Kind::StoragePool, "shared")
        .unwrap();
    assert_eq!(s, PolicySet::new());
}

#[test]
fn all_errors_of_an_apply_are_reported_in_order() {
    let text = format!(
        "{}---\n{}",
        job("a", "  selector: {}\n  pool: shared\n  weight: 0\n"),
        job(
            "B",
            "  selector: {}\n  pool: shared\n  limit: {bandwidth: 1/s}\n  guarantee: {bandwidth: 2/s}\n"
        )
    );
    let e = errors(&text);
    assert_eq!(e.len(), 3, "{e:#?}");
    assert!(e[0].starts_with("t.yaml:8:11: spec.weight"));
    assert!(e[1].starts_with("t.yaml:13:9: metadata.name `B`"));
    assert!(e[2].starts_with("t.yaml:18:26: spec.guarantee.bandwidth (2B/s) is above"));
}

#[test]
fn canonical_form_ignores_spelling() {
    let a = parse_documents(
        "a",
        &with_pool(
            "x",
            "  selector: {matchLabels: {t: a}}\n  pool: shared\n  limit: {bandwidth: 1024MiB/s}\n",
        ),
    )
    .unwrap();
    let b = parse_documents(
        "b",
        "{\"apiVersion\": \"sluice.dev/v1\", \"kind\": \"StoragePool\", \"metadata\": {\"name\": \"shared\"},
          \"spec\": {\"capacity\": {\"ops\": \"10000/s\", \"bandwidth\": \"2048MiB/s\"}, \"sharing\": \"weighted-fair\"}}
---
kind: JobPolicy
apiVersion: sluice.dev/v1
spec:
  pool: shared
  weight: 1
  limit: {bandwidth: 1GiB/s}
  prefetch: {tuner: true, readers: {min: 1}}
  selector:
    matchLabels: {t: a}
metadata: {name: x}
",
    )
    .unwrap();
    assert_eq!(a, b);
    let canon = |d: &[Policy]| d.iter().map(Policy::canonical).collect::<Vec<_>>();
    assert_eq!(canon(&a), canon(&b));
    assert!(
        a[1].canonical().contains("\"bandwidth\": \"1GiB/s\""),
        "{}",
        a[1].canonical()
    );
}
