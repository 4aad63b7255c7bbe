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
}
