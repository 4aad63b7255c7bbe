//! Shardline's deterministic simulation and integration-test helpers.
//!
//! [`sim`] runs the sharding state machines of `shardline-core` in a seeded,
//! virtual-time world of nodes, cores, links and faults, and checks the
//! protocol's guarantees after every step; the `sim` binary drives it.

pub mod sim;
