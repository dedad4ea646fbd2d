//! Quantities with units: byte sizes (`512MiB`, `1.5GiB`, `100kB`), byte
//! rates (`800MiB/s`) and operation rates (`20k ops/s`).
//!
//! SI prefixes are powers of 1000 and IEC prefixes powers of 1024, and the two
//! are never confused: the ambiguous spellings `K`, `KB` and `Kb` are refused
//! with a message that names both correct ones.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// Why a quantity did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} `{input}`: {reason}")]
pub struct QuantityError {
    kind: &'static str,
    input: String,
    reason: String,
}

impl QuantityError {
    fn new(kind: &'static str, input: &str, reason: impl Into<String>) -> Self {
        Self {
            kind,
            input: input.to_owned(),
            reason: reason.into(),
        }
    }
}

const BYTE_UNITS: &[(&str, u64)] = &[
    ("", 1),
    ("B", 1),
    ("k", 1_000),
    ("kB", 1_000),
    ("M", 1_000_000),
    ("MB", 1_000_000),
    ("G", 1_000_000_000),
    ("GB", 1_000_000_000),
    ("T", 1_000_000_000_000),
    ("TB", 1_000_000_000_000),
    ("Ki", 1 << 10),
    ("KiB", 1 << 10),
    ("Mi", 1 << 20),
    ("MiB", 1 << 20),
    ("Gi", 1 << 30),
    ("GiB", 1 << 30),
    ("Ti", 1 << 40),
    ("TiB", 1 << 40),
];

const COUNT_UNITS: &[(&str, u64)] = &[("", 1), ("k", 1_000), ("M", 1_000_000)];

const BYTE_HELP: &str = "write a number with an optional unit: B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)";

/// Splits `input` into its number and unit, scales the number and checks the
/// result is a whole count that fits in a `u64`.
fn scale(
    kind: &'static str,
    input: &str,
    units: &[(&str, u64)],
    help: &str,
) -> Result<u64, QuantityError> {
    let trimmed = input.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let unit = unit.trim_start();
    if number.is_empty() {
        let reason = if trimmed.starts_with('-') {
            "quantities cannot be negative".to_owned()
        } else {
            format!("it does not start with a number; {help}")
        };
        return Err(QuantityError::new(kind, input, reason));
    }
    if matches!(unit, "K" | "KB" | "Kb" | "kb") {
        let fix = if kind == "operation rate" {
            "`K` is ambiguous: write `k` for 1000 operations, for example `20k ops/s`"
        } else {
            "`K`/`KB` is ambiguous: write `kB` for 1000 bytes or `KiB` for 1024 bytes"
        };
        return Err(QuantityError::new(kind, input, fix));
    }
    let Some(&(_, factor)) = units.iter().find(|(name, _)| *name == unit) else {
        return Err(QuantityError::new(
            kind,
            input,
            format!("unknown unit `{unit}`; {help}"),
        ));
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || fraction.contains('.') || (number.contains('.') && fraction.is_empty()) {
        return Err(QuantityError::new(kind, input, "malformed number"));
    }
    // Exact decimal arithmetic: value = (whole.fraction) * factor, in u128.
    let digits = format!("{whole}{fraction}");
    let mantissa: u128 = digits
        .parse()
        .map_err(|_| QuantityError::new(kind, input, "the number is too large"))?;
    let divisor = 10u128
        .checked_pow(u32::try_from(fraction.len()).unwrap_or(u32::MAX))
        .ok_or_else(|| QuantityError::new(kind, input, "too many decimal places"))?;
    let scaled = mantissa
        .checked_mul(u128::from(factor))
        .ok_or_else(|| QuantityError::new(kind, input, "the number is too large"))?;
    if scaled % divisor != 0 {
        return Err(QuantityError::new(
            kind,
            input,
            format!(
                "it is not a whole number of {}",
                if kind == "operation rate" {
                    "operations"
                } else {
                    "bytes"
                }
            ),
        ));
    }
    u64::try_from(scaled / divisor)
        .map_err(|_| QuantityError::new(kind, input, "the number is too large"))
}

/// Formats `value` with the unit that writes it exactly in the fewest
/// digits, preferring IEC on a tie: `1GiB`, `1500MB`, `1000B`... so that
/// canonical documents stay readable.
fn format_bytes(value: u64, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let digits = |n: u64| n.checked_ilog10().unwrap_or(0);
    let mut best = (value, "B");
    for (unit, factor) in [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("TB", 1_000_000_000_000),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("kB", 1_000),
    ] {
        if value >= factor
            && value.is_multiple_of(factor)
            && digits(value / factor) < digits(best.0)
        {
            best = (value / factor, unit);
        }
    }
    write!(f, "{}{}", best.0, best.1)
}

macro_rules! quantity_type {
    ($name:ident, $kind:literal, $expecting:literal) => {
        quantity_type!($name, $kind, $expecting, |v: u64| Ok::<_, QuantityError>(
            $name(v)
        ));
    };
    // `$number` decides what a bare YAML/JSON number means.
    ($name:ident, $kind:literal, $expecting:literal, $number:expr) => {
        impl FromStr for $name {
            type Err = QuantityError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::parse(s)
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl Visitor<'_> for V {
                    type Value = $name;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str($expecting)
                    }
                    fn visit_u64<E: de::Error>(self, v: u64) -> Result<$name, E> {
                        ($number)(v).map_err(E::custom)
                    }
                    fn visit_i64<E: de::Error>(self, v: i64) -> Result<$name, E> {
                        let v = u64::try_from(v)
                            .map_err(|_| E::custom(concat!($kind, " cannot be negative")))?;
                        self.visit_u64(v)
                    }
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<$name, E> {
                        $name::parse(v).map_err(E::custom)
                    }
                }
                d.deserialize_any(V)
            }
        }
    };
}

