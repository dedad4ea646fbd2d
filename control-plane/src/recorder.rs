//! Group commit of what stage sessions report: acks, sightings of stages
//! and jobs, and events. Thousands of stages each report every second; one
//! transaction per report would cost a flush to disk each (SQLite runs
//! with `synchronous=FULL`, Postgres commits durably) and queue every
//! session behind the store. The recorder takes writes from any task,
//! and one task commits whatever is queued in one transaction: a write
//! that arrives while the store is idle is committed at once, and under
//! load the batches grow instead of the queue.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use crate::store::{Record, Store, StoreError};

/// Most writes committed in one transaction.
const MAX_BATCH: usize = 4096;

/// The outcome of one write: its own, or the batch's failure (shared by
/// every write of the batch).
pub type Outcome = Result<u64, Arc<StoreError>>;

#[derive(Debug)]
struct Pending {
    write: Record,
    done: Option<oneshot::Sender<Outcome>>,
}

/// The queue into the committing task; cloning it is cheap.
#[derive(Debug, Clone)]
pub struct Recorder {
    queue: mpsc::UnboundedSender<Pending>,
}

impl Recorder {
    /// Starts the committing task on the current runtime; it ends once
    /// every clone of the recorder is dropped and the queue is drained.
    pub fn start(store: Store) -> Self {
        let (queue, rx) = mpsc::unbounded_channel();
        tokio::spawn(commit(store, rx));
        Self { queue }
    }

    /// Queues a write without waiting for it; a failure is logged.
    pub fn send(&self, write: Record) {
        let _ = self.queue.send(Pending { write, done: None });
    }

    /// Queues a write and returns its outcome once committed.
    pub async fn write(&self, write: Record) -> Outcome {
        let (done, outcome) = oneshot::channel();
        let pending = Pending {
            write,
            done: Some(done),
        };
        if self.queue.send(pending).is_err() {
            return Err(closed());
        }
        outcome.await.unwrap_or_else(|_| Err(closed()))
    }
}

/// What a write gets once the committing task is gone (the controller is
/// stopping).
fn closed() -> Arc<StoreError> {
    Arc::new(StoreError::Database {
        op: "recording",
        source: sqlx::Error::PoolClosed,
    })
}

async fn commit(store: Store, mut queue: mpsc::UnboundedReceiver<Pending>) {
    let mut batch = Vec::new();
    while queue.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let (writes, waiters): (Vec<Record>, Vec<_>) =
            batch.drain(..).map(|p| (p.write, p.done)).unzip();
        match store.record(&writes).await {
            Ok(outcomes) => {
                for (waiter, outcome) in waiters.into_iter().zip(outcomes) {
                    match (waiter, outcome) {
                        (Some(done), outcome) => {
                            let _ = done.send(outcome.map_err(Arc::new));
                        }
                        (None, Err(e)) => warn!(error = %e, "cannot record"),
                        (None, Ok(_)) => {}
                    }
                }
            }
            Err(e) => {
                let e = Arc::new(e);
                warn!(error = %e, writes = writes.len(), "cannot record a batch");
                for done in waiters.into_iter().flatten() {
                    let _ = done.send(Err(e.clone()));
                }
            }
        }
    }
}
