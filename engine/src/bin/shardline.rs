//! The `shardline` command line.

use clap::{Parser, Subcommand};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Shardline: a cluster-sharding message-routing engine.
#[derive(Parser)]
#[command(name = "shardline", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the version and exit.
    Version,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Version => {
            println!("shardline {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
    }
}
