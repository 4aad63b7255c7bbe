//! The port between a data executor's data plane and the fronts that run
//! on it (the native protocol, [`super::native`], and HTTP,
//! [`super::http`]).
//!
//! The fronts own their sockets, decoding and bookkeeping; they reach the
//! data plane only through a [`DataPort`], which the node implements for
//! its data executor and hands to the fronts when it starts them. The data
//! plane answers a front's request through the reply sink, [`super::Fronts`],
//! which the node holds. So the dependencies run one way: the node names
//! the fronts (to start them and to hand them replies), the fronts name only
//! this port and the shared types of [`crate::status`].
//!
//! ```text
//!  native / HTTP connection ──► DataPort::client_request(conn, request id, type, id, payload)
//!                                        │  (the region routes it; an entity answers)
//!  connection's outbox ◄── Fronts::reply(conn, request id, status, payload)
//! ```
//!
//! The port is a generic parameter of the fronts (static dispatch: the
//! request path makes one direct call per request, as before the port).

use std::future::Future;
use std::rc::Rc;
use std::time::{Duration, Instant};

use shardline_core::ids::ShardId;

use super::http::CachedHome;
use crate::status::{AdminAnswer, ClusterShardingStats, CoordinatorCommand, NodeStatus};
use crate::transport::Outbox;

/// A connection of one data executor, numbered by the data plane when a
/// front opens it ([`DataPort::open_conn`]); replies name it
/// ([`super::Fronts::reply`]). Unique per executor for the executor's life.
pub(crate) type ConnId = u64;

/// What the fronts of one data executor need from its data plane. All
/// methods run on the executor's thread and return before any await, except
/// the admin ones, whose futures wait for the other executors (bounded; see
/// each).
pub(crate) trait DataPort: Clone + 'static {
    /// Registers a front connection. `signal` is closed by the data plane
    /// when the node's stop drain ends (the front then answers what it has
    /// read and closes the connection), and when [`DataPort::close_conn`] is
    /// called. Returns the connection's id.
    fn open_conn(&self, signal: Rc<Outbox>) -> ConnId;

    /// Forgets a connection opened by [`DataPort::open_conn`] and closes
    /// its `signal`. Replies still in flight for it are dropped by the sink.
    fn close_conn(&self, conn: ConnId);

    /// The longest request frame the native front reads, in bytes
    /// (`requests.max_message_size_bytes` plus the envelope's overhead).
    fn max_request_frame_bytes(&self) -> usize;

    /// How long a request frame on the native port may take to arrive
    /// whole (`requests.frame_timeout_ms`).
    fn frame_timeout(&self) -> std::time::Duration;

    /// The most native connections this executor keeps open
    /// (`requests.max_native_connections_per_core`).
    fn max_native_connections(&self) -> usize;

    /// How long a client connection may take none of its output before it
    /// is closed (`requests.send_timeout_ms`).
    fn send_timeout(&self) -> std::time::Duration;

    /// Routes one entity request (`type_name`, `entity_id` as read from the
    /// wire, not yet validated). Its answer, an error for a bad type or id
    /// included, comes through [`super::Fronts::reply`] with the same
    /// `conn` and `request_id`, possibly before this returns. `read_at` is
    /// when the front read it (a clock read of the front's, at most a few
    /// tens of µs old): the data plane takes it as the current time instead
    /// of reading the clock again.
    fn client_request(
        &self,
        conn: ConnId,
        request_id: u64,
        type_name: &[u8],
        entity_id: &[u8],
        payload: bytes::Bytes,
        read_at: Instant,
    );

    /// The homes of `shard` this executor's regions have cached from the
    /// coordinator, per entity type, sorted.
    fn cached_homes(&self, shard: ShardId) -> Vec<CachedHome>;

    /// This node's status: the cluster view from the control executor and
    /// the region views of every data executor (waiting at most 2 s for
    /// them). `None` when the control executor did not answer.
    fn node_status(&self) -> impl Future<Output = Option<NodeStatus>>;

    /// Runs a coordinator admin command on the member that runs the
    /// coordinators. `Err((Unavailable, _))` when the control executor does
    /// not answer in time (the forward timeout, 3 s, plus 1 s).
    fn coordinator_admin(&self, cmd: CoordinatorCommand) -> impl Future<Output = AdminAnswer>;

    /// The cluster-wide sharding stats of `type_name` (Akka's
    /// `GetClusterShardingStats`): `local`'s regions of the type and every
    /// other Up member's, waiting at most `wait`; members that did not
    /// answer are listed in `failed`. `None` when the control executor did
    /// not answer at all.
    fn cluster_stats(
        &self,
        type_name: &str,
        local: &NodeStatus,
        wait: Duration,
    ) -> impl Future<Output = Option<ClusterShardingStats>>;
}
