//! Property tests of the validator: random valid sets round-trip through
//! the canonical form, random edits never panic and always yield
//! positioned errors, and the chosen policy is the unique best match.

use std::collections::BTreeMap;
use std::fmt::Write;

use proptest::prelude::*;

use super::{POOL, job};
use crate::*;

/// The random parts of one generated job policy.
type PolicyParts = (
    (Option<u32>, Option<i32>, Option<i32>),
    (
        Option<usize>,
        Option<(usize, std::collections::BTreeSet<String>)>,
    ),
    (Option<f64>, Option<f64>, Option<u64>),
    (Option<f64>, Option<f64>),
    (Option<bool>, Option<(u32, u32)>, Option<(u64, u64)>),
);

fn arb_policy_parts() -> impl Strategy<Value = PolicyParts> {
    (
        (
            prop::option::of(1u32..=10_000),
            prop::option::of(-5i32..5),
            prop::option::of(-5i32..5),
        ),
        (
            prop::option::of(0..3usize),
            prop::option::of((0..4usize, prop::collection::btree_set("[a-z]{1,3}", 1..3))),
        ),
        (
            prop::option::of(0.0f64..1.0),
            prop::option::of(1.0f64..3.0),
            prop::option::of(1u64..60_000),
        ),
        (prop::option::of(0.0f64..1.0), prop::option::of(1.0f64..2.0)),
        (
            prop::option::of(any::<bool>()),
            prop::option::of((1u32..=1024, 1u32..=1024)),
            prop::option::of((1u64..4096, 1u64..4096)),
        ),
    )
}

/// The pool a generated set uses.
struct GenPool {
    bandwidth: u64,
    ops: Option<u64>,
    is_static: bool,
}

/// Renders a random but valid set: a pool, then policies whose selectors
/// each carry `job: pN` so that no two can overlap.
fn arb_valid_set() -> impl Strategy<Value = String> {
    let pool = (
        1u64..100_000,
        prop::option::of(1u64..1_000_000),
        0..4usize,
        any::<bool>(),
    );
    (pool, prop::collection::vec(arb_policy_parts(), 1..6)).prop_map(
        |((bw, ops, sharing, si), policies)| {
            let sharing = ["weighted-fair", "priority", "static", ""][sharing];
            let (written, bytes) = if si {
                (format!("{bw}MB/s"), bw * 1_000_000)
            } else {
                (format!("{bw}MiB/s"), bw << 20)
            };
            let mut text = format!(
                "apiVersion: sluice.dev/v1\nkind: StoragePool\nmetadata:\n  name: pool\nspec:\n  capacity:\n    bandwidth: {written}\n"
            );
            if let Some(ops) = ops {
                let _ = writeln!(text, "    ops: {ops} ops/s");
            }
            if !sharing.is_empty() {
                let _ = writeln!(text, "  sharing: {sharing}");
            }
            let pool = GenPool {
                bandwidth: bytes,
                ops,
                is_static: sharing == "static",
            };
            for (i, parts) in policies.into_iter().enumerate() {
                render_policy(&mut text, i, &pool, parts);
            }
            text
        },
    )
}

