//! Async client (tokio).
