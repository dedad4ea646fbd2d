//! The binaries' log filter, from `SLUICE_LOG`, checked before it is
//! used: the filter takes a bare word it does not know as the name of a
//! module to log, so a misspelt level (`warning`, `inf`) or an empty value
//! turned every log line off, warnings and errors too, and nothing said so.

use tracing_subscriber::EnvFilter;

/// The log filter `SLUICE_LOG` gives, or `default` when it is not set;
/// the error says what to write instead.
pub fn from_env(default: &str) -> Result<EnvFilter, String> {
    match std::env::var("SLUICE_LOG") {
        Ok(value) => check_log_filter(&value)
            .and_then(|()| EnvFilter::try_new(&value).map_err(|e| e.to_string())),
        Err(_) => Ok(EnvFilter::new(default)),
    }
}

/// The levels a directive may name, and their numbers (0, off, to 5,
/// trace), which the filter takes too.
const LEVELS: [&str; 12] = [
    "off", "error", "warn", "info", "debug", "trace", "0", "1", "2", "3", "4", "5",
];

/// Checks a log filter: comma-separated directives, each a level or
/// `TARGET=LEVEL` (a bare target with `::`, or a span filter in `[...]`,
/// is taken as it is). The error says what to write.
pub fn check_log_filter(filter: &str) -> Result<(), String> {
    let refuse = |what: String| {
        Err(format!(
            "{what}: write a level (off, error, warn, info, debug or trace, or 0 to 5), or directives such as `info,TARGET=debug`"
        ))
    };
    if filter.trim().is_empty() {
        return refuse("it is empty".to_owned());
    }
    for directive in filter.split(',').map(str::trim) {
        let level = match directive.rsplit_once('=') {
            // `target[span{field=value}]` names no level after its `]`.
            Some((_, after)) if after.contains(']') => continue,
            Some((_, level)) => level,
            None if directive.contains("::") || directive.contains('[') => continue,
            None => directive,
        };
        if !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(level)) {
            return refuse(if directive.is_empty() {
                "it has an empty directive".to_owned()
            } else {
                format!("`{level}` is not a log level")
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_directives_pass_and_misspelt_levels_are_refused() {
        for good in [
            "info",
            "3",
            "info,sluice_stage=5",
            "WARN",
            "info,object_store=warn",
            "sluice_stage::mount=debug, info",
            "h2[conn]",
            "sluice_stage[read{job=a}]=trace",
        ] {
            assert_eq!(check_log_filter(good), Ok(()), "{good}");
        }
        for (bad, says) in [
            ("warning", "`warning` is not a log level"),
            ("inf", "`inf` is not a log level"),
            ("", "it is empty"),
            ("info,", "it has an empty directive"),
            ("sluice_stage=verbose", "`verbose` is not a log level"),
            ("6", "`6` is not a log level"),
        ] {
            let e = check_log_filter(bad).unwrap_err();
            assert!(
                e.starts_with(says) && e.contains("write a level"),
                "{bad}: {e}"
            );
        }
    }
}
