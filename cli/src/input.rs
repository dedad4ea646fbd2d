//! Where policy text comes from: the `-f FILE|DIR|-` arguments, read into
//! named [`Source`]s. Shared by every subcommand that reads policies.
//!
//! Only the file system is checked here; what the bytes mean (UTF-8, YAML,
//! policies) is the caller's business, so that a bad file is an error in
//! the file (exit 1) and a bad path is a usage error (exit 2).

use std::fmt;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// The argument that means standard input.
const STDIN_ARG: &str = "-";

/// How standard input is named in error locations.
pub const STDIN_NAME: &str = "<stdin>";

/// The most bytes one apply may send: the controller takes requests of up
/// to 4 MiB. An input larger than that is refused as it is read, so a
/// stream without end (`-f /dev/zero`) does not fill the memory.
pub const MAX_INPUT_BYTES: usize = 4 << 20;

/// The bytes of one input and the name its errors are reported under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The path as the user would type it (`policies/a.yaml`), or
    /// [`STDIN_NAME`].
    pub name: String,
    /// The content, not yet decoded.
    pub bytes: Vec<u8>,
}

/// Why the inputs could not be read: a usage error.
#[derive(Debug)]
pub enum InputError {
    /// A path is missing or cannot be read.
    Read { path: PathBuf, error: io::Error },
    /// A directory holds no policy file.
    NoPolicyFiles { dir: PathBuf },
    /// `-` appeared more than once: the second would read nothing.
    StdinTwice,
    /// An input is larger than [`MAX_INPUT_BYTES`].
    TooLarge { name: String },
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Read { path, error } => {
                write!(f, "cannot read {}: {}", path.display(), reason(error))
            }
            Self::NoPolicyFiles { dir } => {
                write!(f, "no *.yaml or *.yml file in directory {}", dir.display())
            }
            Self::StdinTwice => f.write_str("`-` (standard input) can be given only once"),
            Self::TooLarge { name } => write!(
                f,
                "{name} is larger than 4 MiB, the most sluicectl reads from one input (and the controller takes in one apply): split it into smaller files"
            ),
        }
    }
}

impl std::error::Error for InputError {}

/// Reads every argument in order: a file whatever its name, the policy
/// files directly in a directory (see [`policy_files`]), or `stdin` for
/// `-`.
pub fn read_all(args: &[PathBuf], stdin: &mut dyn Read) -> Result<Vec<Source>, InputError> {
    if args.iter().filter(|a| is_stdin(a)).count() > 1 {
        return Err(InputError::StdinTwice);
    }
    let mut sources = Vec::new();
    for arg in args {
        if is_stdin(arg) {
            sources.push(Source {
                name: STDIN_NAME.to_owned(),
                bytes: read_bounded(stdin, STDIN_NAME)?,
            });
        } else if metadata(arg)?.is_dir() {
            for path in policy_files(arg)? {
                sources.push(read_file(&path)?);
            }
        } else {
            sources.push(read_file(arg)?);
        }
    }
    Ok(sources)
}

