//! Which jobs and labels a trainer may claim (`trainers:` in the stage's
//! config file).
//!
//! A trainer names its job and labels in `HELLO`, and operators' policies
//! select on them, so a trainer that may claim anything may take another
//! team's allocation. With rules configured, a claim is allowed only when a
//! rule that covers the trainer allows the job and every label it claims,
//! and the labels carry every key the rule requires. The labels checked
//! are those the job will run under: a trainer that claims none joins the
//! job with the labels it has.
//! A UNIX-socket trainer is known by the kernel's account of its process
//! (`SO_PEERCRED`: uid and primary gid at `connect`), which it cannot forge;
//! a TCP trainer only by being on TCP; an order file by its owner, which
//! only root can change (not by its group, which a set-group-id directory
//! or `chgrp` gives it). Without rules every claim is allowed (the stage's
//! socket permissions are then the only gate).

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;

use serde::Deserialize;

use sluice_policy::{MAX_JOB_ID_BYTES as MAX_JOB_BYTES, job_id_byte, valid_job_id};

/// Longest label value a trainer may send.
pub const MAX_LABEL_VALUE: usize = 256;

/// Who is on the other end of a trainer connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// A UNIX-socket peer, as the kernel reported it.
    Unix { uid: u32, gid: u32 },
    /// A TCP peer: its address, which proves nothing.
    Tcp(SocketAddr),
    /// The owner of an order file. Its group is no proof of the writer's
    /// primary group (a set-group-id directory or `chgrp` sets it), so
    /// `gids` rules do not cover it.
    Owner { uid: u32 },
    /// A UNIX-socket peer whose credentials could not be read.
    Unknown,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unix { uid, gid } => write!(f, "uid {uid} (gid {gid})"),
            Self::Tcp(addr) => write!(f, "TCP peer {addr}"),
            Self::Owner { uid } => write!(f, "uid {uid} (an order file's owner)"),
            Self::Unknown => f.write_str("a peer whose credentials are unknown"),
        }
    }
}

/// One `trainers:` rule: whom it covers and what they may claim.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerRule {
    /// UNIX-socket peers with any of these user ids.
    #[serde(default)]
    pub uids: Vec<u32>,
    /// UNIX-socket peers with any of these primary group ids.
    #[serde(default)]
    pub gids: Vec<u32>,
    /// Every TCP peer.
    #[serde(default)]
    pub tcp: bool,
    /// Every peer.
    #[serde(default)]
    pub any: bool,
    /// Job ids they may claim; `*` matches any run of characters.
    pub jobs: Vec<String>,
    /// Labels they may claim: key -> the values allowed (`*` as in `jobs`).
    /// A key not listed may not be claimed.
    #[serde(default)]
    pub labels: BTreeMap<String, Vec<String>>,
    /// Label keys the job must run under (each listed in `labels`), so
    /// that a trainer cannot escape the policies that select on them by
    /// claiming none.
    #[serde(default)]
    pub require: Vec<String>,
}

impl TrainerRule {
    fn covers(&self, peer: &Peer) -> bool {
        self.any
            || match peer {
                Peer::Unix { uid, gid } => self.uids.contains(uid) || self.gids.contains(gid),
                Peer::Tcp(_) => self.tcp,
                Peer::Owner { uid } => self.uids.contains(uid),
                Peer::Unknown => false,
            }
    }

    fn allows_job(&self, job: &str) -> bool {
        self.jobs.iter().any(|p| glob(p, job))
    }

