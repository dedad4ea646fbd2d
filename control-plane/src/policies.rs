//! Policy changes, shared by the admin API, the HTTP view and start-up:
//! parse and validate against the in-memory [`PolicySet`], store all or
//! nothing, swap the set, and ask the control loop to recompute.

use std::path::Path;

use serde::Serialize;
use sluice_policy::{Kind, Policy, PolicyErrors, PolicySet, parse_documents};

use crate::error::ApiError;
use crate::state::Shared;
use crate::store::{ApplyOutcome, PolicyDocument, StoreError};

/// One source of documents: its name (for error locations) and its text.
#[derive(Debug, Clone)]
pub struct Source {
    pub name: String,
    pub yaml: String,
}

/// What an apply did (or would do) to one document.
#[derive(Debug, Clone, Serialize)]
pub struct ChangeView {
    pub kind: String,
    pub name: String,
    pub revision: u64,
    pub outcome: String,
    pub source: String,
}

/// Loads the store's current policies into the set.
pub async fn load(shared: &Shared) -> Result<(), String> {
    let stored = shared
        .store
        .current_policies()
        .await
        .map_err(|e| e.to_string())?;
    let mut docs = Vec::new();
    let mut errors = PolicyErrors::default();
    for p in &stored {
        let source = format!("stored:{}/{}@r{}", p.kind, p.name, p.revision);
        match parse_documents(&source, p.canonical.as_deref().unwrap_or_default()) {
            Ok(d) => docs.extend(d),
            Err(e) => errors.0.extend(e),
        }
    }
    if !errors.0.is_empty() {
        return Err(errors.to_string());
    }
    let set = PolicySet::from_documents(docs).map_err(|e| e.to_string())?;
    shared.metrics.policies.set(stored.len() as i64);
    *shared
        .policies
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = set;
    Ok(())
}

/// Validates `sources` against the current set and, unless `dry_run`,
/// stores them and makes them current. All or nothing. Sources that hold
/// no document at all (empty, comments, `---`) are refused: an apply of
/// nothing is a mistake upstream, such as a generator that failed.
pub async fn apply(
    shared: &Shared,
    sources: Vec<Source>,
    dry_run: bool,
) -> Result<Vec<ChangeView>, ApiError> {
    // Parsed off the runtime too: thousands of documents take a while.
    let (docs, sources) = tokio::task::spawn_blocking(move || (parse(&sources), sources))
        .await
        .map_err(|e| ApiError::Invalid(format!("parsing the policies failed: {e}")))?;
    let docs = docs?;
    if docs.is_empty() {
        return Err(ApiError::Invalid(no_policies(&sources)));
    }
    apply_documents(shared, docs, dry_run).await
}

/// Applies `--policies` at start, like [`apply`], except that a file or
/// directory holding no document is no error (it changes nothing), and
/// that a document the store already holds as an older revision of its
/// policy is not applied again: the files have not changed since they
/// were applied, and the newer revision (applied or deleted through the
/// API since) stands. So a restart, or a standby taking over, never rolls
/// back what an operator changed with `sluicectl`; a file whose text is
/// new is applied as before.
pub async fn apply_at_start(
    shared: &Shared,
    sources: Vec<Source>,
) -> Result<Vec<ChangeView>, ApiError> {
    let mut docs = Vec::new();
    for (source, policy) in parse(&sources)? {
        let (kind, name) = (policy.kind().as_str(), policy.name());
        let history = shared.store.policy_history(kind, name).await?;
        let canonical = policy.canonical();
        let latest = history.last();
        let superseded = latest.is_some_and(|l| l.canonical.as_ref() != Some(&canonical))
            && history
                .iter()
                .any(|r| r.canonical.as_ref() == Some(&canonical));
        match latest {
            Some(latest) if superseded => {
                let now = if latest.is_tombstone() {
                    "deleted"
                } else {
                    "changed"
                };
                let message = format!(
                    "{kind}/{name} in {source} is an older revision of the policy, {now} since as revision {}: kept as it is (change the file to apply it again)",
                    latest.revision
                );
                tracing::warn!("--policies: {message}");
                shared
                    .event("policy.kept", format!("{kind}/{name}"), message)
                    .await;
            }
            _ => docs.push((source, policy)),
        }
    }
    if docs.is_empty() {
        return Ok(Vec::new());
    }
    apply_documents(shared, docs, false).await
}

