//! The gRPC health protocol on every service with a gRPC server: `SERVING` while PostgreSQL
//! and NATS are reachable, `NOT_SERVING` while NATS is down, `SERVING` again once it is back.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use z29c_scenarios::cluster::{Cluster, Topology};
use z29c_scenarios::infra::PrivateNats;

async fn status(url: &str, service: &str) -> ServingStatus {
    let Ok(channel) = tonic::transport::Endpoint::from_shared(url.to_owned()) else {
        return ServingStatus::Unknown;
    };
    let Ok(channel) = channel.connect().await else {
        return ServingStatus::Unknown;
    };
    let mut c = HealthClient::new(channel);
    match c
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
    {
        Ok(r) => r.into_inner().status(),
        Err(_) => ServingStatus::Unknown,
    }
}

async fn wait_all(targets: &[(&str, &str)], want: ServingStatus) -> Result<()> {
    let start = Instant::now();
    loop {
        let mut wrong = Vec::new();
        for (url, service) in targets {
            let s = status(url, service).await;
            if s != want {
                wrong.push(format!("{service} at {url}: {s:?}"));
            }
        }
        if wrong.is_empty() {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("not {want:?}: {wrong:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_nats_and_every_service_speaks_grpc_health() -> Result<()> {
    let mut nats = PrivateNats::start().await?;
    let mut cluster = Cluster::start_with(Topology {
        recoveries: 1,
        nats_url: Some(nats.url()),
        ..Topology::default()
    })
    .await?;
    // the executor has no API of its own: it serves only the health protocol
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    cluster
        .add_executor_with(&[("Z29C_HEALTH_LISTEN", &format!("127.0.0.1:{port}"))])
        .await?;
    let executor = format!("http://127.0.0.1:{port}");
    let gateway = cluster.gateway_urls[0].clone();
    let targets = [
        (cluster.scheduler_url.as_str(), ""),
        (cluster.scheduler_url.as_str(), "z29c.v1.WorkflowService"),
        (gateway.as_str(), "z29c.v1.AdapterGateway"),
        (cluster.review_url.as_str(), "z29c.v1.ReviewService"),
        (executor.as_str(), ""),
        (executor.as_str(), "z29c.v1.Executor"),
    ];
    wait_all(&targets, ServingStatus::Serving).await?;
    nats.crash_and_restart_after(|| async { wait_all(&targets, ServingStatus::NotServing).await })
        .await?;
    wait_all(&targets, ServingStatus::Serving).await?;
    cluster.stop().await?;
    nats.stop().await;
    Ok(())
}
