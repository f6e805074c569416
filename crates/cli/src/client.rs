//! Client commands: submit, status, list, cancel, review, all through `z29c-client`. Output is
//! for people (`--output text`) or for programs (`--output json`: one JSON document, or one
//! JSON line per change when following). A workflow prints the same JSON shape wherever it
//! appears: product states in snake_case, times in RFC 3339. Exit codes are for scripts, see
//! [`Exit`].

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Value, json};
use tonic::Code;
use z29c_client::{Client, End, ListFilter, Resolution, Reviews, pb};
use z29c_security::TlsConfig;

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

/// Standard output that a reader may close (`z29c status ID | head`): from then on output is
/// dropped and the command ends as it would have, instead of panicking as `println!` does.
#[derive(Debug, Default)]
pub(crate) struct Stdout {
    closed: bool,
}

impl Stdout {
    pub(crate) fn line(&mut self, text: impl std::fmt::Display) -> anyhow::Result<()> {
        if self.closed {
            return Ok(());
        }
        let mut out = std::io::stdout().lock();
        match writeln!(out, "{text}").and_then(|()| out.flush()) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                self.closed = true;
                Ok(())
            }
            r => r.context("cannot write to standard output"),
        }
    }

    /// Whether the reader has gone: following a workflow for nobody stops.
    pub(crate) fn closed(&self) -> bool {
        self.closed
    }
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

    fn client_access(&self) -> z29c_client::Access {
        let access = z29c_client::Access::new().tls(self.tls());
        match &self.token {
            Some(token) => access.token(token.clone()),
            None => access,
        }
    }
}

/// A client error as a command's error: the exit code its gRPC code means, and the server's
/// words after `what`.
fn failed(what: &str, e: z29c_client::Error) -> anyhow::Error {
    let exit = match e.code() {
        Code::InvalidArgument
        | Code::NotFound
        | Code::FailedPrecondition
        | Code::AlreadyExists
        | Code::OutOfRange
        | Code::Aborted
        | Code::Unauthenticated
        | Code::PermissionDenied => Exit::BadInput,
        _ => Exit::Unavailable,
    };
    anyhow::Error::new(exit).context(format!("{what}: {e}"))
}

/// What a workflow's state means for the exit code; `None` is 0 (completed, or not ended).
fn end_code(state: pb::ProductState) -> Option<Exit> {
    match End::of(state)? {
        End::Completed => None,
        End::NeedsReview => Some(Exit::NeedsReview),
        End::Failed | End::Cancelled => Some(Exit::Failed),
    }
}

/// The exit code of a workflow last seen in `state`, as an error when it is not 0.
fn exit_for(id: &str, state: pb::ProductState) -> anyhow::Result<()> {
    match end_code(state) {
        Some(code) => Err(anyhow::Error::new(code).context(format!(
            "workflow {id}: {}",
            state_label(state).to_lowercase()
        ))),
        None => Ok(()),
    }
}

pub(crate) async fn connect(server: &str, access: &Access) -> anyhow::Result<Client> {
    Client::connect(server, &access.client_access())
        .await
        .map_err(|e| failed("the scheduler", e))
}