/// A number of bytes, written with an SI or IEC unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses `512MiB`, `1.5GiB`, `100kB` or a plain number of bytes.
    pub fn parse(input: &str) -> Result<Self, QuantityError> {
        scale("byte size", input, BYTE_UNITS, BYTE_HELP).map(Self)
    }

    /// Returns the number of bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        format_bytes(self.0, f)
    }
}

quantity_type!(ByteSize, "byte size", "a byte size such as 512MiB");

/// Bytes per second, written as a byte size followed by `/s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteRate(pub u64);

impl ByteRate {
    /// Parses `800MiB/s` or `1.5GB/s`.
    pub fn parse(input: &str) -> Result<Self, QuantityError> {
        let Some(size) = input.trim().strip_suffix("/s") else {
            return Err(QuantityError::new(
                "byte rate",
                input,
                "a rate ends in `/s`, for example `800MiB/s`",
            ));
        };
        scale("byte rate", size, BYTE_UNITS, BYTE_HELP)
            .map(Self)
            .map_err(|e| QuantityError {
                input: input.to_owned(),
                ..e
            })
    }

    /// Returns the rate in bytes per second.
    pub fn bytes_per_second(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ByteRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        format_bytes(self.0, f)?;
        f.write_str("/s")
    }
}

// A bare number is refused: `bandwidth: 800` reads as 800 bytes a second
// to the stage, where whoever wrote it meant MiB/s.
quantity_type!(
    ByteRate,
    "byte rate",
    "a byte rate such as 800MiB/s",
    |v: u64| Err::<ByteRate, _>(QuantityError::new(
        "byte rate",
        &v.to_string(),
        format!("a rate ends in `/s`, for example `{v}MiB/s` (or `{v}/s` for bytes a second)")
    ))
);

/// Operations per second: `20k ops/s`, `2000/s` or a plain number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct OpsRate(pub u64);

impl OpsRate {
    /// Parses `20k ops/s`, `2000 ops/s`, `2000/s` or `2000`.
    pub fn parse(input: &str) -> Result<Self, QuantityError> {
        let trimmed = input.trim();
        let number = trimmed
            .strip_suffix("ops/s")
            .or_else(|| trimmed.strip_suffix("/s"))
            .unwrap_or(trimmed);
        scale(
            "operation rate",
            number.trim_end(),
            COUNT_UNITS,
            "write a count with an optional k (1000) or M (1000000), for example `20k ops/s`",
        )
        .map(Self)
        .map_err(|e| QuantityError {
            input: input.to_owned(),
            ..e
        })
    }

