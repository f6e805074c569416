//! Group commit: fenced writes from concurrently running attempts share one transaction and
//! one `COMMIT`.
//!
//! Each write runs exactly the statements it runs alone, inside a `SAVEPOINT` of the shared
//! transaction, so a write refused by its fence (or failing any other way) is rolled back to
//! its savepoint and answered with its own error while the others go on. Nobody hears
//! *committed* before the shared `COMMIT` has returned; if that `COMMIT` fails, every write of
//! the batch hears the failure, exactly as each would have alone. A batch is whatever is
//! waiting when a committer is free (no timer), so a lone write pays no extra latency.
//!
//! Several committers run at once, each on its own connection; writes to one workflow's row
//! (the last receipts of a fan-out) then serialise per batch instead of per step.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::{Connection, PgConnection};
use tokio::sync::{Mutex, mpsc, oneshot};

use uuid::Uuid;
use z29c_core::{AttemptId, LeaseClaim, RequestIdentity};

use crate::leases::{self, CommitOutcome, Observed};
use crate::permits::{self, EndedPermit, Permit, PermitRequest};
use crate::{Result, Store, StoreError};

/// Called once the shared `COMMIT` is known: `Ok` when it succeeded.
type Deliver = Box<dyn FnOnce(std::result::Result<(), String>) + Send>;
/// A write: runs on the shared transaction; says whether it succeeded and how to answer.
type Write = Box<dyn for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, (bool, Deliver)> + Send>;

/// A write and the workflow it locks. A batch runs its writes in workflow order, so two
/// batches lock workflow rows in the same order and cannot deadlock on them.
struct Job {
    workflow: Uuid,
    write: Write,
}

/// A handle on running committers. Cheap to clone; committers stop when every handle is gone.
#[derive(Clone)]
pub struct GroupCommit {
    jobs: mpsc::Sender<Job>,
}

impl std::fmt::Debug for GroupCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCommit").finish_non_exhaustive()
    }
}

impl GroupCommit {
    /// Starts `committers` tasks, each committing up to `max_batch` writes per transaction.
    pub fn start(store: &Store, committers: usize, max_batch: usize) -> Self {
        let (jobs, rx) = mpsc::channel::<Job>(1_024);
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..committers.max(1) {
            tokio::spawn(committer(store.clone(), rx.clone(), max_batch.max(1)));
        }
        Self { jobs }
    }

    /// Runs `write` (a write to `workflow`'s steps) in the next shared transaction and answers
    /// once it is committed.
    pub async fn run<T, F>(&self, workflow: Uuid, write: F) -> Result<T>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T>> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel::<Result<T>>();
        let write: Write = Box::new(move |conn| {
            Box::pin(async move {
                let result = write(conn).await;
                let ok = result.is_ok();
                let deliver: Deliver = Box::new(move |committed| {
                    let _ = answer.send(match (result, committed) {
                        (Ok(v), Ok(())) => Ok(v),
                        (Err(e), _) => Err(e),
                        (Ok(_), Err(e)) => Err(commit_failed(e)),
                    });
                });
                (ok, deliver)
            })
        });
        self.jobs
            .send(Job { workflow, write })
            .await
            .map_err(|_| commit_failed("the committers have stopped".into()))?;
        answered
            .await
            .map_err(|_| commit_failed("the committer was dropped".into()))?
    }
}

fn commit_failed(e: String) -> StoreError {
    StoreError::Database(sqlx::Error::Protocol(format!("group commit: {e}")))
}

async fn committer(store: Store, rx: Arc<Mutex<mpsc::Receiver<Job>>>, max_batch: usize) {
    loop {
        let mut batch = Vec::with_capacity(max_batch);
        {
            let mut rx = rx.lock().await;
            if rx.recv_many(&mut batch, max_batch).await == 0 {
                return; // every handle dropped
            }
        }
        tracing::trace!(writes = batch.len(), "group commit");
        batch.sort_by_key(|j| j.workflow);
        let mut delivers = Vec::with_capacity(batch.len());
        let outcome = async {
            let mut conn = store.pool.acquire().await?;
            let mut tx = conn.begin().await?;
            for job in batch.drain(..) {
                let mut sp = tx.begin().await?;
                let (ok, deliver) = (job.write)(&mut sp).await;
                delivers.push(deliver);
                if ok {
                    sp.commit().await?;
                } else {
                    sp.rollback().await?;
                }
            }
            tx.commit().await
        }
        .await;
        let committed = outcome.map_err(|e: sqlx::Error| e.to_string());
        if let Err(e) = &committed {
            tracing::warn!(error = %e, writes = delivers.len() + batch.len(), "group commit failed");
        }
        for deliver in delivers {
            deliver(committed.clone());
        }
        // writes never started (the transaction failed before them) are dropped: their
        // callers hear that the committer went away, and nothing of theirs was written
        drop(batch);
    }
}

