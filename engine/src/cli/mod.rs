//! Implementations of the `shardline` command line's subcommands. Each
//! subcommand lives in its own module; [`main`] parses and dispatches, and
//! is what `src/bin/shardline.rs` runs (and `shardline-bench node`, which
//! starts the bench's nodes from the bench binary itself).

mod entry;
pub mod journal;
pub mod node;
pub mod rebalance;
pub mod shard_of;
pub mod status;

pub use entry::main;

use thiserror::Error;

/// Why `shardline node`, `status` or `rebalance` failed; its `Display` is
/// the line the command prints before exiting with status 1.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CliError {
    /// The node's config file is invalid (file, key and reason).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The node could not start (a bind failure, a `data_dir` held by
    /// another process or recorded for another cluster, ...).
    #[error(transparent)]
    Node(#[from] crate::node::NodeError),
    /// Writing the output failed (e.g. a closed pipe).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The JSON output could not be encoded.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A request to a node failed: `what` names the node and what was
    /// asked of it.
    #[error("{what}: {error}")]
    Request {
        /// The node and the request, e.g. "cannot connect to 127.0.0.1:7201".
        what: String,
        /// The client's error (in the message, so not repeated as a
        /// source).
        error: crate::client::ClientError,
    },
    /// The node stopped without leaving on a signal: refused at join, or
    /// downed by the cluster (the reason).
    #[error("{0}")]
    Stopped(String),
}

impl CliError {
    /// A [`CliError::Request`] naming `what` was asked.
    pub(crate) fn request(what: String) -> impl FnOnce(crate::client::ClientError) -> CliError {
        move |error| CliError::Request { what, error }
    }
}
