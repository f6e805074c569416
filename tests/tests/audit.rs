//! The record of an operator's change survives the service that made it, as real processes: a
//! submission, a cancel and a resolution each write their audit row in their own transaction,
//! so it is there when the service is killed (SIGKILL) right after answering.
//!
//! Every process runs with the writer of the queued audit rows stalled
//! (`Z29C_FAULT_AUDIT_STALL_MS`, a fault switch of the store's `faults` build): whatever goes
//! through the queue is still unwritten when the service dies, every time, instead of usually
//! written within a millisecond of being queued. A refusal, which is queued, is the control:
//! it must be missing, or the kill did not come before the queue's write and the test proves
//! nothing.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::json;
use sqlx::PgPool;
use tonic::Code;
use z29c_core::Role;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, chain, flaky_workflow};

/// Long past the test's end: a queued row is never written before its service is killed.
const QUEUED_WRITES_STALLED: (&str, &str) = ("Z29C_FAULT_AUDIT_STALL_MS", "600000");

/// The audit log as it is now, oldest first: method, outcome, subject.
async fn audit_rows(pool: &PgPool) -> Result<Vec<(String, String, Option<String>)>> {
    Ok(
        sqlx::query_as("SELECT method, outcome, subject FROM audit_log ORDER BY id")
            .fetch_all(pool)
            .await?,
    )
}

fn allowed(method: &str, subject: &str) -> (String, String, Option<String>) {
    (method.into(), "allowed".into(), Some(subject.into()))
}

async fn kill(cluster: &mut Cluster, name: &str) -> Result<()> {
    cluster
        .process(name)
        .with_context(|| format!("no process {name}"))?
        .kill()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_change_is_on_record_even_when_its_service_is_killed_right_after_answering()
-> Result<()> {
    let (mut cluster, pool) = Cluster::start_secure("opaque", &[QUEUED_WRITES_STALLED]).await?;
    cluster
        .set_faults("flaky", json!({ "drop_response": true }))
        .await?;
    // the step to cancel stays in flight at the destination: its workflow is running
    cluster.set_faults("held", json!({ "hold": true })).await?;
    let tls = cluster.operator_tls();
    let olga = cluster.token("olga", &[Role::Operator])?;
    let vic = cluster.token("vic", &[Role::Viewer])?;
    let rita = cluster.token("rita", &[Role::Resolver])?;

    let refused = cluster
        .client_with(&tls, Some(&vic))
        .await?
        .submit(chain("audit-refused", "ok", 1))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    let review = cluster
        .client_with(&tls, Some(&olga))
        .await?
        .submit(flaky_workflow("audit-review"))
        .await?
        .into_inner()
        .workflow
        .context("submitted workflow")?
        .id;
    kill(&mut cluster, "scheduler").await?;
    assert_eq!(
        audit_rows(&pool).await?,
        [allowed("Submit", "olga")],
        "the submission's row committed with its workflow; the refusal queued before it was \
         lost with the process (if it is here, the z29c binary lacks the faults build: \
         cargo build --workspace --all-targets)"
    );

    cluster.restart("scheduler", &[]).await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&review), Duration::from_secs(60))
        .await?;
    let mut client = cluster.client_with(&tls, Some(&olga)).await?;
    let held = client
        .submit(chain("audit-cancel", "held", 1))
        .await?
        .into_inner()
        .workflow
        .context("submitted workflow")?
        .id;
    let cancelled = client
        .cancel(pb::CancelRequest {
            workflow_id: held,
            reason: "operator asked".into(),
        })
        .await?
        .into_inner();
    assert_eq!(cancelled.state(), pb::ProductState::Cancelled);
    kill(&mut cluster, "scheduler").await?;
    assert_eq!(
        audit_rows(&pool).await?,
        [
            allowed("Submit", "olga"),
            allowed("Submit", "olga"),
            allowed("Cancel", "olga"),
        ]
    );

    let items = cluster
        .reviews(Some(&rita))
        .await?
        .list(pb::ListReviewsRequest::default())
        .await?
        .into_inner()
        .items;
    assert_eq!(items.len(), 1, "the unknown outcome waits for a person");
    let resolved = cluster
        .reviews(Some(&rita))
        .await?
        .resolve(pb::ResolveRequest {
            item_id: items[0].id.clone(),
            expected_version: items[0].version,
            reason: "checked the destination: nothing there".into(),
            resolution: Some(pb::resolve_request::Resolution::Failed(true)),
            result_json: String::new(),
        })
        .await?
        .into_inner();
    assert_eq!(resolved.state, "resolved");
    kill(&mut cluster, "recovery-1").await?;
    assert_eq!(
        audit_rows(&pool).await?,
        [
            allowed("Submit", "olga"),
            allowed("Submit", "olga"),
            allowed("Cancel", "olga"),
            allowed("Resolve", "rita"),
        ]
    );
    pool.close().await;
    cluster.stop().await
}
