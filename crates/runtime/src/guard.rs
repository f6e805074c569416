//! The door of the public services (`WorkflowService`, `ReviewService`): who is calling
//! (operator tokens), whether a role allows the action, whether the caller is over its
//! submission rate, and the audit record of every refusal and every allowed change.
//!
//! An allowed change's audit entry is handed to the change ([`Guard::admit_change`]): the
//! store writes it in the change's own transaction, so a crash after the commit cannot lose
//! the record of an operator's decision. Refusals, and the allowed calls that changed
//! nothing, are written by one background task from a bounded queue. A flood of refused
//! calls (no credentials, over the rate) must not turn into a flood of inserts: beyond the
//! queue's room, refusals are counted in `z29c_audit_dropped_total` and logged instead.

use std::sync::Arc;

use tokio::sync::mpsc;
use tonic::{Request, Status};
use z29c_core::Action;
use z29c_security::rate::PerCaller;
use z29c_security::{AuthConfig, Caller, Verifier};
use z29c_store::Store;
use z29c_store::audit::AuditEntry;

const AUDIT_QUEUE: usize = 1_024;

/// Authentication, authorization, rate limit and audit for one service.
#[derive(Debug, Clone)]
pub struct Guard {
    service: &'static str,
    verifier: Verifier,
    submissions: Option<Arc<PerCaller>>,
    audit: mpsc::Sender<AuditEntry>,
}

impl Guard {
    /// `submissions`: each caller's submissions per second and burst (0: no limit).
    pub fn new(
        service: &'static str,
        auth: &AuthConfig,
        store: Store,
        submissions: (u32, u32),
    ) -> anyhow::Result<Self> {
        let verifier = Verifier::from_config(auth)?;
        if !verifier.enabled() {
            tracing::warn!(
                service,
                "operator authentication is off: every caller may do everything (set auth.enabled)"
            );
        }
        let (tx, mut rx) = mpsc::channel::<AuditEntry>(AUDIT_QUEUE);
        tokio::spawn(async move {
            while let Some(entry) = rx.recv().await {
                if let Err(e) = store.audit(&entry).await {
                    tracing::error!(error = %e, ?entry, "audit record not written");
                }
            }
        });
        Ok(Self {
            service,
            verifier,
            submissions: PerCaller::new(submissions.0, submissions.1).map(Arc::new),
            audit: tx,
        })
    }

    pub fn verifier(&self) -> &Verifier {
        &self.verifier
    }

    /// The caller of `request` if it may do `action` now; otherwise the status to answer
    /// (`UNAUTHENTICATED`, `PERMISSION_DENIED`, `RESOURCE_EXHAUSTED`), audited. An allowed
    /// change is audited through the queue; [`Guard::admit_change`] hands its entry to the
    /// change instead.
    pub async fn admit<T>(
        &self,
        request: &Request<T>,
        method: &'static str,
        action: Action,
    ) -> Result<Caller, Status> {
        let (caller, entry) = self.check(request, method, action)?;
        if let Some(entry) = entry {
            // an allowed change waits for room: it is never left out of the record
            if self.audit.send(entry).await.is_err() {
                return Err(Status::unavailable("audit log unavailable"));
            }
        }
        Ok(caller)
    }

    /// [`Guard::admit`] for a change, with its audit entry for the change to write in its own
    /// transaction ([`ChangeAudit`]).
    pub async fn admit_change<T>(
        &self,
        request: &Request<T>,
        method: &'static str,
        action: Action,
    ) -> Result<(Caller, ChangeAudit), Status> {
        let (caller, entry) = self.check(request, method, action)?;
        Ok((
            caller,
            ChangeAudit {
                entry,
                queue: self.audit.clone(),
            },
        ))
    }

