//! Numbers as operators read them in tables and descriptions: rates in
//! IEC units (the policy language's `800MiB/s`), fractions in percent,
//! times as ages. Machine output (`-o json`) never goes through here.

/// IEC units, each 1024 times the one before.
const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

/// Returns a byte count as `512 B`, `1.5 GiB`: three significant digits.
pub fn bytes(value: f64) -> String {
    if !value.is_finite() || value < 0.0 {
        return "-".to_owned();
    }
    let mut value = value;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        return format!("{value:.0} B");
    }
    let digits = if value >= 100.0 {
        0
    } else if value >= 10.0 {
        1
    } else {
        2
    };
    format!("{value:.digits$} {}", UNITS[unit])
}

/// Returns a rate as `800 MiB/s`.
pub fn rate(bytes_per_second: f64) -> String {
    format!("{}/s", bytes(bytes_per_second))
}

/// Returns an optional rate; unset reads `unlimited`.
pub fn limit(bytes_per_second: Option<u64>) -> String {
    bytes_per_second.map_or_else(|| "unlimited".to_owned(), |b| rate(b as f64))
}

/// Returns an optional operation rate as `20000 ops/s`; unset reads
/// `unlimited`.
pub fn ops_limit(ops_per_second: Option<u64>) -> String {
    ops_per_second.map_or_else(|| "unlimited".to_owned(), |o| format!("{o} ops/s"))
}

/// Returns a fraction (0 to 1) as `3.2%`.
pub fn percent(fraction: f64) -> String {
    if !fraction.is_finite() {
        return "-".to_owned();
    }
    format!("{:.1}%", fraction * 100.0)
}

/// Returns how long ago `then` was, both in milliseconds since the Unix
/// epoch, as `4s`, `12m`, `3h`, `2d`; `-` when unknown (0).
pub fn age(then_millis: i64, now_millis: i64) -> String {
    if then_millis <= 0 {
        return "-".to_owned();
    }
    let seconds = (now_millis - then_millis).max(0) / 1000;
    match seconds {
        s if s < 120 => format!("{s}s"),
        s if s < 120 * 60 => format!("{}m", s / 60),
        s if s < 48 * 3600 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// Returns the current time in milliseconds since the Unix epoch.
pub fn now_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Returns `key=value` pairs joined by commas; `-` when there are none.
pub fn labels<'a>(labels: impl IntoIterator<Item = (&'a String, &'a String)>) -> String {
    let text: Vec<String> = labels
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if text.is_empty() {
        "-".to_owned()
    } else {
        text.join(",")
    }
}

/// Returns `-` for an empty string, the string otherwise.
pub fn or_dash(text: &str) -> String {
    if text.is_empty() { "-" } else { text }.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_use_iec_units_and_three_digits() {
        assert_eq!(bytes(0.0), "0 B");
        assert_eq!(bytes(1023.0), "1023 B");
        assert_eq!(bytes(1536.0), "1.50 KiB");
        assert_eq!(rate(800.0 * 1024.0 * 1024.0), "800 MiB/s");
        assert_eq!(rate(1.5 * 1024.0 * 1024.0 * 1024.0), "1.50 GiB/s");
        assert_eq!(rate(12.25 * 1024.0 * 1024.0), "12.2 MiB/s");
        assert_eq!(limit(None), "unlimited");
        assert_eq!(ops_limit(Some(20_000)), "20000 ops/s");
    }

    #[test]
    fn percents_and_ages() {
        assert_eq!(percent(0.032), "3.2%");
        assert_eq!(percent(1.0), "100.0%");
        assert_eq!(age(0, 5_000), "-");
        assert_eq!(age(1_000, 5_000), "4s");
        assert_eq!(age(1, 1 + 3 * 3600 * 1000), "3h");
    }
}
