//! `shardline status --node ADDR`: a node's view of the cluster (members,
//! coordinator, regions with shards and entities); with `--allocation`, the
//! coordinators' allocation table (every shard's home, generation and
//! hand-off), which the node fetches from the member that runs them.

use std::net::SocketAddr;
use std::time::Duration;

use crate::client::Client;

/// Arguments of `shardline status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Any node's client address.
    #[arg(long)]
    pub node: SocketAddr,
    /// Print the raw JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Print the coordinators' allocation table (shard → region,
    /// generation, hand-off) instead of the node's status.
    #[arg(long)]
    pub allocation: bool,
}

/// Writes the allocation table as readable text: per entity type, each
/// region's shard count, then one line per shard.
///
/// # Errors
/// Write errors of `out`.
pub fn write_allocation(
    t: &crate::status::AllocationTable,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    writeln!(out, "coordinator: {} (uid {})", t.coordinator, t.uid)?;
    for ty in &t.types {
        writeln!(
            out,
            "{}: {} shards allocated, {} in hand-off",
            ty.type_name,
            ty.shards.len(),
            ty.in_hand_off
        )?;
        writeln!(out, "  regions:")?;
        for r in &ty.regions {
            writeln!(
                out,
                "    {:<22} core {:<3} uid {:<20} {} shards",
                r.region.address, r.region.core, r.region.uid, r.shards
            )?;
        }
        writeln!(
            out,
            "  {:<6} {:<22} {:<5} {:<12} hand-off",
            "shard", "home", "core", "generation"
        )?;
        for s in &ty.shards {
            let h = match &s.hand_off {
                None => "-".to_string(),
                Some(h) => format!(
                    "{} for {} ms (abandoned in {} ms{}), planned target {}",
                    h.phase,
                    h.since_ms,
                    h.abandoned_in_ms,
                    if h.pending_acks > 0 {
                        format!(", {} acks missing", h.pending_acks)
                    } else {
                        String::new()
                    },
                    h.planned_target
                        .as_ref()
                        .map(|r| format!("{} core {}", r.address, r.core))
                        .unwrap_or_else(|| "-".into())
                ),
            };
            writeln!(
                out,
                "  {:<6} {:<22} {:<5} {:<12} {h}",
                s.shard, s.region.address, s.region.core, s.generation
            )?;
        }
    }
    Ok(())
}

/// Prints the status.
///
/// # Errors
/// Connection or protocol errors, naming the address and the likely cause
/// (an address that is not a node's `client_address`).
pub fn run(args: &StatusArgs, out: &mut impl std::io::Write) -> Result<(), super::CliError> {
    use super::CliError;
    let mut c = Client::connect(args.node).map_err(CliError::request(format!(
        "cannot connect to {}",
        args.node
    )))?;
    if args.allocation {
        let t = c
            .allocation(Duration::from_secs(10))
            .map_err(CliError::request(format!(
                "{} did not answer the allocation table",
                args.node
            )))?;
        if args.json {
            writeln!(out, "{}", serde_json::to_string_pretty(&t)?)?;
        } else {
            write_allocation(&t, out)?;
        }
        return Ok(());
    }
    let st = c
        .node_status(Duration::from_secs(5))
        .map_err(CliError::request(format!(
            "{} did not answer as a Shardline node's native client port \
             (give the node's `client_address`, not its http or cluster address)",
            args.node
        )))?;
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&st)?)?;
        return Ok(());
    }
    writeln!(
        out,
        "node {} (uid {}), clients on {}",
        st.address, st.uid, st.client_address
    )?;
    writeln!(
        out,
        "cluster: {} (id {}), journal {}",
        st.cluster_name,
        st.cluster_id.as_deref().unwrap_or("not known yet"),
        st.journal_identity
    )?;
    writeln!(out, "leader: {}", st.leader.as_deref().unwrap_or("-"))?;
    writeln!(
        out,
        "coordinator: {}{}",
        st.coordinator.as_deref().unwrap_or("-"),
        if st.coordinator_here { " (here)" } else { "" }
    )?;
    for c in &st.coordinators {
        writeln!(
            out,
            "  coordinator {}: epoch {}, recovered from {}{} ({} records, {} shards), {} shards now{}",
            c.type_name,
            c.writer_epoch,
            c.recovered_from,
            c.journal_dir
                .as_deref()
                .map(|d| format!(" {d}"))
                .unwrap_or_default(),
            c.recovered_records,
            c.recovered_shards,
            c.shards,
            c.refused
                .as_deref()
                .map(|r| format!("; REFUSED: {r}"))
                .unwrap_or_default(),
        )?;
        if let Some(e) = &c.journal_error {
            writeln!(
                out,
                "  COORDINATOR JOURNAL ERROR ({}): {e} (the coordinator waits and retries)",
                c.type_name
            )?;
        }
    }
    writeln!(out, "members:")?;
    for m in &st.members {
        writeln!(
            out,
            "  {:<22} uid {:<20} {:<9} {}",
            m.address,
            m.uid,
            m.status,
            if m.reachable {
                "reachable"
            } else {
                "UNREACHABLE"
            }
        )?;
    }
    for r in &st.regions {
        if let Some(e) = &r.journal_error {
            if e.starts_with("journal ") {
                // The PostgreSQL backend: unreachable, or a newer schema.
                writeln!(
                    out,
                    "JOURNAL ERROR on core {} ({}): {e} (durable commands answer JournalUnavailable; non-durable types keep serving)",
                    r.core, r.type_name
                )?;
            } else {
                writeln!(
                    out,
                    "JOURNAL ERROR on core {} ({}): {e} (durable entities fail; see `shardline journal verify`)",
                    r.core, r.type_name
                )?;
            }
        }
    }
    writeln!(out, "regions:")?;
    for r in &st.regions {
        writeln!(
            out,
            "  {:<12} core {:<3} {} shards {:<5} entities {:<7} delivered {:<10} activated {:<8} buffered {} dead letters {}",
            r.type_name,
            r.core,
            if r.proxy { "proxy" } else { "     " },
            r.shards.len(),
            r.entities,
            r.messages_delivered,
            r.entities_activated,
            r.buffered,
            r.dead_letters
        )?;
        if let Some(w) = &r.worker {
            writeln!(
                out,
                "  {:<12} core {:<3} stateless worker: activations {} (max seen {}, core limit {}, node max {}) queued {} executed {} created {} collected {} rejected {}",
                r.type_name,
                r.core,
                w.activations,
                w.max_activations_seen,
                w.core_limit,
                w.max_local_workers,
                w.queued,
                w.executed_locally,
                w.created,
                w.collected,
                w.rejected
            )?;
        }
    }
    Ok(())
}
