//! `spec.prefetch`: reader and buffer bounds, with defaults that never
//! contradict what the operator wrote.

use std::fmt::Display;

use super::{Check, MAX_READERS, invalid, ranged};
use crate::ByteSize;
use crate::document::{RawBounds, RawPrefetch};
use crate::error::ErrorKind;
use crate::model::{BufferBounds, Prefetch, ReaderBounds};

/// Default reader bounds, as the stage's.
const DEFAULT_READERS: (u32, u32) = (1, 64);
/// Default smallest buffer, as the stage's.
const DEFAULT_MIN_BUFFER: ByteSize = ByteSize(4 << 20);

pub(super) fn prefetch(check: &mut Check, raw: RawPrefetch) -> Option<Prefetch> {
    let errors_before = check.errors.len();
    let mut reader = |field: &str, v: Option<i64>| {
        let path = format!("spec.prefetch.readers.{field}");
        v.and_then(|v| {
            ranged(
                check,
                &path,
                v,
                1,
                i64::from(MAX_READERS),
                "readers are threads per job on each stage that read ahead of the trainer",
            )
        })
        .and_then(|v| u32::try_from(v).ok())
    };
    let readers = RawBounds {
        min: reader("min", raw.readers.min),
        max: reader("max", raw.readers.max),
        initial: reader("initial", raw.readers.initial),
    };
    let buffer = raw.buffer;
    for (field, v) in [
        ("min", buffer.min),
        ("max", buffer.max),
        ("initial", buffer.initial),
    ] {
        if v.is_some_and(|v| v.0 == 0) {
            let path = format!("spec.prefetch.buffer.{field}");
            check.push(
                &path,
                invalid(
                    &path,
                    "a buffer of 0B holds no sample: write a size such as `64MiB`",
                ),
            );
        }
    }
    if check.errors.len() > errors_before {
        return None;
    }
    let (min, max) = fill(&readers, DEFAULT_READERS.0, Some(DEFAULT_READERS.1));
    let max = max.unwrap_or(DEFAULT_READERS.1);
    check_order(check, "spec.prefetch.readers", readers.min, readers.max);
    check_initial(
        check,
        "spec.prefetch.readers",
        readers.initial,
        min,
        Some(max),
    );
    let readers = ReaderBounds {
        min,
        max,
        initial: readers.initial,
    };
    let (min, max) = fill(&buffer, DEFAULT_MIN_BUFFER, None);
    check_order(check, "spec.prefetch.buffer", buffer.min, buffer.max);
    check_initial(check, "spec.prefetch.buffer", buffer.initial, min, max);
    let buffer = BufferBounds {
        min,
        max,
        initial: buffer.initial,
    };
    (check.errors.len() == errors_before).then_some(Prefetch {
        tuner: raw.tuner.unwrap_or(true),
        readers,
        buffer,
    })
}

/// Fills in omitted bounds: an omitted `min` takes its default, lowered to
/// a written `max` or `initial` below it; an omitted `max` takes its
/// default (if any), raised to `min` or `initial` above it. So defaults
/// never contradict what the operator wrote.
fn fill<T: Ord + Copy>(
    raw: &RawBounds<T>,
    default_min: T,
    default_max: Option<T>,
) -> (T, Option<T>) {
    let min = raw.min.unwrap_or_else(|| {
        [raw.max, raw.initial]
            .into_iter()
            .flatten()
            .fold(default_min, Ord::min)
    });
    let max = raw.max.or_else(|| {
        default_max.map(|d| {
            [Some(min), raw.initial]
                .into_iter()
                .flatten()
                .fold(d, Ord::max)
        })
    });
    (min, max)
}

fn check_order<T: PartialOrd + Display>(
    check: &mut Check,
    path: &str,
    min: Option<T>,
    max: Option<T>,
) {
    if let (Some(min), Some(max)) = (min, max)
        && min > max
    {
        check.push(
            &format!("{path}.min"),
            ErrorKind::MinAboveMax {
                path: path.into(),
                min: min.to_string(),
                max: max.to_string(),
            },
        );
    }
}

fn check_initial<T: PartialOrd + Display + Copy>(
    check: &mut Check,
    path: &str,
    initial: Option<T>,
    min: T,
    max: Option<T>,
) {
    let Some(initial) = initial else { return };
    if initial < min || max.is_some_and(|m| initial > m) {
        check.push(
            &format!("{path}.initial"),
            ErrorKind::InitialOutsideBounds {
                path: path.into(),
                initial: initial.to_string(),
                min: min.to_string(),
                max: max.map_or_else(|| "the stage's budget".to_owned(), |m| m.to_string()),
            },
        );
    }
}
