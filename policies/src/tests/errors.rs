//! One test per error kind: the exact `file:line:column` and message an
//! operator sees.

use super::{POOL, error, errors, job, with_pool};

#[test]
fn yaml_syntax_errors() {
    assert_eq!(
        error("a: [1\n"),
        "t.yaml:2:1: invalid YAML: while parsing a flow sequence, expected ',' or ']'"
    );
    assert_eq!(
        error("apiVersion: sluice.dev/v1\nkind: JobPolicy\nkind: StoragePool\n"),
        "t.yaml:3:1: invalid YAML: duplicate key `kind` (first at line 2, column 1): each key may appear once in a mapping"
    );
}

#[test]
fn document_shape_errors() {
    assert_eq!(
        error("- a\n- b\n"),
        "t.yaml:1:1: a policy document must be a mapping with `apiVersion`, `kind`, `metadata` and `spec`, found a list"
    );
    assert_eq!(
        error("kind: JobPolicy\n"),
        "t.yaml:1:1: missing field `apiVersion` in the document: write `apiVersion: sluice.dev/v1`"
    );
    assert_eq!(
        error("apiVersion: sluice.dev/v2\nkind: JobPolicy\n"),
        "t.yaml:1:13: unknown apiVersion `sluice.dev/v2`: write `apiVersion: sluice.dev/v1`"
    );
    assert_eq!(
        error("apiVersion: sluice.dev/v1\nkind: StoragePol\n"),
        "t.yaml:2:7: unknown kind `StoragePol`: did you mean `StoragePool`? sluice.dev/v1 has the kinds `StoragePool`, `JobPolicy` and `DatasetCache`"
    );
    assert_eq!(
        error("apiVersion: sluice.dev/v1\nkind: JobPolicy\nmetadata: {name: a}\n"),
        "t.yaml:1:1: missing field `spec` in the document: add a `spec:` mapping"
    );
}

#[test]
fn unknown_fields_suggest_the_closest() {
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  wieght: 2\n"
        )),
        "t.yaml:8:3: unknown field `wieght` in spec: did you mean `weight`? the fields here are `selector`, `pool`, `weight`, `priority`, `precedence`, `guarantee`, `limit` or `prefetch`"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector:\n    match_labels: {a: b}\n  pool: shared\n"
        )),
        "t.yaml:7:5: unknown field `match_labels` in spec.selector: did you mean `matchLabels`? the fields here are `matchLabels` or `matchExpressions`"
    );
    assert_eq!(
        error(
            "apiVersion: sluice.dev/v1\nkind: StoragePool\nmetadata: {name: p, namespace: x}\nspec: {capacity: {bandwidth: 1GiB/s}}\n"
        ),
        "t.yaml:3:21: unknown field `namespace` in metadata: the fields here are `name`, `labels` or `annotations`"
    );
}

#[test]
fn missing_and_mistyped_fields() {
    assert_eq!(
        error(&job("train", "  selector: {}\n  weight: 2\n")),
        "t.yaml:6:3: missing field `pool` in spec: name the StoragePool these jobs use, e.g. `pool: shared`"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  weight: heavy\n"
        )),
        "t.yaml:8:11: spec.weight must be a whole number, found the string `heavy`"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  prefetch: {tuner: yes}\n"
        )),
        "t.yaml:8:21: spec.prefetch.tuner must be `true` or `false`, found the string `yes`"
    );
    assert_eq!(
        error(&job("train", "  selector:\n  pool: shared\n")),
        "t.yaml:6:3: spec.selector: an empty selector would select every job: write `selector: {}` if that is meant, or add `matchLabels:`"
    );
    // Other empty mappings read as `{}`.
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  prefetch:\n  limit:\n  guarantee: 1GiB/s\n"
        )),
        "t.yaml:10:14: spec.guarantee must be a mapping of `key: value` lines, found the string `1GiB/s`"
    );
    assert_eq!(
        error(
            "apiVersion: sluice.dev/v1\nkind: StoragePool\nmetadata: {name: p}\nspec:\n  capacity: {bandwidth: 1GiB/s}\n  sharing: weighted_fair\n"
        ),
        "t.yaml:6:12: spec.sharing cannot be `weighted_fair`: did you mean `weighted-fair`? write `weighted-fair`, `priority` or `static`"
    );
}

#[test]
fn bad_units_use_the_quantity_messages() {
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  limit:\n    bandwidth: 800MiB\n"
        )),
        "t.yaml:9:16: spec.limit.bandwidth: invalid byte rate `800MiB`: a rate ends in `/s`, for example `800MiB/s`"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  limit:\n    bandwidth: 10KB/s\n"
        )),
        "t.yaml:9:16: spec.limit.bandwidth: invalid byte rate `10KB/s`: `K`/`KB` is ambiguous: write `kB` for 1000 bytes or `KiB` for 1024 bytes"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  limit:\n    burst: 100\n"
        )),
        "t.yaml:9:12: spec.limit.burst: invalid duration `100`: write a unit: `ms` or `s`, for example `100ms` or `1.5s`"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  prefetch:\n    buffer: {max: -5MiB}\n"
        )),
        "t.yaml:9:19: spec.prefetch.buffer.max: invalid byte size `-5MiB`: quantities cannot be negative"
    );
}