/// Checks `--policies` before the store is opened: every document parses
/// and is valid on its own (how it fits the stored policies is checked
/// when it is applied).
pub fn check_sources(sources: &[Source]) -> Result<(), String> {
    parse(sources).map(drop).map_err(|e| e.to_string())
}

/// The longest source name (a file path, `?source=`) stored with a policy.
const MAX_SOURCE_NAME: usize = 1024;

/// Parses every source; returns each document with its source's name, or
/// every error.
fn parse(sources: &[Source]) -> Result<Vec<(String, Policy)>, ApiError> {
    let mut docs: Vec<(String, Policy)> = Vec::new();
    let mut errors = PolicyErrors::default();
    for s in sources {
        // Stored with each revision and shown in operators' terminals.
        if s.name.chars().any(char::is_control) || s.name.len() > MAX_SOURCE_NAME {
            return Err(ApiError::Invalid(format!(
                "the source name `{}` is refused: it must be at most {MAX_SOURCE_NAME} bytes with no control characters",
                s.name.chars().take(80).collect::<String>().escape_debug()
            )));
        }
        match parse_documents(&s.name, &s.yaml) {
            Ok(d) => docs.extend(d.into_iter().map(|p| (s.name.clone(), p))),
            Err(e) => errors.0.extend(e),
        }
    }
    if errors.0.is_empty() {
        Ok(docs)
    } else {
        Err(ApiError::Invalid(errors.to_string()))
    }
}

/// Returns "no policies in a.yaml, standard input: ..." for sources that
/// hold no document.
fn no_policies(sources: &[Source]) -> String {
    let names: Vec<&str> = sources
        .iter()
        .map(|s| match s.name.as_str() {
            // How `PolicySource.name` spells standard input.
            "-" => "standard input",
            name => name,
        })
        .collect();
    sluice_policy::no_documents(&names)
}

/// Validates parsed documents against the current set and, unless
/// `dry_run`, stores them and makes them current. All or nothing.
async fn apply_documents(
    shared: &Shared,
    docs: Vec<(String, Policy)>,
    dry_run: bool,
) -> Result<Vec<ChangeView>, ApiError> {
    let _serial = shared.policy_changes.lock().await;
    let policies: Vec<Policy> = docs.iter().map(|(_, p)| p.clone()).collect();
    // Checked off the runtime and without the policies' lock held (a set of
    // thousands takes seconds): stage hellos, reports and views go on.
    let current = shared.read_policies().clone();
    let (next, _) = tokio::task::spawn_blocking(move || current.apply(policies))
        .await
        .map_err(|e| ApiError::Invalid(format!("checking the policies failed: {e}")))?
        .map_err(|e| ApiError::Invalid(e.to_string()))?;
    let stored: Vec<PolicyDocument> = docs
        .iter()
        .map(|(_, p)| PolicyDocument::new(p.kind().as_str(), p.name(), p.canonical()))
        .collect();
    let results = if dry_run {
        preview(shared, &stored).await?
    } else {
        shared
            .store
            .apply_policies(&stored)
            .await?
            .into_iter()
            .map(|a| (a.revision, a.outcome))
            .collect()
    };
    let changes: Vec<ChangeView> = docs
        .iter()
        .zip(results)
        .map(|((source, p), (revision, outcome))| ChangeView {
            kind: p.kind().as_str().to_owned(),
            name: p.name().to_owned(),
            revision,
            outcome: outcome.to_string(),
            source: source.clone(),
        })
        .collect();
    if dry_run {
        return Ok(changes);
    }
    let live = next.pools().count() + next.job_policies().count();
    shared.set_policies(next);
    shared.metrics.policies.set(live as i64);
    for c in changes.iter().filter(|c| c.outcome != "unchanged") {
        shared.metrics.policy_revisions.inc();
        let message = format!(
            "{}/{} {} as revision {} from {}",
            c.kind, c.name, c.outcome, c.revision, c.source
        );
        shared
            .event("policy.applied", format!("{}/{}", c.kind, c.name), message)
            .await;
    }
    shared.recompute.notify_one();
    Ok(changes)
}