fn render_policy(text: &mut String, i: usize, pool: &GenPool, parts: PolicyParts) {
    let ((weight, priority, precedence), (team, expr), (g, l, burst), (gops, lops), prefetch) =
        parts;
    let _ = write!(
        text,
        "---\napiVersion: sluice.dev/v1\nkind: JobPolicy\nmetadata:\n  name: p{i}\nspec:\n  pool: pool\n  selector:\n    matchLabels:\n      job: p{i}\n"
    );
    if let Some(t) = team {
        let _ = writeln!(text, "      team: t{t}");
    }
    if let Some((op, values)) = expr {
        let op = ["In", "NotIn", "Exists", "DoesNotExist"][op];
        let _ = write!(
            text,
            "    matchExpressions:\n      - key: zone\n        operator: {op}\n"
        );
        if matches!(op, "In" | "NotIn") {
            let values: Vec<String> = values.into_iter().collect();
            let _ = writeln!(text, "        values: [{}]", values.join(", "));
        }
    }
    for (field, v) in [
        ("weight", weight.map(i64::from)),
        ("priority", priority.map(i64::from)),
        ("precedence", precedence.map(i64::from)),
    ] {
        if let Some(v) = v {
            let _ = writeln!(text, "  {field}: {v}");
        }
    }
    // Guarantees are fractions of the capacity; limits multiples of the
    // guarantee (or of a nominal 1MiB/s). Truncating casts are fine here.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let scale = |v: u64, f: f64| ((v as f64 * f) as u64).max(1);
    let guarantee = g
        .filter(|_| !pool.is_static)
        .map(|f| scale(pool.bandwidth, f));
    let gops = gops
        .filter(|_| !pool.is_static)
        .and_then(|f| pool.ops.map(|c| scale(c, f)));
    let limit = l
        .map(|m| scale(guarantee.unwrap_or(1 << 20), m))
        .or(pool.is_static.then_some(1 << 20))
        .map(|l| l.max(guarantee.unwrap_or(1)));
    let lops = lops.map(|m| scale(gops.unwrap_or(100), m).max(gops.unwrap_or(1)));
    if guarantee.is_some() || gops.is_some() {
        text.push_str("  guarantee:\n");
        if let Some(g) = guarantee {
            let _ = writeln!(text, "    bandwidth: {g}B/s");
        }
        if let Some(g) = gops {
            let _ = writeln!(text, "    ops: {g}");
        }
    }
    if limit.is_some() || lops.is_some() || burst.is_some() {
        text.push_str("  limit:\n");
        if let Some(l) = limit {
            let _ = writeln!(text, "    bandwidth: {l}/s");
        }
        if let Some(l) = lops {
            let _ = writeln!(text, "    ops: {l}/s");
        }
        if let Some(b) = burst {
            let _ = writeln!(text, "    burst: {b}ms");
        }
    }
    let (tuner, readers, buffer) = prefetch;
    text.push_str("  prefetch:\n");
    if let Some(t) = tuner {
        let _ = writeln!(text, "    tuner: {t}");
    }
    if let Some((a, b)) = readers {
        let (lo, hi) = (a.min(b), a.max(b));
        let _ = writeln!(
            text,
            "    readers: {{min: {lo}, max: {hi}, initial: {}}}",
            (lo + hi) / 2
        );
    }
    if let Some((a, b)) = buffer {
        let _ = writeln!(
            text,
            "    buffer: {{min: {}MiB, max: {}MiB}}",
            a.min(b),
            a.max(b)
        );
    }
}

/// Random edits of a valid text: deletions, insertions of YAML-ish
/// fragments, swapped lines.
fn mutate(text: &str, edits: &[(usize, usize, usize)]) -> String {
    const FRAGMENTS: [&str; 16] = [
        ":", " ", "\n", "- ", "{", "}", "[", "]", "'", "\"", "0", "-1", "MiB/s", "é", "\t", "&a *a",
    ];
    let mut chars: Vec<char> = text.chars().collect();
    for &(op, at, what) in edits {
        if chars.is_empty() {
            break;
        }
        let at = at % chars.len();
        match op % 3 {
            0 => {
                let end = (at + what % 8 + 1).min(chars.len());
                chars.drain(at..end);
            }
            1 => {
                let fragment = FRAGMENTS[what % FRAGMENTS.len()];
                chars.splice(at..at, fragment.chars());
            }
            _ => {
                let s: String = chars.iter().collect();
                let mut lines: Vec<&str> = s.lines().collect();
                let (a, b) = (at % lines.len().max(1), what % lines.len().max(1));
                if a < lines.len() && b < lines.len() {
                    lines.swap(a, b);
                }
                chars = lines.join("\n").chars().collect();
            }
        }
    }
    chars.into_iter().collect()
}

/// Every label set over `keys` with the values `x`, `y` and one outside
/// them, `w`.
fn universe(keys: &[&str]) -> Vec<BTreeMap<String, String>> {
    let mut sets = vec![BTreeMap::new()];
    for k in keys {
        sets = sets
            .into_iter()
            .flat_map(|l: BTreeMap<String, String>| {
                [None, Some("x"), Some("y"), Some("w")]
                    .into_iter()
                    .map(move |v| {
                        let mut l = l.clone();
                        if let Some(v) = v {
                            l.insert((*k).to_owned(), v.to_owned());
                        }
                        l
                    })
            })
            .collect();
    }
    sets
}

