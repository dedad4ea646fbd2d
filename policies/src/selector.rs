//! Label selectors, exactly as Kubernetes defines them: `matchLabels`
//! (each `key: value` must be present) and `matchExpressions` with the
//! operators `In`, `NotIn`, `Exists` and `DoesNotExist`, all ANDed. An
//! empty selector selects every job.
//!
//! Besides matching, this module decides whether a conjunction of
//! requirements can match any label set at all, and builds an example label
//! set when it can. That decision is exact: per key, requirements allow a
//! finite set of values, a co-finite set, "absent" or nothing, so the
//! validator can refuse a selector that matches nothing and find every pair
//! of policies that could both claim a job.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::hash::BuildHasher;

use serde::{Deserialize, Serialize};

/// Anything that can answer "what is the value of label `key`?".
pub trait Labels {
    /// Returns the value of label `key`, if the job has it.
    fn label(&self, key: &str) -> Option<&str>;
}

impl Labels for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

impl<S: BuildHasher> Labels for HashMap<String, String, S> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

/// A set operator of a `matchExpressions` entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Operator {
    /// The label is present and its value is one of `values`.
    In,
    /// The label is absent, or present with a value not in `values`.
    NotIn,
    /// The label is present, with any value.
    Exists,
    /// The label is absent.
    DoesNotExist,
}

/// One `matchExpressions` entry.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Requirement {
    /// The label key tested.
    pub key: String,
    /// How it is tested.
    pub operator: Operator,
    /// The values for `In`/`NotIn`; empty for `Exists`/`DoesNotExist`.
    #[serde(skip_serializing_if = "BTreeSet::is_empty")]
    pub values: BTreeSet<String>,
}

impl Requirement {
    /// Returns whether `labels` satisfy this requirement.
    pub fn matches<L: Labels + ?Sized>(&self, labels: &L) -> bool {
        let value = labels.label(&self.key);
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.contains(v)),
            Operator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
        }
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}", self.key, self.operator)?;
        if matches!(self.operator, Operator::In | Operator::NotIn) {
            let values: Vec<&str> = self.values.iter().map(String::as_str).collect();
            write!(f, " [{}]", values.join(", "))?;
        }
        Ok(())
    }
}

/// A label selector: every `matchLabels` pair and every
/// `matchExpressions` requirement must hold.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Selector {
    /// Labels that must be present with exactly these values.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    /// Set-based requirements, kept sorted so equal selectors compare equal.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<Requirement>,
}

impl Selector {
    /// Returns whether a job with `labels` is selected.
    pub fn matches<L: Labels + ?Sized>(&self, labels: &L) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.label(k) == Some(v.as_str()))
            && self.match_expressions.iter().all(|r| r.matches(labels))
    }

    /// Returns the number of terms (`matchLabels` pairs plus
    /// `matchExpressions` entries): the more terms, the more specific.
    pub fn specificity(&self) -> usize {
        self.match_labels.len() + self.match_expressions.len()
    }

    /// Returns every term as a requirement (`matchLabels` as `In` with one
    /// value), with how to print it.
    fn terms(&self) -> impl Iterator<Item = (Requirement, String)> + '_ {
        let labels = self.match_labels.iter().map(|(k, v)| {
            let r = Requirement {
                key: k.clone(),
                operator: Operator::In,
                values: BTreeSet::from([v.clone()]),
            };
            (r, format!("{k}={v}"))
        });
        let expressions = self
            .match_expressions
            .iter()
            .map(|r| (r.clone(), r.to_string()));
        labels.chain(expressions)
    }

    /// Returns an example of the labels a job selected by both `self` and
    /// `other` has, or `None` when no job can be selected by both.
    pub fn overlap(&self, other: &Selector) -> Option<Witness> {
        // Two values asked of one label never meet: most pairs of a large
        // policy set (a team each) part here, without a witness built
        // (3,000 policies took the check 10 s).
        let parted = self
            .match_labels
            .iter()
            .any(|(key, value)| other.match_labels.get(key).is_some_and(|v| v != value));
        if parted {
            return None;
        }
        solve(self.terms().chain(other.terms())).ok()
    }

    /// Returns `Err` with the requirements that contradict each other when
    /// this selector can match no job at all.
    pub(crate) fn check_satisfiable(&self) -> Result<Witness, Contradiction> {
        solve(self.terms())
    }
}

/// Requirements on one key that no label value satisfies together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Contradiction {
    /// The key.
    pub key: String,
    /// The requirements on it, as written.
    pub terms: Vec<String>,
}

/// What a label must be for a job selected by a selector (or by two).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WitnessValue {
    /// Exactly this value.
    Exact(String),
    /// Any value except these.
    AnyBut(BTreeSet<String>),
    /// The label must be absent.
    Absent,
}

/// An example label set matched by a selector, with free values kept free:
/// `{team=a, gpu=(any value)}`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Witness(pub BTreeMap<String, WitnessValue>);

