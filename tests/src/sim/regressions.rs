//! Seeds that once broke an invariant, replayed on every `cargo test`.
//!
//! Each was found by a sweep over seeds no test had used (issue 18:
//! `sim --seeds 3500 --start-seed 31000001`), fixed in the state machines,
//! and is kept here with the default world (3 nodes x 2 cores) so that the
//! bug cannot come back unnoticed. A run takes well under a second.

use super::membership::{run_membership, MEMBERSHIP_SCENARIOS};
use super::{run, SimConfig, SCENARIOS};

/// Runs a sharding scenario with `seed`; panics with the violation (and the
/// last events of a traced replay) if an invariant breaks.
fn sharding_seed_passes(scenario: &str, seed: u64) {
    let sc = SCENARIOS
        .iter()
        .find(|s| s.name == scenario)
        .expect("known scenario");
    let cfg = SimConfig::default();
    let o = run(sc, seed, &cfg, false);
    if let Some(v) = o.violation {
        let replay = run(sc, seed, &cfg, true);
        panic!(
            "{scenario} seed {seed}: {} at {:?}: {}\n{}",
            v.invariant,
            v.at,
            v.detail,
            replay.last_events.join("\n")
        );
    }
    assert!(o.stats.delivered > 0, "{scenario} seed {seed}: no traffic");
}

/// Runs a membership scenario with `seed`; panics with the violation.
fn membership_seed_passes(scenario: &str, seed: u64) {
    let sc = MEMBERSHIP_SCENARIOS
        .iter()
        .find(|s| s.name == scenario)
        .expect("known scenario");
    let o = run_membership(sc, seed, false);
    if let Some(v) = o.violation {
        let replay = run_membership(sc, seed, true);
        panic!(
            "{scenario} seed {seed}: {} at {:?}: {}\n{}",
            v.invariant,
            v.at,
            v.detail,
            replay.last_events.join("\n")
        );
    }
}

/// Shard 20 moves from 0/1 to 3/0 while e2 passivates at 0/1 with seq 3
/// of sender 9 waiting for it; the old home used to send seq 3 on to the
/// new home after the hand-off, where seq 4 (buffered at 3/0 itself) was
/// delivered first. Order: seq 3 was processed after seq 4.
#[test]
fn passivation_31000309_order_through_passivation_and_hand_off() {
    sharding_seed_passes("passivation", 31_000_309);
}

/// As above, with the later message buffered at a third region (1/0):
/// sender 3 to e29, seq 7 was processed after seq 8.
#[test]
fn passivation_31002081_order_through_a_third_region() {
    sharding_seed_passes("passivation", 31_002_081);
}

/// Sender 10 to e41: seq 2 was processed after seq 3.
#[test]
fn passivation_31003319_order_through_passivation_and_hand_off() {
    sharding_seed_passes("passivation", 31_003_319);
}

/// The leader gossiped its version to members that had not acknowledged
/// it; they had that version already and answered nothing, so the leader
/// never saw convergence and node 1's graceful leave hung.
#[test]
fn membership_rolling_restart_31000797_every_leave_completes() {
    membership_seed_passes("membership-rolling-restart", 31_000_797);
}

/// Heavy loss after a healed 2|3 partition: nodes 0 and 2 each found every
/// other member indirectly connected and downed them all, keeping itself.
/// Each answered the other's probes with `Downed`, which the other ignored
/// because it held the sender Down; so both kept running, removed each
/// other after the down-removal margin, and both hosted the coordinator.
/// A member told `Downed` now stops whoever the sender is.
#[test]
fn membership_unstable_330_members_that_downed_each_other_stop() {
    membership_seed_passes("membership-unstable", 330);
}

/// As above, nodes 1 and 4 on the same side of a 3|2 partition downed each
/// other; after removing node 1, node 4 saw it still serving (no zombie).
#[test]
fn membership_unstable_1762_members_that_downed_each_other_stop() {
    membership_seed_passes("membership-unstable", 1762);
}

/// The coordinator's member (node 0) leaves; at 13.06 s node 2's cores had
/// re-registered with the moved coordinator and were not all registered
/// when its warm-routing wait (armed while they were) ran out. The control
/// plane kept reporting that deadline as due but ended the wait only while
/// every region was registered, so the simulation fired the same timer at
/// the same instant until its step bound. A warm deadline is now a timer
/// only while the rest of readiness holds.
#[test]
fn cluster_leave_coordinator_timeout_602_a_passed_warm_deadline_is_no_timer() {
    sharding_seed_passes("cluster-leave-coordinator-timeout", 602);
}
