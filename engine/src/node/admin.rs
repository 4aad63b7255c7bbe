//! The coordinator's admin commands (the allocation table, a rebalance
//! round on request), answered by the member that runs the coordinators
//! from their sans-IO state machines; other members forward them there on
//! the control lane (see `control.rs`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use shardline_core::ids::{RegionId, UniqueAddress};
use shardline_core::sharding::{HandOffPhase, ShardCoordinator};

use super::core::DataExecutorRef;
use super::msg::ClusterView;
use super::{NodeStatus, RegionStatusView, StatsEvent, ToControl, ToCore};
use crate::envelope::Status;
use crate::status::{
    AllocationTable, HandOffStatus, RebalanceAnswer, RebalanceMove, RegionLoad, RegionRef,
    ShardAllocationStatus, TypeAllocation, TypeRebalance,
};
use crate::status::{ClusterShardingStats, FailedMember, MemberShardStats, RegionShardStats};

pub(crate) use crate::status::{AdminAnswer, CoordinatorCommand};

/// How long a member waits for the coordinator's member to answer a
/// forwarded command.
pub(crate) const FORWARD_TIMEOUT: Duration = Duration::from_secs(3);

fn region_ref(r: &RegionId) -> RegionRef {
    RegionRef {
        address: r.member.address.0.to_string(),
        uid: r.member.uid.0,
        core: r.core,
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The allocation table of every coordinator in `coordinators` (by type
/// name), at `now` on their clock.
pub(crate) fn allocation(
    me: &UniqueAddress,
    now: Duration,
    coordinators: &BTreeMap<String, ShardCoordinator>,
) -> AllocationTable {
    let mut types: Vec<TypeAllocation> = coordinators
        .iter()
        .map(|(t, c)| {
            let shards: Vec<ShardAllocationStatus> = c
                .allocation()
                .into_iter()
                .map(|a| ShardAllocationStatus {
                    shard: a.shard.0,
                    region: region_ref(&a.region),
                    generation: a.generation.0,
                    hand_off: a.hand_off.map(|h| {
                        let (phase, pending_acks) = match h.phase {
                            HandOffPhase::WaitingForAcks { pending } => {
                                ("waiting_for_acks", pending)
                            }
                            HandOffPhase::Stopping => ("stopping", 0),
                        };
                        HandOffStatus {
                            since_ms: ms(now.saturating_sub(h.since)),
                            abandoned_in_ms: ms(h.deadline.saturating_sub(now)),
                            phase: phase.to_string(),
                            pending_acks,
                            planned_target: h.planned_target.as_ref().map(region_ref),
                        }
                    }),
                })
                .collect();
            let regions = c
                .state()
                .regions
                .iter()
                .map(|(r, s)| RegionLoad {
                    region: region_ref(r),
                    shards: s.len(),
                })
                .collect();
            TypeAllocation {
                type_name: t.clone(),
                in_hand_off: shards.iter().filter(|s| s.hand_off.is_some()).count(),
                shards,
                regions,
            }
        })
        .collect();
    types.sort_by(|a, b| a.type_name.cmp(&b.type_name));
    AllocationTable {
        coordinator: me.address.0.to_string(),
        uid: me.uid.0,
        types,
    }
}

/// Runs one rebalance round now in the coordinator of `type_name`, or of
/// every type. The caller carries out the coordinators' effects.
///
/// # Errors
/// `UnknownEntityType` when no coordinator of `type_name` runs here.
pub(crate) fn rebalance(
    me: &UniqueAddress,
    now: Duration,
    coordinators: &mut BTreeMap<String, ShardCoordinator>,
    type_name: Option<&str>,
) -> Result<RebalanceAnswer, (Status, String)> {
    let mut names: Vec<String> = match type_name {
        Some(t) if coordinators.contains_key(t) => vec![t.to_string()],
        Some(t) => {
            return Err((
                Status::UnknownEntityType,
                format!(
                    "no coordinator of entity type `{}` runs on {}",
                    t.escape_debug(),
                    me.address.0
                ),
            ))
        }
        None => coordinators.keys().cloned().collect(),
    };
    names.sort();
    let mut types = Vec::new();
    for t in names {
        let Some(c) = coordinators.get_mut(&t) else {
            continue;
        };
        let round = c.rebalance_now(now);
        for s in &round.started {
            tracing::info!(
                type_name = t,
                shard = s.shard.0,
                from = %s.from,
                planned_target = ?s.planned_target.as_ref().map(|r| r.to_string()),
                "rebalance on request: hand-off started"
            );
        }
        types.push(TypeRebalance {
            type_name: t,
            started: round
                .started
                .iter()
                .map(|s| RebalanceMove {
                    shard: s.shard.0,
                    from: region_ref(&s.from),
                    planned_target: s.planned_target.as_ref().map(region_ref),
                })
                .collect(),
            skipped: round.skipped,
            in_hand_off: round.in_progress,
        });
    }
    Ok(RebalanceAnswer {
        coordinator: me.address.0.to_string(),
        uid: me.uid.0,
        types,
    })
}

/// Answers `cmd` from the coordinators running here.
pub(crate) fn answer(
    me: &UniqueAddress,
    now: Duration,
    coordinators: &mut BTreeMap<String, ShardCoordinator>,
    cmd: &CoordinatorCommand,
) -> AdminAnswer {
    if coordinators.is_empty() {
        return Err((
            Status::Unavailable,
            format!(
                "the coordinators on {} have not started yet (recovering, or no entity type registered)",
                me.address.0
            ),
        ));
    }
    let body = match cmd {
        CoordinatorCommand::Allocation => serde_json::to_vec(&allocation(me, now, coordinators)),
        CoordinatorCommand::Rebalance { type_name } => {
            serde_json::to_vec(&rebalance(me, now, coordinators, type_name.as_deref())?)
        }
    };
    body.map_err(|e| (Status::EntityFailed, format!("cannot encode JSON: {e}")))
}

// ----- scatter/gather for the fronts (through `gateway::port::DataPort`) -----

/// How long a status request waits for the other executors.
const STATUS_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs a coordinator admin command through the control executor, which
/// answers it from the coordinators on this member or forwards it to the
/// member that runs them. `Unavailable` when the control executor does not
/// answer in time (the forward timeout plus 1 s).
pub(crate) async fn coordinator_admin(
    core: &DataExecutorRef,
    cmd: CoordinatorCommand,
) -> AdminAnswer {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let sent = core
        .borrow()
        .to_control()
        .send(ToControl::CoordinatorAdmin { cmd, reply: tx })
        .is_ok();
    let wait = FORWARD_TIMEOUT + Duration::from_secs(1);
    let deadline = Instant::now() + wait;
    while sent && Instant::now() < deadline {
        if let Ok(a) = rx.try_recv() {
            return a;
        }
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    Err((
        Status::Unavailable,
        "the node's control executor did not answer".into(),
    ))
}

/// Collects this node's status: the cluster view from the control executor
/// and the region views from every data executor (waiting at most
/// `STATUS_TIMEOUT`). `None` when the control executor did not answer.
pub(crate) async fn collect_status(core: &DataExecutorRef) -> Option<NodeStatus> {
    let (ctx, crx) = crossbeam_channel::bounded(1);
    let (rtx, rrx) = crossbeam_channel::bounded(64);
    let (me, client_address, mut regions, others) = {
        let c = core.borrow();
        let _ = c.to_control().send(ToControl::Status { reply: ctx });
        let mut others = 0;
        for (i, tx) in c.to_cores().iter().enumerate() {
            if i != usize::from(c.index()) && tx.send(ToCore::Status { reply: rtx.clone() }).is_ok()
            {
                others += 1;
            }
        }
        (c.me().clone(), c.client_address(), c.status(), others)
    };
    let deadline = Instant::now() + STATUS_TIMEOUT;
    let mut view = None;
    let mut got_cores = 0;
    while Instant::now() < deadline && (view.is_none() || got_cores < others) {
        if view.is_none() {
            view = crx.try_recv().ok();
        }
        while let Ok(mut r) = rrx.try_recv() {
            regions.append(&mut r);
            got_cores += 1;
        }
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    Some(node_status(&me, client_address, view?, regions))
}

/// The status of the node `me` (client address `client_address`) from the
/// control executor's cluster view and its data cores' regions (sorted by
/// type, then core): what [`collect_status`] and `Node::status` answer.
pub(crate) fn node_status(
    me: &UniqueAddress,
    client_address: String,
    view: ClusterView,
    mut regions: Vec<RegionStatusView>,
) -> NodeStatus {
    regions.sort_by(|a, b| (a.type_name.as_str(), a.core).cmp(&(b.type_name.as_str(), b.core)));
    NodeStatus {
        address: me.address.0.to_string(),
        uid: me.uid.0,
        client_address,
        members: view.members,
        leader: view.leader,
        coordinator: view.coordinator,
        coordinator_here: view.coordinator_here,
        regions,
        coordinators: view.coordinators,
        cluster_name: view.cluster_name,
        cluster_id: view.cluster_id,
        journal_identity: view.journal_identity,
    }
}

/// Gathers the cluster-wide sharding stats of `type_name` (Akka's
/// `GetClusterShardingStats`): this node's regions from `local`, and every
/// other Up member's over the control lanes, waiting at most `wait`.
/// Members that are unreachable, or that do not answer in time, are listed
/// in `failed` with the reason. `None` when the control executor did not
/// answer at all.
pub(crate) async fn collect_cluster_stats(
    core: &DataExecutorRef,
    type_name: &str,
    local: &NodeStatus,
    wait: Duration,
) -> Option<ClusterShardingStats> {
    let (tx, rx) = crossbeam_channel::unbounded();
    core.borrow()
        .to_control()
        .send(ToControl::ShardingStats {
            type_name: type_name.to_string(),
            wait,
            reply: tx,
        })
        .ok()?;
    let mut stats = ClusterShardingStats::default();
    stats.members.push(MemberShardStats {
        address: local.address.clone(),
        uid: local.uid,
        regions: local
            .regions
            .iter()
            .filter(|r| r.type_name == type_name)
            .map(RegionShardStats::of)
            .collect(),
    });
    let deadline = Instant::now() + wait;
    let mut asked: Option<Vec<(String, u64)>> = None;
    loop {
        while let Ok(ev) = rx.try_recv() {
            match ev {
                StatsEvent::Asked {
                    asked: a,
                    unreachable,
                } => {
                    stats
                        .failed
                        .extend(unreachable.into_iter().map(|(address, uid)| FailedMember {
                            address,
                            uid,
                            reason: "unreachable".into(),
                        }));
                    asked = Some(a);
                }
                StatsEvent::Answer(m) => {
                    if let Some(a) = &mut asked {
                        if let Some(i) = a
                            .iter()
                            .position(|(addr, uid)| *addr == m.address && *uid == m.uid)
                        {
                            a.swap_remove(i);
                            stats.members.push(m);
                        }
                    }
                }
            }
        }
        let done = asked.as_ref().is_some_and(|a| a.is_empty());
        if done || Instant::now() >= deadline {
            break;
        }
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    let missing = asked?;
    stats
        .failed
        .extend(missing.into_iter().map(|(address, uid)| FailedMember {
            address,
            uid,
            reason: format!("no answer within {} ms", wait.as_millis()),
        }));
    stats.members.sort_by(|a, b| a.address.cmp(&b.address));
    stats.failed.sort_by(|a, b| a.address.cmp(&b.address));
    Some(stats)
}
