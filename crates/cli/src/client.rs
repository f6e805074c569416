//! Client commands: submit, watch, status, review. Output is for people (`--output text`) or
//! for programs (`--output json`: one JSON document, or one JSON line per change when
//! following). Exit codes are for scripts, see [`Exit`].

#![allow(clippy::print_stdout)]

use std::path::Path;

use anyhow::Context;
use serde_json::{Value, json};
use z29c_proto::v1::workflow_service_client::WorkflowServiceClient;
use z29c_proto::v1::{self as pb, ProductState};
use z29c_security::{Authed, Bearer, TlsConfig};

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Output {
    Text,
    Json,
}

/// The exit codes scripts can rely on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Exit {
    /// 1: the workflow failed or was cancelled.
    #[error("the workflow failed or was cancelled")]
    Failed = 1,
    /// 2: the input was refused (a bad file, a bad field, an unknown id).
    #[error("the input was refused")]
    BadInput = 2,
    /// 3: the workflow waits for a person (a delivery status needs review).
    #[error("the workflow waits for a person")]
    NeedsReview = 3,
    /// 4: the service could not be reached or failed.
    #[error("the service could not be reached or failed")]
    Unavailable = 4,
}

/// Reads a workflow file, naming it in any error.
pub(crate) fn read_workflow(
    path: &Path,
) -> anyhow::Result<z29c_proto::workflow_file::WorkflowFile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read workflow file {}", path.display()))?;
    z29c_proto::workflow_file::parse(&text)
        .with_context(|| format!("workflow file {}", path.display()))
}

/// How the client reaches the services: an operator token and, with mutual TLS, a client
/// certificate. Flags or the same `Z29C_…` variables the services read.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct Access {
    /// Operator token (JWT) sent as `authorization: Bearer …`.
    #[arg(long, global = true, env = "Z29C_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// CA certificate (PEM) the services' certificates are signed by.
    #[arg(long, global = true, env = "Z29C_TLS__CA_FILE")]
    tls_ca_file: Option<std::path::PathBuf>,
    /// This client's certificate (PEM), for services that require one.
    #[arg(long, global = true, env = "Z29C_TLS__CERT_FILE")]
    tls_cert_file: Option<std::path::PathBuf>,
    #[arg(long, global = true, env = "Z29C_TLS__KEY_FILE")]
    tls_key_file: Option<std::path::PathBuf>,
    /// The name the services' certificates carry, when it is not the URL's host.
    #[arg(long, global = true, env = "Z29C_TLS__SERVER_NAME")]
    tls_server_name: Option<String>,
}

impl Access {
    pub(crate) fn new(token: Option<String>, tls: &TlsConfig) -> Self {
        Self {
            token,
            tls_ca_file: tls.ca_file.clone(),
            tls_cert_file: tls.cert_file.clone(),
            tls_key_file: tls.key_file.clone(),
            tls_server_name: tls.server_name.clone(),
        }
    }

    pub(crate) fn tls(&self) -> TlsConfig {
        TlsConfig {
            ca_file: self.tls_ca_file.clone(),
            cert_file: self.tls_cert_file.clone(),
            key_file: self.tls_key_file.clone(),
            server_name: self.tls_server_name.clone(),
        }
    }

    pub(crate) fn bearer(&self) -> anyhow::Result<Bearer> {
        Bearer::new(self.token.as_deref()).map_err(|e| e.context(Exit::BadInput))
    }
}

/// Maps a gRPC refusal to an exit code, keeping the server's reason.
fn refused(what: &str, s: tonic::Status) -> anyhow::Error {
    use tonic::Code;
    let exit = match s.code() {
        Code::InvalidArgument
        | Code::NotFound
        | Code::FailedPrecondition
        | Code::AlreadyExists
        | Code::OutOfRange
        | Code::Unauthenticated
        | Code::PermissionDenied => Exit::BadInput,
        _ => Exit::Unavailable,
    };
    anyhow::Error::new(exit).context(format!("{what} ({:?}): {}", s.code(), s.message()))
}

fn end_code(state: ProductState) -> Option<Exit> {
    match state {
        ProductState::Completed => None,
        ProductState::NeedsReview => Some(Exit::NeedsReview),
        ProductState::Failed | ProductState::Cancelled => Some(Exit::Failed),
        _ => None,
    }
}

pub(crate) async fn connect(
    server: &str,
    access: &Access,
) -> anyhow::Result<WorkflowServiceClient<Authed>> {
    let endpoint = access
        .tls()
        .endpoint(server)
        .map_err(|e| e.context(Exit::BadInput))?;
    let channel = endpoint.connect().await.map_err(|e| {
        anyhow::Error::new(Exit::Unavailable)
            .context(format!("cannot reach the scheduler at {server}: {e}"))
    })?;
    Ok(WorkflowServiceClient::with_interceptor(
        channel,
        access.bearer()?,
    ))
}

