//! [`ApiError`]: what the admin operations fail with, and its one mapping
//! to gRPC statuses and HTTP status codes.

use axum::http::StatusCode;

use crate::store::StoreError;

/// Why an admin operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request cannot be accepted (policy errors: one
    /// `FILE:LINE:COLUMN: message` per line).
    #[error("{0}")]
    Invalid(String),
    /// The thing asked for does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with the current state (a pool still in use).
    #[error("{0}")]
    Conflict(String),
    /// No bearer token, or one the controller does not accept.
    #[error("{0}")]
    Unauthenticated(String),
    /// The token's role does not allow the operation.
    #[error("{0}")]
    Forbidden(String),
    /// The request is larger than the controller takes.
    #[error("{0}")]
    TooLarge(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ApiError {
    fn code(&self) -> (tonic::Code, StatusCode) {
        use tonic::Code;
        match self {
            Self::Invalid(_) => (Code::InvalidArgument, StatusCode::BAD_REQUEST),
            Self::NotFound(_) => (Code::NotFound, StatusCode::NOT_FOUND),
            Self::Conflict(_) => (Code::FailedPrecondition, StatusCode::CONFLICT),
            Self::Unauthenticated(_) => (Code::Unauthenticated, StatusCode::UNAUTHORIZED),
            Self::Forbidden(_) => (Code::PermissionDenied, StatusCode::FORBIDDEN),
            Self::TooLarge(_) => (Code::ResourceExhausted, StatusCode::PAYLOAD_TOO_LARGE),
            Self::Store(e) => match e {
                StoreError::PolicyNotFound { .. } | StoreError::StageNotFound { .. } => {
                    (Code::NotFound, StatusCode::NOT_FOUND)
                }
                StoreError::Invalid { .. } => (Code::InvalidArgument, StatusCode::BAD_REQUEST),
                StoreError::LeadershipLost { .. } => {
                    (Code::Unavailable, StatusCode::SERVICE_UNAVAILABLE)
                }
                // The database is unreachable (down, or restarting): the
                // caller may try again.
                StoreError::Database {
                    source: sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed,
                    ..
                } => (Code::Unavailable, StatusCode::SERVICE_UNAVAILABLE),
                _ => (Code::Internal, StatusCode::INTERNAL_SERVER_ERROR),
            },
        }
    }

    /// Returns the HTTP status and the body text.
    pub fn http(&self) -> (StatusCode, String) {
        (self.code().1, self.message())
    }

    fn message(&self) -> String {
        match self {
            // The whole chain: the sqlx cause is what an operator needs.
            Self::Store(e) => {
                let mut text = e.to_string();
                let mut source = std::error::Error::source(e);
                while let Some(s) = source {
                    text.push_str(&format!(": {s}"));
                    source = s.source();
                }
                text
            }
            other => other.to_string(),
        }
    }
}

impl From<ApiError> for tonic::Status {
    fn from(e: ApiError) -> Self {
        tonic::Status::new(e.code().0, e.message())
    }
}

/// Returns the gRPC status for a store error.
pub fn status(e: StoreError) -> tonic::Status {
    ApiError::Store(e).into()
}
