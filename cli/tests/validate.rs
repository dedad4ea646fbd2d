//! `sluicectl validate`, run as the real binary: what an operator sees on
//! stdout and stderr, and the exit code.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod run;
use run::sluicectl;

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../policies/examples");

const POOL: &str = "\
apiVersion: sluice.dev/v1
kind: StoragePool
metadata:
  name: shared-nfs
spec:
  capacity:
    bandwidth: 2GiB/s
";

/// An unknown field (line 8) and a bad unit (line 18, column 16).
const MALFORMED: &str = "\
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata:
  name: vision
spec:
  selector: {matchLabels: {team: vision}}
  pool: shared-nfs
  wieght: 3
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata:
  name: audio
spec:
  selector: {matchLabels: {team: audio}}
  pool: shared-nfs
  limit:
    bandwidth: 800MiBps
";

/// Valid on its own; names a pool that does not exist (line 7, column 9).
const TYPO_POOL: &str = "\
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata:
  name: speech
spec:
  selector: {matchLabels: {team: speech}}
  pool: shared-nsf
";

/// A temporary directory holding `files` (name, content).
fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        let path = dir.path().join(name);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }
    dir
}

fn examples() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(EXAMPLES)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    files
}

#[test]
fn every_example_validates() {
    let here = Path::new(EXAMPLES);
    for file in examples() {
        let run = sluicectl(here, &["validate", "-f", file.to_str().unwrap()], "");
        assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{file:?}");
        assert!(run.stdout.starts_with("ok: 1 pool, "), "{}", run.stdout);
        assert!(run.stdout.ends_with(" in 1 file\n"), "{}", run.stdout);
    }
}

#[test]
fn a_directory_validates_as_one_set() {
    // One example split over two files: the policies use the pool of the
    // other file. Other names, subdirectories and dot files are skipped.
    let example = fs::read_to_string(Path::new(EXAMPLES).join("shared-weighted.yaml")).unwrap();
    let (pool, policies) = example.split_once("\n---\n").unwrap();
    let dir = dir_with(&[
        ("10-pool.yaml", pool),
        ("20-policies.yml", policies),
        ("README.md", "not yaml"),
        ("old/broken.yaml", "kind: ["),
        (".broken.yaml.swp.yaml", "kind: ["),
    ]);

    let run = sluicectl(dir.path(), &["validate", "-f", "."], "");

    assert_eq!((run.code, run.stderr.as_str()), (0, ""));
    assert_eq!(run.stdout, "ok: 1 pool, 3 job policies in 2 files\n");
}

#[test]
fn malformed_policies_are_located_and_all_reported() {
    let dir = dir_with(&[("pool.yaml", POOL), ("bad.yaml", MALFORMED)]);

    let run = sluicectl(
        dir.path(),
        &["validate", "-f", "pool.yaml", "-f", "bad.yaml"],
        "",
    );

    assert_eq!(run.code, 1, "{}", run.stderr);
    assert_eq!(run.stdout, "");
    let lines: Vec<&str> = run.stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(
        lines[0]
            .starts_with("bad.yaml:8:3: unknown field `wieght` in spec: did you mean `weight`?"),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].starts_with("bad.yaml:18:16: spec.limit.bandwidth: invalid byte rate `800MiBps`"),
        "{}",
        lines[1]
    );
}

#[test]
fn an_unknown_pool_is_found_across_files() {
    let dir = dir_with(&[("pool.yaml", POOL), ("speech.yaml", TYPO_POOL)]);

    let run = sluicectl(dir.path(), &["validate", "-f", "."], "");

    assert_eq!(run.code, 1, "{}", run.stderr);
    assert_eq!(run.stdout, "");
    assert!(
        run.stderr.starts_with(
            "./speech.yaml:7:9: pool `shared-nsf` does not exist: did you mean `shared-nfs`?"
        ),
        "{}",
        run.stderr
    );
    assert_eq!(run.stderr.lines().count(), 1, "{}", run.stderr);
}

