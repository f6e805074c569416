//! Client commands: submit, watch, status. Output is for people; exit codes for scripts
//! (0 completed or accepted, 1 failed/cancelled/needs review, 2 bad input).

#![allow(clippy::print_stdout)]

use std::path::Path;

use anyhow::Context;
use z29c_proto::v1::review_service_client::ReviewServiceClient;
use z29c_proto::v1::workflow_service_client::WorkflowServiceClient;
use z29c_proto::v1::{self as pb, ProductState};

use crate::workflow_file;

async fn connect(server: &str) -> anyhow::Result<WorkflowServiceClient<tonic::transport::Channel>> {
    WorkflowServiceClient::connect(server.to_owned())
        .await
        .with_context(|| format!("cannot reach the scheduler at {server}"))
}

pub(crate) async fn submit(server: &str, file: &Path, watch: bool) -> anyhow::Result<()> {
    let req = workflow_file::read(file)?.into_request()?;
    let mut client = connect(server).await?;
    let resp = client
        .submit(req)
        .await
        .map_err(|s| anyhow::anyhow!("submit refused: {}", s.message()))?;
    let resp = resp.into_inner();
    let wf = resp
        .workflow
        .context("scheduler answered without a workflow")?;
    println!(
        "{} {} ({})",
        if resp.created {
            "submitted"
        } else {
            "already submitted"
        },
        wf.id,
        wf.name
    );
    if watch {
        let end = watch_until_done(&mut client, &wf.id).await?;
        print_workflow(
            &client
                .get(pb::GetRequest {
                    workflow_id: wf.id.clone(),
                })
                .await?
                .into_inner(),
        );
        if end != ProductState::Completed {
            std::process::exit(1);
        }
    }
    Ok(())
}

pub(crate) async fn status(server: &str, id: &str) -> anyhow::Result<()> {
    let mut client = connect(server).await?;
    let wf = client
        .get(pb::GetRequest {
            workflow_id: id.to_owned(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?
        .into_inner();
    print_workflow(&wf);
    Ok(())
}

/// Prints each user-facing change until the workflow ends; returns its final state.
pub(crate) async fn watch_until_done(
    client: &mut WorkflowServiceClient<tonic::transport::Channel>,
    id: &str,
) -> anyhow::Result<ProductState> {
    let mut stream = client
        .watch(pb::WatchRequest {
            workflow_id: id.to_owned(),
        })
        .await?
        .into_inner();
    let mut last = ProductState::Unspecified;
    while let Some(event) = stream.message().await? {
        last = event.state();
        if event.step_name.is_empty() {
            println!("  workflow: {}", event.state_label);
        } else {
            println!(
                "  {:<10} {:<32} workflow: {}",
                event.step_name,
                label(event.step_state()),
                event.state_label
            );
        }
    }
    Ok(last)
}

fn label(p: ProductState) -> &'static str {
    match p {
        ProductState::Unspecified => "",
        ProductState::Preparing => "Preparing",
        ProductState::WaitingOnExternalService => "Waiting on an external service",
        ProductState::RecoveringExecution => "Recovering execution",
        ProductState::NeedsReview => "Delivery status needs review",
        ProductState::Completed => "Completed",
        ProductState::Failed => "Failed",
        ProductState::Cancelled => "Cancelled",
    }
}

pub(crate) fn print_workflow(wf: &pb::Workflow) {
    println!("workflow {} — {}: {}", wf.id, wf.name, wf.state_label);
    for s in &wf.steps {
        println!("  step {:<10} {}", s.name, s.state_label);
        if let Some(r) = &s.receipt {
            println!(
                "    receipt: {} ref={} verified={:?} identity={}",
                r.outcome,
                r.external_reference,
                r.verification(),
                r.request_identity
            );
        }
        if let Some(t) = &s.technical {
            let leases = t
                .events
                .iter()
                .filter(|e| e.kind == "lease_acquired")
                .count();
            println!(
                "    technical: lease v{} ({} acquisitions), attempts {}, checkpoint {}",
                t.lease_version, leases, t.attempts, t.checkpoint
            );
        }
    }
}

#[derive(Debug, clap::Subcommand)]
pub(crate) enum ReviewCommand {
    /// Open items (all items with --all).
    List {
        #[arg(long)]
        all: bool,
    },
    /// One item.
    Show { item_id: String },
    /// Resolve an item at its current version, with a reason.
    Resolve {
        item_id: String,
        /// The item's version as last seen (compare-and-set).
        #[arg(long)]
        version: i64,
        #[arg(long)]
        reason: String,
        /// The effect happened; the external system's reference for it.
        #[arg(long, group = "resolution")]
        succeeded: Option<String>,
        /// The effect did not happen.
        #[arg(long, group = "resolution")]
        failed: bool,
        /// Send again with the same request identity.
        #[arg(long, group = "resolution")]
        retry: bool,
        #[arg(long, env = "Z29C_OPERATOR", default_value = "operator")]
        operator: String,
    },
}

fn print_item(i: &pb::ReviewItem) {
    println!(
        "{}  v{}  {}  workflow {} step {}  identity {}\n    {}",
        i.id, i.version, i.state, i.workflow_id, i.step_name, i.request_identity, i.reason
    );
}

pub(crate) async fn review(server: &str, command: ReviewCommand) -> anyhow::Result<()> {
    let mut client = ReviewServiceClient::connect(server.to_owned())
        .await
        .with_context(|| format!("cannot reach the review service at {server}"))?;
    match command {
        ReviewCommand::List { all } => {
            let items = client
                .list(pb::ListReviewsRequest {
                    include_resolved: all,
                    ..Default::default()
                })
                .await?
                .into_inner()
                .items;
            if items.is_empty() {
                println!("no review items");
            }
            items.iter().for_each(print_item);
        }
        ReviewCommand::Show { item_id } => {
            let items = client
                .list(pb::ListReviewsRequest {
                    include_resolved: true,
                    page_size: 500,
                    ..Default::default()
                })
                .await?
                .into_inner()
                .items;
            let item = items
                .iter()
                .find(|i| i.id == item_id)
                .context("no such review item")?;
            print_item(item);
        }
        ReviewCommand::Resolve {
            item_id,
            version,
            reason,
            succeeded,
            failed,
            retry,
            operator,
        } => {
            use pb::resolve_request::Resolution;
            let resolution = match (succeeded, failed, retry) {
                (Some(r), false, false) => Resolution::SucceededExternalReference(r),
                (None, true, false) => Resolution::Failed(true),
                (None, false, true) => Resolution::RetrySameIdentity(true),
                _ => anyhow::bail!("give exactly one of --succeeded REF, --failed, --retry"),
            };
            let mut req = tonic::Request::new(pb::ResolveRequest {
                item_id,
                expected_version: version,
                reason,
                resolution: Some(resolution),
            });
            req.metadata_mut()
                .insert("x-z29c-operator", operator.parse()?);
            let item = client
                .resolve(req)
                .await
                .map_err(|s| anyhow::anyhow!("resolve refused ({:?}): {}", s.code(), s.message()))?
                .into_inner();
            print_item(&item);
        }
    }
    Ok(())
}
