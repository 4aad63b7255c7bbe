//! The deterministic simulation of cluster sharding.
//!
//! ```text
//!   scenario script ──> World ──(virtual clock, one seeded RNG)──> events
//!                        │ nodes × cores: ShardRegion + entities (actors)
//!                        │ per node: the node's ControlPlane (ClusterNode,
//!                        │   the ShardCoordinator where the singleton runs)
//!                        │ network: FIFO links, random latency, partitions
//!                        └─ invariants after every step
//! ```
//!
//! A world of N nodes × C cores runs the real state machines of
//! `shardline_core::sharding` (every region and the entities' mailboxes)
//! and, on every node, the node's own control plane
//! (`shardline::plane::ControlPlane`: membership, the coordinator's hosting
//! and recovery, its journal barrier, the graceful leave). The network keeps each directed node-to-node link
//! FIFO (like TCP) with a random latency per packet, so packets on different
//! links reorder; a partition holds packets until it heals (TCP retransmits);
//! a crash loses everything in flight to or from the node and everything it
//! held. The script starts, crashes, restarts, partitions, pauses nodes
//! and asks them to leave; membership itself is the real
//! `shardline_core::cluster::ClusterNode` in every plane, whose gossip goes
//! over the same links, and whose events, singleton placement and stop
//! drive the regions and the coordinator (see `world/clustered.rs`; there
//! is no interpreter of coordinator effects in the world). Everything random comes from one
//! `ChaCha8Rng` seeded from the run's seed and scenario, so a run replays
//! exactly.
//!
//! Invariants (checked after every step, or at the end where stated):
//! - **single incarnation**: at most one live incarnation of each entity in
//!   the whole world;
//! - **one home**: at most one live region hosts a shard, and a region runs a
//!   shard only while the journal's latest allocation names it (no region
//!   acting on an older generation);
//! - **exactly once**: no message is processed twice, none after its sender
//!   got a failure, none is left in a mailbox behind its entity's stop;
//! - **order**: per (sender, entity), processed sequence numbers increase;
//! - **drained** (end of run, after faults stopped): every accepted message
//!   was processed or its sender got a failure with a reason; every buffer is
//!   empty;
//! - **balanced** (join scenarios): a bounded number of rebalance rounds after
//!   the last join, shard counts of the Up regions differ by at most 1;
//! - **left** (leave scenarios): a graceful leave completes within a bound.

pub mod membership;
#[cfg(test)]
mod regressions;
mod scenario;
mod world;

pub use scenario::{Scenario, OPEN_SCENARIOS, SCENARIOS};
pub use world::{RunOutcome, SimConfig, Violation, World};

/// Runs one scenario with one seed; `trace` keeps a log of every event (for
/// printing the last events of a failing run).
pub fn run(scenario: &Scenario, seed: u64, cfg: &SimConfig, trace: bool) -> RunOutcome {
    let mut world = World::new(scenario, seed, cfg, trace);
    world.run();
    world.outcome()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_runs_clean_and_replays_exactly() {
        let cfg = SimConfig::default();
        for sc in SCENARIOS {
            {
                let seed = 7;
                let a = run(sc, seed, &cfg, true);
                assert!(
                    a.violation.is_none(),
                    "{} seed {seed}: {:?}",
                    sc.name,
                    a.violation
                );
                assert!(
                    a.stats.sent > 0 && a.stats.delivered > 0,
                    "{}: no traffic",
                    sc.name
                );
                let b = run(sc, seed, &cfg, true);
                assert_eq!(a.stats, b.stats, "{} seed {seed} does not replay", sc.name);
                // The whole event trace, not only the counters: every
                // effect of every state machine, in the same order.
                assert!(a.trace_digest.1 > 0, "{}: empty trace", sc.name);
                assert_eq!(
                    a.trace_digest, b.trace_digest,
                    "{} seed {seed}: the event trace does not replay",
                    sc.name
                );
            }
        }
    }

    #[test]
    fn the_replay_check_sees_two_inputs_swapped() {
        // The same run with two entities' processing steps swapped once
        // (one input order changed) must not pass for a replay.
        let cfg = SimConfig::default();
        for name in ["steady", "crash"] {
            let sc = SCENARIOS.iter().find(|s| s.name == name).expect("known");
            let a = run(sc, 7, &cfg, true);
            let mut w = World::new(sc, 7, &cfg, true);
            w.swap_processing_at(3_000);
            w.run();
            assert!(w.perturbed(), "{name}: not perturbed");
            let b = w.outcome();
            assert_ne!(
                a.trace_digest, b.trace_digest,
                "{name}: the digest missed a changed order"
            );
        }
    }

    #[test]
    fn a_lost_message_is_a_violation() {
        // The drained check fails when a message is neither processed nor
        // failed: stop the run before the world has drained.
        let cfg = SimConfig::default();
        let sc = SCENARIOS
            .iter()
            .find(|s| s.name == "steady")
            .expect("steady");
        // With warm routing a message is in flight for milliseconds only:
        // cut the run at successive instants until one catches some.
        let caught = (0..500u64).find_map(|ms| {
            let mut w = World::new(sc, 1, &cfg, false);
            w.run_until(std::time::Duration::from_millis(5_000 + ms));
            let o = w.outcome();
            o.violation.map(|v| v.invariant)
        });
        assert_eq!(caught, Some("drained"));
    }
}