impl Witness {
    /// Returns one concrete label set this witness describes.
    pub fn example(&self) -> BTreeMap<String, String> {
        self.0
            .iter()
            .filter_map(|(k, v)| match v {
                WitnessValue::Exact(s) => Some((k.clone(), s.clone())),
                WitnessValue::AnyBut(except) => Some((k.clone(), fresh(except))),
                WitnessValue::Absent => None,
            })
            .collect()
    }
}

/// A value not in `except`.
fn fresh(except: &BTreeSet<String>) -> String {
    (0..)
        .map(|i| {
            if i == 0 {
                "x".to_owned()
            } else {
                format!("x{i}")
            }
        })
        .find(|v| !except.contains(v))
        .unwrap_or_default()
}

impl fmt::Display for Witness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        for (k, v) in &self.0 {
            parts.push(match v {
                WitnessValue::Exact(s) => format!("{k}={s}"),
                WitnessValue::AnyBut(e) if e.is_empty() => format!("{k}=(any value)"),
                WitnessValue::AnyBut(e) => {
                    let e: Vec<&str> = e.iter().map(String::as_str).collect();
                    format!("{k}=(any value but {})", e.join(", "))
                }
                WitnessValue::Absent => format!("no {k}"),
            });
        }
        if parts.is_empty() {
            f.write_str("{} (every job)")
        } else {
            write!(f, "{{{}}}", parts.join(", "))
        }
    }
}

/// What the requirements on one key allow.
#[derive(Default)]
struct KeyConstraint {
    /// `Some`: the value must be one of these (and the key present).
    allowed: Option<BTreeSet<String>>,
    forbidden: BTreeSet<String>,
    must_exist: bool,
    must_not_exist: bool,
    terms: Vec<String>,
}

