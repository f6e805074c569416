//! Vacuuming z29c's tables where the server's autovacuum will not
//! ([`z29c_core::maintenance`]).

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use z29c_store::Store;

/// Every `every`, vacuums the tables that no autovacuum visits and whose dead rows are past
/// autovacuum's own threshold for them. Where autovacuum runs, a round is one read of the
/// statistics. Scheduler replicas take turns on a lock.
pub async fn vacuum_neglected(store: Store, every: Duration, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        // a vacuum half-way when shutdown comes is dropped: its connection closes with it
        let round = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = store.vacuum_neglected() => r,
        };
        match round {
            Ok(Some(done)) => {
                for v in done {
                    tracing::info!(table = %v.table, dead_rows = v.dead, took_ms = v.took.as_millis() as u64,
                        "vacuumed a table no autovacuum visits");
                }
            }
            Ok(None) => tracing::debug!("another scheduler is vacuuming"),
            Err(e) => tracing::warn!(error = %e, "vacuum round failed; trying again next round"),
        }
    }
}
