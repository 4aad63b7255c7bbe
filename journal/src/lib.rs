//! # shardline-journal
//!
//! Append-only, memory-mapped segment journal.
