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
    /// Print the shard of each entity id (`ID SHARD` lines).
    ShardOf(shardline::cli::shard_of::ShardOfArgs),
    /// Run a node: `shardline node --config FILE`.
    Node(shardline::cli::node::NodeArgs),
    /// Print a node's view of the cluster: `shardline status --node ADDR`
    /// (`--allocation`: the coordinators' allocation table).
    Status(shardline::cli::status::StatusArgs),
    /// Run one rebalance round of the coordinator now:
    /// `shardline rebalance --node ADDR [--type T]`.
    Rebalance(shardline::cli::rebalance::RebalanceArgs),
    /// Journal tools: `shardline journal verify DIR`, `shardline journal inspect DIR`.
    Journal(shardline::cli::journal::JournalArgs),
}

fn main() -> anyhow::Result<()> {
    match run() {
        // A closed stdout (`shardline status | head`) ends the output quietly.
        Err(e)
            if e.chain().any(|c| {
                let io = c.downcast_ref::<std::io::Error>().or_else(|| {
                    match c.downcast_ref::<shardline::cli::CliError>() {
                        Some(shardline::cli::CliError::Io(io)) => Some(io),
                        _ => None,
                    }
                });
                io.is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            Ok(())
        }
        other => other,
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Version => {
            println!("shardline {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Command::Node(args) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .with_writer(std::io::stderr)
                .init();
            Ok(shardline::cli::node::run(&args)?)
        }
        Command::Status(args) => Ok(shardline::cli::status::run(
            &args,
            &mut std::io::stdout().lock(),
        )?),
        Command::Rebalance(args) => Ok(shardline::cli::rebalance::run(
            &args,
            &mut std::io::stdout().lock(),
        )?),
        Command::Journal(args) => {
            if !shardline::cli::journal::run(&args, &mut std::io::stdout().lock())? {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::ShardOf(args) => {
            shardline::cli::shard_of::run(&args, &mut std::io::stdout().lock())?;
            Ok(())
        }
    }
}
