//! The `--token-file` format and the constant-time token comparison.
//!
//! One token per line, `ROLE TOKEN`, separated by spaces or tabs; blank
//! lines and lines starting with `#` are ignored:
//!
//! ```text
//! # sluice admin API tokens
//! admin  5b0c9d1e6f...
//! read   9a8b7c6d5e...
//! ```
//!
//! `ROLE` is `admin` (everything) or `read` (list, get, describe, watch).
//! A token is 16 to 4096 visible ASCII characters (what an HTTP header can
//! carry, no spaces); a role may have several tokens (rotation: add the new
//! one, move the clients, remove the old one). Errors name the file and
//! line, never the token.
//!
//! Tokens are held as their SHA-256 digests: a presented token is hashed
//! and looked up, so checking it costs the same with ten tokens or a
//! million, and the time taken says nothing about how much of it was
//! right (a lookup compares digests, which an attacker cannot steer
//! towards a held token's).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::path::Path;

/// Shortest token accepted: shorter ones are guessable.
const MIN_TOKEN: usize = 16;
/// Longest token accepted (a header must stay small).
const MAX_TOKEN: usize = 4096;

/// What a token lets its holder do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Reads: list, get, describe, watch.
    Read,
    /// Everything a read token may do, and apply and delete policies.
    Admin,
}

impl Role {
    /// Returns the role's name in the token file.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Admin => "admin",
        }
    }
}

/// The tokens of one token file, by digest. Its `Debug` shows counts,
/// never digests; `==` compares two reads of the file.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Tokens {
    by_digest: HashMap<Digest, Role>,
}

/// A token's SHA-256 digest.
type Digest = [u8; 32];

fn digest(token: &[u8]) -> Digest {
    let mut out = [0; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, token).as_ref());
    out
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokens")
            .field("admin", &self.count(Role::Admin))
            .field("read", &self.count(Role::Read))
            .finish()
    }
}

/// Why a token file was refused: `FILE[:LINE]: reason`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{location}: {reason}")]
pub struct TokenFileError {
    /// The file, with `:LINE` when one line is at fault.
    pub location: String,
    /// What is wrong and what to write instead.
    pub reason: String,
}

/// Why a file that parses but holds no token is refused (at start: a
/// controller nobody could call; read again, it revokes every token).
const NO_TOKEN: &str =
    "no token in it: write one `ROLE TOKEN` line per token, ROLE `admin` or `read`";

impl TokenFileError {
    /// Whether the file parsed but holds no token (every line deleted or
    /// commented out): a revocation of them all, not a typo.
    pub fn holds_no_token(&self) -> bool {
        self.reason == NO_TOKEN
    }
}

impl Tokens {
    /// Reads and parses the token file at `path`.
    pub fn read(path: &Path) -> Result<Self, TokenFileError> {
        let bytes = std::fs::read(path).map_err(|e| TokenFileError {
            location: path.display().to_string(),
            reason: format!("cannot read it: {e}"),
        })?;
        let text = String::from_utf8(bytes).map_err(|e| {
            let bad = e.utf8_error().valid_up_to();
            let line = e.as_bytes()[..bad].iter().filter(|&&b| b == b'\n').count() + 1;
            TokenFileError {
                location: format!("{}:{line}", path.display()),
                reason: "the line is not text (UTF-8): write `ROLE TOKEN` lines, TOKEN in visible \
                         ASCII (for example `openssl rand -hex 32`)"
                    .into(),
            }
        })?;
        Self::parse(&text, path)
    }

    /// Parses the text of a token file (`path` only names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<Self, TokenFileError> {
        let mut tokens = Self::default();
        // The line each digest came from, for a token given twice.
        let mut lines: HashMap<Digest, usize> = HashMap::new();
        for (index, line) in text.lines().enumerate() {
            let number = index + 1;
            let fail = |reason: String| TokenFileError {
                location: format!("{}:{number}", path.display()),
                reason,
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [role, token] = fields[..] else {
                return Err(fail(format!(
                    "expected `ROLE TOKEN` (two fields), found {}",
                    fields.len()
                )));
            };
            let role = match role {
                "admin" => Role::Admin,
                "read" => Role::Read,
                other => {
                    return Err(fail(format!(
                        "unknown role `{other}`: write `admin` or `read`"
                    )));
                }
            };
            check_token(token).map_err(fail)?;
            let digest = digest(token.as_bytes());
            match lines.entry(digest) {
                Entry::Occupied(first) => {
                    return Err(fail(format!(
                        "the token repeats the one on line {}: give every token once",
                        first.get()
                    )));
                }
                Entry::Vacant(slot) => {
                    slot.insert(number);
                }
            }
            tokens.by_digest.insert(digest, role);
        }
        if tokens.by_digest.is_empty() {
            return Err(TokenFileError {
                location: path.display().to_string(),
                reason: NO_TOKEN.into(),
            });
        }
        Ok(tokens)
    }

