//! The client library (`z29c-client`) against a running deployment: an order of three steps,
//! each using what the one before it produced, submitted as a workflow file's document and
//! awaited to its end while a watcher follows it; workflows no executor has started yet,
//! listed by state, by client key and page by page, one of them cancelled; and the errors a
//! caller sees, with their gRPC codes and the server's words.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use tokio_stream::StreamExt;
use z29c_client::{Access, Client, End, ListFilter, pb};
use z29c_scenarios::apis::Apis;
use z29c_scenarios::cluster::{Cluster, Topology, chain};
use z29c_scenarios::order;

/// Longer than any of these workflows needs on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(90);

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_submitted_through_the_library_completes_carrying_each_result_downstream()
-> Result<()> {
    let apis = Apis::start(order::KEY).await?;
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        ..Topology::default()
    })
    .await?;
    cluster
        .add_gateway_serving(
            &order::gateway_toml(&apis.url),
            &[(order::KEY_ENV, order::KEY)],
        )
        .await?;
    let client = Client::connect(&cluster.scheduler_url, &Access::new()).await?;

    let (key, sku) = (unique("order"), unique("sku"));
    let submitted = client
        .submit_file(serde_json::from_value(order::document(&key, &sku))?)
        .await?;
    assert!(submitted.created);
    let id = submitted.workflow.id.clone();
    // a watcher from the start sees the workflow through to its end, and its stream ends
    let watcher = {
        let (client, id) = (client.clone(), id.clone());
        tokio::spawn(async move {
            let events: Vec<pb::WorkflowEvent> =
                client.watch(&id).await?.collect::<Result<_, _>>().await?;
            anyhow::Ok(events)
        })
    };

    let ended = tokio::time::timeout(PATIENCE, client.await_end(&id))
        .await
        .context("the order never ended")??;
    assert_eq!(ended.end, End::Completed, "{:#?}", ended.workflow);
    assert_eq!(ended.workflow.state(), pb::ProductState::Completed);
    for name in ["reserve", "charge", "ship"] {
        let step = ended.step(name).context(name)?;
        let receipt = step.receipt.as_ref().context("a receipt")?;
        assert!(!receipt.external_reference.is_empty(), "{step:#?}");
        let result: Value = serde_json::from_str(&step.result_json)
            .with_context(|| format!("step {name}'s result: {:?}", step.result_json))?;
        assert_eq!(
            result["id"], receipt.external_reference,
            "the result is the API's answer"
        );
        assert!(step.reason.is_empty(), "{step:#?}");
    }
    let charge = ended.step("charge").context("charge")?;
    assert_eq!(charge.depends_on, ["reserve"]);
    let input: Value = serde_json::from_str(&charge.input_json)?;
    assert_eq!(
        input["metadata"]["reservation"],
        result_id(ended.step("reserve").context("reserve")?)?,
        "the charge's input shows the reference resolved"
    );
    order::check_carried(&apis, &sku)?;

    let events = tokio::time::timeout(PATIENCE, watcher).await???;
    let last = events.last().context("events")?;
    assert_eq!(last.state(), pb::ProductState::Completed, "{events:#?}");
    assert!(
        events.iter().any(|e| e.step_name == "ship"),
        "a change per step: {events:#?}"
    );

    // the same document again answers the same workflow; the same key with other steps is
    // refused, in the server's words
    let again = client
        .submit_file(serde_json::from_value(order::document(&key, &sku))?)
        .await?;
    assert_eq!(
        (again.created, again.workflow.id.as_str()),
        (false, id.as_str())
    );
    let refused = client
        .submit_file(serde_json::from_value(order::document(
            &key,
            "another-sku",
        ))?)
        .await
        .expect_err("the same key with another payload");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused}");
    let listed = client
        .list_all(&ListFilter::new().search(key.as_str()))
        .await?;
    assert_eq!(
        listed.iter().map(|w| w.id.as_str()).collect::<Vec<_>>(),
        [id.as_str()]
    );
    cluster.stop().await
}

