//! What can go wrong talking to z29c, each variant saying what the caller can do about it.

use tonic::Code;
use z29c_proto::workflow_file::WorkflowFileError;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error from the client. Its `Display` is the reason in words (the server's own message
/// for a refusal); [`Error::code`] is the gRPC code, for deciding what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The connection settings cannot be used (a TLS file, the URL, the token): fix them.
    #[error("{0}")]
    Config(String),
    /// Nothing answered at the address: start the service or correct the address.
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    /// The service refused or failed the call. `INVALID_ARGUMENT`, `NOT_FOUND`,
    /// `FAILED_PRECONDITION` (`ABORTED` for a stale review version) need a different request;
    /// `UNAVAILABLE` may pass if tried again.
    #[error("{}", status_text(*code, message))]
    Status { code: Code, message: String },
    /// A workflow file that cannot become a submission: fix the field it names.
    #[error("workflow file: {0}")]
    WorkflowFile(#[from] WorkflowFileError),
    /// The service answered without something the protocol promises (a server of another
    /// version, or a broken one).
    #[error("unexpected answer: {0}")]
    Protocol(&'static str),
}

impl Error {
    /// The gRPC code this error amounts to: the server's for a refusal, `UNAVAILABLE` when
    /// nothing answered, `INVALID_ARGUMENT` for unusable settings or files.
    pub fn code(&self) -> Code {
        match self {
            Self::Config(_) | Self::WorkflowFile(_) => Code::InvalidArgument,
            Self::Unreachable { .. } => Code::Unavailable,
            Self::Status { code, .. } => *code,
            Self::Protocol(_) => Code::Internal,
        }
    }

    /// The server's message for a refusal (empty for errors that did not come from it).
    pub fn message(&self) -> &str {
        match self {
            Self::Status { message, .. } => message,
            _ => "",
        }
    }

    pub(crate) fn config(e: impl std::fmt::Display) -> Self {
        Self::Config(format!("{e:#}"))
    }

    pub(crate) fn unreachable(url: &str, e: &dyn std::error::Error) -> Self {
        // a transport error's own text is "transport error"; the reason is in its sources
        let mut reason = e.to_string();
        let mut source = e.source();
        while let Some(s) = source {
            reason.push_str(": ");
            reason.push_str(&s.to_string());
            source = s.source();
        }
        Self::Unreachable {
            url: url.to_owned(),
            reason,
        }
    }
}

impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        Self::Status {
            code: s.code(),
            message: s.message().to_owned(),
        }
    }
}

/// A refusal in words: the code's name, then the server's reason.
fn status_text(code: Code, message: &str) -> String {
    let name = match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown error",
        Code::InvalidArgument => "invalid argument",
        Code::DeadlineExceeded => "deadline exceeded",
        Code::NotFound => "not found",
        Code::AlreadyExists => "already exists",
        Code::PermissionDenied => "permission denied",
        Code::ResourceExhausted => "resource exhausted",
        Code::FailedPrecondition => "failed precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out of range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal error",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data loss",
        Code::Unauthenticated => "unauthenticated",
    };
    if message.is_empty() {
        name.to_owned()
    } else {
        format!("{name}: {message}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_shows_the_servers_words_and_keeps_its_code() {
        let e = Error::from(tonic::Status::not_found("no workflow 0199"));
        assert_eq!(e.to_string(), "not found: no workflow 0199");
        assert_eq!(e.code(), Code::NotFound);
        assert_eq!(e.message(), "no workflow 0199");
        let e = Error::from(tonic::Status::new(Code::Unavailable, ""));
        assert_eq!(e.to_string(), "unavailable");
    }

    #[test]
    fn an_unreachable_service_names_the_cause_not_only_the_wrapper() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        #[derive(Debug, thiserror::Error)]
        #[error("transport error")]
        struct Transport(#[source] std::io::Error);
        let e = Error::unreachable("http://127.0.0.1:9", &Transport(io));
        assert_eq!(
            e.to_string(),
            "cannot reach http://127.0.0.1:9: transport error: refused"
        );
        assert_eq!(e.code(), Code::Unavailable);
    }
}