/// Returns the revision and outcome each document would get.
async fn preview(
    shared: &Shared,
    docs: &[PolicyDocument],
) -> Result<Vec<(u64, ApplyOutcome)>, StoreError> {
    let mut out = Vec::new();
    for d in docs {
        let history = shared.store.policy_history(&d.kind, &d.name).await?;
        let result = match history.last() {
            Some(last) if last.canonical.as_deref() == Some(d.canonical.as_str()) => {
                (last.revision, ApplyOutcome::Unchanged)
            }
            Some(last) if last.canonical.is_some() => (last.revision + 1, ApplyOutcome::Updated),
            Some(last) => (last.revision + 1, ApplyOutcome::Created),
            None => (1, ApplyOutcome::Created),
        };
        out.push(result);
    }
    Ok(out)
}

/// Deletes the policy `name` of `kind` (any kind when empty); returns the
/// kind deleted and the revision that records it.
pub async fn delete(shared: &Shared, kind: &str, name: &str) -> Result<(Kind, u64), ApiError> {
    let _serial = shared.policy_changes.lock().await;
    let kind = resolve_kind(&shared.read_policies(), kind, name)?;
    let next = shared
        .read_policies()
        .delete(kind, name)
        .map_err(|e| match e {
            sluice_policy::DeleteError::NotFound { .. } => ApiError::NotFound(e.to_string()),
            other => ApiError::Conflict(other.to_string()),
        })?;
    let revision = shared.store.delete_policy(kind.as_str(), name).await?;
    let live = next.pools().count() + next.job_policies().count();
    shared.set_policies(next);
    shared.metrics.policies.set(live as i64);
    shared.metrics.policy_revisions.inc();
    let subject = format!("{kind}/{name}");
    let message = format!("{subject} deleted as revision {revision}");
    shared.event("policy.deleted", subject, message).await;
    shared.recompute.notify_one();
    Ok((kind, revision))
}

fn resolve_kind(set: &PolicySet, kind: &str, name: &str) -> Result<Kind, ApiError> {
    if !kind.is_empty() {
        return kind.parse::<Kind>().map_err(|_| {
            ApiError::Invalid(format!(
                "unknown kind `{kind}`: write StoragePool, JobPolicy or DatasetCache"
            ))
        });
    }
    let found: Vec<Kind> = [
        (Kind::StoragePool, set.pool(name).is_some()),
        (Kind::JobPolicy, set.job_policy(name).is_some()),
        (Kind::DatasetCache, set.dataset_cache(name).is_some()),
    ]
    .into_iter()
    .filter_map(|(kind, found)| found.then_some(kind))
    .collect();
    match found.as_slice() {
        [kind] => Ok(*kind),
        [] => Err(ApiError::NotFound(format!("no policy is named `{name}`"))),
        kinds => {
            let kinds: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
            Err(ApiError::Invalid(format!(
                "a {} are named `{name}`: give the kind of the one to delete ({})",
                kinds.join(" and a "),
                kinds.join(" or ")
            )))
        }
    }
}

/// Reads a policy file, or every `*.yaml`/`*.yml` file of a directory in
/// name order, as sources.
pub fn read_sources(path: &Path) -> std::io::Result<Vec<Source>> {
    let mut files = Vec::new();
    if path.is_dir() {
        for entry in std::fs::read_dir(path)? {
            let p = entry?.path();
            let ext = p.extension().and_then(|e| e.to_str());
            if matches!(ext, Some("yaml" | "yml")) {
                files.push(p);
            }
        }
        files.sort();
    } else {
        files.push(path.to_owned());
    }
    files
        .into_iter()
        .map(|f| {
            Ok(Source {
                name: f.display().to_string(),
                yaml: std::fs::read_to_string(&f)?,
            })
        })
        .collect()
}
