//! The `[cluster]` table: what a node does when the cluster will not have
//! it.

use serde::{Deserialize, Serialize};

/// What a node does when a seed node refuses it at the handshake (another
/// protocol version, `number_of_shards` or cluster name): it never forms a
/// cluster of its own either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnJoinRefused {
    /// Log the refusal and keep asking the seeds (a seed restarted with a
    /// matching configuration lets it in). The default.
    #[default]
    Retry,
    /// Stop: `shardline node` exits with the refusal as its error and exit
    /// code 1, so that a supervisor sees the misconfiguration (Akka's
    /// `configuration-compatibility-check.enforce-on-join`, which shuts a
    /// refused joining node down).
    Exit,
}

/// The `[cluster]` table (every key optional).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterTableConfig {
    /// `"retry"` (default) or `"exit"`: see [`OnJoinRefused`].
    pub on_join_refused: OnJoinRefused,
}