pub(crate) async fn submit(
    server: &str,
    file: &Path,
    follow_changes: bool,
    wait: bool,
    output: Output,
    access: &Access,
) -> anyhow::Result<()> {
    // the whole file is checked before anything is reached: a bad field is named offline
    let request = read_workflow(file)
        .and_then(|w| w.into_request().map_err(anyhow::Error::new))
        .map_err(|e| e.context(Exit::BadInput))?;
    let client = connect(server, access).await?;
    let submitted = client
        .submit(request)
        .await
        .map_err(|e| failed("submit refused", e))?;
    let wf = &submitted.workflow;
    let mut out = Stdout::default();
    match output {
        Output::Text => out.line(format_args!(
            "{} {} ({})",
            if submitted.created {
                "submitted"
            } else {
                "already submitted"
            },
            wf.id,
            wf.name
        ))?,
        Output::Json if follow_changes => out.line(json!({
            "event": "submitted",
            "workflow_id": wf.id,
            "created": submitted.created,
        }))?,
        Output::Json if !wait => {
            let mut doc = workflow_json(wf);
            doc["created"] = json!(submitted.created);
            out.line(doc)?;
        }
        Output::Json => {}
    }
    if follow_changes {
        return follow(&client, &wf.id, output, &mut out).await;
    }
    if wait {
        let ended = client
            .await_end(&wf.id)
            .await
            .map_err(|e| failed("waiting refused", e))?;
        match output {
            Output::Text => print_workflow(&mut out, &ended.workflow)?,
            Output::Json => {
                let mut doc = workflow_json(&ended.workflow);
                doc["created"] = json!(submitted.created);
                out.line(doc)?;
            }
        }
        return exit_for(&wf.id, ended.end.state());
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
    let client = connect(server, access).await?;
    let mut out = Stdout::default();
    if watch {
        return follow(&client, id, output, &mut out).await;
    }
    let wf = client
        .get(id)
        .await
        .map_err(|e| failed("status refused", e))?;
    match output {
        Output::Text => print_workflow(&mut out, &wf)?,
        Output::Json => out.line(workflow_json(&wf))?,
    }
    exit_for(id, wf.state())
}

/// Follows a workflow to its end, prints it, and turns its end into the exit code: the same
/// code `status` gives once it has ended.
async fn follow(client: &Client, id: &str, output: Output, out: &mut Stdout) -> anyhow::Result<()> {
    let total = client
        .get(id)
        .await
        .map_err(|e| failed("status refused", e))?
        .steps
        .len();
    let last = watch_until_done(client, id, output, total, out).await?;
    if out.closed() {
        // nobody reads on: the code of the state last seen
        return exit_for(id, last);
    }
    let wf = client
        .get(id)
        .await
        .map_err(|e| failed("status refused", e))?;
    match output {
        Output::Text => print_workflow(out, &wf)?,
        Output::Json => out.line(json!({ "event": "ended", "workflow": workflow_json(&wf) }))?,
    }
    if End::of(wf.state()).is_none() {
        return Err(anyhow::Error::new(Exit::Unavailable).context(format!(
            "workflow {id}: the watch ended before the workflow did"
        )));
    }
    exit_for(id, wf.state())
}

/// Prints each user-facing change until the workflow ends or needs review; returns the state
/// last seen. With more than a few steps, text output is a progress bar of ended steps
/// instead of a line per change.
pub(crate) async fn watch_until_done(
    client: &Client,
    id: &str,
    output: Output,
    total_steps: usize,
    out: &mut Stdout,
) -> anyhow::Result<pb::ProductState> {
    use futures::TryStreamExt;
    let mut events = client
        .watch(id)
        .await
        .map_err(|e| failed("watch refused", e))?;
    let bar = (output == Output::Text && total_steps > 10).then(|| {
        let bar = indicatif::ProgressBar::new(total_steps as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("  {bar:40} {pos}/{len} steps ended  {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    });
    let mut ended = std::collections::BTreeSet::new();
    let mut last = pb::ProductState::Unspecified;
    while let Some(event) = events
        .try_next()
        .await
        .map_err(|e| failed("watch failed", e))?
    {
        last = event.state();
        match (output, &bar) {
            (Output::Json, _) => out.line(event_json(&event))?,
            (Output::Text, Some(bar)) => {
                if End::of(event.step_state()).is_some() {
                    ended.insert(event.step_name.clone());
                    bar.set_position(ended.len() as u64);
                }
                bar.set_message(event.state_label.clone());
            }
            (Output::Text, None) if event.step_name.is_empty() => {
                out.line(format_args!("  workflow: {}", event.state_label))?;
            }
            (Output::Text, None) => out.line(format_args!(
                "  {:<10} {:<32} workflow: {}",
                event.step_name,
                state_label(event.step_state()),
                event.state_label
            ))?,
        }
        // nothing moves in review until a person resolves it; nobody reads a closed pipe
        if last == pb::ProductState::NeedsReview || out.closed() {
            break;
        }
    }
    if let Some(bar) = bar {
        bar.finish();
    }
    Ok(last)
}

/// The filters and page of `z29c list`.
#[derive(Debug, clap::Args)]
pub(crate) struct ListArgs {
    /// Only workflows in this product state (repeat for several): preparing,
    /// waiting-on-external-service, recovering-execution, needs-review, completed, failed,
    /// cancelled.
    #[arg(long = "state", value_name = "STATE", value_parser = parse_state)]
    states: Vec<pb::ProductState>,
    /// Only workflows of this name.
    #[arg(long)]
    name: Option<String>,
    /// Only the workflow with this id or client key.
    #[arg(long)]
    search: Option<String>,
    /// Workflows per page (the scheduler's default when absent; at most 500).
    #[arg(long, default_value_t = 0)]
    page_size: u32,
    /// Where to start: the `next_page_token` of the page before.
    #[arg(long, conflicts_with = "all")]
    page_token: Option<String>,
    /// Every page, not only the first.
    #[arg(long)]
    all: bool,
}

/// A product state as `status` shows it in JSON (`needs_review`) or with hyphens.
pub(crate) fn parse_state(s: &str) -> Result<pb::ProductState, String> {
    s.replace('-', "_")
        .parse::<z29c_core::ProductState>()
        .ok()
        .and_then(|p| {
            pb::ProductState::from_str_name(&format!(
                "PRODUCT_STATE_{}",
                p.as_str().to_ascii_uppercase()
            ))
        })
        .ok_or_else(|| {
            let names: Vec<_> = z29c_core::ProductState::ALL
                .iter()
                .map(|p| p.as_str().replace('_', "-"))
                .collect();
            format!("'{s}' is not a product state: use {}", names.join(", "))
        })
}

pub(crate) async fn list(
    server: &str,
    args: ListArgs,
    output: Output,
    access: &Access,
) -> anyhow::Result<()> {
    let client = connect(server, access).await?;
    let filter = ListFilter {
        states: args.states,
        name: args.name,
        search: args.search,
    };
    let (workflows, next) = if args.all {
        let all = client
            .list_all(&filter)
            .await
            .map_err(|e| failed("list refused", e))?;
        (all, None)
    } else {
        let page = client
            .list(&filter, args.page_size, args.page_token.as_deref())
            .await
            .map_err(|e| failed("list refused", e))?;
        (page.workflows, page.next_page_token)
    };
    let mut out = Stdout::default();
    match output {
        Output::Json => out.line(json!({
            "workflows": workflows.iter().map(workflow_json).collect::<Vec<_>>(),
            "next_page_token": next,
        }))?,
        Output::Text => {
            if workflows.is_empty() {
                out.line("no workflows")?;
            }
            for wf in &workflows {
                out.line(format_args!(
                    "{:<36}  {:<20}  {:<27}  {}",
                    wf.id,
                    wf.name,
                    state_name(wf.state()).unwrap_or_default(),
                    time(wf.created_at.as_ref()).unwrap_or_default()
                ))?;
            }
            if let Some(next) = next {
                out.line(format_args!("more: --page-token {next}"))?;
            }
        }
    }
    Ok(())
}

pub(crate) async fn cancel(
    server: &str,
    id: &str,
    reason: &str,
    output: Output,
    access: &Access,
) -> anyhow::Result<()> {
    let client = connect(server, access).await?;
    let wf = client
        .cancel(id, reason)
        .await
        .map_err(|e| failed("cancel refused", e))?;
    let mut out = Stdout::default();
    match output {
        Output::Text => print_workflow(&mut out, &wf),
        Output::Json => out.line(workflow_json(&wf)),
    }
}

/// The JSON name of a product state (`needs_review`); `None` for none.
fn state_name(p: pb::ProductState) -> Option<&'static str> {
    let name = p.as_str_name().strip_prefix("PRODUCT_STATE_")?;
    z29c_core::ProductState::ALL
        .iter()
        .find(|s| s.as_str().eq_ignore_ascii_case(name))
        .map(|s| s.as_str())
}

/// The wording a person reads.
fn state_label(p: pb::ProductState) -> &'static str {
    state_name(p)
        .and_then(|n| n.parse::<z29c_core::ProductState>().ok())
        .map_or("", z29c_core::ProductState::label)
}

fn verification_name(v: pb::Verification) -> &'static str {
    match v {
        pb::Verification::Unspecified => "",
        pb::Verification::Direct => "direct",
        pb::Verification::StatusQuery => "status_query",
        pb::Verification::LateEvidence => "late_evidence",
        pb::Verification::Manual => "manual",
    }
}

/// A time in RFC 3339, UTC, to the millisecond.
fn time(t: Option<&prost_types::Timestamp>) -> Option<String> {
    let t = t?;
    let at = DateTime::<Utc>::from_timestamp(t.seconds, u32::try_from(t.nanos).ok()?)?;
    Some(at.to_rfc3339_opts(SecondsFormat::Millis, true))
}

/// JSON text as its value, when it is JSON; empty text is `null`.
fn json_text(text: &str) -> Value {
    if text.is_empty() {
        return Value::Null;
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

fn non_empty(text: &str) -> Value {
    if text.is_empty() {
        Value::Null
    } else {
        Value::String(text.to_owned())
    }
}

pub(crate) fn print_workflow(out: &mut Stdout, wf: &pb::Workflow) -> anyhow::Result<()> {
    out.line(format_args!(
        "workflow {} — {}: {}",
        wf.id, wf.name, wf.state_label
    ))?;
    if !wf.reason.is_empty() {
        out.line(format_args!("  reason: {}", wf.reason))?;
    }
    for s in &wf.steps {
        out.line(format_args!("  step {:<10} {}", s.name, s.state_label))?;
        if !s.reason.is_empty() {
            out.line(format_args!("    reason: {}", s.reason))?;
        }
        if let Some(next) = time(s.next_attempt_at.as_ref()) {
            out.line(format_args!("    next turn: {next}"))?;
        }
        if let Some(r) = &s.receipt {
            out.line(format_args!(
                "    receipt: {} ref={} verified={} identity={}",
                r.outcome,
                r.external_reference,
                verification_name(r.verification()),
                r.request_identity
            ))?;
        }
        if !s.result_json.is_empty() {
            out.line(format_args!("    result: {}", s.result_json))?;
        }
        if let Some(t) = &s.technical {
            let leases = t
                .events
                .iter()
                .filter(|e| e.kind == "lease_acquired")
                .count();
            out.line(format_args!(
                "    technical: lease v{} ({} acquisitions), attempts {}, given back {} (waits {}), checkpoint {}",
                t.lease_version, leases, t.attempts, t.given_back, t.waits, t.checkpoint
            ))?;
        }
    }
    Ok(())
}

/// A workflow as JSON, the same wherever it is printed: product states first, technical
/// details (the lease history, each event with its time, owner and detail) beneath.
pub(crate) fn workflow_json(wf: &pb::Workflow) -> Value {
    json!({
        "id": wf.id,
        "client_key": wf.client_key,
        "name": wf.name,
        "state": state_name(wf.state()),
        "label": wf.state_label,
        "reason": non_empty(&wf.reason),
        "created_at": time(wf.created_at.as_ref()),
        "deadline": time(wf.deadline.as_ref()),
        "steps": wf.steps.iter().map(step_json).collect::<Vec<_>>(),
    })
}

fn step_json(s: &pb::Step) -> Value {
    json!({
        "id": s.id,
        "name": s.name,
        "adapter": s.adapter,
        "operation": s.operation,
        "depends_on": s.depends_on,
        "state": state_name(s.state()),
        "label": s.state_label,
        "reason": non_empty(&s.reason),
        "next_attempt_at": time(s.next_attempt_at.as_ref()),
        "input": json_text(&s.input_json),
        "result": json_text(&s.result_json),
        "receipt": s.receipt.as_ref().map(|r| json!({
            "outcome": r.outcome,
            "external_reference": r.external_reference,
            "verification": verification_name(r.verification()),
            "request_identity": r.request_identity,
            "adapter": r.adapter,
            "adapter_version": r.adapter_version,
            "committed_at": time(r.committed_at.as_ref()),
        })),
        "technical": s.technical.as_ref().map(|t| json!({
            "step_state": t.step_state,
            "lease_version": t.lease_version,
            "lease_owner": non_empty(&t.lease_owner),
            "lease_expires_at": time(t.lease_expires_at.as_ref()),
            "attempts": t.attempts,
            "given_back": t.given_back,
            "waits": t.waits,
            "checkpoint": non_empty(&t.checkpoint),
            "events": t.events.iter().map(|e| json!({
                "kind": e.kind,
                "at": time(e.at.as_ref()),
                "owner": non_empty(&e.owner),
                "lease_version": e.lease_version,
                "attempt_id": non_empty(&e.attempt_id),
                "detail": json_text(&e.detail_json),
            })).collect::<Vec<_>>(),
        })),
    })
}

/// One change of a followed workflow, as a JSON line.
fn event_json(e: &pb::WorkflowEvent) -> Value {
    json!({
        "event": "changed",
        "workflow_id": e.workflow_id,
        "at": time(e.at.as_ref()),
        "workflow_state": state_name(e.state()),
        "workflow_label": e.state_label,
        "step": non_empty(&e.step_name),
        "step_state": state_name(e.step_state()),
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
        /// With --succeeded: the result found, as JSON, for dependent steps to use.
        #[arg(long, requires = "succeeded")]
        result: Option<String>,
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
fn print_review(out: &mut Stdout, r: &z29c_console::view::ReviewView) -> anyhow::Result<()> {
    let at = |t: &Option<DateTime<Utc>>| {
        t.map(|t| t.format("%H:%M:%S%.3f").to_string())
            .unwrap_or_default()
    };
    out.line(format_args!(
        "{}  v{}  {}  opened {}",
        r.id,
        r.version,
        r.state,
        at(&r.created_at)
    ))?;
    out.line(format_args!(
        "  workflow {} ({}): {}",
        r.workflow_name, r.workflow_id, r.workflow_label
    ))?;
    out.line(format_args!(
        "  step {}  {}/{}  identity {}  attempts {}",
        r.step_name, r.adapter, r.operation, r.request_identity, r.attempts_made
    ))?;
    out.line(format_args!("  reason: {}", r.reason))?;
    for e in &r.evidence {
        let reference = if e.external_reference.is_empty() {
            String::new()
        } else {
            format!("  reference {}", e.external_reference)
        };
        out.line(format_args!("  {} {}{reference}", at(&e.at), e.summary))?;
    }
    Ok(())
}

/// The review items with each one's workflow, as the console shows them.
async fn review_queue(
    reviews: &Reviews,
    workflows: &Client,
    include_resolved: bool,
) -> anyhow::Result<Vec<z29c_console::view::ReviewView>> {
    let items = reviews
        .list(include_resolved)
        .await
        .map_err(|e| failed("review list refused", e))?;
    let mut views = Vec::with_capacity(items.len());
    for item in &items {
        // an item is shown even when its workflow cannot be read
        let workflow = workflows.get(&item.workflow_id).await.ok();
        views.push(z29c_console::view::review(item, workflow.as_ref()));
    }
    Ok(views)
}

pub(crate) async fn review(
    server: &str,
    workflow_server: &str,
    command: ReviewCommand,
    output: Output,
    access: &Access,
) -> anyhow::Result<()> {
    let reviews = Reviews::connect(server, &access.client_access())
        .await
        .map_err(|e| failed("the review service", e))?;
    let workflows = connect(workflow_server, access).await?;
    let mut out = Stdout::default();
    let mut show = |items: &[z29c_console::view::ReviewView]| -> anyhow::Result<()> {
        match output {
            Output::Json => out.line(serde_json::to_string(items)?),
            Output::Text if items.is_empty() => out.line("no review items"),
            Output::Text => items.iter().try_for_each(|i| print_review(&mut out, i)),
        }
    };
    match command {
        ReviewCommand::List { all } => show(&review_queue(&reviews, &workflows, all).await?),
        ReviewCommand::Show { item_id } => {
            let items = review_queue(&reviews, &workflows, true).await?;
            let item = items
                .iter()
                .find(|i| i.id == item_id)
                .ok_or_else(|| anyhow::Error::new(Exit::BadInput).context("no such review item"))?;
            show(std::slice::from_ref(item))
        }
        ReviewCommand::Resolve {
            item_id,
            version,
            reason,
            succeeded,
            result,
            failed: did_fail,
            retry,
            operator,
        } => {
            let resolution = match (succeeded, did_fail, retry) {
                (Some(external_reference), false, false) => Resolution::Succeeded {
                    external_reference,
                    result_json: result,
                },
                (None, true, false) => Resolution::Failed,
                (None, false, true) => Resolution::Retry,
                _ => {
                    return Err(anyhow::Error::new(Exit::BadInput)
                        .context("give exactly one of --succeeded REF, --failed, --retry"));
                }
            };
            let item = reviews
                .with_operator(&operator)
                .map_err(|e| failed("--operator", e))?
                .resolve(&item_id, version, resolution, &reason)
                .await
                .map_err(|e| failed("resolve refused", e))?;
            let workflow = workflows.get(&item.workflow_id).await.ok();
            show(&[z29c_console::view::review(&item, workflow.as_ref())])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_product_state_reads_with_hyphens_or_underscores_and_prints_in_snake_case() {
        for p in z29c_core::ProductState::ALL {
            let wire = parse_state(&p.as_str().replace('_', "-")).unwrap();
            assert_eq!(parse_state(p.as_str()).unwrap(), wire);
            assert_eq!(state_name(wire), Some(p.as_str()));
            assert_eq!(state_label(wire), p.label());
        }
        let e = parse_state("done").unwrap_err();
        assert!(e.contains("needs-review"), "{e}");
        assert_eq!(state_name(pb::ProductState::Unspecified), None);
    }

    #[test]
    fn json_times_are_rfc_3339_and_json_text_is_a_value() {
        let t = prost_types::Timestamp {
            seconds: 1_767_225_600,
            nanos: 5_000_000,
        };
        assert_eq!(time(Some(&t)).as_deref(), Some("2026-01-01T00:00:00.005Z"));
        assert_eq!(json_text(r#"{"id":"res_1"}"#)["id"], "res_1");
        assert_eq!(json_text(""), Value::Null);
        assert_eq!(json_text("not json"), "not json");
    }

    #[test]
    fn refusals_map_to_exit_codes_and_read_without_debug_formatting() {
        let e = failed(
            "submit refused",
            tonic::Status::invalid_argument("steps[1].depends_on[0]: unknown step \"zz\"").into(),
        );
        assert_eq!(e.downcast_ref::<Exit>(), Some(&Exit::BadInput));
        let text = format!("{e:#}");
        assert!(
            text.starts_with("submit refused: invalid argument: steps[1]"),
            "{text}"
        );
        assert!(!text.contains("InvalidArgument"), "{text}");
        let e = failed("x", tonic::Status::unavailable("gone").into());
        assert_eq!(e.downcast_ref::<Exit>(), Some(&Exit::Unavailable));
    }
}
