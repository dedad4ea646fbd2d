//! A message on a stage session as the controller receives it off the
//! wire (protobuf): any bytes decode to a message or an error, and a
//! message encodes back to bytes that decode to the same message (compared
//! encoded: a NaN a stage sends is not equal to itself).
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use sluice_proto::v1::StageMessage;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(message) = StageMessage::decode(bytes) {
        let encoded = message.encode_to_vec();
        let again = StageMessage::decode(encoded.as_slice()).expect("an encoded message decodes");
        assert_eq!(again.encode_to_vec(), encoded);
    }
});
