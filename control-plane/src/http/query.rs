//! [`Query`]: a request's query parameters, percent-decoded and checked
//! against what the endpoint takes. A parameter the endpoint does not know
//! (a typo such as `dryrun`) or a value it cannot read (`dry_run=yes`) is
//! refused with 400 rather than ignored: ignoring `dry_run` would apply a
//! policy for real.

use crate::error::ApiError;

/// The parameters of one request, in order, each key at most once.
#[derive(Debug, Default)]
pub struct Query {
    /// Key and value; `None` for a bare key (`?history`).
    pairs: Vec<(String, Option<String>)>,
}

impl Query {
    /// Parses a raw query string (`a=1&b=x%20y`); refuses keys not in
    /// `allowed`, keys given twice and text that does not decode.
    pub fn parse(raw: Option<&str>, allowed: &[&str]) -> Result<Self, ApiError> {
        let mut query = Self::default();
        let mut unknown = Vec::new();
        for pair in raw.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
            let (key, value) = match pair.split_once('=') {
                Some((k, v)) => (decode(k)?, Some(decode(v)?)),
                None => (decode(pair)?, None),
            };
            if !allowed.contains(&key.as_str()) {
                unknown.push(key);
            } else if query.pairs.iter().any(|(k, _)| *k == key) {
                return Err(ApiError::Invalid(format!(
                    "query parameter `{key}` is given twice: give it once"
                )));
            } else {
                query.pairs.push((key, value));
            }
        }
        if unknown.is_empty() {
            Ok(query)
        } else {
            Err(ApiError::Invalid(unknown_message(&unknown, allowed)))
        }
    }

    /// Returns the text of `key`, if given; a bare key has no text.
    pub fn text(&self, key: &str) -> Result<Option<&str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Some(value)) if !value.is_empty() => Ok(Some(value)),
            Some(_) => Err(ApiError::Invalid(format!(
                "query parameter `{key}` needs a value: write {key}=VALUE"
            ))),
        }
    }

    /// Returns the boolean `key`: `true` or `1`, `false` or `0`, or a bare
    /// key for true; `false` when absent.
    pub fn flag(&self, key: &str) -> Result<bool, ApiError> {
        match self.get(key) {
            None | Some(Some("false" | "0")) => Ok(false),
            Some(None | Some("true" | "1")) => Ok(true),
            Some(Some(other)) => Err(ApiError::Invalid(format!(
                "query parameter {key}={other} is not a boolean: write {key}=true or {key}=false"
            ))),
        }
    }

    fn get(&self, key: &str) -> Option<Option<&str>> {
        self.pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_deref())
    }
}

/// Returns "unknown query parameter `dryrun` (did you mean `dry_run`?):
/// this endpoint takes `dry_run` or `source`".
fn unknown_message(unknown: &[String], allowed: &[&str]) -> String {
    let quoted =
        |names: &mut dyn Iterator<Item = &str>| names.map(|n| format!("`{n}`")).collect::<Vec<_>>();
    let names = quoted(&mut unknown.iter().map(String::as_str));
    let mut message = if names.len() == 1 {
        format!("unknown query parameter {}", names[0])
    } else {
        format!("unknown query parameters {}", names.join(", "))
    };
    let meant: Vec<&str> = unknown
        .iter()
        .filter_map(|u| allowed.iter().copied().find(|a| loose(a) == loose(u)))
        .collect();
    if !meant.is_empty() {
        message.push_str(&format!(
            " (did you mean {}?)",
            quoted(&mut meant.into_iter()).join(", ")
        ));
    }
    match allowed {
        [] => message.push_str(": this endpoint takes no query parameters"),
        _ => message.push_str(&format!(
            ": this endpoint takes {}",
            quoted(&mut allowed.iter().copied()).join(" or ")
        )),
    }
    message
}

/// A key without case, `-` and `_`, to suggest what a typo meant.
fn loose(key: &str) -> String {
    key.chars()
        .filter(|c| !matches!(c, '-' | '_'))
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// Percent-decodes one key or value (`+` is a space, as in HTML forms).
fn decode(text: &str) -> Result<String, ApiError> {
    let bad = || {
        ApiError::Invalid(format!(
            "query text `{text}` is not valid percent-encoding of UTF-8: write %XX with two hex \
             digits for each byte"
        ))
    };
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&b, tail)) = rest.split_first() {
        rest = tail;
        match b {
            b'+' => bytes.push(b' '),
            b'%' => {
                let hex = rest.get(..2).ok_or_else(bad)?;
                let hex = std::str::from_utf8(hex).map_err(|_| bad())?;
                bytes.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
                rest = &rest[2..];
            }
            _ => bytes.push(b),
        }
    }
    String::from_utf8(bytes).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(raw: &str, allowed: &[&str]) -> String {
        match Query::parse(Some(raw), allowed) {
            Err(ApiError::Invalid(message)) => message,
            other => panic!("{raw}: {other:?}"),
        }
    }

    const APPLY: &[&str] = &["dry_run", "source"];

    #[test]
    fn booleans_are_true_false_1_or_0_and_nothing_else() {
        for (raw, expected) in [
            ("", false),
            ("dry_run=true", true),
            ("dry_run=1", true),
            ("dry_run", true),
            ("dry_run=false", false),
            ("dry_run=0", false),
            ("source=a.yaml", false),
        ] {
            let query = Query::parse(Some(raw), APPLY).unwrap();
            assert_eq!(query.flag("dry_run").unwrap(), expected, "{raw}");
        }
        for value in ["yes", "TRUE", "True", "on", "", "2"] {
            let query = Query::parse(Some(&format!("dry_run={value}")), APPLY).unwrap();
            let Err(ApiError::Invalid(message)) = query.flag("dry_run") else {
                panic!("dry_run={value} was read as a boolean");
            };
            assert_eq!(
                message,
                format!(
                    "query parameter dry_run={value} is not a boolean: write dry_run=true or \
                     dry_run=false"
                )
            );
        }
    }

    #[test]
    fn unknown_and_repeated_parameters_are_named() {
        assert_eq!(
            refused("dryrun=true", APPLY),
            "unknown query parameter `dryrun` (did you mean `dry_run`?): this endpoint takes \
             `dry_run` or `source`"
        );
        assert_eq!(
            refused("Dry-Run=1&x=2&source=a", APPLY),
            "unknown query parameters `Dry-Run`, `x` (did you mean `dry_run`?): this endpoint \
             takes `dry_run` or `source`"
        );
        assert_eq!(
            refused("history=true", &[]),
            "unknown query parameter `history`: this endpoint takes no query parameters"
        );
        assert_eq!(
            refused("dry_run=true&dry_run=false", APPLY),
            "query parameter `dry_run` is given twice: give it once"
        );
    }

    #[test]
    fn keys_and_values_are_percent_decoded() {
        let query = Query::parse(Some("source=team%2Fa+b%C3%A9.yaml&dry%5Frun=1"), APPLY).unwrap();
        assert_eq!(query.text("source").unwrap(), Some("team/a bé.yaml"));
        assert!(query.flag("dry_run").unwrap());
        assert!(
            Query::parse(None, APPLY)
                .unwrap()
                .text("source")
                .unwrap()
                .is_none()
        );
        for bad in ["source=%", "source=%4", "source=%zz", "source=%ff"] {
            assert!(
                refused(bad, APPLY).contains("is not valid percent-encoding"),
                "{bad}"
            );
        }
        let bare = Query::parse(Some("source"), APPLY).unwrap();
        assert!(bare.text("source").is_err());
    }
}
