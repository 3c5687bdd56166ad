//! Store URLs and the errors of stores.

/// A parsed store URL.
///
/// * `file:///abs/path/` — a directory.
/// * `s3://bucket/prefix/?endpoint=http://127.0.0.1:9000&region=us-east-1&path_style=true`
///   — credentials from the standard AWS environment variables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreUrl {
    _private: (),
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store {store}: {message}")]
    Unavailable { store: String, message: String },
}

impl StoreError {
    /// Whether retrying later may succeed.
    pub fn is_retryable(&self) -> bool {
        true
    }
}