    /// The caller and, for an allowed change with authentication on, its audit entry; or the
    /// refusal, queued for the audit log.
    fn check<T>(
        &self,
        request: &Request<T>,
        method: &'static str,
        action: Action,
    ) -> Result<(Caller, Option<AuditEntry>), Status> {
        let peer = request.remote_addr().map(|a| a.to_string());
        let caller = match self.verifier.authorize(request.metadata(), action) {
            Ok(c) => c,
            Err(denied) => {
                tracing::warn!(service = self.service, method, reason = %denied, "call refused");
                self.refused(AuditEntry {
                    service: self.service.into(),
                    method: method.into(),
                    subject: denied.subject().map(str::to_owned),
                    action: action.as_str().into(),
                    outcome: denied.kind().into(),
                    detail: denied.to_string(),
                    peer,
                });
                return Err(denied.into());
            }
        };
        if action == Action::Submit
            && let Some(limit) = &self.submissions
        {
            // without authentication every caller is "anonymous": tell them apart by address
            let key = if self.verifier.enabled() {
                caller.subject.clone()
            } else {
                request
                    .remote_addr()
                    .map_or_else(|| caller.subject.clone(), |a| a.ip().to_string())
            };
            if let Err(wait) = limit.check(&key) {
                let detail = format!(
                    "{key} is over its submission rate; retry in {} ms",
                    wait.as_millis().max(1)
                );
                self.refused(AuditEntry {
                    service: self.service.into(),
                    method: method.into(),
                    subject: Some(caller.subject.clone()),
                    action: action.as_str().into(),
                    outcome: "rate_limited".into(),
                    detail: detail.clone(),
                    peer,
                });
                return Err(Status::resource_exhausted(detail));
            }
        }
        let entry = (action.mutates() && self.verifier.enabled()).then(|| AuditEntry {
            service: self.service.into(),
            method: method.into(),
            subject: Some(caller.subject.clone()),
            action: action.as_str().into(),
            outcome: "allowed".into(),
            detail: String::new(),
            peer,
        });
        Ok((caller, entry))
    }

    fn refused(&self, entry: AuditEntry) {
        z29c_telemetry::metrics::counter!(
            z29c_telemetry::CALLS_REFUSED,
            "service" => self.service,
            "outcome" => entry.outcome.clone()
        )
        .increment(1);
        if let Err(mpsc::error::TrySendError::Full(entry)) = self.audit.try_send(entry) {
            z29c_telemetry::metrics::counter!(z29c_telemetry::AUDIT_DROPPED).increment(1);
            tracing::warn!(?entry, "audit queue full; refusal not recorded");
        }
    }
}

/// The audit entry of an allowed change, for the store to write in the change's transaction
/// (`None` when allowed calls are not audited: authentication is off). Call
/// [`ChangeAudit::written`] once the change committed with it. Dropped unwritten (the call
/// was refused further on, failed, or changed nothing), it goes to the background writer's
/// queue as an admitted change always did: the call is on record either way. Should a caller
/// go away while its commit is under way, the entry may be recorded twice; never not at all.
#[derive(Debug)]
#[must_use = "an allowed change's audit entry is written with the change"]
pub struct ChangeAudit {
    entry: Option<AuditEntry>,
    queue: mpsc::Sender<AuditEntry>,
}

impl ChangeAudit {
    /// The entry to write with the change.
    pub fn entry(&self) -> Option<&AuditEntry> {
        self.entry.as_ref()
    }

    /// The change committed, its entry with it: nothing is left to queue.
    pub fn written(mut self) {
        self.entry = None;
    }
}

impl Drop for ChangeAudit {
    fn drop(&mut self) {
        let Some(entry) = self.entry.take() else {
            return;
        };
        match self.queue.try_send(entry) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(entry)) => {
                // an allowed call waits for room: it is never left out of the record
                let queue = self.queue.clone();
                match tokio::runtime::Handle::try_current() {
                    Ok(runtime) => {
                        runtime.spawn(async move {
                            let _ = queue.send(entry).await;
                        });
                    }
                    Err(_) => {
                        tracing::error!(?entry, "audit queue full; allowed call not recorded")
                    }
                }
            }
            Err(mpsc::error::TrySendError::Closed(entry)) => {
                tracing::error!(?entry, "audit log unavailable; allowed call not recorded");
            }
        }
    }
}
