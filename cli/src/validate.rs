//! `sluicectl validate`: checks policy documents offline, as one set, and
//! prints every error as `FILE:LINE:COLUMN: message`.

use std::fmt;
use std::io::{self, Write};

use sluice_policy::{PolicySet, parse_documents};

use crate::args::ValidateArgs;
use crate::exit::Exit;
use crate::input::{self, Source};

/// Runs `validate`: reads the inputs, checks them, reports on stdout
/// (success) or stderr (errors, or a path that cannot be read).
pub fn run(args: &ValidateArgs) -> Exit {
    let sources = match input::read_all(&args.files, &mut io::stdin().lock()) {
        Ok(sources) => sources,
        Err(e) => {
            print_lines(io::stderr().lock(), [format!("sluicectl: {e}")]);
            return Exit::Usage;
        }
    };
    match check(&sources) {
        Ok(summary) => {
            print_lines(io::stdout().lock(), [summary.to_string()]);
            Exit::Ok
        }
        Err(errors) => {
            print_lines(io::stderr().lock(), errors);
            Exit::Failed
        }
    }
}

/// What a valid set holds, printed as `ok: 2 pools, 5 job policies in 3
/// files` (and `, 1 data set cache` before ` in` where there are some).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    pub pools: usize,
    pub job_policies: usize,
    pub dataset_caches: usize,
    pub files: usize,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        let caches = match self.dataset_caches {
            0 => String::new(),
            n => format!(", {}", count(n, "data set cache", "data set caches")),
        };
        write!(
            f,
            "ok: {}, {}{caches} in {}",
            count(self.pools, "pool", "pools"),
            count(self.job_policies, "job policy", "job policies"),
            count(self.files, "file", "files"),
        )
    }
}

/// Parses every source and validates all documents as one set. Returns
/// what the set holds, or every error as a `FILE:LINE:COLUMN: message`
/// line, sources in the order given. The rules across documents run only
/// when every document is valid on its own: a pool with a typo would
/// otherwise also show up as "pool does not exist" in every policy using
/// it.
pub fn check(sources: &[Source]) -> Result<Summary, Vec<String>> {
    let set = load(sources)?;
    Ok(Summary {
        pools: set.pools().count(),
        job_policies: set.job_policies().count(),
        dataset_caches: set.cached_datasets().count(),
        files: sources.len(),
    })
}

/// Parses every source and builds one policy set (see [`check`]); returns
/// every error as a `FILE:LINE:COLUMN: message` line.
pub fn load(sources: &[Source]) -> Result<PolicySet, Vec<String>> {
    let mut documents = Vec::new();
    let mut errors = Vec::new();
    for source in sources {
        let parsed = decode(source).and_then(|text| {
            parse_documents(&source.name, text)
                .map_err(|e| e.into_iter().map(|e| e.to_string()).collect())
        });
        match parsed {
            Ok(docs) => documents.extend(docs),
            Err(e) => errors.extend(e),
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    if documents.is_empty() {
        let names: Vec<&str> = sources
            .iter()
            .map(|s| match s.name.as_str() {
                input::STDIN_NAME => "standard input",
                name => name,
            })
            .collect();
        return Err(vec![sluice_policy::no_documents(&names)]);
    }
    PolicySet::from_documents(documents).map_err(|e| e.into_iter().map(|e| e.to_string()).collect())
}

/// Returns the source's text, or where it stops being UTF-8 (line and
/// column in characters, as the policy errors count them).
pub fn decode(source: &Source) -> Result<&str, Vec<String>> {
    let e = match std::str::from_utf8(&source.bytes) {
        Ok(text) => return Ok(text),
        Err(e) => e,
    };
    let valid = &source.bytes[..e.valid_up_to()];
    // Valid by construction: `valid_up_to` ends on a character boundary.
    let valid = std::str::from_utf8(valid).unwrap_or_default();
    let line = valid.matches('\n').count() + 1;
    let last = valid.rsplit('\n').next().unwrap_or_default();
    let column = last.chars().count() + 1;
    let byte = source.bytes[e.valid_up_to()];
    Err(vec![format!(
        "{}:{line}:{column}: the text is not UTF-8 (byte 0x{byte:02x}): \
         save the file as UTF-8",
        source.name
    )])
}

/// Writes one line each; a closed pipe (`| head`) is not worth a panic.
fn print_lines(mut out: impl Write, lines: impl IntoIterator<Item = String>) {
    for line in lines {
        if writeln!(out, "{line}").is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(name: &str, text: &[u8]) -> Source {
        Source {
            name: name.to_owned(),
            bytes: text.to_vec(),
        }
    }

    const POOL: &str = "apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: nfs}
spec: {capacity: {bandwidth: 1GiB/s}}
";

    const POLICY: &str = "apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: vision}
spec:
  selector: {matchLabels: {team: vision}}
  pool: nfs
";

    #[test]
    fn documents_of_several_sources_form_one_set() {
        let sources = [
            source("pool.yaml", POOL.as_bytes()),
            source("p.yaml", POLICY.as_bytes()),
        ];
        let summary = check(&sources).unwrap();
        assert_eq!(summary.to_string(), "ok: 1 pool, 1 job policy in 2 files");

        let alone = check(&sources[1..]).unwrap_err();
        assert_eq!(alone.len(), 1);
        assert!(
            alone[0].starts_with("p.yaml:6:9: pool `nfs` does not exist"),
            "{alone:?}"
        );
    }

    #[test]
    fn input_with_no_document_is_refused_as_apply_refuses_it() {
        let sources = [
            source(input::STDIN_NAME, b""),
            source("gen.yaml", b"# generated\n---\n"),
        ];
        let errors = check(&sources).unwrap_err();
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].starts_with("no policies in standard input, gen.yaml: give at least one"),
            "{errors:?}"
        );
        // One document in any source is enough.
        let with_one = [
            source("gen.yaml", b"---\n"),
            source("pool.yaml", POOL.as_bytes()),
        ];
        check(&with_one).unwrap();
    }

    #[test]
    fn every_source_is_parsed_before_giving_up() {
        let sources = [
            source("a.yaml", b"kind: [\n"),
            source("b.yaml", b"apiVersion: sluice.dev/v1\nkind: Pool\n"),
        ];
        let errors = check(&sources).unwrap_err();
        assert!(errors[0].starts_with("a.yaml:"), "{errors:?}");
        assert!(errors.last().unwrap().starts_with("b.yaml:"), "{errors:?}");
    }

    #[test]
    fn text_that_is_not_utf8_is_located() {
        let errors = check(&[source("l.yaml", b"kind: x\nname: \xc3\xa9t\xe9\n")]).unwrap_err();
        assert_eq!(
            errors,
            ["l.yaml:2:9: the text is not UTF-8 (byte 0xe9): save the file as UTF-8"]
        );
    }

    #[test]
    fn summaries_count_in_plural() {
        let s = Summary {
            pools: 2,
            job_policies: 5,
            dataset_caches: 0,
            files: 3,
        };
        assert_eq!(s.to_string(), "ok: 2 pools, 5 job policies in 3 files");
        let s = Summary {
            pools: 1,
            job_policies: 0,
            dataset_caches: 2,
            files: 1,
        };
        assert_eq!(
            s.to_string(),
            "ok: 1 pool, 0 job policies, 2 data set caches in 1 file"
        );
    }
}