    /// The first label this rule does not allow.
    fn refused_label<'a>(
        &self,
        labels: &'a BTreeMap<String, String>,
    ) -> Option<(&'a str, &'a str)> {
        labels
            .iter()
            .find(|(k, v)| {
                !self
                    .labels
                    .get(k.as_str())
                    .is_some_and(|values| values.iter().any(|p| glob(p, v)))
            })
            .map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// The first label the rule requires that `labels` lacks.
    fn missing_label(&self, labels: &BTreeMap<String, String>) -> Option<&str> {
        // An empty value names nothing: it does not carry the label.
        self.require
            .iter()
            .find(|k| labels.get(k.as_str()).is_none_or(String::is_empty))
            .map(String::as_str)
    }

    /// Checks that the rule says something.
    pub fn validate(&self, index: usize) -> Result<(), String> {
        if !self.any && !self.tcp && self.uids.is_empty() && self.gids.is_empty() {
            return Err(format!(
                "trainers[{index}] covers nobody: give it uids, gids, `tcp: true` or `any: true`"
            ));
        }
        if self.jobs.is_empty() {
            return Err(format!(
                "trainers[{index}] allows no job: give it `jobs` (`\"*\"` for any)"
            ));
        }
        // A pattern no job id can match (`team-a/*`, "", `..`, one too
        // long): a typo that would allow nothing.
        let may_match = |p: &str| match p.contains('*') {
            false => valid_job_id(p),
            true => literal(p).len() <= MAX_JOB_BYTES && literal(p).bytes().all(job_id_byte),
        };
        if let Some(p) = self.jobs.iter().find(|p| !may_match(p)) {
            return Err(format!(
                "trainers[{index}] allows job `{p}`, which no job id can be (1 to {MAX_JOB_BYTES} characters of [A-Za-z0-9._-], not `.` or `..`; `*` for any run of them)"
            ));
        }
        if let Some(why) = self
            .labels
            .keys()
            .find_map(|k| sluice_policy::check_label(k, "").err())
        {
            return Err(format!(
                "trainers[{index}] allows a label no trainer can send: {why}"
            ));
        }
        if let Some((k, v)) = self.labels.iter().find_map(|(k, values)| {
            values
                .iter()
                .find(|v| literal(v).len() > MAX_LABEL_VALUE)
                .map(|v| (k, v))
        }) {
            return Err(format!(
                "trainers[{index}] allows value `{v}` of label `{k}`, which no trainer can send (values are at most {MAX_LABEL_VALUE} bytes)"
            ));
        }
        // An empty value does not carry a required label.
        let carried = |k: &String| {
            self.labels
                .get(k)
                .is_some_and(|values| values.iter().any(|v| !v.is_empty()))
        };
        if let Some(k) = self.require.iter().find(|k| !carried(k)) {
            return Err(format!(
                "trainers[{index}] requires label `{k}` but allows no value that carries it: list non-empty values of it under `labels`"
            ));
        }
        Ok(())
    }
}

/// The stage's rules, checked at every `HELLO`.
#[derive(Debug, Clone, Default)]
pub struct TrainerAccess {
    rules: Vec<TrainerRule>,
}

impl TrainerAccess {
    pub fn new(rules: Vec<TrainerRule>) -> Self {
        Self { rules }
    }

    /// Whether any rule is configured (else every claim is allowed).
    pub fn restricts(&self) -> bool {
        !self.rules.is_empty()
    }