/// The `id` in a step's result, as the API named it.
fn result_id(step: &pb::Step) -> Result<Value> {
    let result: Value = serde_json::from_str(&step.result_json)?;
    ensure!(result["id"].is_string(), "{result}");
    Ok(result["id"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workflows_are_listed_by_state_and_key_page_by_page_and_one_not_started_is_cancelled()
-> Result<()> {
    // no executor yet: nothing submitted can start until one is added
    let mut cluster = Cluster::start_with(Topology {
        executors: 0,
        ..Topology::default()
    })
    .await?;
    let client = Client::connect(&cluster.scheduler_url, &Access::new()).await?;
    let keys: Vec<String> = (0..3).map(|i| unique(&format!("listed-{i}"))).collect();
    let mut ids = Vec::new();
    for key in &keys {
        ids.push(client.submit(chain(key, "ok", 1)).await?.workflow.id);
    }

    let cancelled = client
        .cancel(&ids[0], "the customer withdrew the order")
        .await?;
    assert_eq!(cancelled.state(), pb::ProductState::Cancelled);
    assert!(
        cancelled.reason.contains("the customer withdrew the order"),
        "{cancelled:#?}"
    );
    let ended = client.await_end(&ids[0]).await?;
    assert_eq!(ended.end, End::Cancelled);
    let events: Vec<pb::WorkflowEvent> = tokio::time::timeout(
        PATIENCE,
        client.watch(&ids[0]).await?.collect::<Result<Vec<_>, _>>(),
    )
    .await??;
    assert_eq!(
        events.last().map(pb::WorkflowEvent::state),
        Some(pb::ProductState::Cancelled),
        "a watch of an ended workflow says how it ended, and ends: {events:#?}"
    );

    let only = |workflows: &[pb::Workflow]| {
        let mut ids: Vec<String> = workflows.iter().map(|w| w.id.clone()).collect();
        ids.sort();
        ids
    };
    let by_state = client
        .list_all(&ListFilter::new().state(pb::ProductState::Cancelled))
        .await?;
    assert_eq!(only(&by_state), [ids[0].clone()]);
    let by_key = client.list_all(&ListFilter::new().search(&keys[2])).await?;
    assert_eq!(only(&by_key), [ids[2].clone()]);
    let by_id = client.list_all(&ListFilter::new().search(&ids[1])).await?;
    assert_eq!(only(&by_id), [ids[1].clone()]);
    let mut preparing = client
        .list_all(&ListFilter::new().state(pb::ProductState::Preparing))
        .await?;
    let mut want = vec![ids[1].clone(), ids[2].clone()];
    want.sort();
    assert_eq!(only(&preparing), want);

    // pages of one, newest first, until the last names no next page
    let mut paged = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let page = client.list(&ListFilter::new(), 1, token.as_deref()).await?;
        ensure!(page.workflows.len() <= 1, "{page:#?}");
        paged.extend(page.workflows.into_iter().map(|w| w.id));
        match page.next_page_token {
            Some(next) if paged.len() <= ids.len() => token = Some(next),
            Some(_) => anyhow::bail!("more pages than workflows: {paged:?}"),
            None => break,
        }
    }
    let newest_first: Vec<String> = ids.iter().rev().cloned().collect();
    assert_eq!(paged, newest_first);

    // an executor lets the rest run to their end
    cluster.add_executor().await?;
    for id in &ids[1..] {
        let ended = tokio::time::timeout(PATIENCE, client.await_end(id)).await??;
        assert_eq!(ended.end, End::Completed, "{:#?}", ended.workflow);
    }
    preparing = client
        .list_all(&ListFilter::new().state(pb::ProductState::Preparing))
        .await?;
    assert!(preparing.is_empty(), "{preparing:#?}");
    let done = client
        .list_all(
            &ListFilter::new()
                .state(pb::ProductState::Completed)
                .state(pb::ProductState::Cancelled)
                .name(format!("scenario {}", keys[1])),
        )
        .await?;
    assert_eq!(only(&done), [ids[1].clone()]);
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_keep_the_grpc_code_and_read_in_the_servers_words() -> Result<()> {
    let nobody = Client::connect("http://127.0.0.1:9", &Access::new())
        .await
        .expect_err("nothing listens on port 9");
    assert_eq!(nobody.code(), tonic::Code::Unavailable);
    assert!(
        nobody
            .to_string()
            .starts_with("cannot reach http://127.0.0.1:9: "),
        "{nobody}"
    );

    let cluster = Cluster::start(1, 0, 4).await?;
    let client = Client::connect(&cluster.scheduler_url, &Access::new()).await?;
    let missing = client
        .get(&uuid::Uuid::now_v7().to_string())
        .await
        .expect_err("no such workflow");
    assert_eq!(missing.code(), tonic::Code::NotFound, "{missing}");
    let bad = client.get("not-a-uuid").await.expect_err("not an id");
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad}");
    assert!(bad.to_string().starts_with("invalid argument: "), "{bad}");
    let mut cyclic = chain(&unique("bad"), "ok", 2);
    cyclic.steps[1].depends_on = vec!["zz".into()];
    let refused = client
        .submit(cyclic)
        .await
        .expect_err("an unknown dependency");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
    let text = refused.to_string();
    assert!(text.contains("steps[1].depends_on[0]"), "{text}");
    assert!(
        !text.contains("StepName("),
        "no Rust debug formatting: {text}"
    );
    let no_file = z29c_client::workflow_file::parse("name: x\nstepz: []\n")
        .map_err(z29c_client::Error::from)
        .expect_err("an unknown field");
    assert_eq!(no_file.code(), tonic::Code::InvalidArgument);
    assert!(no_file.to_string().contains("stepz"), "{no_file}");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_deployment_is_reached_with_a_certificate_and_a_token_whose_role_decides()
-> Result<()> {
    use z29c_client::Reviews;
    use z29c_core::Role;
    let (cluster, pool) = Cluster::start_secure("idempotent", &[]).await?;
    pool.close().await;
    let tls = cluster.operator_tls();
    let as_role = |roles: &[Role]| -> Result<Access> {
        Ok(Access::new()
            .tls(tls.clone())
            .token(cluster.token("client-test", roles)?))
    };

    let anonymous =
        Client::connect(&cluster.scheduler_url, &Access::new().tls(tls.clone())).await?;
    let e = anonymous
        .list(&ListFilter::new(), 0, None)
        .await
        .expect_err("no token");
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    let viewer = Client::connect(&cluster.scheduler_url, &as_role(&[Role::Viewer])?).await?;
    let e = viewer
        .submit(chain(&unique("viewer"), "ok", 1))
        .await
        .expect_err("a viewer may not submit");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");

    let operator = Client::connect(&cluster.scheduler_url, &as_role(&[Role::Operator])?).await?;
    let id = operator
        .submit(chain(&unique("secure"), "ok", 2))
        .await?
        .workflow
        .id;
    let ended = tokio::time::timeout(PATIENCE, operator.await_end(&id)).await??;
    assert_eq!(ended.end, End::Completed, "{:#?}", ended.workflow);
    assert_eq!(viewer.list_all(&ListFilter::new()).await?.len(), 1);

    let reviews = Reviews::connect(&cluster.review_url, &as_role(&[Role::Viewer])?).await?;
    assert!(reviews.list(true).await?.is_empty());
    cluster.stop().await
}
