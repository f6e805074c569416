//! Service identities: every certificate of a secure cluster comes from one CA, and names its
//! role (`spiffe://z29c/<role>`). Each server accepts only the roles whose work needs it: the
//! gateway, which sends requests to the outside world, executors and recovery and nobody
//! else; the workflow service (gRPC and HTTP) operators, the console and applications; the
//! review service operators and the console. A refused caller gets `PERMISSION_DENIED` naming
//! its role, and nothing it sent reaches the destination.

use anyhow::Result;
use sqlx::PgPool;
use tonic::Code;
use z29c_core::Role;
use z29c_core::identity::ServiceRole;
use z29c_proto::v1::adapter_gateway_client::AdapterGatewayClient;
use z29c_proto::v1::review_service_client::ReviewServiceClient;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, Topology, invoke_request};
use z29c_security::{Bearer, TlsConfig};

/// A secure cluster with recovery and no executor: the test claims a step itself.
async fn cluster() -> Result<(Cluster, PgPool)> {
    let cluster = Cluster::start_with(Topology {
        executors: 0,
        recoveries: 1,
        secure: true,
        ..Topology::default()
    })
    .await?;
    let pool = cluster.db.pool(2).await?;
    Ok((cluster, pool))
}

fn assert_refused<T: std::fmt::Debug>(
    answer: Result<T, tonic::Status>,
    role: ServiceRole,
    what: &str,
) {
    let status = answer.expect_err(what);
    assert_eq!(status.code(), Code::PermissionDenied, "{what}: {status:?}");
    assert!(
        status.message().contains(&format!("names the role {role}")),
        "{what}: {}",
        status.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_executors_and_recovery_reach_the_gateway() -> Result<()> {
    let (cluster, pool) = cluster().await?;
    let gateway = cluster.gateway_urls[0].clone();
    let c = cluster.claimed_by_test(&pool, "roles-1", "ok").await?;
    let own = invoke_request(&c);
    let before = cluster.requests_received().await?;

    // the attempt's own request, from every role that may not send it
    for role in [
        ServiceRole::Operator,
        ServiceRole::Console,
        ServiceRole::Application,
        ServiceRole::Scheduler,
        ServiceRole::Gateway,
    ] {
        let channel = cluster.channel(&gateway, &cluster.role_tls(role)).await?;
        let mut gw = AdapterGatewayClient::new(channel);
        assert_refused(gw.invoke(own.clone()).await, role, "invoke");
        assert_refused(gw.describe(pb::DescribeRequest {}).await, role, "describe");
        assert_refused(
            gw.query(pb::QueryRequest {
                adapter: own.adapter.clone(),
                request_identity: own.request_identity.clone(),
            })
            .await,
            role,
            "query",
        );
    }
    // a certificate claiming the executor's role from another CA does not get a connection
    let security = cluster.security.clone().expect("a secure cluster");
    let forged = TlsConfig {
        ca_file: cluster.operator_tls().ca_file,
        ..security.foreign.tls("executor")
    };
    if let Ok(channel) = cluster.channel(&gateway, &forged).await {
        assert!(
            AdapterGatewayClient::new(channel)
                .invoke(own.clone())
                .await
                .is_err(),
            "a foreign CA's executor was heard"
        );
    }
    assert_eq!(
        cluster.requests_received().await?,
        before,
        "a refused caller's request reached the destination"
    );

    // recovery may ask; the executor's own call goes out, once
    let channel = cluster
        .channel(&gateway, &cluster.role_tls(ServiceRole::Recovery))
        .await?;
    let described = AdapterGatewayClient::new(channel)
        .describe(pb::DescribeRequest {})
        .await?
        .into_inner();
    assert!(!described.gateway_id.is_empty());
    let channel = cluster
        .channel(&gateway, &cluster.role_tls(ServiceRole::Executor))
        .await?;
    let answer = AdapterGatewayClient::new(channel).invoke(own).await?;
    assert!(
        matches!(
            answer.get_ref().outcome,
            Some(pb::invoke_response::Outcome::Succeeded(_))
        ),
        "{answer:?}"
    );
    assert_eq!(cluster.requests_received().await?, before + 1);
    pool.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workflow_and_review_services_accept_people_and_applications_not_services() -> Result<()>
{
    let (cluster, pool) = cluster().await?;
    let token = cluster.token("olga", Role::ALL)?;
    let list = || pb::ListRequest::default();
    let reviews = async |role: ServiceRole| -> Result<_> {
        let channel = cluster
            .channel(&cluster.review_url, &cluster.role_tls(role))
            .await?;
        Ok(
            ReviewServiceClient::with_interceptor(channel, Bearer::new(Some(&token))?)
                .list(pb::ListReviewsRequest::default())
                .await,
        )
    };
    for role in [
        ServiceRole::Executor,
        ServiceRole::Recovery,
        ServiceRole::Gateway,
        ServiceRole::Scheduler,
    ] {
        let mut workflows = cluster
            .client_with(&cluster.role_tls(role), Some(&token))
            .await?;
        assert_refused(workflows.list(list()).await, role, "workflows");
        assert_refused(reviews(role).await?, role, "reviews");
    }
    // an application submits and reads, but does not review
    assert_refused(
        reviews(ServiceRole::Application).await?,
        ServiceRole::Application,
        "reviews",
    );
    for role in [ServiceRole::Operator, ServiceRole::Console] {
        reviews(role).await??;
    }
    for role in [
        ServiceRole::Operator,
        ServiceRole::Console,
        ServiceRole::Application,
    ] {
        let mut workflows = cluster
            .client_with(&cluster.role_tls(role), Some(&token))
            .await?;
        workflows.list(list()).await?;
    }
    // refused at the door: no token was read, so nothing was audited for them
    let audited: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE outcome <> 'allowed'")
            .fetch_one(&pool)
            .await?;
    assert_eq!(audited, 0);
    pool.close().await;
    cluster.stop().await
}
