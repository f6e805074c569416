//! The whole system runs with the database privileges production gives it: every service
//! connects as a login role in `z29c_service` (rows only), as real processes, and a workflow
//! runs to the end with its effects in the destination's records, a crash and recovery
//! included, while no service ever meets a refusal for want of privilege.

use std::time::Duration;

use anyhow::{Context, Result};
use z29c_scenarios::cluster::{Cluster, Topology, chain};

/// Lines of the services' logs where PostgreSQL refused a privilege.
fn privilege_refusals(cluster: &Cluster) -> Vec<String> {
    cluster
        .log_lines()
        .into_iter()
        .filter(|l| l.contains("permission denied") || l.contains("must be owner"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_do_all_their_work_with_rows_only_privileges() -> Result<()> {
    let mut cluster = Cluster::start_with(Topology {
        recoveries: 1,
        least_privilege: true,
        ..Topology::default()
    })
    .await?;
    let owner = cluster.db.pool(2).await?;
    // every service's session is the service role, not the owner
    let users: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT usename::text FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND usename IS NOT NULL",
    )
    .fetch_all(&owner)
    .await?;
    assert!(!users.is_empty());
    assert!(
        users.iter().all(|u| u.starts_with("z29c_svc_")),
        "sessions as {users:?}"
    );

    let mut client = cluster.client().await?;
    let first = client
        .submit(chain("least-1", "ok", 3))
        .await?
        .into_inner()
        .workflow
        .context("workflow")?;
    // an executor crashes mid-work; recovery and a new executor finish it
    let second = client
        .submit(chain("least-2", "ok", 2))
        .await?
        .into_inner()
        .workflow
        .context("workflow")?;
    cluster
        .process("executor-1")
        .context("executor-1")?
        .kill()
        .await?;
    cluster.add_executor().await?;
    cluster
        .wait_all_ended(
            &[first.id.clone(), second.id.clone()],
            Duration::from_secs(90),
        )
        .await?;
    for id in [&first.id, &second.id] {
        assert_eq!(
            cluster.product_state(id).await?,
            z29c_proto::v1::ProductState::Completed,
            "{id}"
        );
    }
    let receipts = z29c_scenarios::count_rows(&owner, "step_receipts").await?;
    assert_eq!(receipts, 5);
    let ledger = cluster.ledger_pool().await?;
    let effects = z29c_scenarios::count_rows(&ledger, "destination.requests").await?;
    ledger.close().await;
    assert!(effects >= 5, "{effects} requests for 5 receipts");
    let refusals = privilege_refusals(&cluster);
    assert!(refusals.is_empty(), "{refusals:#?}");
    owner.close().await;
    cluster.stop().await
}