/// Returns the `*.yaml` and `*.yml` files (any case) directly in `dir`,
/// sorted by name. Names starting with `.` are skipped (editor and
/// Kubernetes ConfigMap bookkeeping), so are subdirectories; symbolic
/// links are followed.
fn policy_files(dir: &Path) -> Result<Vec<PathBuf>, InputError> {
    let read_err = |error| InputError::Read {
        path: dir.to_owned(),
        error,
    };
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(read_err)? {
        let name = entry.map_err(read_err)?.file_name();
        let path = dir.join(&name);
        if is_policy_file_name(Path::new(&name)) && metadata(&path)?.is_file() {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(InputError::NoPolicyFiles {
            dir: dir.to_owned(),
        });
    }
    files.sort();
    Ok(files)
}

fn is_policy_file_name(name: &Path) -> bool {
    let hidden = name.as_os_str().as_encoded_bytes().starts_with(b".");
    let yaml = name
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"));
    yaml && !hidden
}

fn is_stdin(arg: &Path) -> bool {
    arg.as_os_str() == STDIN_ARG
}

fn metadata(path: &Path) -> Result<fs::Metadata, InputError> {
    fs::metadata(path).map_err(|error| InputError::Read {
        path: path.to_owned(),
        error,
    })
}

/// Reads `input` to its end, refusing more than [`MAX_INPUT_BYTES`].
fn read_bounded(input: &mut dyn Read, name: &str) -> Result<Vec<u8>, InputError> {
    let mut bytes = Vec::new();
    input
        .take(MAX_INPUT_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|error| InputError::Read {
            path: PathBuf::from(name),
            error,
        })?;
    if bytes.len() > MAX_INPUT_BYTES {
        return Err(InputError::TooLarge {
            name: name.to_owned(),
        });
    }
    Ok(bytes)
}

fn read_file(path: &Path) -> Result<Source, InputError> {
    let name = path.display().to_string();
    let mut file = fs::File::open(path).map_err(|error| InputError::Read {
        path: path.to_owned(),
        error,
    })?;
    let bytes = read_bounded(&mut file, &name)?;
    Ok(Source { name, bytes })
}

/// An I/O error as a person reads it: "No such file or directory",
/// without the " (os error 2)" that follows it.
fn reason(error: &io::Error) -> String {
    let text = error.to_string();
    match error.raw_os_error() {
        Some(code) => text
            .strip_suffix(&format!(" (os error {code})"))
            .map_or_else(|| text.clone(), str::to_owned),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(sources: &[Source]) -> Vec<&str> {
        sources.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn a_directory_gives_its_policy_files_sorted_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["b.yaml", "a.yml", "c.YAML", ".hidden.yaml", "notes.txt"] {
            fs::write(dir.path().join(name), "x").unwrap();
        }
        fs::create_dir(dir.path().join("sub.yaml")).unwrap();
        fs::write(dir.path().join("sub.yaml/d.yaml"), "x").unwrap();

        let sources = read_all(&[dir.path().to_owned()], &mut io::empty()).unwrap();

        let base = dir.path().display().to_string();
        let expected: Vec<String> = ["a.yml", "b.yaml", "c.YAML"]
            .iter()
            .map(|n| format!("{base}/{n}"))
            .collect();
        assert_eq!(names(&sources), expected);
    }

    #[test]
    fn a_file_is_read_whatever_its_name_and_stdin_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("policy.txt");
        fs::write(&file, "from file").unwrap();

        let args = [file.clone(), PathBuf::from("-")];
        let sources = read_all(&args, &mut &b"from stdin"[..]).unwrap();

        assert_eq!(
            names(&sources),
            [file.display().to_string(), "<stdin>".into()]
        );
        assert_eq!(sources[0].bytes, b"from file");
        assert_eq!(sources[1].bytes, b"from stdin");
    }

    #[test]
    fn bad_paths_are_usage_errors_that_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.yaml");
        let err = read_all(std::slice::from_ref(&missing), &mut io::empty()).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "cannot read {}: No such file or directory",
                missing.display()
            )
        );

        let err = read_all(&[dir.path().to_owned()], &mut io::empty()).unwrap_err();
        assert!(matches!(err, InputError::NoPolicyFiles { .. }), "{err}");

        let twice = [PathBuf::from("-"), PathBuf::from("-")];
        let err = read_all(&twice, &mut io::empty()).unwrap_err();
        assert!(matches!(err, InputError::StdinTwice), "{err}");
    }

    #[test]
    fn an_input_larger_than_an_apply_is_refused_as_it_is_read() {
        let mut endless = io::repeat(b'#');
        let err = read_all(&[PathBuf::from("-")], &mut endless).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("<stdin> is larger than 4 MiB, the most sluicectl reads"),
            "{err}"
        );
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.yaml");
        fs::write(&big, vec![b'#'; MAX_INPUT_BYTES + 1]).unwrap();
        let err = read_all(std::slice::from_ref(&big), &mut io::empty()).unwrap_err();
        assert!(matches!(err, InputError::TooLarge { .. }), "{err}");
        fs::write(&big, vec![b'#'; MAX_INPUT_BYTES]).unwrap();
        assert_eq!(
            read_all(&[big], &mut io::empty()).unwrap()[0].bytes.len(),
            MAX_INPUT_BYTES
        );
    }
}
