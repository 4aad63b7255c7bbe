//! # shardline
//!
//! The engine shell: runtime, transport, fronts, embedding API and the
//! `shardline` command line.

pub mod cli;
