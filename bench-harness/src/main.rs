//! `shardline-bench`: Shardline's bench harness.

use clap::Parser;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Shardline's bench harness.
#[derive(Parser)]
#[command(name = "shardline-bench", version, about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    Ok(())
}
