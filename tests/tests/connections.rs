//! More services than the server has connections for: a PostgreSQL of 30 connections under
//! six executors whose pools could ask for far more, one of them alone for more than all. Each service says so at start, naming the
//! numbers; work slows (calls wait for a connection, some are refused and tried again), and
//! nothing is lost: every step ends with one receipt and one effect in the destination's
//! records.

use std::time::Duration;

use anyhow::Result;
use z29c_scenarios::cluster::{Cluster, Topology, chain};
use z29c_scenarios::infra::PrivatePostgres;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_executors_than_the_server_can_serve_slow_down_and_lose_nothing() -> Result<()> {
    let pg = PrivatePostgres::start_with(&["fsync=off", "max_connections=30"]).await?;
    let mut cluster = Cluster::start_with(Topology {
        executors: 5,
        recoveries: 1,
        postgres_admin_url: Some(pg.admin_url()),
        // as in production: the services are no superusers, so the slots PostgreSQL keeps
        // for superusers stay free for this test's own look at the tables
        least_privilege: true,
        ..Topology::default()
    })
    .await?;
    // one executor's pool alone is larger than the server
    cluster
        .add_executor_with(&[("Z29C_MAX_CONNECTIONS", "40")])
        .await?;
    let mut client = cluster.client().await?;
    let mut ids = Vec::new();
    for i in 0..30 {
        let wf = client
            .submit(chain(&format!("crowded-{i}"), "ok", 2))
            .await?
            .into_inner()
            .workflow
            .expect("workflow");
        ids.push(wf.id);
    }
    cluster
        .wait_all_ended(&ids, Duration::from_secs(240))
        .await?;
    for id in &ids {
        assert_eq!(
            cluster.product_state(id).await?,
            z29c_proto::v1::ProductState::Completed,
            "{id}"
        );
    }
    let pool = cluster.db.pool(1).await?;
    let receipts = z29c_scenarios::count_rows(&pool, "step_receipts").await?;
    assert_eq!(receipts, 60, "one receipt per step");
    pool.close().await;
    let ledger = cluster.ledger_pool().await?;
    let effects = z29c_scenarios::count_rows(&ledger, "destination.ledger").await?;
    ledger.close().await;
    assert_eq!(effects, 60, "one effect per step at the destination");
    // the executor whose pool cannot fit said so at start, naming the numbers
    let warned: Vec<String> = cluster
        .log_lines()
        .into_iter()
        .filter(|l| l.starts_with("executor-6") && l.contains("may open 40 connections"))
        .collect();
    assert_eq!(warned.len(), 1, "{warned:#?}");
    assert!(warned[0].contains("max_connections 30"), "{}", warned[0]);
    cluster.stop().await?;
    pg.stop().await;
    Ok(())
}
