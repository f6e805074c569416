//! Submissions of many workflows in one statement: the scheduler's submission batching (on
//! unless its `submission_batch` is 1).
//!
//! Each submission is validated on its own first ([`Prepared::new`]); what a committer finds
//! waiting is written by [`Store::insert_workflows`], one round trip and one commit for all of
//! them. A submission whose client key was taken, or whose shared statement failed, wrote
//! nothing there and takes [`Store::submit_prepared`], which answers it as a submission of its
//! own would be answered (the earlier workflow, a conflict, or the new one).

use crate::Result;
use crate::Store;
use crate::shared::Shared;
use crate::workflows::{Prepared, Submitted};

/// Committers that write concurrent submissions in shared statements. Cheap to clone;
/// committers stop when every handle is gone.
#[derive(Clone)]
pub struct SubmissionBatches {
    store: Store,
    shared: Shared<Prepared, Option<Submitted>>,
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
        let shared = Shared::start(committers, max_batch, move |batch: Vec<Prepared>| {
            let store = batches.clone();
            async move {
                // a failed statement wrote nothing: each submission goes its own way
                store.insert_workflows(&batch).await.unwrap_or_else(|e| {
                    tracing::warn!(error = %e, submissions = batch.len(), "shared submission statement failed; each is submitted on its own");
                    vec![None; batch.len()]
                })
            }
        });
        Self {
            store: store.clone(),
            shared,
        }
    }

    /// Submits in the next shared statement, or on its own where that one did not take it;
    /// answered exactly as [`Store::submit_workflow`] answers.
    pub async fn submit(&self, prepared: Prepared) -> Result<Submitted> {
        if let Some(Some(created)) = self.shared.ask(prepared.clone()).await {
            return Ok(created);
        }
        self.store.submit_prepared(&prepared).await
    }
}