#[test]
fn two_policies_claiming_the_same_jobs_are_refused() {
    let other = TYPO_POOL
        .replace("name: speech", "name: speech-copy")
        .replace("shared-nsf", "shared-nfs");
    let first = TYPO_POOL.replace("shared-nsf", "shared-nfs");
    let dir = dir_with(&[("a.yaml", &first), ("b.yaml", &other), ("pool.yaml", POOL)]);

    let run = sluicectl(dir.path(), &["validate", "-f", "."], "");

    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(
        run.stderr.starts_with("./b.yaml:6:13: policies `speech-copy` (./b.yaml:6:13) and `speech` (./a.yaml:6:13) both select jobs"),
        "{}",
        run.stderr
    );
}

#[test]
fn standard_input_is_read_for_a_dash() {
    let here = Path::new(EXAMPLES);
    let text = fs::read_to_string(here.join("static-split.yaml")).unwrap();
    let run = sluicectl(here, &["validate", "-f", "-"], &text);
    assert_eq!((run.code, run.stderr.as_str()), (0, ""));
    assert_eq!(run.stdout, "ok: 1 pool, 2 job policies in 1 file\n");

    // With the pool from a file, the policy from stdin.
    let dir = dir_with(&[("pool.yaml", POOL)]);
    let run = sluicectl(
        dir.path(),
        &["validate", "-f", "pool.yaml", "-f", "-"],
        TYPO_POOL,
    );
    assert_eq!(run.code, 1);
    assert!(
        run.stderr
            .starts_with("<stdin>:7:9: pool `shared-nsf` does not exist"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_path_that_cannot_be_read_is_a_usage_error() {
    let dir = dir_with(&[("pool.yaml", POOL), ("notes.txt", "")]);
    let run = sluicectl(
        dir.path(),
        &["validate", "-f", "pool.yaml", "-f", "missing.yaml"],
        "",
    );
    assert_eq!(run.code, 2);
    assert_eq!(run.stdout, "");
    assert_eq!(
        run.stderr,
        "sluicectl: cannot read missing.yaml: No such file or directory\n"
    );

    fs::create_dir(dir.path().join("empty")).unwrap();
    let run = sluicectl(dir.path(), &["validate", "-f", "empty"], "");
    assert_eq!(run.code, 2);
    assert_eq!(
        run.stderr,
        "sluicectl: no *.yaml or *.yml file in directory empty\n"
    );
}

#[test]
fn a_wrong_command_line_exits_2_with_usage() {
    let here = Path::new(EXAMPLES);
    for args in [
        &[][..],
        &["validate"],
        &["validate", "-f", "static-split.yaml", "--frobnicate"],
        &["apply"],
        &["get", "nodes"],
        &["describe", "job"],
        &["validate", "-f", "-", "-f", "-"],
    ] {
        let run = sluicectl(here, args, "");
        assert_eq!(run.code, 2, "{args:?}: {}", run.stderr);
        assert_eq!(run.stdout, "", "{args:?}");
        assert!(
            run.stderr.contains("Usage: sluicectl")
                || run.stderr.starts_with("sluicectl: ")
                || run.stderr.starts_with("error: invalid value"),
            "{args:?}: {}",
            run.stderr
        );
    }
}

#[test]
fn the_server_flag_and_variable_are_accepted() {
    let here = Path::new(EXAMPLES);
    let args = [
        "--server",
        "http://10.0.0.1:7070",
        "validate",
        "-f",
        "static-split.yaml",
    ];
    assert_eq!(sluicectl(here, &args, "").code, 0);
    let args = [
        "validate",
        "-f",
        "static-split.yaml",
        "--server",
        "http://10.0.0.1:7070",
    ];
    assert_eq!(sluicectl(here, &args, "").code, 0);

    let status = Command::new(env!("CARGO_BIN_EXE_sluicectl"))
        .args(["validate", "-f", "static-split.yaml"])
        .current_dir(here)
        .env("SLUICE_SERVER", "http://10.0.0.1:7070")
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

#[test]
fn help_fits_80_columns_and_lists_exit_codes() {
    let here = Path::new(EXAMPLES);
    for args in [
        &["--help"][..],
        &["-h"],
        &["validate", "--help"],
        &["validate", "-h"],
        &["help", "validate"],
    ] {
        let run = sluicectl(here, args, "");
        assert_eq!(run.code, 0, "{args:?}");
        assert!(run.stdout.contains("Exit codes:"), "{args:?}");
        for line in run.stdout.lines() {
            assert!(line.chars().count() <= 80, "{args:?}: {line:?}");
        }
    }
}
