//! What a data executor shows its fronts: the [`DataPort`] they call,
//! and the status views of its regions and entities.

use std::rc::Rc;
use std::time::Duration;

use shardline_core::ids::ShardId;

use super::{DataExecutor, DataExecutorRef, TypeIdx};
use crate::gateway::port::{ConnId, DataPort};
use crate::node::RegionStatusView;
use crate::transport::Outbox;

impl DataExecutor {
    pub(crate) fn status(&self) -> Vec<RegionStatusView> {
        // A journal that did not open, or a database that is unavailable.
        let journal_error = self
            .journal_error
            .clone()
            .or_else(|| self.host.journal().log_ref().and_then(|l| l.health()))
            .or_else(|| self.host.remember_error().map(str::to_string));
        let mut v: Vec<RegionStatusView> = (0..self.plane.type_count())
            .map(|i| {
                let ty = TypeIdx(i);
                let region = self.plane.region(ty);
                let st = region.shard_region_state();
                let figures = self.host.figures(ty).unwrap_or_default();
                RegionStatusView {
                    type_name: self.plane.type_name(ty).to_string(),
                    core: self.index,
                    proxy: region.is_proxy(),
                    registered: region.is_registered(),
                    homes_known: region.known_homes(),
                    entities: figures.entities,
                    shards: st
                        .shards
                        .into_iter()
                        .map(|(s, ids)| {
                            (
                                s.0,
                                ids.into_iter().map(|i| i.as_str().to_string()).collect(),
                            )
                        })
                        .collect(),
                    messages_delivered: figures.delivered,
                    entities_activated: figures.activated,
                    dead_letters: region.dead_letters(),
                    journal_error: journal_error.clone(),
                    dead_letter_reasons: region
                        .dead_letters_by_reason()
                        .into_iter()
                        .filter(|(_, n)| *n > 0)
                        .map(|(r, n)| (r.label().to_string(), n))
                        .collect(),
                    buffered: region.buffered(),
                    hand_offs_begun: region.hand_offs_begun(),
                    hand_offs_completed: region.hand_offs_completed(),
                    worker: figures.worker,
                }
            })
            .collect();
        v.sort_by(|a, b| a.type_name.cmp(&b.type_name));
        v
    }

    /// The homes of `shard` this core's regions have cached from the
    /// coordinator, per entity type, in type name order.
    pub(crate) fn cached_homes(&self, shard: ShardId) -> Vec<crate::gateway::http::CachedHome> {
        let mut out: Vec<_> = (0..self.plane.type_count())
            .filter_map(|i| {
                let ty = TypeIdx(i);
                self.plane.region(ty).home_of(shard).map(|(r, _)| {
                    crate::gateway::http::CachedHome {
                        type_name: self.plane.type_name(ty).to_string(),
                        node: r.member.address.0.to_string(),
                        core: r.core,
                    }
                })
            })
            .collect();
        out.sort();
        out
    }
}

/// The data plane's side of the port to the fronts of this executor.
impl DataPort for DataExecutorRef {
    fn open_conn(&self, signal: Rc<Outbox>) -> ConnId {
        self.borrow_mut().add_conn(signal)
    }

    fn close_conn(&self, conn: ConnId) {
        self.borrow_mut().remove_conn(conn);
    }

    fn max_request_frame_bytes(&self) -> usize {
        self.borrow().max_request_frame_bytes()
    }

    fn frame_timeout(&self) -> std::time::Duration {
        self.borrow().config.requests.frame_timeout()
    }

    fn send_timeout(&self) -> std::time::Duration {
        self.borrow().config.requests.send_timeout()
    }

    fn max_native_connections(&self) -> usize {
        self.borrow()
            .config
            .requests
            .max_native_connections_per_core as usize
    }

    fn client_request(
        &self,
        conn: ConnId,
        request_id: u64,
        type_name: &[u8],
        entity_id: &[u8],
        payload: bytes::Bytes,
        read_at: std::time::Instant,
    ) {
        self.borrow_mut()
            .client_request(conn, request_id, type_name, entity_id, payload, read_at);
    }

    fn cached_homes(&self, shard: ShardId) -> Vec<crate::gateway::http::CachedHome> {
        self.borrow().cached_homes(shard)
    }

    fn node_status(&self) -> impl std::future::Future<Output = Option<crate::node::NodeStatus>> {
        crate::node::admin::collect_status(self)
    }

    fn coordinator_admin(
        &self,
        cmd: crate::status::CoordinatorCommand,
    ) -> impl std::future::Future<Output = crate::status::AdminAnswer> {
        crate::node::admin::coordinator_admin(self, cmd)
    }

    fn cluster_stats(
        &self,
        type_name: &str,
        local: &crate::node::NodeStatus,
        wait: Duration,
    ) -> impl std::future::Future<Output = Option<crate::status::ClusterShardingStats>> {
        crate::node::admin::collect_cluster_stats(self, type_name, local, wait)
    }
}
