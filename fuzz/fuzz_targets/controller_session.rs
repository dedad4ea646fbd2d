//! A stage session as the controller digests it: any sequence of messages
//! (each a 2-byte length, then that many bytes of protobuf) a stage could
//! send, through the telemetry windows, the demand estimate and the
//! allocation, must neither panic nor push a job past its limit or a pool
//! past its capacity.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use prost::Message;
use sluice_policy::{PolicySet, parse_documents};
use sluice_proto::v1::{StageMessage, stage_message};

const POLICIES: &str = "
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: shared}
spec: {capacity: {bandwidth: 1GB/s}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: vision}
spec:
  selector: {matchLabels: {team: vision}}
  pool: shared
  limit: {bandwidth: 100MB/s}
";
const LIMIT: u64 = 100_000_000;

fn policies() -> &'static PolicySet {
    static SET: OnceLock<PolicySet> = OnceLock::new();
    SET.get_or_init(|| {
        let documents = parse_documents("fuzz.yaml", POLICIES).expect("the fixed policies parse");
        PolicySet::new()
            .apply(documents)
            .expect("the fixed policies apply")
            .0
    })
}

fuzz_target!(|data: &[u8]| {
    let mut messages = Vec::new();
    let mut rest = data;
    while let [a, b, tail @ ..] = rest {
        let len = usize::from(u16::from_be_bytes([*a, *b])).min(tail.len());
        let (body, after) = tail.split_at(len);
        rest = after;
        let Ok(mut message) = StageMessage::decode(body) else {
            continue;
        };
        // Half the jobs (by their name's first byte) carry the labels the
        // policy selects, so the allocation runs without the fuzzer having
        // to guess them.
        if let Some(stage_message::Kind::Telemetry(t)) = &mut message.kind {
            for job in &mut t.jobs {
                if job.job.as_bytes().first().is_some_and(|b| b % 2 == 0) {
                    job.labels.insert("team".into(), "vision".into());
                }
            }
        }
        messages.push(message);
        if messages.len() == 64 {
            break;
        }
    }
    sluice_controller::fuzzing::session(messages, policies(), LIMIT);
});
