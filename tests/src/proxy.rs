//! A TCP proxy the harness puts between one service and PostgreSQL, to cut the connection
//! while a call is in flight, or to drop it exactly at the `COMMIT` of a chosen transaction:
//! before the server saw it (the commit never happened) or after (it happened; the worker
//! cannot know). sqlx sends `COMMIT` as a simple-protocol `Query` message, which the proxy
//! spots in the client's byte stream; the transaction is chosen by a piece of its statements'
//! text, which the client sends in each `Parse` when it caches no prepared statements
//! (`statement-cache-capacity=0` in its URL).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, watch};

/// `Query` message: 'Q', length 11 (4 + "COMMIT" + NUL), "COMMIT\0".
const COMMIT: &[u8] = b"Q\x00\x00\x00\x0bCOMMIT\x00";
/// `Query` message: 'Q', length 13 (4 + "ROLLBACK" + NUL), "ROLLBACK\0".
const ROLLBACK: &[u8] = b"Q\x00\x00\x00\x0dROLLBACK\x00";

/// Where a connection is dropped relative to the trapped `COMMIT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitTrap {
    /// The `COMMIT` is never forwarded: PostgreSQL rolls the transaction back.
    DropBefore,
    /// The `COMMIT` reaches PostgreSQL, its answer never reaches the client.
    DropAfter,
}

#[derive(Debug)]
struct State {
    upstream: String,
    refusing: AtomicBool,
    /// Bumped to close every open connection.
    cut: watch::Sender<u64>,
    /// The trap, and the text a transaction must have sent for its `COMMIT` to spring it.
    trap: Mutex<Option<(CommitTrap, Vec<u8>)>>,
    sprung: AtomicBool,
}

#[derive(Debug, Clone)]
pub struct Proxy {
    pub port: u16,
    state: Arc<State>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(State {
            upstream,
            refusing: AtomicBool::new(false),
            cut: watch::Sender::new(0),
            trap: Mutex::new(None),
            sprung: AtomicBool::new(false),
        });
        let s = state.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if s.refusing.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                tokio::spawn(pipe(client, s.clone()));
            }
        });
        Ok(Self { port, state })
    }

    /// Closes every connection and refuses new ones for `period`.
    pub async fn cut_for(&self, period: Duration) {
        self.state.refusing.store(true, Ordering::SeqCst);
        self.state.cut.send_modify(|g| *g += 1);
        tokio::time::sleep(period).await;
        self.state.refusing.store(false, Ordering::SeqCst);
    }

    /// Drops the connection at the next `COMMIT` of a transaction that sent `marker` (a piece
    /// of one of its statements), as `trap` says; other transactions' `COMMIT`s pass.
    pub async fn trap_commit_of(&self, marker: &str, trap: CommitTrap) {
        *self.state.trap.lock().await = Some((trap, marker.as_bytes().to_vec()));
    }

    /// Whether a trapped `COMMIT` has been dropped.
    pub fn sprung(&self) -> bool {
        self.state.sprung.load(Ordering::SeqCst)
    }
}

async fn pipe(client: TcpStream, state: Arc<State>) {
    let Ok(server) = TcpStream::connect(&state.upstream).await else {
        return;
    };
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let mut cut = state.cut.subscribe();
    let severed = Arc::new(AtomicBool::new(false));
    let down = {
        let severed = severed.clone();
        async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = match sr.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if severed.load(Ordering::SeqCst) {
                    continue; // the answer to the trapped COMMIT is swallowed
                }
                if cw.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    let up = async move {
        let mut buf = vec![0u8; 16 * 1024];
        // what this connection's open transaction sent, kept only while a trap is set
        let mut sent: Vec<u8> = Vec::new();
        let has = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let chunk = &buf[..n];
            let mut guard = state.trap.lock().await;
            if guard.is_some() {
                sent.extend_from_slice(chunk);
            }
            let ends = has(chunk, COMMIT);
            let chosen = ends && guard.as_ref().is_some_and(|(_, marker)| has(&sent, marker));
            if ends || has(chunk, ROLLBACK) {
                sent.clear();
            }
            let trap = if chosen { guard.take() } else { None };
            drop(guard);
            if let Some((trap, _)) = trap {
                match trap {
                    CommitTrap::DropBefore => {
                        state.sprung.store(true, Ordering::SeqCst);
                        return;
                    }
                    CommitTrap::DropAfter => {
                        severed.store(true, Ordering::SeqCst);
                        let _ = sw.write_all(chunk).await;
                        state.sprung.store(true, Ordering::SeqCst);
                        // let the server commit, then vanish without its answer
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        return;
                    }
                }
            }
            if sw.write_all(chunk).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = down => {}
        _ = up => {}
        _ = cut.changed() => {}
    }
}
