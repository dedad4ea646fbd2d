//! Quantities with units (sizes, rates, operations, durations), as every
//! flag and policy field parses them: a value that parses prints as text
//! that parses back to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_policy::{ByteRate, ByteSize, Millis, OpsRate};

fuzz_target!(|text: &[u8]| {
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    if let Ok(v) = ByteSize::parse(text) {
        assert_eq!(ByteSize::parse(&v.to_string()).ok(), Some(v), "{text:?}");
    }
    if let Ok(v) = ByteRate::parse(text) {
        assert_eq!(ByteRate::parse(&v.to_string()).ok(), Some(v), "{text:?}");
    }
    if let Ok(v) = OpsRate::parse(text) {
        assert_eq!(OpsRate::parse(&v.to_string()).ok(), Some(v), "{text:?}");
    }
    if let Ok(v) = Millis::parse(text) {
        assert_eq!(Millis::parse(&v.to_string()).ok(), Some(v), "{text:?}");
    }
});