/// Decides whether a conjunction of requirements can hold, key by key.
fn solve(terms: impl Iterator<Item = (Requirement, String)>) -> Result<Witness, Contradiction> {
    let mut keys: BTreeMap<String, KeyConstraint> = BTreeMap::new();
    for (r, text) in terms {
        let c = keys.entry(r.key.clone()).or_default();
        c.terms.push(text);
        match r.operator {
            Operator::In => {
                c.must_exist = true;
                c.allowed = Some(match c.allowed.take() {
                    Some(a) => a.intersection(&r.values).cloned().collect(),
                    None => r.values,
                });
            }
            Operator::NotIn => c.forbidden.extend(r.values),
            Operator::Exists => c.must_exist = true,
            Operator::DoesNotExist => c.must_not_exist = true,
        }
    }
    let mut witness = Witness::default();
    for (key, c) in keys {
        let value = if c.must_not_exist {
            (!c.must_exist).then_some(WitnessValue::Absent)
        } else if let Some(allowed) = &c.allowed {
            allowed
                .difference(&c.forbidden)
                .next()
                .map(|v| WitnessValue::Exact(v.clone()))
        } else if c.must_exist {
            Some(WitnessValue::AnyBut(c.forbidden))
        } else {
            // Only NotIn: satisfied by the label's absence, nothing to show.
            continue;
        };
        match value {
            Some(v) => {
                witness.0.insert(key, v);
            }
            None => {
                return Err(Contradiction {
                    key,
                    terms: c.terms,
                });
            }
        }
    }
    Ok(witness)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn req(key: &str, operator: Operator, values: &[&str]) -> Requirement {
        Requirement {
            key: key.into(),
            operator,
            values: values.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn operators_follow_kubernetes() {
        let l = labels(&[("team", "a"), ("gpu", "a100")]);
        assert!(req("team", Operator::In, &["a", "b"]).matches(&l));
        assert!(!req("team", Operator::In, &["b"]).matches(&l));
        assert!(!req("zone", Operator::In, &["b"]).matches(&l));
        assert!(req("team", Operator::NotIn, &["b"]).matches(&l));
        // NotIn matches a job without the label at all.
        assert!(req("zone", Operator::NotIn, &["b"]).matches(&l));
        assert!(req("gpu", Operator::Exists, &[]).matches(&l));
        assert!(req("zone", Operator::DoesNotExist, &[]).matches(&l));
        assert!(
            Selector::default().matches(&l),
            "an empty selector selects every job"
        );
    }

    #[test]
    fn contradictions_are_found() {
        let s = Selector {
            match_labels: labels(&[("team", "a")]),
            match_expressions: vec![req("team", Operator::NotIn, &["a"])],
        };
        let c = s.check_satisfiable().unwrap_err();
        assert_eq!(c.key, "team");
        assert_eq!(c.terms, ["team=a", "team NotIn [a]"]);
        let s = Selector {
            match_labels: BTreeMap::new(),
            match_expressions: vec![
                req("gpu", Operator::Exists, &[]),
                req("gpu", Operator::DoesNotExist, &[]),
            ],
        };
        assert!(s.check_satisfiable().is_err());
        let s = Selector {
            match_labels: BTreeMap::new(),
            match_expressions: vec![
                req("t", Operator::In, &["a", "b"]),
                req("t", Operator::In, &["b", "c"]),
            ],
        };
        assert_eq!(
            s.check_satisfiable().unwrap().example(),
            labels(&[("t", "b")])
        );
    }

    #[test]
    fn overlap_gives_an_example() {
        let a = Selector {
            match_labels: labels(&[("team", "a")]),
            match_expressions: vec![],
        };
        let b = Selector {
            match_labels: BTreeMap::new(),
            match_expressions: vec![
                req("gpu", Operator::Exists, &[]),
                req("zone", Operator::NotIn, &["x"]),
            ],
        };
        let w = a.overlap(&b).unwrap();
        assert_eq!(w.to_string(), "{gpu=(any value), team=a}");
        assert!(a.matches(&w.example()) && b.matches(&w.example()));
        let c = Selector {
            match_labels: labels(&[("team", "b")]),
            match_expressions: vec![],
        };
        assert_eq!(a.overlap(&c), None);
        assert_eq!(
            Selector::default()
                .overlap(&Selector::default())
                .unwrap()
                .to_string(),
            "{} (every job)"
        );
    }

    // A small universe so that random selectors and label sets collide.
    const KEYS: [&str; 3] = ["a", "b", "c"];
    const VALUES: [&str; 3] = ["x", "y", "z"];

    fn arb_requirement() -> impl Strategy<Value = Requirement> {
        (
            0..KEYS.len(),
            prop_oneof![
                Just(Operator::In),
                Just(Operator::NotIn),
                Just(Operator::Exists),
                Just(Operator::DoesNotExist)
            ],
            prop::collection::btree_set(0..VALUES.len(), 1..3),
        )
            .prop_map(|(k, operator, vs)| Requirement {
                key: KEYS[k].into(),
                operator,
                values: if matches!(operator, Operator::In | Operator::NotIn) {
                    vs.into_iter().map(|v| VALUES[v].to_owned()).collect()
                } else {
                    BTreeSet::new()
                },
            })
    }

    fn arb_selector() -> impl Strategy<Value = Selector> {
        (
            prop::collection::btree_map(0..KEYS.len(), 0..VALUES.len(), 0..3),
            prop::collection::vec(arb_requirement(), 0..4),
        )
            .prop_map(|(ml, me)| Selector {
                match_labels: ml
                    .into_iter()
                    .map(|(k, v)| (KEYS[k].to_owned(), VALUES[v].to_owned()))
                    .collect(),
                match_expressions: me,
            })
    }

    /// Every label set over the universe, plus one value outside it ("w").
    fn all_label_sets() -> Vec<BTreeMap<String, String>> {
        let choices: Vec<Option<&str>> = std::iter::once(None)
            .chain(VALUES.iter().copied().chain(["w"]).map(Some))
            .collect();
        let mut sets = vec![BTreeMap::new()];
        for key in KEYS {
            sets = sets
                .into_iter()
                .flat_map(|s| {
                    choices.iter().map(move |c| {
                        let mut s = s.clone();
                        if let Some(v) = c {
                            s.insert(key.to_owned(), (*v).to_owned());
                        }
                        s
                    })
                })
                .collect();
        }
        sets
    }

    /// The Kubernetes definition, written out term by term.
    fn reference_matches(s: &Selector, l: &BTreeMap<String, String>) -> bool {
        for (k, v) in &s.match_labels {
            if l.get(k) != Some(v) {
                return false;
            }
        }
        for r in &s.match_expressions {
            let ok = match (r.operator, l.get(&r.key)) {
                (Operator::In, Some(v)) => r.values.contains(v),
                (Operator::In, None) => false,
                (Operator::NotIn, Some(v)) => !r.values.contains(v),
                (Operator::NotIn, None) => true,
                (Operator::Exists, found) => found.is_some(),
                (Operator::DoesNotExist, found) => found.is_none(),
            };
            if !ok {
                return false;
            }
        }
        true
    }

    proptest! {
        #[test]
        fn matching_agrees_with_the_reference(s in arb_selector(), l in prop::collection::btree_map(0..KEYS.len(), 0..VALUES.len(), 0..4)) {
            let l: BTreeMap<String, String> = l.into_iter().map(|(k, v)| (KEYS[k].to_owned(), VALUES[v].to_owned())).collect();
            prop_assert_eq!(s.matches(&l), reference_matches(&s, &l));
        }

        #[test]
        fn overlap_is_exact(a in arb_selector(), b in arb_selector()) {
            let brute = all_label_sets().into_iter().find(|l| reference_matches(&a, l) && reference_matches(&b, l));
            match a.overlap(&b) {
                Some(w) => {
                    let example = w.example();
                    prop_assert!(a.matches(&example) && b.matches(&example), "{example:?}");
                }
                None => prop_assert!(brute.is_none(), "missed {brute:?}"),
            }
            prop_assert_eq!(a.check_satisfiable().is_ok(), all_label_sets().iter().any(|l| reference_matches(&a, l)));
        }
    }
}
