//! An entry point for the coverage-guided fuzzer (`fuzz/`, built with
//! `--cfg fuzzing`; absent from every other build): what the controller
//! does with the messages of a stage session, without a store or a network.

use std::collections::BTreeMap;
use std::time::Instant;

use sluice_policy::PolicySet;
use sluice_policy::coordination::{Coordinator, StageReport};
use sluice_proto::v1::{StageMessage, stage_message};

use crate::control::reports;
use crate::sessions::{from_proto, share_labels, to_proto};
use crate::state::{HelloInfo, LiveStage};

/// Digests one stage's session messages as the controller does (the hello,
/// every telemetry report into the stage's windows, acks), decides the
/// allocations over that stage under `policies` after every message, and
/// encodes the settings it would push. Panics on what no stage may cause:
/// a job pushed above its policy's limit (`limit`, bytes per second), or
/// a pool handing out more than its capacity (or a rate that is not a
/// number).
pub fn session(messages: Vec<StageMessage>, policies: &PolicySet, limit: u64) {
    let mut live = LiveStage::new(Instant::now());
    let mut coordinator = Coordinator::default();
    for message in messages {
        match message.kind {
            Some(stage_message::Kind::Hello(hello)) => {
                live.running_version = hello.settings_version;
                live.hello = HelloInfo::from(hello);
            }
            Some(stage_message::Kind::Telemetry(t)) => {
                let mut snapshot = from_proto(t);
                share_labels(&mut snapshot, live.latest());
                live.record(snapshot);
            }
            Some(stage_message::Kind::Ack(a)) => {
                live.acked(a.version);
            }
            Some(stage_message::Kind::Nack(_)) | None => {}
        }
        let stages = BTreeMap::from([("fuzz".to_owned(), live)]);
        let (reports, _) = reports(&stages);
        let views: Vec<StageReport<'_>> = reports.iter().map(|r| r.view()).collect();
        let decision = coordinator.decide(policies, &views);
        for (stage, assignment) in &decision.assignments {
            for (job, settings) in &assignment.jobs {
                if let Some(rate) = settings.bytes_per_second {
                    assert!(
                        rate <= limit,
                        "{stage}: job {job} pushed {rate} B/s over its limit"
                    );
                }
            }
            let _ = to_proto(1, assignment);
        }
        for (pool, share) in &decision.shares.pools {
            let (given, capacity) = (
                share.allocated_bytes_per_second,
                share.capacity_bytes_per_second,
            );
            assert!(
                given.is_finite() && given >= 0.0 && given <= capacity * 1.000_001,
                "pool {pool} handed out {given} of {capacity} B/s"
            );
        }
        live = stages.into_values().next().expect("the one stage");
    }
}
