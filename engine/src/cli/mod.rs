//! Implementations of the `shardline` command line's subcommands. Each
//! subcommand lives in its own module; `src/bin/shardline.rs` only parses and
//! dispatches.

pub mod journal;
pub mod node;
pub mod rebalance;
pub mod shard_of;
pub mod status;
