//! `shardline rebalance --node ADDR [--type T]`: runs one rebalance round
//! of the coordinator (of type `T`, or of every type) now, and prints the
//! hand-offs it started.

use std::net::SocketAddr;
use std::time::Duration;

use crate::client::Client;

/// Arguments of `shardline rebalance`.
#[derive(Debug, clap::Args)]
pub struct RebalanceArgs {
    /// Any node's client address (it forwards the command to the member
    /// that runs the coordinators).
    #[arg(long)]
    pub node: SocketAddr,
    /// The entity type (default: every type). An empty or over-long name
    /// is refused (exit 2) rather than taken as "every type".
    #[arg(long = "type", value_parser = type_name)]
    pub type_name: Option<String>,
    /// Print the raw JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

fn type_name(s: &str) -> Result<String, String> {
    shardline_core::ids::TypeName::new(s)
        .map(|t| t.as_str().to_string())
        .map_err(|e| e.to_string())
}

/// Runs the round and prints what it started.
///
/// # Errors
/// Connection errors, and the node's reason when it refused (no
/// coordinator yet, an unknown type).
pub fn run(args: &RebalanceArgs, out: &mut impl std::io::Write) -> Result<(), super::CliError> {
    use super::CliError;
    let mut c = Client::connect(args.node).map_err(CliError::request(format!(
        "cannot connect to {}",
        args.node
    )))?;
    let a = c
        .rebalance(args.type_name.as_deref(), Duration::from_secs(10))
        .map_err(CliError::request(format!(
            "{} did not run the rebalance round",
            args.node
        )))?;
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&a)?)?;
        return Ok(());
    }
    writeln!(out, "coordinator: {} (uid {})", a.coordinator, a.uid)?;
    for t in &a.types {
        match &t.skipped {
            Some(why) => writeln!(out, "{}: round skipped: {why}", t.type_name)?,
            None => writeln!(
                out,
                "{}: {} hand-offs started, {} shards in hand-off now",
                t.type_name,
                t.started.len(),
                t.in_hand_off
            )?,
        }
        for m in &t.started {
            writeln!(
                out,
                "  shard {:<6} from {} core {} to {}",
                m.shard,
                m.from.address,
                m.from.core,
                m.planned_target
                    .as_ref()
                    .map(|r| format!("{} core {} (planned)", r.address, r.core))
                    .unwrap_or_else(|| "(decided at re-allocation)".into())
            )?;
        }
    }
    Ok(())
}