fn rank(p: &JobPolicy) -> (i32, usize) {
    (p.spec().precedence, p.spec().selector.specificity())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn valid_documents_round_trip_through_canonical_form(text in arb_valid_set()) {
        let docs = parse_documents("gen.yaml", &text)
            .map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        let set = PolicySet::from_documents(docs.clone())
            .map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        let canonical: Vec<String> = docs.iter().map(Policy::canonical).collect();
        let again = parse_documents("canonical.yaml", &canonical.join("\n---\n")).unwrap();
        prop_assert_eq!(&again, &docs);
        prop_assert_eq!(again.iter().map(Policy::canonical).collect::<Vec<_>>(), canonical);
        prop_assert_eq!(PolicySet::from_documents(again).unwrap(), set);
    }

    #[test]
    fn mutations_never_panic_and_errors_are_positioned(
        which in 0..3usize,
        edits in prop::collection::vec((0..3usize, any::<usize>(), any::<usize>()), 1..4),
    ) {
        let original = [
            include_str!("../../examples/shared-weighted.yaml"),
            include_str!("../../examples/priority-classes.yaml"),
            include_str!("../../examples/static-split.yaml"),
        ][which];
        let text = mutate(original, &edits);
        let lines = u32::try_from(text.lines().count()).unwrap() + 1;
        match parse_documents("m.yaml", &text).and_then(PolicySet::from_documents) {
            Ok(set) => {
                for d in set.documents() {
                    let again = parse_documents("c", &d.canonical()).unwrap();
                    prop_assert_eq!(again, vec![d]);
                }
            }
            Err(errors) => {
                prop_assert!(!errors.errors().is_empty());
                for e in errors.errors() {
                    prop_assert_eq!(&*e.location.source, "m.yaml");
                    prop_assert!((1..=lines).contains(&e.location.line), "{e} (of {lines} lines)");
                    prop_assert!(e.location.column >= 1, "{e}");
                    let message = e.kind.to_string();
                    prop_assert!(!message.is_empty() && !message.ends_with('.'), "{message}");
                }
            }
        }
    }

    #[test]
    fn the_chosen_policy_is_the_unique_best_match(
        policies in prop::collection::vec(
            (
                0..2i32,
                prop::collection::btree_map(0..3usize, 0..2usize, 0..3),
                prop::option::of((0..3usize, 0..4usize, 0..2usize)),
            ),
            1..5,
        ),
    ) {
        const KEYS: [&str; 3] = ["a", "b", "c"];
        const VALUES: [&str; 2] = ["x", "y"];
        let mut text = POOL.to_owned();
        for (i, (precedence, ml, expr)) in policies.iter().enumerate() {
            let ml: Vec<String> = ml.iter().map(|(k, v)| format!("{}: {}", KEYS[*k], VALUES[*v])).collect();
            let mut spec = format!(
                "  pool: shared\n  precedence: {precedence}\n  selector:\n    matchLabels: {{{}}}\n",
                ml.join(", ")
            );
            if let Some((k, op, v)) = expr {
                let op = ["In", "NotIn", "Exists", "DoesNotExist"][*op];
                let values = if matches!(op, "In" | "NotIn") {
                    format!(", values: [{}]", VALUES[*v])
                } else {
                    String::new()
                };
                let _ = writeln!(spec, "    matchExpressions: [{{key: {}, operator: {op}{values}}}]", KEYS[*k]);
            }
            text.push_str(&format!("---\n{}", job(&format!("p{i}"), &spec)));
        }
        let universe = universe(&KEYS);
        let Ok(docs) = parse_documents("p.yaml", &text) else {
            // A generated selector may contradict itself; that is refused
            // with a position, which other tests check.
            return Ok(());
        };
        match PolicySet::from_documents(docs.clone()) {
            Ok(set) => {
                for l in &universe {
                    let matching: Vec<&JobPolicy> =
                        set.job_policies().filter(|p| p.spec().selector.matches(l)).collect();
                    let best = matching.iter().map(|p| rank(p)).max();
                    let top: Vec<&&JobPolicy> = matching.iter().filter(|p| Some(rank(p)) == best).collect();
                    prop_assert!(top.len() <= 1, "tie for {l:?}");
                    prop_assert_eq!(set.policy_for_job(l).map(JobPolicy::name), top.first().map(|p| p.name()));
                }
            }
            Err(e) => {
                // Refused only for a real equal-rank overlap.
                prop_assert!(
                    e.errors().iter().all(|e| matches!(e.kind, ErrorKind::Ambiguous { .. })),
                    "{e}"
                );
                let jobs: Vec<&JobPolicy> = docs
                    .iter()
                    .filter_map(|d| match d {
                        Policy::JobPolicy(p) => Some(p),
                        Policy::StoragePool(_) | Policy::DatasetCache(_) => None,
                    })
                    .collect();
                let overlap = jobs.iter().enumerate().any(|(i, a)| {
                    jobs[i + 1..].iter().any(|b| {
                        rank(a) == rank(b)
                            && universe.iter().any(|l| a.spec().selector.matches(l) && b.spec().selector.matches(l))
                    })
                });
                prop_assert!(overlap, "refused without a brute-force overlap: {e}");
            }
        }
    }
}
