//! Committers that answer many callers with one statement: the executor's receipts
//! ([`crate::receipts::ReceiptBatches`]) and the gateway's *invocation began*
//! ([`crate::invocations::InvocationBatches`]).
//!
//! A batch is whatever is waiting when a committer is free (no timer), so a lone caller waits
//! for nothing; several committers run at once, each with its own connection from the pool
//! the statement is run on.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{Mutex, mpsc, oneshot};

/// A handle on running committers. Cheap to clone; committers stop when every handle is gone.
pub(crate) struct Shared<T, A> {
    waiting: mpsc::Sender<(T, oneshot::Sender<A>)>,
}

impl<T, A> Clone for Shared<T, A> {
    fn clone(&self) -> Self {
        Self {
            waiting: self.waiting.clone(),
        }
    }
}

impl<T: Send + 'static, A: Send + 'static> Shared<T, A> {
    /// Starts `committers` tasks, each handing up to `max_batch` waiting items to `write`,
    /// which answers each of them, in order.
    pub(crate) fn start<W, F>(committers: usize, max_batch: usize, write: W) -> Self
    where
        W: Fn(Vec<T>) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Vec<A>> + Send,
    {
        let (waiting, rx) = mpsc::channel::<(T, oneshot::Sender<A>)>(1_024);
        let rx = Arc::new(Mutex::new(rx));
        let max = max_batch.max(1);
        for _ in 0..committers.max(1) {
            let (rx, write) = (rx.clone(), write.clone());
            tokio::spawn(async move {
                loop {
                    let mut batch = Vec::with_capacity(max);
                    {
                        let mut rx = rx.lock().await;
                        if rx.recv_many(&mut batch, max).await == 0 {
                            return; // every handle is gone
                        }
                    }
                    let (items, answers): (Vec<T>, Vec<_>) = batch.into_iter().unzip();
                    for (answer, a) in answers.into_iter().zip(write(items).await) {
                        let _ = answer.send(a);
                    }
                }
            });
        }
        Self { waiting }
    }

    /// `item` in the next batch, and its answer; `None` if the committers are gone (or
    /// `write` answered fewer items than it was given).
    pub(crate) async fn ask(&self, item: T) -> Option<A> {
        let (answer, answered) = oneshot::channel();
        self.waiting.send((item, answer)).await.ok()?;
        answered.await.ok()
    }
}