async fn get(client: &mut WorkflowServiceClient<Authed>, id: &str) -> anyhow::Result<pb::Workflow> {
    Ok(client
        .get(pb::GetRequest {
            workflow_id: id.to_owned(),
        })
        .await
        .map_err(|s| refused("status refused", s))?
        .into_inner())
}

pub(crate) async fn submit(
    server: &str,
    file: &Path,
    watch: bool,
    output: Output,
    access: &Access,
) -> anyhow::Result<()> {
    let req = read_workflow(file)
        .and_then(|f| Ok(f.into_request()?))
        .map_err(|e| e.context(Exit::BadInput))?;
    let mut client = connect(server, access).await?;
    let resp = client
        .submit(req)
        .await
        .map_err(|s| refused("submit refused", s))?
        .into_inner();
    let wf = resp
        .workflow
        .context("scheduler answered without a workflow")?;
    match output {
        Output::Text => println!(
            "{} {} ({})",
            if resp.created {
                "submitted"
            } else {
                "already submitted"
            },
            wf.id,
            wf.name
        ),
        Output::Json if !watch => {
            let mut doc = workflow_json(&wf);
            doc["created"] = json!(resp.created);
            println!("{doc}");
        }
        Output::Json => println!(
            "{}",
            json!({ "event": "submitted", "workflow_id": wf.id, "created": resp.created })
        ),
    }
    if watch {
        follow(&mut client, &wf.id, output).await?;
    }
    Ok(())
}

pub(crate) async fn status(
    server: &str,
    id: &str,
    watch: bool,
    output: Output,
    access: &Access,
) -> anyhow::Result<()> {
    let mut client = connect(server, access).await?;
    if watch {
        return follow(&mut client, id, output).await;
    }
    let wf = get(&mut client, id).await?;
    match output {
        Output::Text => print_workflow(&wf),
        Output::Json => println!("{}", workflow_json(&wf)),
    }
    Ok(())
}

/// Follows a workflow to its end, prints it, and turns its end into the exit code.
async fn follow(
    client: &mut WorkflowServiceClient<Authed>,
    id: &str,
    output: Output,
) -> anyhow::Result<()> {
    let now = get(client, id).await?;
    // a workflow waiting for a person stays running; following it ends there (exit 3)
    let end = if now.state() == ProductState::NeedsReview {
        ProductState::NeedsReview
    } else {
        watch_until_done(client, id, output, now.steps.len()).await?
    };
    let wf = get(client, id).await?;
    match output {
        Output::Text => print_workflow(&wf),
        Output::Json => println!(
            "{}",
            json!({ "event": "ended", "workflow": workflow_json(&wf) })
        ),
    }
    match end_code(end) {
        Some(code) => {
            Err(anyhow::Error::new(code).context(format!("workflow {id} ended {}", label(end))))
        }
        None => Ok(()),
    }
}

