//! The rules of a policy's history that both backends follow: when an apply
//! writes a revision and which number it gets, and when a delete may write
//! a tombstone. The backends only read the head and write what these say.

use super::StoreError;
use super::model::{Applied, ApplyOutcome, PolicyDocument};
use super::rows::to_u64;

/// The current revision of a policy as read inside an apply or delete.
pub(super) type HeadRow = (i64, Option<String>);

/// What an apply must do given the policy's current revision.
pub(super) struct ApplyPlan {
    /// The revision after the apply.
    pub revision: i64,
    pub outcome: ApplyOutcome,
}

impl ApplyPlan {
    /// Decides: an identical text is no change; anything else (including
    /// a policy never seen or deleted) appends the next revision.
    pub fn new(head: Option<HeadRow>, canonical: &str) -> Self {
        match head {
            None => Self {
                revision: 1,
                outcome: ApplyOutcome::Created,
            },
            Some((rev, None)) => Self {
                revision: rev + 1,
                outcome: ApplyOutcome::Created,
            },
            Some((rev, Some(text))) if text == canonical => Self {
                revision: rev,
                outcome: ApplyOutcome::Unchanged,
            },
            Some((rev, Some(_))) => Self {
                revision: rev + 1,
                outcome: ApplyOutcome::Updated,
            },
        }
    }

    pub fn writes(&self) -> bool {
        self.outcome != ApplyOutcome::Unchanged
    }

    pub fn applied(&self, doc: &PolicyDocument) -> Result<Applied, StoreError> {
        Ok(Applied {
            kind: doc.kind.clone(),
            name: doc.name.clone(),
            revision: to_u64("policy revision", self.revision)?,
            outcome: self.outcome,
        })
    }
}

/// Returns the tombstone's revision, or why there is nothing to delete.
pub(super) fn delete_revision(
    head: Option<HeadRow>,
    kind: &str,
    name: &str,
) -> Result<i64, StoreError> {
    match head {
        Some((rev, Some(_))) => Ok(rev + 1),
        None | Some((_, None)) => Err(StoreError::PolicyNotFound {
            kind: kind.to_owned(),
            name: name.to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_plan_follows_the_head() {
        let plan = ApplyPlan::new(None, "a");
        assert_eq!((plan.revision, plan.outcome), (1, ApplyOutcome::Created));
        let plan = ApplyPlan::new(Some((3, Some("a".into()))), "a");
        assert_eq!(
            (plan.revision, plan.outcome, plan.writes()),
            (3, ApplyOutcome::Unchanged, false)
        );
        let plan = ApplyPlan::new(Some((3, Some("a".into()))), "b");
        assert_eq!((plan.revision, plan.outcome), (4, ApplyOutcome::Updated));
        let plan = ApplyPlan::new(Some((4, None)), "a");
        assert_eq!((plan.revision, plan.outcome), (5, ApplyOutcome::Created));
    }

    #[test]
    fn delete_needs_a_live_policy() {
        assert_eq!(
            delete_revision(Some((2, Some("a".into()))), "K", "n").unwrap(),
            3
        );
        for head in [None, Some((3, None))] {
            let err = delete_revision(head, "JobPolicy", "vision").unwrap_err();
            assert_eq!(err.to_string(), "JobPolicy `vision` does not exist");
        }
    }
}
