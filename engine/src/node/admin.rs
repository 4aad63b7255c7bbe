//! The coordinator's admin commands (the allocation table, a rebalance
//! round on request), answered by the member that runs the coordinators
//! from their sans-IO state machines; other members forward them there on
//! the control lane (see `control.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use shardline_core::ids::{RegionId, UniqueAddress};
use shardline_core::sharding::{HandOffPhase, ShardCoordinator};

use crate::envelope::Status;
use crate::status::{
    AllocationTable, HandOffStatus, RebalanceAnswer, RebalanceMove, RegionLoad, RegionRef,
    ShardAllocationStatus, TypeAllocation, TypeRebalance,
};

/// A coordinator admin command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CoordinatorCommand {
    /// The allocation table of every entity type.
    Allocation,
    /// One rebalance round now, for `type_name` or every type (`None`).
    Rebalance { type_name: Option<String> },
}

/// A command's answer: the JSON body, or why not (a status whose HTTP code
/// [`crate::gateway::http::status_code_of`] gives, and the reason).
pub(crate) type AdminAnswer = Result<Vec<u8>, (Status, String)>;

/// How long a member waits for the coordinator's member to answer a
/// forwarded command.
pub(crate) const FORWARD_TIMEOUT: Duration = Duration::from_secs(3);

fn region_ref(r: &RegionId) -> RegionRef {
    RegionRef {
        address: r.member.address.0.clone(),
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
        coordinator: me.address.0.clone(),
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
        coordinator: me.address.0.clone(),
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
