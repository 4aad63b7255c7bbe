//! The client-to-node frame (kept in its own module so that the types rkyv
//! generates for it stay private).

use rkyv::{Archive, Deserialize, Serialize};

/// A frame from a client to a node.
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs)))]
pub enum ClientFrame {
    /// An entity request. Type name and entity id are raw bytes on the wire
    /// so that a bad id gets an `InvalidEntityId` answer, not a closed
    /// connection.
    Request {
        /// Chosen by the client; echoed in the response.
        request_id: u64,
        /// Entity type name (UTF-8, 1..=255 bytes).
        type_name: Vec<u8>,
        /// Entity id (UTF-8, 1..=255 bytes).
        entity_id: Vec<u8>,
        /// The message for the entity.
        payload: Vec<u8>,
    },
    /// Admin: this node's status; answered with a JSON [`crate::node::NodeStatus`].
    NodeStatus {
        /// Echoed in the response.
        request_id: u64,
    },
    /// Admin: a coordinator command, answered by the member that runs the
    /// coordinators (any node forwards it there): with `rebalance` false,
    /// the allocation table (JSON [`crate::status::AllocationTable`]); with
    /// `rebalance` true, one rebalance round now for `type_name` (empty:
    /// every type), answered with a JSON [`crate::status::RebalanceAnswer`].
    /// An error status carries the reason as text.
    CoordinatorAdmin {
        /// Echoed in the response.
        request_id: u64,
        /// Run a rebalance round (else: read the allocation table).
        rebalance: bool,
        /// The entity type of a rebalance (UTF-8; empty: every type).
        type_name: Vec<u8>,
    },
}
