//! # shardline
//!
//! The engine shell: runtime, transport, fronts, embedding API and the
//! `shardline` command line. It carries out what the sans-IO state machines
//! of `shardline-core` decide; it decides nothing about shards or members.
//!
//! ```text
//!  clients ──TCP (SO_REUSEPORT)──► gateway ─┐           data executor k (pinned)
//!                                           ├─► ShardRegion (per type) ─► entities
//!  other nodes ──data lane (per core)──────►┘        │ Forward to another node's core: data lane
//!                                                    │ SendToCoordinator / SendToRegion: ring
//!                                                    ▼
//!  other nodes ◄──control lane──► control executor: ClusterNode (gossip, heartbeats,
//!                                 phi-accrual, downing) + ShardCoordinator (when oldest)
//! ```
//!
//! ## Threading model
//! One monoio executor (io_uring, `COOP_TASKRUN|TASKRUN_FLAG`; see
//! `docs/decisions/runtime.md`) per data core and one control executor, each
//! on its own thread; state inside an executor is `Rc<RefCell<_>>` and never
//! crosses threads; executors talk only through bounded rings
//! (`runtime::ring`). The blocking [`client::Client`] and the embedding
//! handle ([`Node`]) are used from ordinary threads.
//!
//! ## Invariants
//! - Every queue is bounded: rings, region buffers (`buffer_size`), each
//!   connection's outbox (reading stops above its high-water mark).
//! - A frame longer than 16 MiB or failing validation closes only the
//!   connection it came on.
//! - Every forwarded message is answered: by its entity, by a failure status,
//!   or `TimedOut` when its link broke or no reply came by its ask deadline
//!   plus 500 ms (10 s for a message without a deadline).

pub mod api;
pub mod cli;
pub mod client;
pub mod config;
pub mod entity;
pub mod envelope;
pub mod gateway;
pub mod node;
pub mod persistence;
/// The node's sans-IO control plane and the types of its inputs and
/// outputs, for drivers other than the node's own control executor (the
/// deterministic simulation in `shardline-tests`). Not a stable user API:
/// hidden from the docs and may change with any release.
#[doc(hidden)]
pub mod plane {
    pub use crate::envelope::ControlFrame;
    pub use crate::node::plane::control::*;
    pub use crate::node::{ClusterView, StatsEvent};
    pub use crate::persistence::coordinator::{
        next_epoch, CoordinatorConfig as JournalConfig, RecoveredCoordinator,
    };
    pub use crate::status::{AdminAnswer, CoordinatorCommand};

    /// The node's sans-IO data plane (one per data core) and the types of
    /// its inputs and outputs, for drivers other than the node's own data
    /// executor (the deterministic simulation in `shardline-tests`).
    pub mod data {
        pub use crate::envelope::{
            encode_frame, DataFrame, FrameError, Status, FRAME_HEADER_BYTES,
        };
        pub use crate::node::msg::{ReplyTo, ToControl, UserEnvelope};
        pub use crate::node::plane::data::*;
        pub use crate::node::watch::{EntityKey, SystemMsg};
    }
}
pub(crate) mod runtime;

/// A hash map with foldhash and a random seed per map: fast, and not
/// predictable by a client choosing the keys (entity ids, request ids,
/// type names). The data plane's, the entity host's, the data executor's
/// and the fronts' maps on the request path use it (SipHash cost about 1 %
/// of a data core's time per request in the fronts' maps).
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
pub mod status;
pub mod transport;
pub mod typed;

pub use config::NodeConfig;
pub use entity::worker::WorkerSettings;
pub use entity::{
    AskId, Entity, EntityAskError, EntityContext, EntityError, EntityFactory, TerminatedReason,
};
pub use node::{
    AskError, EntityRef, EntitySettings, Node, NodeError, NodeStatus, RegionHandle,
    BIND_RETRY_TIMEOUT,
};
pub use runtime::disable_transparent_huge_pages;
pub use shardline_core::ids::EntityId;
pub use status::WorkerPoolStatus;