    /// Returns the rate in operations per second.
    pub fn per_second(self) -> u64 {
        self.0
    }
}

impl fmt::Display for OpsRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            v if v >= 1_000_000 && v.is_multiple_of(1_000_000) => {
                write!(f, "{}M ops/s", v / 1_000_000)
            }
            v if v >= 1_000 && v.is_multiple_of(1_000) => write!(f, "{}k ops/s", v / 1_000),
            v => write!(f, "{v} ops/s"),
        }
    }
}

quantity_type!(
    OpsRate,
    "operation rate",
    "an operation rate such as 20k ops/s"
);

/// A duration in whole milliseconds, written `100ms`, `1.5s` or `2s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Millis(pub u64);

impl Millis {
    /// Parses `100ms`, `1.5s` or `2 s`. A bare number is refused: it could
    /// mean either unit.
    pub fn parse(input: &str) -> Result<Self, QuantityError> {
        let trimmed = input.trim();
        let (number, factor) = if let Some(n) = trimmed.strip_suffix("ms") {
            (n, 1)
        } else if let Some(n) = trimmed.strip_suffix('s') {
            (n, 1000)
        } else {
            return Err(QuantityError::new(
                "duration",
                input,
                "write a unit: `ms` or `s`, for example `100ms` or `1.5s`",
            ));
        };
        let units: &[(&str, u64)] = &[("", factor)];
        scale(
            "duration",
            number.trim_end(),
            units,
            "write for example `100ms` or `1.5s`",
        )
        .map(Self)
        .map_err(|e| QuantityError {
            input: input.to_owned(),
            reason: e.reason.replace("bytes", "milliseconds"),
            ..e
        })
    }

    /// Returns the duration.
    pub fn duration(self) -> std::time::Duration {
        std::time::Duration::from_millis(self.0)
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 >= 1000 && self.0.is_multiple_of(1000) {
            write!(f, "{}s", self.0 / 1000)
        } else {
            write!(f, "{}ms", self.0)
        }
    }
}

