//! The deterministic simulation of cluster sharding.
//!
//! ```text
//!   scenario script ──> World ──(virtual clock, one seeded RNG)──> events
//!                        │ per node: the node's ControlPlane (ClusterNode,
//!                        │   the ShardCoordinator where the singleton runs)
//!                        │ per data core: the node's DataPlane (its
//!                        │   ShardRegion, forwarding, lanes, reports) and
//!                        │   the world's test entities (mailboxes)
//!                        │ network: FIFO links, random latency, partitions;
//!                        │   data lanes carry the planes' encoded frames
//!                        └─ invariants after every step
//! ```
//!
//! A world of N nodes × C cores runs, on every node, the node's own planes:
//! the control plane (`shardline::plane::ControlPlane`: membership, the
//! coordinator's hosting and recovery, its journal barrier, the graceful
//! leave) and one data plane per core (`shardline::plane::data::DataPlane`:
//! the core's `ShardRegion` of `shardline_core::sharding`, the forwarding
//! bookkeeping and its deadlines, the data lanes and their backoff, the
//! registration and hand-off reports, the stop). The world hosts the
//! entities (mailboxes processed one message at a time) and carries the
//! planes' outputs (see `world/clustered.rs` and `world/data.rs`; there is
//! no interpreter of region, coordinator or membership effects in the
//! world). The network keeps each directed node-to-node link FIFO (like
//! TCP) with a random latency per packet, so packets on different links
//! reorder; a partition holds packets until it heals (TCP retransmits); a
//! crash loses everything in flight to or from the node and everything it
//! held, and breaks the other nodes' data lanes to it. The script starts,
//! crashes, restarts, partitions, pauses nodes and asks them to leave;
//! membership itself is the real `shardline_core::cluster::ClusterNode` in
//! every control plane, whose gossip goes over the same links, and whose
//! events, singleton placement and stop drive the data planes and the
//! coordinator. Everything random comes from one `ChaCha8Rng` seeded from
//! the run's seed and scenario, so a run replays exactly.
//!
//! Invariants (checked after every step, or at the end where stated):
//! - **single incarnation**: at most one live incarnation of each entity in
//!   the whole world;
//! - **one home**: at most one live region hosts a shard, and a region runs a
//!   shard only while the journal's latest allocation names it (no region
//!   acting on an older generation);
//! - **exactly once**: no message is processed twice, none after its sender
//!   got a failure (other than `TimedOut`, which says it may be processed),
//!   none is left in a mailbox behind its entity's stop, none answered Ok
//!   unprocessed or a failure once processed;
//! - **one answer**: every sender is answered at most once;
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
        // failed: stop the run while one is on its way.
        let cfg = SimConfig::default();
        let sc = SCENARIOS
            .iter()
            .find(|s| s.name == "steady")
            .expect("steady");
        let mut w = World::new(sc, 1, &cfg, false);
        w.cut_with_a_message_pending_after(std::time::Duration::from_secs(5));
        w.run();
        let o = w.outcome();
        assert_eq!(o.violation.map(|v| v.invariant), Some("drained"));
    }
}
