//! A `sluicectl simulate` scenario file: parsed with positioned errors.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_policy::simulation::Scenario;

fuzz_target!(|text: &[u8]| {
    let text = String::from_utf8_lossy(text);
    if let Err(errors) = Scenario::parse("fuzz.yaml", &text) {
        assert!(!errors.to_string().is_empty());
    }
});