/// The attempt protocol's writes and the gateway's permits, through a [`GroupCommit`]: the same
/// statements and fences as the [`Store`] methods of the same names, sharing a `COMMIT`.
impl GroupCommit {
    /// [`Store::begin_invocation`], group-committed.
    pub async fn begin_invocation(&self, claim: &LeaseClaim) -> Result<i64> {
        let claim = claim.clone();
        self.run(Uuid::nil(), move |conn| {
            Box::pin(async move { leases::begin_invocation_in(conn, &claim).await })
        })
        .await
    }

    /// [`Store::commit_or_keep_late`] with the receipt group-committed (a late observation,
    /// rare, is written alone).
    pub async fn commit_or_keep_late(
        &self,
        store: &Store,
        workflow: Uuid,
        claim: &LeaseClaim,
        observed: &Observed,
    ) -> Result<CommitOutcome> {
        let (c, o) = (claim.clone(), observed.clone());
        let committed = self
            .run(workflow, move |conn| {
                Box::pin(async move { leases::commit_receipt_in(conn, &c, &o).await })
            })
            .await;
        store
            .keep_late_unless_committed(claim, observed, committed)
            .await
    }

    /// [`Store::acquire_permit`], group-committed: a batch locks the limit once, and each
    /// permit in it counts those taken before it in the same transaction.
    pub async fn acquire_permit(&self, req: &PermitRequest<'_>) -> Result<Permit> {
        let req = OwnedPermitRequest::from(req);
        self.run(Uuid::nil(), move |conn| {
            Box::pin(async move { permits::acquire_permit_in(conn, &req.borrow()).await })
        })
        .await
    }

    /// [`Store::begin_invocation_with_permit`], group-committed.
    pub async fn begin_invocation_with_permit(
        &self,
        claim: &LeaseClaim,
        req: &PermitRequest<'_>,
        ended: &[EndedPermit],
    ) -> Result<(Permit, i64)> {
        let (claim, req, ended) = (claim.clone(), OwnedPermitRequest::from(req), ended.to_vec());
        self.run(Uuid::nil(), move |conn| {
            Box::pin(async move {
                permits::begin_invocation_with_permit_in(conn, &claim, &req.borrow(), &ended).await
            })
        })
        .await
    }

    /// [`Store::release_permits`], group-committed.
    pub async fn release_permits(&self, ended: &[EndedPermit]) -> Result<()> {
        let ended = ended.to_vec();
        self.run(Uuid::nil(), move |conn| {
            Box::pin(async move {
                for e in &ended {
                    permits::release_permit_in(&mut *conn, e.permit, e.reason, e.ended).await?;
                }
                Ok(())
            })
        })
        .await
    }

    /// [`Store::release_permit`], group-committed.
    pub async fn release_permit(&self, id: Uuid, reason: &str) -> Result<()> {
        let (reason, ended) = (reason.to_owned(), std::time::Instant::now());
        self.run(Uuid::nil(), move |conn| {
            Box::pin(async move { permits::release_permit_in(conn, id, &reason, ended).await })
        })
        .await
    }
}

/// A [`PermitRequest`] that can move into a write.
pub(crate) struct OwnedPermitRequest {
    adapter: String,
    operation_class: String,
    attempt: Option<AttemptId>,
    request_identity: RequestIdentity,
    gateway: String,
    hold: Duration,
}

impl OwnedPermitRequest {
    pub(crate) fn from(req: &PermitRequest<'_>) -> Self {
        Self {
            adapter: req.adapter.to_owned(),
            operation_class: req.operation_class.to_owned(),
            attempt: req.attempt,
            request_identity: req.request_identity.clone(),
            gateway: req.gateway.to_owned(),
            hold: req.hold,
        }
    }

    pub(crate) fn borrow(&self) -> PermitRequest<'_> {
        PermitRequest {
            adapter: &self.adapter,
            operation_class: &self.operation_class,
            attempt: self.attempt,
            request_identity: &self.request_identity,
            gateway: &self.gateway,
            hold: self.hold,
        }
    }
}
