//! The store's one error type and its one mapping from PostgreSQL error codes.

use z29c_core::FenceReason;

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// What went wrong, phrased as what the caller should do about it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The write was made under a lease that is no longer current. Stop working on the step;
    /// keep what you observed as a late observation.
    #[error("fenced: {0}")]
    Fenced(FenceReason),
    /// The named thing does not exist. Do not retry.
    #[error("{what} not found")]
    NotFound { what: &'static str },
    /// The write contradicts durable state (a second receipt, a client key reused with a
    /// different payload, a stale review version). Do not retry the same write.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The input is invalid; `field` names it. Fix the input.
    #[error("invalid {field}: {reason}")]
    Invalid { field: String, reason: String },
    /// An append-only table refused an update or delete. A bug in the caller.
    #[error("append-only: {0}")]
    AppendOnly(String),
    /// No adapter permit is free for this adapter and operation class. Come back later.
    #[error("no permit free for {adapter}/{operation_class} (limit {limit})")]
    PermitsExhausted {
        adapter: String,
        operation_class: String,
        limit: i32,
    },
    /// A transient database condition (serialization failure, deadlock, lost connection).
    /// Safe to retry the whole operation.
    #[error("transient database error: {0}")]
    Transient(#[source] sqlx::Error),
    /// Anything else from the database. Not safe to assume anything; report it.
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),
    /// A stored value did not parse into its domain type: the schema and the code disagree.
    #[error("corrupt stored value: {0}")]
    Corrupt(String),
    /// A file could not be written (an export of a period before its drop). Nothing was
    /// dropped.
    #[error("{0}")]
    Io(String),
    /// Applying migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

impl StoreError {
    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// Whether retrying the same operation may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Transient(_))
    }
}

/// Parses a value read back from PostgreSQL into its domain type.
pub(crate) fn parse<T>(s: &str) -> Result<T>
where
    T: std::str::FromStr<Err = z29c_core::ParseError>,
{
    s.parse()
        .map_err(|e: z29c_core::ParseError| StoreError::Corrupt(e.to_string()))
}

/// SQLSTATE raised by `z29c_reject_mutation()` on append-only tables.
const APPEND_ONLY: &str = "Z29A0";

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::Database(db) => match db.code().as_deref() {
                Some(APPEND_ONLY) => Self::AppendOnly(db.message().to_owned()),
                // unique_violation: the database refused a duplicate
                Some("23505") => Self::Conflict(
                    db.constraint()
                        .map_or_else(|| db.message().to_owned(), |c| format!("{c} violated")),
                ),
                // check_violation, not_null_violation, invalid_text_representation, and
                // foreign_key_violation: a reference to a row that is not there (or, for a
                // step's history, to a step of another workflow)
                Some("23514" | "23502" | "22P02" | "23503") => Self::Invalid {
                    field: db.constraint().unwrap_or("input").to_owned(),
                    reason: db.message().to_owned(),
                },
                // serialization_failure, deadlock_detected, lock_not_available (a table kept
                // busy while a retention period is made), admin/crash shutdown, cannot connect
                Some(
                    "40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03" | "08000" | "08003"
                    | "08006",
                ) => Self::Transient(e),
                _ => Self::Database(e),
            },
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => Self::Transient(e),
            _ => Self::Database(e),
        }
    }
}