/// Prints each user-facing change until the workflow ends; returns its final state. With more
/// than a few steps, text output is a progress bar of ended steps instead of a line per change.
pub(crate) async fn watch_until_done(
    client: &mut WorkflowServiceClient<Authed>,
    id: &str,
    output: Output,
    total_steps: usize,
) -> anyhow::Result<ProductState> {
    let mut stream = client
        .watch(pb::WatchRequest {
            workflow_id: id.to_owned(),
        })
        .await
        .map_err(|s| refused("watch refused", s))?
        .into_inner();
    let bar = (output == Output::Text && total_steps > 10).then(|| {
        let bar = indicatif::ProgressBar::new(total_steps as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("  {bar:40} {pos}/{len} steps ended  {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    });
    let mut ended = std::collections::BTreeSet::new();
    let mut last = ProductState::Unspecified;
    while let Some(event) = stream
        .message()
        .await
        .map_err(|s| refused("watch failed", s))?
    {
        last = event.state();
        match (output, &bar) {
            (Output::Json, _) => println!(
                "{}",
                json!({
                    "event": "changed",
                    "workflow_id": id,
                    "step": event.step_name,
                    "step_state": label(event.step_state()),
                    "workflow_state": event.state_label,
                })
            ),
            (Output::Text, Some(bar)) => {
                if matches!(
                    event.step_state(),
                    ProductState::Completed
                        | ProductState::Failed
                        | ProductState::Cancelled
                        | ProductState::NeedsReview
                ) {
                    ended.insert(event.step_name.clone());
                    bar.set_position(ended.len() as u64);
                }
                bar.set_message(event.state_label.clone());
            }
            (Output::Text, None) if event.step_name.is_empty() => {
                println!("  workflow: {}", event.state_label);
            }
            (Output::Text, None) => println!(
                "  {:<10} {:<32} workflow: {}",
                event.step_name,
                label(event.step_state()),
                event.state_label
            ),
        }
        if last == ProductState::NeedsReview {
            break; // nothing moves until a person resolves it
        }
    }
    if let Some(bar) = bar {
        bar.finish();
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

/// A workflow as JSON: product states first, technical details (lease history) beneath.
pub(crate) fn workflow_json(wf: &pb::Workflow) -> Value {
    json!({
        "id": wf.id,
        "name": wf.name,
        "state": wf.state_label,
        "steps": wf.steps.iter().map(|s| json!({
            "name": s.name,
            "adapter": s.adapter,
            "state": s.state_label,
            "receipt": s.receipt.as_ref().map(|r| json!({
                "outcome": r.outcome,
                "external_reference": r.external_reference,
                "verification": format!("{:?}", r.verification()),
                "request_identity": r.request_identity,
            })),
            "technical": s.technical.as_ref().map(|t| json!({
                "lease_version": t.lease_version,
                "attempts": t.attempts,
                "checkpoint": t.checkpoint,
                "events": t.events.iter().map(|e| json!({ "kind": e.kind })).collect::<Vec<_>>(),
            })),
        })).collect::<Vec<_>>(),
    })
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

/// One review item as the console's queue shows it: the item, its workflow's state, the
/// step's adapter, attempts, evidence and decisions.
fn print_review(r: &z29c_console::view::ReviewView) {
    let at = |t: &Option<chrono::DateTime<chrono::Utc>>| {
        t.map(|t| t.format("%H:%M:%S%.3f").to_string())
            .unwrap_or_default()
    };
    println!(
        "{}  v{}  {}  opened {}",
        r.id,
        r.version,
        r.state,
        at(&r.created_at)
    );
    println!(
        "  workflow {} ({}): {}",
        r.workflow_name, r.workflow_id, r.workflow_label
    );
    println!(
        "  step {}  {}/{}  identity {}  attempts {}",
        r.step_name, r.adapter, r.operation, r.request_identity, r.attempts_made
    );
    println!("  reason: {}", r.reason);
    for e in &r.evidence {
        let reference = if e.external_reference.is_empty() {
            String::new()
        } else {
            format!("  reference {}", e.external_reference)
        };
        println!("  {} {}{reference}", at(&e.at), e.summary);
    }
}

pub(crate) async fn review(
    server: &str,
    workflow_server: &str,
    command: ReviewCommand,
    output: Output,
    access: &Access,
) -> anyhow::Result<()> {
    let (mut workflows, mut client) =
        z29c_console::clients(workflow_server, server, &access.tls(), access.bearer()?)
            .map_err(|e| anyhow::Error::new(Exit::BadInput).context(format!("{e:#}")))?;
    let unavailable = |s: tonic::Status| {
        if s.code() == tonic::Code::Unavailable {
            anyhow::Error::new(Exit::Unavailable).context(format!(
                "cannot reach the review service at {server} or the workflow service at {workflow_server}: {}",
                s.message()
            ))
        } else {
            refused("list refused", s)
        }
    };
    let show = |items: &[z29c_console::view::ReviewView]| -> anyhow::Result<()> {
        match output {
            Output::Json => println!("{}", serde_json::to_string(items)?),
            Output::Text if items.is_empty() => println!("no review items"),
            Output::Text => items.iter().for_each(print_review),
        }
        Ok(())
    };
    match command {
        ReviewCommand::List { all } => {
            let items = z29c_console::review_queue(&mut workflows, &mut client, all)
                .await
                .map_err(unavailable)?;
            show(&items)?;
        }
        ReviewCommand::Show { item_id } => {
            let items = z29c_console::review_queue(&mut workflows, &mut client, true)
                .await
                .map_err(unavailable)?;
            let item = items
                .iter()
                .find(|i| i.id == item_id)
                .ok_or_else(|| anyhow::Error::new(Exit::BadInput).context("no such review item"))?;
            show(std::slice::from_ref(item))?;
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
                _ => {
                    return Err(anyhow::Error::new(Exit::BadInput)
                        .context("give exactly one of --succeeded REF, --failed, --retry"));
                }
            };
            let mut req = tonic::Request::new(pb::ResolveRequest {
                item_id,
                expected_version: version,
                reason,
                resolution: Some(resolution),
                result_json: String::new(),
            });
            req.metadata_mut()
                .insert("x-z29c-operator", operator.parse()?);
            let item = client
                .resolve(req)
                .await
                .map_err(|s| refused("resolve refused", s))?
                .into_inner();
            let workflow = workflows
                .get(pb::GetRequest {
                    workflow_id: item.workflow_id.clone(),
                })
                .await
                .ok()
                .map(tonic::Response::into_inner);
            show(&[z29c_console::view::review(&item, workflow.as_ref())])?;
        }
    }
    Ok(())
}