    /// Returns the role of `presented`, or `None` for a token not in the
    /// file: its digest looked up among the file's.
    pub fn role_of(&self, presented: &[u8]) -> Option<Role> {
        self.by_digest.get(&digest(presented)).copied()
    }

    /// Returns how many tokens `role` has.
    pub fn count(&self, role: Role) -> usize {
        self.by_digest.values().filter(|r| **r == role).count()
    }
}

/// Checks a token's length and characters; the reason never quotes it.
fn check_token(token: &str) -> Result<(), String> {
    let length = token.len();
    if !(MIN_TOKEN..=MAX_TOKEN).contains(&length) {
        return Err(format!(
            "the token is {length} characters long: use {MIN_TOKEN} to {MAX_TOKEN} (for \
             example `openssl rand -hex 32`)"
        ));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(
            "the token has a character a header cannot carry: use visible ASCII \
                    (for example `openssl rand -hex 32`)"
                .into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADMIN: &str = "admin-token-0123456789";
    const READ: &str = "read-token-0123456789";

    fn parse(text: &str) -> Result<Tokens, TokenFileError> {
        Tokens::parse(text, Path::new("tokens"))
    }

    #[test]
    fn lines_give_roles_and_comments_are_skipped() {
        let text = format!("# sluice\n\nadmin {ADMIN}\n  read\t{READ}  \nread {ADMIN}x\n");
        let tokens = parse(&text).unwrap();
        assert_eq!(tokens.role_of(ADMIN.as_bytes()), Some(Role::Admin));
        assert_eq!(tokens.role_of(READ.as_bytes()), Some(Role::Read));
        assert_eq!(
            tokens.role_of(format!("{ADMIN}x").as_bytes()),
            Some(Role::Read)
        );
        assert_eq!(tokens.role_of(b"admin-token-012345678"), None);
        assert_eq!(tokens.role_of(b""), None);
        assert_eq!(
            (tokens.count(Role::Admin), tokens.count(Role::Read)),
            (1, 2)
        );
    }

    #[test]
    fn bad_files_name_the_line_and_never_the_token() {
        let cases = [
            (
                format!("admin {ADMIN}\nwrite {READ}\n"),
                "tokens:2: unknown role `write`",
            ),
            (
                format!("admin {ADMIN} extra\n"),
                "tokens:1: expected `ROLE TOKEN` (two fields), found 3",
            ),
            (
                "admin\n".to_owned(),
                "tokens:1: expected `ROLE TOKEN` (two fields), found 1",
            ),
            (
                "read short-secret\n".to_owned(),
                "tokens:1: the token is 12 characters long",
            ),
            (
                format!("admin {ADMIN}\n\nread {ADMIN}\n"),
                "tokens:3: the token repeats the one on line 1",
            ),
            ("# nothing\n\n".to_owned(), "tokens: no token in it"),
            (
                format!("read {READ}\u{e9}\n"),
                "tokens:1: the token has a character",
            ),
        ];
        for (text, expected) in cases {
            let e = parse(&text).unwrap_err().to_string();
            assert!(e.starts_with(expected), "{text:?}: {e}");
            assert!(
                !e.contains("0123456789") && !e.contains("short-secret"),
                "{e}"
            );
        }
    }

    #[test]
    fn debug_shows_counts_only() {
        let tokens = parse(&format!("admin {ADMIN}\n")).unwrap();
        assert_eq!(format!("{tokens:?}"), "Tokens { admin: 1, read: 0 }");
    }

    #[test]
    fn a_file_that_is_not_text_names_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        let mut bytes = format!("admin {ADMIN}\n# binary below\n").into_bytes();
        bytes.extend_from_slice(&[0xff, 0xfe, b'\n']);
        std::fs::write(&path, bytes).unwrap();
        let e = Tokens::read(&path).unwrap_err();
        assert_eq!(e.location, format!("{}:3", path.display()));
        assert!(e.reason.contains("not text"), "{e}");
    }

    #[test]
    fn many_tokens_are_read_and_looked_up_in_linear_time() {
        // 200,000 tokens: a check of each against every one before it
        // (20 billion byte comparisons) took minutes.
        let text: String = (0..200_000)
            .map(|i| format!("read token-{i:016}\n"))
            .collect();
        let started = std::time::Instant::now();
        let tokens = parse(&text).unwrap();
        assert_eq!(tokens.count(Role::Read), 200_000);
        assert_eq!(tokens.role_of(b"token-0000000000199999"), Some(Role::Read));
        assert_eq!(tokens.role_of(b"token-0000000000200000"), None);
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
    }

    #[test]
    fn reading_a_missing_file_says_so() {
        let e = Tokens::read(Path::new("/nonexistent/tokens")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("/nonexistent/tokens: cannot read it: "),
            "{e}"
        );
    }
}