    /// Allows `peer` to claim `job` with `labels`, or says in one sentence
    /// why not.
    pub fn check(
        &self,
        peer: &Peer,
        job: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<(), String> {
        if !self.restricts() {
            return Ok(());
        }
        let covering: Vec<&TrainerRule> = self.rules.iter().filter(|r| r.covers(peer)).collect();
        if covering.is_empty() {
            return Err(format!(
                "{peer} may not claim any job on this stage: no rule in its `trainers:` list covers it"
            ));
        }
        let for_job: Vec<&TrainerRule> = covering
            .iter()
            .copied()
            .filter(|r| r.allows_job(job))
            .collect();
        if for_job.is_empty() {
            let allowed: Vec<&str> = covering
                .iter()
                .flat_map(|r| r.jobs.iter().map(String::as_str))
                .collect();
            return Err(format!(
                "{peer} may not claim job `{job}`: it may claim {}",
                allowed.join(", ")
            ));
        }
        let (mut refused, mut missing) = (None, None);
        for rule in for_job {
            match (rule.refused_label(labels), rule.missing_label(labels)) {
                (None, None) => return Ok(()),
                (Some(label), _) => refused = refused.or(Some(label)),
                (None, Some(key)) => missing = missing.or(Some(key)),
            }
        }
        if let Some((k, v)) = refused {
            return Err(format!(
                "{peer} may not claim label `{k}={v}` for job `{job}`: no rule of the stage's `trainers:` list that allows the job allows it"
            ));
        }
        let k = missing.expect("at least one rule was tried");
        Err(format!(
            "{peer} must claim label `{k}` for job `{job}`: the stage's `trainers:` rule for it requires the label"
        ))
    }
}

/// `{a=1, b=2}`, for messages (`{}` for none).
pub fn show_labels(labels: &BTreeMap<String, String>) -> String {
    let pairs: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{{{}}}", pairs.join(", "))
}

/// What `pattern` matches at the least: itself without its `*`s.
fn literal(pattern: &str) -> String {
    pattern.replace('*', "")
}

/// Matches `text` against `pattern`, where `*` stands for any run of
/// characters (including none) and everything else for itself.
fn glob(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn rules(yaml: &str) -> TrainerAccess {
        TrainerAccess::new(serde_yaml_ng::from_str(yaml).unwrap())
    }

    #[test]
    fn globs() {
        assert!(glob("*", ""));
        assert!(glob("team-a-*", "team-a-resnet"));
        assert!(!glob("team-a-*", "team-b-resnet"));
        assert!(glob("a*b*c", "aXbYc") && glob("a*b*c", "abc") && !glob("a*b*c", "acb"));
        assert!(glob("exact", "exact") && !glob("exact", "exactly"));
        assert!(!glob("ab*ba", "aba"), "prefix and suffix may not overlap");
    }

    #[test]
    fn no_rules_allow_everything() {
        let open = TrainerAccess::default();
        assert!(!open.restricts());
        assert!(
            open.check(&Peer::Unknown, "any", &labels(&[("team", "x")]))
                .is_ok()
        );
    }

    #[test]
    fn claims_are_checked_by_peer_job_and_label() {
        let access = rules(
            r#"
- uids: [1000]
  jobs: ["team-a-*"]
  labels: {team: [a], priority: [low, normal]}
- gids: [2000]
  jobs: ["*"]
  labels: {team: ["*"]}
- tcp: true
  jobs: [public]
"#,
        );
        let alice = Peer::Unix {
            uid: 1000,
            gid: 1000,
        };
        let ops = Peer::Unix { uid: 5, gid: 2000 };
        let tcp = Peer::Tcp("10.0.0.1:5000".parse().unwrap());
        assert!(
            access
                .check(&alice, "team-a-resnet", &labels(&[("team", "a")]))
                .is_ok()
        );
        let e = access
            .check(&alice, "team-a-resnet", &labels(&[("team", "b")]))
            .unwrap_err();
        assert!(e.contains("uid 1000") && e.contains("`team=b`"), "{e}");
        let e = access
            .check(&alice, "team-a-bert", &labels(&[("priority", "high")]))
            .unwrap_err();
        assert!(e.contains("`priority=high`"), "{e}");
        let e = access
            .check(&alice, "team-b-bert", &labels(&[]))
            .unwrap_err();
        assert!(
            e.contains("may not claim job `team-b-bert`") && e.contains("team-a-*"),
            "{e}"
        );
        assert!(
            access
                .check(&ops, "anything", &labels(&[("team", "z")]))
                .is_ok()
        );
        assert!(access.check(&tcp, "public", &labels(&[])).is_ok());
        let e = access
            .check(&tcp, "public", &labels(&[("team", "a")]))
            .unwrap_err();
        assert!(e.contains("TCP peer"), "{e}");
        let e = access
            .check(&Peer::Unix { uid: 7, gid: 7 }, "public", &labels(&[]))
            .unwrap_err();
        assert!(e.contains("no rule") && e.contains("uid 7"), "{e}");
        assert!(
            access
                .check(&Peer::Unknown, "public", &labels(&[]))
                .is_err()
        );
    }

    #[test]
    fn required_labels_must_be_claimed() {
        let access = rules(
            r#"
- uids: [1000]
  jobs: ["team-a-*"]
  labels: {team: [a, ""], priority: [low, normal]}
  require: [team]
"#,
        );
        let alice = Peer::Unix {
            uid: 1000,
            gid: 1000,
        };
        assert!(
            access
                .check(&alice, "team-a-x", &labels(&[("team", "a")]))
                .is_ok()
        );
        for claim in [
            labels(&[]),
            labels(&[("priority", "low")]),
            labels(&[("team", "")]),
        ] {
            let e = access.check(&alice, "team-a-x", &claim).unwrap_err();
            assert!(e.contains("must claim label `team`"), "{e}");
        }
        let r: Vec<TrainerRule> =
            serde_yaml_ng::from_str("- any: true\n  jobs: [x]\n  require: [team]").unwrap();
        assert!(
            r[0].validate(0)
                .unwrap_err()
                .contains("requires label `team`")
        );
    }

    #[test]
    fn empty_rules_are_refused() {
        let r: Vec<TrainerRule> = serde_yaml_ng::from_str("- jobs: [x]").unwrap();
        assert!(r[0].validate(0).unwrap_err().contains("covers nobody"));
        let r: Vec<TrainerRule> = serde_yaml_ng::from_str("- any: true\n  jobs: []").unwrap();
        assert!(
            r[0].validate(3)
                .unwrap_err()
                .contains("trainers[3] allows no job")
        );
        assert!(serde_yaml_ng::from_str::<Vec<TrainerRule>>("- uid: [1]\n  jobs: [x]").is_err());
        // Rules that can allow nothing: refused too.
        let long_job = format!("jobs: [{}]", "j".repeat(129));
        let long_job_pattern = format!("jobs: ['{}*']", "j".repeat(129));
        let long_key = format!("jobs: [x]\n  labels: {{{}: [a]}}", "k".repeat(64));
        let long_value = format!("jobs: [x]\n  labels: {{team: ['{}']}}", "v".repeat(257));
        for (rule, said) in [
            ("jobs: ['']", "allows job ``"),
            ("jobs: ['team-a/*']", "allows job `team-a/*`"),
            (
                "jobs: [x]\n  labels: {'': [a]}",
                "label key `` is not valid",
            ),
            (
                "jobs: [x]\n  labels: {'cost center': [a]}",
                "label key `cost center` is not valid",
            ),
            (
                "jobs: [x]\n  labels: {team: []}\n  require: [team]",
                "requires label `team`",
            ),
            ("jobs: ['..']", "allows job `..`"),
            ("jobs: ['.']", "allows job `.`"),
            (&long_job, "which no job id can be"),
            (&long_job_pattern, "which no job id can be"),
            (
                &long_key,
                "allows a label no trainer can send: label key `kkk",
            ),
            (&long_value, "values are at most 256 bytes"),
            (
                "jobs: [x]\n  labels: {team: ['']}\n  require: [team]",
                "allows no value that carries it",
            ),
        ] {
            let r: Vec<TrainerRule> =
                serde_yaml_ng::from_str(&format!("- any: true\n  {rule}")).unwrap();
            let e = r[0].validate(0).unwrap_err();
            assert!(e.contains(said), "{rule}: {e}");
        }
        // What the longest ids, keys and values are is allowed.
        for rule in [
            format!("jobs: [{}, '.*', '{}*']", "j".repeat(128), "j".repeat(128)),
            format!(
                "jobs: [x]\n  labels: {{{}: ['{}', '*']}}",
                "k".repeat(63),
                "v".repeat(256)
            ),
            "jobs: [x]\n  labels: {team: ['', a]}\n  require: [team]".to_owned(),
        ] {
            let r: Vec<TrainerRule> =
                serde_yaml_ng::from_str(&format!("- any: true\n  {rule}")).unwrap();
            assert_eq!(r[0].validate(0), Ok(()), "{rule}");
        }
    }

    #[test]
    fn an_order_files_owner_is_covered_by_its_uid_never_by_its_group() {
        let access = rules(
            r#"
- uids: [1000]
  jobs: ["team-a-*"]
- gids: [2000]
  jobs: ["*"]
"#,
        );
        let owner = Peer::Owner { uid: 1000 };
        assert!(access.check(&owner, "team-a-x", &labels(&[])).is_ok());
        let e = access.check(&owner, "team-b-x", &labels(&[])).unwrap_err();
        assert!(
            e.contains("uid 1000 (an order file's owner) may not claim job `team-b-x`"),
            "{e}"
        );
        let e = access
            .check(&Peer::Owner { uid: 2000 }, "team-b-x", &labels(&[]))
            .unwrap_err();
        assert!(e.contains("no rule"), "{e}");
    }
}
