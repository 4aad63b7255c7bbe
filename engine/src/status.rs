//! The admin view of a node (`shardline status`, `Client::node_status`):
//! plain structs, serialized as JSON in the native protocol's status answer.
//! Also the admin types that the fronts (`crate::gateway`) and the node
//! both use (`CoordinatorCommand`, `AdminAnswer`): this module sits
//! below both and imports neither.

use serde::{Deserialize, Serialize};

use crate::envelope::Status;

/// One member in a [`NodeStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberStatusView {
    /// Cluster address.
    pub address: String,
    /// Incarnation uid (a JSON string, as everywhere: see `uid_string`).
    #[serde(with = "uid_string")]
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
    /// Shards whose home the region has cached (count; equal to
    /// `number_of_shards` once routing is warm, see
    /// `coordinator.warm_allocation`).
    #[serde(default)]
    pub homes_known: usize,
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
    /// [`Self::dead_letters`] by reason (`buffer_full`, `shutting_down`,
    /// `not_hosted`, `deadline_passed`; reasons never seen are left out), in
    /// counts.
    #[serde(default)]
    pub dead_letter_reasons: std::collections::BTreeMap<String, u64>,
    /// Why the core's journal could not be opened (a corrupt or unreadable
    /// segment, see `shardline journal verify`); `None` when it opened.
    /// While set, the core's durable entities answer `EntityFailed` and the
    /// node is not ready.
    #[serde(default)]
    pub journal_error: Option<String>,
    /// Messages waiting in the region's buffers (count).
    pub buffered: usize,
    /// The core's pool of a stateless worker type (`None` for other types).
    #[serde(default)]
    pub worker: Option<WorkerPoolStatus>,
    /// Shard hand-offs this region began (count).
    #[serde(default)]
    pub hand_offs_begun: u64,
    /// Shard hand-offs this region completed (count).
    #[serde(default)]
    pub hand_offs_completed: u64,
}

/// One core's pool of a stateless worker type (all counts; counters since
/// the node started).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerPoolStatus {
    /// The type's `max_local_workers` on this node.
    pub max_local_workers: usize,
    /// The part of it this core runs (0: its requests go to another core).
    pub core_limit: usize,
    /// Activations now.
    pub activations: usize,
    /// Most activations at one time.
    pub max_activations_seen: usize,
    /// Requests waiting for an idle activation now.
    pub queued: usize,
    /// Requests executed by activations on this core.
    pub executed_locally: u64,
    /// Activations created.
    pub created: u64,
    /// Activations collected after their idle timeout.
    pub collected: u64,
    /// Requests refused because the queue was full.
    pub rejected: u64,
}

/// A node's view of the cluster (`shardline status`, `Client::node_status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// This node's cluster address.
    pub address: String,
    /// This incarnation's uid (a JSON string).
    #[serde(with = "uid_string")]
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
    /// The coordinators running on this node (one per entity type; empty
    /// unless `coordinator_here`).
    #[serde(default)]
    pub coordinators: Vec<CoordinatorStatusView>,
    /// The configured `cluster_name`.
    #[serde(default)]
    pub cluster_name: String,
    /// The cluster's id as this node knows it (`None` before it joined;
    /// see `docs/persistence.md`, "One cluster per data directory").
    #[serde(default)]
    pub cluster_id: Option<String>,
    /// Where this node keeps durable state (`local:<data root id>`);
    /// members with durable types must all have the same one.
    #[serde(default)]
    pub journal_identity: String,
}

/// One coordinator in a [`NodeStatus`]: how its incarnation recovered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinatorStatusView {
    /// Entity type.
    pub type_name: String,
    /// The incarnation's journal writer epoch (0 without a journal).
    pub writer_epoch: u64,
    /// Where its state came from: `journal` (a control journal of the data
    /// root), `database` (the PostgreSQL backend), `recovering` (the
    /// database read is under way), `replicated` (the in-memory copy other coordinators sent this
    /// member), or `empty`.
    pub recovered_from: String,
    /// The control journal directory it recovered from, if any.
    pub journal_dir: Option<String>,
    /// Journal records (snapshot + events) replayed (count).
    pub recovered_records: u64,
    /// Allocated shards in the recovered state (count).
    pub recovered_shards: u64,
    /// Allocated shards now (count).
    pub shards: u64,
    /// Why the coordinator refused to start or stopped (config mismatch,
    /// fenced or failed journal), if it did.
    pub refused: Option<String>,
    /// Why its journal cannot be written or read now (the PostgreSQL
    /// database unreachable: the coordinator waits and retries, and a
    /// recovery under way shows `recovered_from = "recovering"`).
    #[serde(default)]
    pub journal_error: Option<String>,
}

