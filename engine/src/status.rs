//! The admin view of a node (`shardline status`, `Client::node_status`):
//! plain structs, serialized as JSON in the native protocol's status answer.

use serde::{Deserialize, Serialize};

/// One member in a [`NodeStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberStatusView {
    /// Cluster address.
    pub address: String,
    /// Incarnation uid.
    pub uid: u64,
    /// Joining, WeaklyUp, Up, Leaving, Exiting, Down, Removed.
    pub status: String,
    /// Whether this node sees it as reachable.
    pub reachable: bool,
}

/// One region in a [`NodeStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionStatusView {
    /// Entity type.
    pub type_name: String,
    /// Data core index.
    pub core: u16,
    /// Whether it is a proxy (hosts nothing).
    pub proxy: bool,
    /// Whether the coordinator acknowledged its registration.
    pub registered: bool,
    /// Hosted shards → ids of their live entities.
    pub shards: std::collections::BTreeMap<u32, Vec<String>>,
    /// Live entities (count).
    pub entities: usize,
    /// Messages handed to entities here (count).
    pub messages_delivered: u64,
    /// Entity incarnations started here (count).
    pub entities_activated: u64,
    /// Messages refused by the region (count).
    pub dead_letters: u64,
    /// Messages waiting in the region's buffers (count).
    pub buffered: usize,
}

/// A node's view of the cluster (`shardline status`, `Client::node_status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// This node's cluster address.
    pub address: String,
    /// This incarnation's uid.
    pub uid: u64,
    /// This node's client address.
    pub client_address: String,
    /// Members as seen from here.
    pub members: Vec<MemberStatusView>,
    /// The leader's address.
    pub leader: Option<String>,
    /// Where the coordinator runs (the oldest Up member).
    pub coordinator: Option<String>,
    /// Whether the coordinator runs on this node.
    pub coordinator_here: bool,
    /// This node's regions.
    pub regions: Vec<RegionStatusView>,
}