#[test]
fn impossible_values() {
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  weight: 0\n"
        )),
        "t.yaml:8:11: spec.weight must be from 1 to 10000, found 0: weights are relative shares: a job with weight 2 gets twice what a job with weight 1 gets"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  prefetch:\n    readers: {max: 5000}\n"
        )),
        "t.yaml:9:20: spec.prefetch.readers.max must be from 1 to 1024, found 5000: readers are threads per job on each stage that read ahead of the trainer"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  limit: {bandwidth: 0/s}\n"
        )),
        "t.yaml:8:22: spec.limit.bandwidth: a limit of 0 would stop every read: leave it out for no limit"
    );
    // A bare number would be bytes a second, where MiB/s was meant.
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  limit: {bandwidth: 800}\n"
        )),
        "t.yaml:8:22: spec.limit.bandwidth: invalid byte rate `800`: a rate ends in `/s`, for example `800MiB/s` (or `800/s` for bytes a second)"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  limit: {burst: 2min}\n"
        )),
        "t.yaml:8:18: spec.limit.burst: invalid duration `2min`: write a unit: `ms` or `s`, for example `100ms` or `1.5s`"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  limit: {burst: 61s}\n"
        )),
        "t.yaml:8:18: spec.limit.burst must be from 1ms to 60s, found 61s: the burst window is how long a job may read above its rate after idling; 100ms is typical"
    );
    assert_eq!(
        error(
            "apiVersion: sluice.dev/v1\nkind: StoragePool\nmetadata: {name: p}\nspec:\n  capacity: {bandwidth: 0B/s}\n"
        ),
        "t.yaml:5:25: spec.capacity.bandwidth: a pool with no bandwidth can serve no job: write what the storage sustains, e.g. `2GiB/s`"
    );
}

#[test]
fn names_and_labels() {
    assert_eq!(
        error(&job("Train_A", "  selector: {}\n  pool: shared\n")),
        "t.yaml:4:9: metadata.name `Train_A` is not a valid name: use 1 to 63 lowercase letters, digits and `-`, starting and ending with a letter or digit, e.g. `train-a`"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector:\n    matchLabels: {\"team name\": a}\n  pool: shared\n"
        )),
        "t.yaml:7:19: spec.selector.matchLabels.team name: label key `team name` is not valid: use 1 to 63 letters, digits, `-`, `_`, `.` and at most one `/`, starting and ending with a letter or digit, e.g. `team` or `example.com/team`"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector:\n    matchLabels:\n      example.com/team: \"a\\tb\"\n  pool: shared\n"
        )),
        "t.yaml:8:25: spec.selector.matchLabels.example.com/team: label value `a\\tb` is not valid: use at most 256 bytes and no control characters"
    );
}

#[test]
fn min_above_max_and_guarantee_above_limit() {
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  guarantee: {bandwidth: 2GiB/s}\n  limit: {bandwidth: 1GiB/s}\n"
        )),
        "t.yaml:8:26: spec.guarantee.bandwidth (2GiB/s) is above spec.limit.bandwidth (1GiB/s): a job cannot be promised more than it may use; lower the guarantee or raise the limit"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector: {}\n  pool: shared\n  prefetch:\n    readers: {min: 8, max: 4}\n"
        )),
        "t.yaml:9:20: spec.prefetch.readers.min (8) is above spec.prefetch.readers.max (4): write a min that is at most the max"
    );
    assert_eq!(
        errors(&job(
            "train",
            "  selector: {}\n  pool: shared\n  prefetch:\n    buffer: {min: 1GiB, max: 64MiB, initial: 2GiB}\n"
        )),
        [
            "t.yaml:9:19: spec.prefetch.buffer.min (1GiB) is above spec.prefetch.buffer.max (64MiB): write a min that is at most the max",
            "t.yaml:9:46: spec.prefetch.buffer.initial (2GiB) is not between min (1GiB) and max (64MiB): write an initial value between them",
        ]
    );
}

#[test]
fn selectors_that_match_nothing() {
    assert_eq!(
        error(&job(
            "train",
            "  selector:\n    matchExpressions:\n      - key: team\n        operator: In\n        values: []\n  pool: shared\n"
        )),
        "t.yaml:10:17: spec.selector.matchExpressions[0]: operator `In` with no values matches no job: list the values to select, or use `Exists` to select any value"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector:\n    matchExpressions:\n      - {key: gpu, operator: Exists, values: [a100]}\n  pool: shared\n"
        )),
        "t.yaml:8:46: spec.selector.matchExpressions[0]: operators `Exists` and `DoesNotExist` take no values: remove `values`, or use `In`/`NotIn`"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector:\n    matchLabels: {team: a}\n    matchExpressions:\n      - key: team\n        operator: NotIn\n        values: [a]\n  pool: shared\n"
        )),
        "t.yaml:9:9: this selector can match no job: no value of label `team` satisfies all of `team=a`, `team NotIn [a]`; remove one of the contradicting requirements"
    );
    assert_eq!(
        error(&job(
            "train",
            "  selector:\n    matchExpressions:\n      - key: team\n        operator: in\n        values: [a]\n  pool: shared\n"
        )),
        "t.yaml:9:19: spec.selector.matchExpressions[0].operator cannot be `in`: did you mean `In`? write `In`, `NotIn`, `Exists` or `DoesNotExist`"
    );
}