/// One region's figures in [`ClusterShardingStats`] (Akka's
/// `ShardRegionStats`: shard → number of live entities).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionShardStats {
    /// Data core index of the region on its member.
    pub core: u16,
    /// Whether it is a proxy (hosts nothing).
    pub proxy: bool,
    /// Whether the coordinator acknowledged its registration.
    pub registered: bool,
    /// Hosted shards → live entities in each (count).
    pub shards: std::collections::BTreeMap<u32, u32>,
    /// Messages waiting in the region's buffers (count).
    pub buffered: u64,
    /// Messages refused by the region (count).
    pub dead_letters: u64,
}

impl RegionShardStats {
    /// The stats of one region status (entity ids counted per shard).
    pub fn of(r: &RegionStatusView) -> Self {
        RegionShardStats {
            core: r.core,
            proxy: r.proxy,
            registered: r.registered,
            shards: r
                .shards
                .iter()
                .map(|(s, ids)| (*s, u32::try_from(ids.len()).unwrap_or(u32::MAX)))
                .collect(),
            buffered: r.buffered as u64,
            dead_letters: r.dead_letters,
        }
    }
}

/// One member's answer in [`ClusterShardingStats`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberShardStats {
    /// The member's cluster address.
    pub address: String,
    /// Its incarnation uid (a JSON string).
    #[serde(with = "uid_string")]
    pub uid: u64,
    /// Its regions of the asked type, by core.
    pub regions: Vec<RegionShardStats>,
}

/// A member that was asked for (or could not be asked for) its stats and
/// did not answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedMember {
    /// The member's cluster address.
    pub address: String,
    /// Its incarnation uid (a JSON string).
    #[serde(with = "uid_string")]
    pub uid: u64,
    /// `"unreachable"` (the failure detector marks it; not asked) or
    /// `"no answer within N ms"`.
    pub reason: String,
}

/// Cluster-wide sharding stats of one entity type, gathered from every Up
/// member (Akka's `GetClusterShardingStats` / `ClusterShardingStats`,
/// where regions that do not answer in time are reported as failed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ClusterShardingStats {
    /// Members that answered, by address.
    pub members: Vec<MemberShardStats>,
    /// Members that did not answer, by address.
    pub failed: Vec<FailedMember>,
}

/// Writes and reads a member uid as a JSON string: uids use all 64 bits,
/// and JSON readers that parse numbers as IEEE doubles (JavaScript, jq)
/// would round those above 2^53. (The HTTP front's JSON uses it too.)
pub(crate) mod uid_string {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes `uid` as a JSON string of its decimal digits.
    pub fn serialize<S: Serializer>(uid: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(uid)
    }

    /// Reads a string, or a number as nodes before uids were strings
    /// everywhere wrote in their status (so a CLI reads both during a
    /// rolling upgrade).
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Uid {
            Number(u64),
            Text(String),
        }
        match Uid::deserialize(d)? {
            Uid::Number(n) => Ok(n),
            Uid::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// A region in the allocation table: (member address, uid, data core).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionRef {
    /// The member's cluster address.
    pub address: String,
    /// The member's incarnation uid (a JSON string).
    #[serde(with = "uid_string")]
    pub uid: u64,
    /// The data core index on that member.
    pub core: u16,
}

/// A shard's hand-off in progress in an [`AllocationTable`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandOffStatus {
    /// How long ago it started, in milliseconds.
    pub since_ms: u64,
    /// Milliseconds left before it is abandoned (`[coordinator]
    /// handoff_timeout_ms`; the shard then stays with its owner).
    pub abandoned_in_ms: u64,
    /// `waiting_for_acks` (regions have not all acknowledged
    /// `BeginHandOff`) or `stopping` (the owner stops the shard's entities).
    pub phase: String,
    /// Regions whose `BeginHandOffAck` is missing (count; 0 when
    /// `stopping`).
    pub pending_acks: usize,
    /// The region the allocation strategy planned for the shard when the
    /// hand-off started (`null` for a hand-off of a leaving member); the
    /// shard's new home is decided when it is allocated again after it
    /// stopped, from the loads of that moment.
    pub planned_target: Option<RegionRef>,
}

/// One allocated shard in an [`AllocationTable`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardAllocationStatus {
    /// The shard id.
    pub shard: u32,
    /// Its home region.
    pub region: RegionRef,
    /// The generation of its allocation.
    pub generation: u64,
    /// Its hand-off, if one is in progress.
    pub hand_off: Option<HandOffStatus>,
}

