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

/// The tokens of one token file. Its `Debug` shows counts, never tokens;
/// `==` (which is not constant-time) only compares two reads of the file.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Tokens {
    entries: Vec<(Role, Vec<u8>)>,
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

impl Tokens {
    /// Reads and parses the token file at `path`.
    pub fn read(path: &Path) -> Result<Self, TokenFileError> {
        let text = std::fs::read_to_string(path).map_err(|e| TokenFileError {
            location: path.display().to_string(),
            reason: format!("cannot read it: {e}"),
        })?;
        Self::parse(&text, path)
    }

    /// Parses the text of a token file (`path` only names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<Self, TokenFileError> {
        let mut tokens = Self::default();
        let mut lines: Vec<usize> = Vec::new();
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
            if let Some(at) = tokens
                .entries
                .iter()
                .position(|(_, t)| t == token.as_bytes())
            {
                return Err(fail(format!(
                    "the token repeats the one on line {}: give every token once",
                    lines[at]
                )));
            }
            tokens.entries.push((role, token.as_bytes().to_vec()));
            lines.push(number);
        }
        if tokens.entries.is_empty() {
            return Err(TokenFileError {
                location: path.display().to_string(),
                reason: "no token in it: write one `ROLE TOKEN` line per token, ROLE `admin` \
                         or `read`"
                    .into(),
            });
        }
        Ok(tokens)
    }

    /// Returns the role of `presented`, or `None` for a token not in the
    /// file. Every token is compared, each in constant time, so the time
    /// taken does not say how much of a token was right.
    pub fn role_of(&self, presented: &[u8]) -> Option<Role> {
        let mut found = None;
        for (role, token) in &self.entries {
            if constant_time_eq(presented, token) {
                found = found.max(Some(*role));
            }
        }
        found
    }

    /// Returns how many tokens `role` has.
    pub fn count(&self, role: Role) -> usize {
        self.entries.iter().filter(|(r, _)| *r == role).count()
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

/// Returns whether `a` and `b` are equal, looking at every byte of the
/// longer one whatever the others hold: the time taken depends on the
/// lengths only, never on where the first difference is.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        // black_box keeps the optimizer from ending the loop once `diff`
        // can no longer become zero.
        diff = std::hint::black_box(diff | (x ^ y));
    }
    diff == 0
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
    fn constant_time_eq_is_equality() {
        let cases: [(&[u8], &[u8], bool); 7] = [
            (b"", b"", true),
            (b"abc", b"abc", true),
            (b"abc", b"abd", false),
            (b"abc", b"xbc", false),
            (b"abc", b"ab", false),
            (b"ab", b"abc", false),
            // A shorter token padded with what the comparison pads with.
            (b"ab\0", b"ab", false),
        ];
        for (a, b, equal) in cases {
            assert_eq!(constant_time_eq(a, b), equal, "{a:?} {b:?}");
        }
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
