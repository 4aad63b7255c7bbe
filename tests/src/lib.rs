//! Shardline's deterministic simulation and integration-test helpers.