#[test]
fn set_rules_point_at_both_documents() {
    assert_eq!(
        error(&with_pool("train", "  selector: {}\n  pool: shard\n")),
        "t.yaml:16:9: pool `shard` does not exist: did you mean `shared`? apply a StoragePool with this name or name one of `shared`"
    );
    assert_eq!(
        error(&job("train", "  selector: {}\n  pool: shared\n")),
        "t.yaml:7:9: pool `shared` does not exist: no StoragePool is defined yet; apply one with this name, in this apply or before it"
    );
    assert_eq!(
        error(&with_pool(
            "train",
            "  selector: {}\n  pool: shared\n  guarantee:\n    bandwidth: 3GiB/s\n"
        )),
        "t.yaml:18:16: spec.guarantee.bandwidth (3GiB/s) is above the capacity of pool `shared` (2GiB/s, t.yaml:7:16): lower the guarantee or raise the pool's spec.capacity.bandwidth"
    );
    assert_eq!(
        error(&format!(
            "{POOL}---\n{}---\n{}",
            job("a", "  selector: {}\n  pool: shared\n"),
            job("a", "  selector: {}\n  pool: shared\n")
        )),
        "t.yaml:21:9: JobPolicy `a` is defined twice (first at t.yaml:13:9): give each document its own metadata.name"
    );
}

#[test]
fn static_pools_need_limits_and_refuse_guarantees() {
    let pool = "apiVersion: sluice.dev/v1\nkind: StoragePool\nmetadata: {name: s}\nspec:\n  capacity: {bandwidth: 1GB/s}\n  sharing: static\n---\n";
    assert_eq!(
        error(&format!(
            "{pool}{}",
            job("a", "  selector: {}\n  pool: s\n")
        )),
        "t.yaml:13:3: pool `s` (t.yaml:6:12) shares statically, so each job gets exactly its limit: set spec.limit.bandwidth, or use `sharing: weighted-fair` in the pool"
    );
    assert_eq!(
        error(&format!(
            "{pool}{}",
            job(
                "a",
                "  selector: {}\n  pool: s\n  limit: {bandwidth: 100MB/s}\n  guarantee: {bandwidth: 10MB/s}\n"
            )
        )),
        "t.yaml:16:14: pool `s` (t.yaml:6:12) shares statically, so each job gets exactly its limit and a guarantee has no effect: remove spec.guarantee, or use `sharing: weighted-fair` in the pool"
    );
}

#[test]
fn ops_guarantees_need_ops_capacity() {
    let pool = "apiVersion: sluice.dev/v1\nkind: StoragePool\nmetadata: {name: p}\nspec:\n  capacity: {bandwidth: 1GB/s}\n---\n";
    assert_eq!(
        error(&format!(
            "{pool}{}",
            job(
                "a",
                "  selector: {}\n  pool: p\n  guarantee: {ops: 1k ops/s}\n"
            )
        )),
        "t.yaml:14:20: spec.guarantee.ops cannot be honoured: pool `p` (t.yaml:5:13) declares no spec.capacity.ops; add one to the pool or remove the ops guarantee"
    );
    assert_eq!(
        error(&with_pool(
            "a",
            "  selector: {}\n  pool: shared\n  guarantee: {ops: 20k ops/s}\n"
        )),
        "t.yaml:17:20: spec.guarantee.ops (20k ops/s) is above the capacity of pool `shared` (10k ops/s, t.yaml:8:10): lower the guarantee or raise the pool's spec.capacity.ops"
    );
}

#[test]
fn control_characters_quoted_from_the_document_are_escaped() {
    // An escape sequence in a kind (a terminal would have run it), and a
    // tab and a newline in a key quoted by its error.
    assert_eq!(
        error("apiVersion: sluice.dev/v1\nkind: \"\\e[2JJobPolicy\"\n"),
        "t.yaml:2:7: unknown kind `\\u{1b}[2JJobPolicy`: did you mean `JobPolicy`? sluice.dev/v1 has the kinds `StoragePool`, `JobPolicy` and `DatasetCache`"
    );
    let text = error(&job(
        "train",
        "  selector: {}\n  pool: shared\n  \"we\\tig\\nht\": 2\n",
    ));
    assert!(text.contains("`we\\tig\\nht`"), "{text}");
    assert!(!text.chars().any(char::is_control), "{text}");
}