/// One region's load in an [`AllocationTable`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionLoad {
    /// The region.
    pub region: RegionRef,
    /// Shards allocated to it (count).
    pub shards: usize,
}

/// One entity type's allocation in an [`AllocationTable`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeAllocation {
    /// The entity type.
    pub type_name: String,
    /// Every allocated shard, by shard id.
    pub shards: Vec<ShardAllocationStatus>,
    /// Every registered region (proxies excluded) with its shard count,
    /// regions without shards included.
    pub regions: Vec<RegionLoad>,
    /// Shards in hand-off now (count).
    pub in_hand_off: usize,
}

/// The coordinators' allocation tables (`GET /v1/coordinator/allocation`,
/// `shardline status --allocation`), answered by the member that runs the
/// coordinators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationTable {
    /// The cluster address of the member that runs the coordinators.
    pub coordinator: String,
    /// Its incarnation uid (a JSON string).
    #[serde(with = "uid_string")]
    pub uid: u64,
    /// Per entity type, by name.
    pub types: Vec<TypeAllocation>,
}

/// A hand-off a requested rebalance round started ([`RebalanceAnswer`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalanceMove {
    /// The shard.
    pub shard: u32,
    /// Its owner, which hands it off.
    pub from: RegionRef,
    /// See [`HandOffStatus::planned_target`].
    pub planned_target: Option<RegionRef>,
}

/// What a requested rebalance round did for one entity type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeRebalance {
    /// The entity type.
    pub type_name: String,
    /// The hand-offs it started.
    pub started: Vec<RebalanceMove>,
    /// Why the round did not run (too few Up members, the strategy failed),
    /// or `null` when it ran (an empty `started` then means the regions are
    /// balanced within the strategy's threshold, or an earlier round is
    /// still in progress).
    pub skipped: Option<String>,
    /// Shards in hand-off after the round (count).
    pub in_hand_off: usize,
}

/// The answer to `POST /v1/coordinator/rebalance` (`shardline rebalance`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalanceAnswer {
    /// The cluster address of the member that runs the coordinators.
    pub coordinator: String,
    /// Its incarnation uid (a JSON string).
    #[serde(with = "uid_string")]
    pub uid: u64,
    /// Per entity type asked for, by name.
    pub types: Vec<TypeRebalance>,
}

/// A coordinator admin command, sent by a front (the HTTP admin routes, the
/// native `CoordinatorAdmin` frame) and answered by the member that runs
/// the coordinators (`node::admin`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoordinatorCommand {
    /// The allocation table of every entity type.
    Allocation,
    /// One rebalance round now, for `type_name` or every type (`None`).
    Rebalance {
        /// The entity type (`None`: every type).
        type_name: Option<String>,
    },
}

/// A coordinator admin command's answer: the JSON body, or why not (a
/// status whose HTTP code the HTTP front's `status_code_of` gives,
/// and the reason).
pub type AdminAnswer = Result<Vec<u8>, (Status, String)>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_uid_is_a_json_string() {
        let uid = u64::MAX - 1; // above 2^53: a double would round it
        let st = NodeStatus {
            address: "127.0.0.1:1".into(),
            uid,
            client_address: "127.0.0.1:2".into(),
            members: vec![MemberStatusView {
                address: "127.0.0.1:1".into(),
                uid,
                status: "Up".into(),
                reachable: true,
            }],
            leader: None,
            coordinator: None,
            coordinator_here: false,
            regions: Vec::new(),
            coordinators: Vec::new(),
            cluster_name: "shardline".into(),
            cluster_id: None,
            journal_identity: String::new(),
        };
        let json = serde_json::to_value(&st).unwrap();
        assert_eq!(json["uid"], serde_json::json!(uid.to_string()));
        assert_eq!(
            json["members"][0]["uid"],
            serde_json::json!(uid.to_string())
        );
        let back: NodeStatus = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, st);
        // A node that wrote them as numbers is still read.
        let mut old = json;
        old["uid"] = serde_json::json!(uid);
        old["members"][0]["uid"] = serde_json::json!(uid);
        let back: NodeStatus = serde_json::from_value(old).unwrap();
        assert_eq!(back, st);
        let stats = ClusterShardingStats {
            members: vec![MemberShardStats {
                address: "a".into(),
                uid,
                regions: Vec::new(),
            }],
            failed: vec![FailedMember {
                address: "b".into(),
                uid,
                reason: "unreachable".into(),
            }],
        };
        let json = serde_json::to_value(&stats).unwrap();
        assert_eq!(
            json["members"][0]["uid"],
            serde_json::json!(uid.to_string())
        );
        assert_eq!(json["failed"][0]["uid"], serde_json::json!(uid.to_string()));
    }
}
