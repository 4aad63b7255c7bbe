//! # shardline-core
//!
//! The sans-IO state machines of Shardline. Nothing in this crate opens a
//! socket, touches a file, spawns a thread or reads a clock: every input
//! arrives with the current time, every effect leaves as a value.

pub mod cluster;
pub mod det;
pub mod ids;
pub mod sharding;
