//! A trainer's frame body as the stage decodes it: any bytes give a
//! request or an error, never a panic, and a request encodes back to a
//! frame that decodes to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_stage::Request;

fuzz_target!(|body: &[u8]| {
    if let Ok(request) = Request::decode(body) {
        let frame = request.encode();
        // The encoding is a whole frame: a 4-byte length, then the body.
        let again = Request::decode(&frame[4..]).expect("an encoded request decodes");
        assert_eq!(again, request);
    }
});
