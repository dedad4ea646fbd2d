//! `sluicectl apply -f FILE|DIR|-`: sends every source to the controller in
//! one `ApplyPolicies` request (all or nothing) and prints what changed,
//! one line per document: `pool/shared-nfs created (revision 1)`.

use std::io;

use sluice_proto::v1::{self, ApplyOutcome};

use crate::args::ApplyArgs;
use crate::client::{self, Controller};
use crate::exit::{self, Exit};
use crate::input::{self, STDIN_NAME, Source};
use crate::validate;

/// How a source read from standard input is named in the request, as
/// `PolicySource.name` documents it.
const STDIN_SOURCE: &str = "-";

/// Runs `apply`: reads the inputs, sends them, reports on stdout (the
/// changes) or stderr (the problems).
pub fn run(controller: &Controller, args: &ApplyArgs) -> Exit {
    let sources = match input::read_all(&args.files, &mut io::stdin().lock()) {
        Ok(sources) => sources,
        Err(e) => {
            eprintln!("sluicectl: {e}");
            return Exit::Usage;
        }
    };
    let request = match request(&sources, args.dry_run) {
        Ok(request) => request,
        Err(errors) => {
            for line in errors {
                eprintln!("{line}");
            }
            return Exit::Failed;
        }
    };
    let response = client::block_on(client::call(controller, |mut admin| async move {
        admin.apply_policies(request).await
    }));
    match response {
        Ok(response) => {
            for change in &response.changes {
                exit::say(&format!("{}\n", change_line(change, response.dry_run)));
            }
            Exit::Ok
        }
        Err(e) => client::report(&e),
    }
}

/// Builds the request; a source that is not UTF-8 cannot be sent and is
/// reported as `FILE:LINE:COLUMN: message`, like any invalid policy.
fn request(sources: &[Source], dry_run: bool) -> Result<v1::ApplyPoliciesRequest, Vec<String>> {
    let mut policy_sources = Vec::new();
    let mut errors = Vec::new();
    for source in sources {
        match validate::decode(source) {
            Ok(text) => policy_sources.push(v1::PolicySource {
                name: if source.name == STDIN_NAME {
                    STDIN_SOURCE.to_owned()
                } else {
                    source.name.clone()
                },
                yaml: text.to_owned(),
            }),
            Err(e) => errors.extend(e),
        }
    }
    if !errors.is_empty() {
        // Nothing is sent: the other sources' mistakes are found here too,
        // as `validate` finds them, rather than one at a time.
        return Err(validate::load(sources).err().unwrap_or(errors));
    }
    // The request's own framing is a few bytes per source.
    let size: usize = policy_sources
        .iter()
        .map(|s| s.name.len() + s.yaml.len() + 16)
        .sum();
    if size > input::MAX_INPUT_BYTES {
        return Err(vec![format!(
            "sluicectl: the inputs together are {size} bytes, more than the 4 MiB the controller takes in one apply: apply them in several runs"
        )]);
    }
    Ok(v1::ApplyPoliciesRequest {
        sources: policy_sources,
        dry_run,
    })
}

/// Returns `pool/shared-nfs created (revision 1)`; a dry run says so.
pub fn change_line(change: &v1::PolicyChange, dry_run: bool) -> String {
    let outcome = match ApplyOutcome::try_from(change.outcome) {
        Ok(ApplyOutcome::Created) => "created",
        Ok(ApplyOutcome::Updated) => "updated",
        Ok(ApplyOutcome::Unchanged) => "unchanged",
        _ => "applied",
    };
    let dry = if dry_run { ", dry run" } else { "" };
    format!(
        "{}/{} {outcome} (revision {}{dry})",
        short_kind(&change.kind),
        change.name,
        change.revision
    )
}

/// The short, lower-case name of a policy kind, as `delete` takes it.
pub fn short_kind(kind: &str) -> String {
    match kind {
        "StoragePool" => "pool".to_owned(),
        other => other.to_ascii_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(kind: &str, name: &str, revision: u64, outcome: ApplyOutcome) -> v1::PolicyChange {
        v1::PolicyChange {
            kind: kind.into(),
            name: name.into(),
            revision,
            outcome: outcome as i32,
            source: "a.yaml".into(),
        }
    }

    #[test]
    fn changes_read_as_one_line_each() {
        let pool = change("StoragePool", "shared-nfs", 1, ApplyOutcome::Created);
        assert_eq!(
            change_line(&pool, false),
            "pool/shared-nfs created (revision 1)"
        );
        let policy = change("JobPolicy", "vision", 4, ApplyOutcome::Unchanged);
        assert_eq!(
            change_line(&policy, true),
            "jobpolicy/vision unchanged (revision 4, dry run)"
        );
    }

    #[test]
    fn stdin_is_sent_as_dash_and_bad_utf8_is_located() {
        let sources = [Source {
            name: STDIN_NAME.into(),
            bytes: b"kind: x\n".to_vec(),
        }];
        let request = request(&sources, true).unwrap();
        assert_eq!(request.sources[0].name, "-");
        assert!(request.dry_run);

        let bad = [Source {
            name: "l.yaml".into(),
            bytes: b"x: \xff\n".to_vec(),
        }];
        let errors = super::request(&bad, false).unwrap_err();
        assert!(errors[0].starts_with("l.yaml:1:4: "), "{errors:?}");

        // Every source's mistakes at once, as `validate` gives them.
        let zero = "apiVersion: sluice.dev/v1\nkind: StoragePool\nmetadata:\n  name: p1\nspec:\n  capacity:\n    bandwidth: 0B/s\n";
        let both = [
            bad[0].clone(),
            Source {
                name: "zero.yaml".into(),
                bytes: zero.as_bytes().to_vec(),
            },
        ];
        let errors = super::request(&both, false).unwrap_err();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[1].starts_with("zero.yaml:7:"), "{errors:?}");
    }
}
