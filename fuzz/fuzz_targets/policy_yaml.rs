//! A policy file as `sluicectl apply` and the controller read it: parsed
//! with positioned errors, then validated against an empty policy set.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_policy::{PolicySet, parse_documents};

fuzz_target!(|text: &[u8]| {
    let text = String::from_utf8_lossy(text);
    match parse_documents("fuzz.yaml", &text) {
        Ok(documents) => {
            let _ = PolicySet::new().apply(documents);
        }
        Err(errors) => assert!(!errors.to_string().is_empty()),
    }
});
