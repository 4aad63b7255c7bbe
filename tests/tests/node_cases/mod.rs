//! The node tests, as modules of one test binary (one link of the engine
//! instead of one per file). Each test takes [`support::serial`] first.

mod bad_input;
mod cluster;
mod embedded;
mod kill;
mod leave;
mod multicore;
mod restart;
pub mod support;
mod warm;