quantity_type!(
    Millis,
    "duration",
    "a duration such as 100ms or 2s",
    |v: u64| { Millis::parse(&v.to_string()) }
);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes_with_si_and_iec_units() {
        assert_eq!(ByteSize::parse("512MiB").unwrap().0, 512 << 20);
        assert_eq!(ByteSize::parse("1.5GiB").unwrap().0, 3 << 29);
        assert_eq!(ByteSize::parse("100kB").unwrap().0, 100_000);
        assert_eq!(ByteSize::parse("100KiB").unwrap().0, 102_400);
        assert_eq!(ByteSize::parse("2 GB").unwrap().0, 2_000_000_000);
        assert_eq!(ByteSize::parse("4096").unwrap().0, 4096);
        assert_eq!(ByteSize::parse("1Gi").unwrap().0, 1 << 30);
    }

    /// The table the Python parser is tested against too.
    #[test]
    fn the_shared_table_of_byte_sizes() {
        let table = include_str!("byte_size_cases.txt");
        let cases = table
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty());
        let mut n = 0;
        for line in cases {
            let (input, want) = line.rsplit_once('|').expect("input|expected");
            let got = ByteSize::parse(input);
            match want.strip_prefix("error: ") {
                Some(words) => {
                    let err = got.expect_err(input).to_string();
                    assert!(err.contains(words), "{input:?}: {err}");
                }
                None => assert_eq!(
                    got.expect(input).0,
                    want.parse::<u64>().unwrap(),
                    "{input:?}"
                ),
            }
            n += 1;
        }
        assert!(n >= 30, "{n} cases");
    }

    #[test]
    fn rates() {
        assert_eq!(ByteRate::parse("800MiB/s").unwrap().0, 800 << 20);
        assert_eq!(ByteRate::parse("1.5GB/s").unwrap().0, 1_500_000_000);
        assert_eq!(OpsRate::parse("20k ops/s").unwrap().0, 20_000);
        assert_eq!(OpsRate::parse("2000/s").unwrap().0, 2000);
        assert_eq!(OpsRate::parse("2000").unwrap().0, 2000);
    }

    #[test]
    fn refusals_say_what_to_write() {
        let ambiguous = ByteSize::parse("10KB").unwrap_err().to_string();
        assert!(
            ambiguous.contains("`kB`") && ambiguous.contains("`KiB`"),
            "{ambiguous}"
        );
        // An operation rate has no bytes: its hint names what it takes.
        let ops = OpsRate::parse("20K ops/s").unwrap_err().to_string();
        assert!(
            ops.contains("`k`") && !ops.contains("kB") && OpsRate::parse("20k ops/s").is_ok(),
            "{ops}"
        );
        assert!(
            ByteSize::parse("-5MiB")
                .unwrap_err()
                .to_string()
                .contains("negative")
        );
        assert!(
            ByteSize::parse("5 parsecs")
                .unwrap_err()
                .to_string()
                .contains("unknown unit")
        );
        assert!(
            ByteSize::parse("0.5B")
                .unwrap_err()
                .to_string()
                .contains("whole number")
        );
        assert!(ByteSize::parse("1.2.3MiB").is_err());
        assert!(ByteSize::parse("").is_err());
        assert!(
            ByteSize::parse("99999999999TiB")
                .unwrap_err()
                .to_string()
                .contains("too large")
        );
        assert!(
            ByteRate::parse("800MiB")
                .unwrap_err()
                .to_string()
                .contains("/s")
        );
    }

    #[test]
    fn durations() {
        assert_eq!(Millis::parse("100ms").unwrap().0, 100);
        assert_eq!(Millis::parse("1.5s").unwrap().0, 1500);
        assert_eq!(Millis::parse("2 s").unwrap().0, 2000);
        assert!(
            Millis::parse("100")
                .unwrap_err()
                .to_string()
                .contains("write a unit")
        );
        assert!(
            Millis::parse("0.5ms")
                .unwrap_err()
                .to_string()
                .contains("whole number of milliseconds")
        );
        assert_eq!(Millis(2000).to_string(), "2s");
        assert_eq!(Millis(1500).to_string(), "1500ms");
    }

    #[test]
    fn display_prefers_the_shortest_exact_unit() {
        assert_eq!(ByteSize(1 << 30).to_string(), "1GiB");
        assert_eq!(ByteSize(1_500_000_000).to_string(), "1500MB");
        assert_eq!(ByteSize(1000).to_string(), "1kB");
        assert_eq!(ByteSize(1024).to_string(), "1KiB");
        assert_eq!(ByteSize(1234).to_string(), "1234B");
        assert_eq!(ByteSize(0).to_string(), "0B");
        assert_eq!(ByteRate(3 << 29).to_string(), "1536MiB/s");
        assert_eq!(OpsRate(20_000).to_string(), "20k ops/s");
        assert_eq!(OpsRate(2_000_000).to_string(), "2M ops/s");
        assert_eq!(OpsRate(1_500).to_string(), "1500 ops/s");
    }

    proptest! {
        #[test]
        fn display_round_trips(v in any::<u64>()) {
            prop_assert_eq!(Millis::parse(&Millis(v).to_string()).unwrap(), Millis(v));
            let size = ByteSize(v);
            prop_assert_eq!(ByteSize::parse(&size.to_string()).unwrap(), size);
            let rate = ByteRate(v);
            prop_assert_eq!(ByteRate::parse(&rate.to_string()).unwrap(), rate);
            prop_assert_eq!(OpsRate::parse(&OpsRate(v).to_string()).unwrap(), OpsRate(v));
        }

        #[test]
        fn iec_and_si_scale_exactly(n in 0u64..1_000_000) {
            prop_assert_eq!(ByteSize::parse(&format!("{n}MiB")).unwrap().0, n << 20);
            prop_assert_eq!(ByteSize::parse(&format!("{n}MB")).unwrap().0, n * 1_000_000);
        }

        #[test]
        fn arbitrary_text_never_panics(s in ".{0,24}") {
            let _ = ByteSize::parse(&s);
            let _ = ByteRate::parse(&s);
            let _ = OpsRate::parse(&s);
        }
    }
}
