//! `sluicectl delete policy NAME`, `delete pool NAME`, `delete jobpolicy
//! NAME` and `delete datasetcache NAME`: the controller records the
//! deletion as a new revision, which is printed. `delete policy` lets the
//! controller find the kind; when several kinds share the name it says
//! which commands would delete each. Deleting a JobPolicy that running
//! jobs are under notes those jobs on standard error: they lose its
//! limits and guarantees at once.

use sluice_proto::v1;
use tonic::Code;

use crate::apply::short_kind;
use crate::args::DeleteTarget;
use crate::client::{self, CallError, Controller};
use crate::exit::{self, Exit};

/// Runs `delete`: prints `pool/NAME deleted (revision N)` (the kind the
/// controller deleted).
pub fn run(controller: &Controller, target: &DeleteTarget) -> Exit {
    let (word, kind, name) = match target {
        // Empty kind: whichever kind has a policy of this name.
        DeleteTarget::Policy { name } => ("policy", "", name),
        DeleteTarget::Pool { name } => ("pool", "StoragePool", name),
        DeleteTarget::Jobpolicy { name } => ("jobpolicy", "JobPolicy", name),
        DeleteTarget::Datasetcache { name } => ("datasetcache", "DatasetCache", name),
    };
    let request = v1::DeletePolicyRequest {
        kind: kind.to_owned(),
        name: name.clone(),
    };
    let response = client::block_on(async {
        // Asked before the deletion, which moves the jobs off the policy.
        let under = match kind {
            "" | "JobPolicy" => jobs_under(controller, name).await,
            _ => Vec::new(),
        };
        let deleted = client::call(controller, |mut admin| async move {
            admin.delete_policy(request).await
        })
        .await;
        match deleted {
            Err(CallError::Refused(status))
                if kind.is_empty() && status.code() == Code::InvalidArgument =>
            {
                Err(ambiguous(controller, name)
                    .await
                    .unwrap_or_else(|| format!("sluicectl: {}", CallError::Refused(status))))
            }
            Err(e) => Err(format!("sluicectl: {e}")),
            Ok(deleted) => Ok((deleted, under)),
        }
    });
    match response {
        Ok((deleted, under)) => {
            // An older controller does not say which kind it deleted.
            let word = match deleted.kind.as_str() {
                "" => word.to_owned(),
                found => short_kind(found),
            };
            exit::say(&format!(
                "{word}/{name} deleted (revision {})\n",
                deleted.revision
            ));
            let job_policy =
                deleted.kind == "JobPolicy" || (deleted.kind.is_empty() && kind == "JobPolicy");
            if job_policy && !under.is_empty() {
                eprintln!(
                    "sluicectl: note: running jobs were under jobpolicy/{name}: {}; each is now under the next JobPolicy that selects it, or under none (its stages' own settings: their --rate-limit and --ops-limit, if any, and no guarantee)",
                    under.join(", ")
                );
            }
            Exit::Ok
        }
        Err(line) => {
            // One line, with the prefix, even for a refused argument.
            eprintln!("{line}");
            Exit::Failed
        }
    }
}

/// Returns the jobs the controller has under the JobPolicy `name` (none
/// when it cannot say: the note is only a courtesy).
async fn jobs_under(controller: &Controller, name: &str) -> Vec<String> {
    let listed = client::call(controller, |mut admin| async move {
        admin.list_jobs(v1::ListJobsRequest {}).await
    })
    .await;
    listed.map_or_else(
        |_| Vec::new(),
        |jobs| {
            jobs.jobs
                .into_iter()
                // A job no stage serves now has ended (or not begun):
                // the deletion takes nothing from it.
                .filter(|j| j.policy == name && !j.stages.is_empty())
                .map(|j| j.id)
                .collect()
        },
    )
}

/// Returns, when several kinds of policy are named `name`, the line that
/// says how to delete each; `None` when they are not (or cannot be
/// listed): the controller's own reason then stands.
async fn ambiguous(controller: &Controller, name: &str) -> Option<String> {
    let request = v1::ListPoliciesRequest {
        include_history: false,
    };
    let listed = client::call(controller, |mut admin| async move {
        admin.list_policies(request).await
    })
    .await
    .ok()?;
    let kinds: Vec<&str> = listed
        .policies
        .iter()
        .filter(|p| p.name == name && !p.deleted)
        .map(|p| p.kind.as_str())
        .collect();
    (kinds.len() > 1).then(|| ambiguity_line(&kinds, name))
}

/// Returns "sluicectl: a StoragePool and a JobPolicy are named `dup`: say
/// which with `sluicectl delete pool dup` or `sluicectl delete jobpolicy
/// dup`".
fn ambiguity_line(kinds: &[&str], name: &str) -> String {
    let (articles, commands): (Vec<String>, Vec<String>) = kinds
        .iter()
        .map(|k| {
            let command = format!("`sluicectl delete {} {name}`", short_kind(k));
            (format!("a {k}"), command)
        })
        .unzip();
    format!(
        "sluicectl: {} are named `{name}`: say which with {}",
        listed(&articles, "and"),
        listed(&commands, "or")
    )
}

/// Returns "a, b and c".
fn listed(items: &[String], last: &str) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., end] => format!("{} {last} {end}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ambiguous_name_gets_one_command_per_kind() {
        assert_eq!(
            ambiguity_line(&["StoragePool", "JobPolicy"], "dup"),
            "sluicectl: a StoragePool and a JobPolicy are named `dup`: say which with \
             `sluicectl delete pool dup` or `sluicectl delete jobpolicy dup`"
        );
        assert_eq!(
            ambiguity_line(&["StoragePool", "JobPolicy", "DatasetCache"], "x"),
            "sluicectl: a StoragePool, a JobPolicy and a DatasetCache are named `x`: say \
             which with `sluicectl delete pool x`, `sluicectl delete jobpolicy x` or \
             `sluicectl delete datasetcache x`"
        );
    }
}
