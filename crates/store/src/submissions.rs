//! Submissions of many workflows in one statement: the scheduler's submission batching (on
//! unless its `submission_batch` is 1).
//!
//! Each submission is validated on its own first ([`Prepared::new`]); what a committer finds
//! waiting is written by [`Store::insert_workflows`], one round trip and one commit for all of
//! them. A submission whose client key was taken, or whose shared statement failed, wrote
//! nothing there and takes [`Store::submit_prepared`], which answers it as a submission of its
//! own would be answered (the earlier workflow, a conflict, or the new one).
//!
//! A submission's audit row, when its call is audited, is written by the statement that creates
//! its workflow, so `created` answers whether it was written. One that changed nothing (its key
//! taken by the same submission) wrote no row: its caller records the call the old way, through
//! the queue of the public service's door.

use crate::Store;
use crate::audit::AuditEntry;
use crate::shared::Shared;
use crate::workflows::{Prepared, Submitted};
use crate::{Result, StoreError};

/// Committers that write concurrent submissions in shared statements. Cheap to clone;
/// committers stop when every handle is gone.
#[derive(Clone)]
pub struct SubmissionBatches {
    store: Store,
    shared: Shared<(Prepared, Option<AuditEntry>), Option<Submitted>>,
}

impl std::fmt::Debug for SubmissionBatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubmissionBatches").finish_non_exhaustive()
    }
}

impl SubmissionBatches {
    /// Starts `committers` tasks, each writing up to `max_batch` submissions per statement on
    /// `batches` (a pool with [`crate::BATCH_SESSION_SETTINGS`]); a submission the statement
    /// did not take goes its own way on `store`.
    pub fn start(batches: &Store, store: &Store, committers: usize, max_batch: usize) -> Self {
        let batches = batches.clone();
        let shared = Shared::start(
            committers,
            max_batch,
            move |batch: Vec<(Prepared, Option<AuditEntry>)>| {
                let store = batches.clone();
                async move {
                    let (submissions, audits): (Vec<Prepared>, Vec<Option<AuditEntry>>) =
                        batch.into_iter().unzip();
                    let audits: Vec<Option<&AuditEntry>> =
                        audits.iter().map(Option::as_ref).collect();
                    // a failed statement wrote nothing: each submission goes its own way
                    store
                        .insert_audited_workflows(&submissions, &audits)
                        .await
                        .unwrap_or_else(|e| {
                            tracing::warn!(error = %e, submissions = submissions.len(), "shared submission statement failed; each is submitted on its own");
                            vec![None; submissions.len()]
                        })
                }
            },
        );
        Self {
            store: store.clone(),
            shared,
        }
    }

    /// Submits in the next shared statement, or on its own where that one did not take it;
    /// answered exactly as [`Store::submit_workflow`] answers.
    pub async fn submit(&self, prepared: Prepared) -> Result<Submitted> {
        self.submit_audited(prepared, None).await
    }

    /// [`SubmissionBatches::submit`], with `audit` written by the statement that creates the
    /// workflow ([`Store::submit_audited`]).
    pub async fn submit_audited(
        &self,
        prepared: Prepared,
        audit: Option<AuditEntry>,
    ) -> Result<Submitted> {
        if let Some(Some(created)) = self.shared.ask((prepared.clone(), audit.clone())).await {
            return Ok(created);
        }
        self.store.submit_audited(&prepared, audit.as_ref()).await
    }
}

impl Store {
    /// [`Store::submit_prepared`], with `audit` (the allowed call that submitted it) written
    /// in the statement that creates the workflow: a new workflow (`created`) is on record
    /// even if its service dies before answering. A submission that changed nothing wrote no
    /// row; its caller records it apart.
    pub async fn submit_audited(
        &self,
        prepared: &Prepared,
        audit: Option<&AuditEntry>,
    ) -> Result<Submitted> {
        match self
            .insert_audited_workflows(std::slice::from_ref(prepared), &[audit])
            .await?
            .pop()
            .flatten()
        {
            Some(created) => Ok(created),
            None => self
                .earlier_submission(prepared)
                .await?
                .ok_or(StoreError::NotFound {
                    what: "workflow of the client key",
                }),
        }
    }
}
